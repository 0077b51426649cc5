"""The Neuron region graphs an engine config compiles, counted from the model config alone (no model
build, nothing compiled; docs/neuron.md §5.10):

    python examples/neuron/compile_plan.py --config examples/configs/v41-flash.json [--nextn 5]
        [--max-num-seqs 64] [--max-num-batched-tokens 2048] [--max-model-len 4096] [--json OUT]

The buckets are NeuronPlatform.bucket_spec's for those engine options (DEEPINFER_NEURON_ROW_BUCKETS,
_CTX_BUCKETS, _PREFILL_BUCKET and _REGION_SPLIT apply as in the engine).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from deepinfer.config import ModelConfig  # noqa: E402
from deepinfer.engine_config import EngineConfig  # noqa: E402
from deepinfer.platforms.neuron.compile_plan import compile_plan, config_layer_kinds  # noqa: E402
from deepinfer.platforms.neuron.platform import NeuronPlatform  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="a checkpoint directory or its config.json")
    ap.add_argument("--nextn", type=int, default=0, help="num_speculative_tokens")
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--json", default=None, help="write the plan as JSON here")
    args = ap.parse_args(argv)
    path = os.path.join(args.config, "config.json") if os.path.isdir(args.config) else args.config
    with open(path) as f:
        cfg = ModelConfig.from_dict(json.load(f))
    engine = {k: v for k, v in dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                    max_model_len=args.max_model_len).items() if v is not None}
    ec = EngineConfig(model=args.config, num_speculative_tokens=args.nextn, **engine)
    ec.resolve(cfg)
    platform = NeuronPlatform(host=True)
    platform.validate_config(ec, cfg)
    plan = compile_plan(platform.bucket_spec(ec), config_layer_kinds(cfg), platform.region_split,
                        drafts=ec.num_speculative_tokens)
    print(plan.describe())
    for row in plan.buckets():
        print(f"  {row['step']:8s} {row['tokens']:6d} tokens  context {row['context']:7d}  "
              f"{'+'.join(row['regions']):28s} {row['graphs']:4d} graphs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(plan.to_dict(), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
