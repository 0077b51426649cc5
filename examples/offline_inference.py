"""Offline generation with the vLLM-style API: prompts of the synthetic language in, the model's
greedy answers out, and how many were right.

    python examples/offline_inference.py --model checkpoints/trained-v41 [--per-kind 3] [--long 1]

`make run` runs this on held-out prompts of each kind of docs/tiny_language.md (count, copy,
lookup, and --long prompts of long lookup, 1,000-4,000 tokens each) with the trained V4.1
checkpoint expanded from examples/artifacts/trained-v41.safetensors when that artifact is committed
(examples/train_tiny.py writes it), else with the random tiny checkpoint, which answers none.
Set DEEPINFER_ACCELERATOR=neuron to run the Neuron platform (host mode without a device).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny_language as lang  # noqa: E402
from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.config import ModelConfig  # noqa: E402

MAX_TOKENS = {"count": 12, "copy": 14, "lookup": 3, "long_lookup": 3}


def shorten(text: str, keep: int = 90) -> str:
    return text if len(text) <= keep else f"{text[:40]} ...({len(text) - 80} chars)... {text[-40:]}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory (config.json, safetensors, tokenizer)")
    ap.add_argument("--per-kind", type=int, default=3, help="held-out prompts of count, copy and lookup each")
    ap.add_argument("--long", type=int, default=1, help="held-out long-lookup prompts")
    ap.add_argument("--seed", type=int, default=0, help="held-out prompt stream (examples/tiny_language.py)")
    args = ap.parse_args(argv)

    prompts = [p for kind in ("count", "copy", "lookup") for p in lang.heldout_prompts(kind, args.per_kind, args.seed)]
    prompts += lang.heldout_prompts("long_lookup", args.long, args.seed)
    if not prompts:
        ap.error("no prompts: --per-kind and --long are both 0")
    # long lookups need up to ~4,100 positions; a checkpoint with fewer (the random tiny one has 4096)
    # runs the long prompts that fit and says how many it left out
    positions = ModelConfig.from_pretrained(args.model).max_position_embeddings
    max_len = min(4200, positions) if args.long else min(256, positions)
    llm = LLM(model=args.model, max_model_len=max_len, max_num_seqs=len(prompts))
    tok = llm.get_tokenizer()
    fits = [p for p in prompts if len(tok.encode(p.prompt)) + 1 + MAX_TOKENS[p.kind] <= max_len]
    if len(fits) < len(prompts):
        print(f"{len(prompts) - len(fits)} prompt(s) longer than the model's {max_len} positions left out")
    prompts = fits
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[p.kind], ignore_eos=True) for p in prompts]
    outputs = llm.generate([p.prompt for p in prompts], params, use_tqdm=False)
    right = 0
    for p, out in zip(prompts, outputs):
        text = out.outputs[0].text
        ok = p.correct(text)
        right += ok
        print(f"[{p.kind}] {shorten(p.prompt)!r} ({len(out.prompt_token_ids)} tokens)")
        print(f"    model: {text!r}   expected: {p.answer!r}   {'right' if ok else 'WRONG'}")
    print(f"{right} of {len(prompts)} right")
    return 0


if __name__ == "__main__":
    sys.exit(main())
