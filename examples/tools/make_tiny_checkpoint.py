"""Write a tiny random DeepSeek V4 / V4.1 checkpoint in the real Hugging Face layout (docs/model.md §7).

    python examples/tools/make_tiny_checkpoint.py --kind v41 --out checkpoints/tiny-v41
    python examples/tools/make_tiny_checkpoint.py --kind v4 --out checkpoints/tiny-v4 --unquantized

The logic lives in deepinfer/model_executor/tiny_checkpoint.py; this is its command line.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from deepinfer.config import ModelConfig  # noqa: E402
from deepinfer.model_executor.checkpoint_schema import count_parameters  # noqa: E402
from deepinfer.model_executor.tiny_checkpoint import make_tiny_checkpoint  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", choices=("v41", "v4"), required=True)
    ap.add_argument("--out", required=True, help="output directory (created if needed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shards", type=int, default=1, help="number of safetensors shards (>1 writes an index)")
    ap.add_argument("--unquantized", action="store_true", help="v4 only: dense weights loadable by transformers")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="dense dtype of --unquantized weights")
    ap.add_argument("--index-topk", type=int, default=None, help="override index_topk (v4 default 64, v41 16)")
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (v4 default 6, v41 8)")
    args = ap.parse_args(argv)
    try:
        out = make_tiny_checkpoint(args.kind, args.out, seed=args.seed, shards=args.shards,
                                   unquantized=args.unquantized, index_topk=args.index_topk, layers=args.layers,
                                   dtype=args.dtype)
    except ValueError as e:
        ap.error(str(e))
    cfg = ModelConfig.from_pretrained(out)
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(f"wrote {out}: {cfg.model_type}, {cfg.num_layers} layers, {count_parameters(cfg):,} parameters "
          f"(dense), {size / 2**20:.1f} MiB of safetensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
