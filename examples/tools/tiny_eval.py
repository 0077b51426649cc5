"""Greedy accuracy of a checkpoint on held-out prompts of the synthetic language
(examples/tiny_language.py, docs/tiny_language.md), through this engine's offline API.

    python examples/tools/tiny_eval.py --model checkpoints/trained-v41 [--n 50] [--kinds count,copy,lookup]

A completion is right when it starts with the prompt's answer: the next four numbers of a count,
the copied words and the newline of a copy, the value and the newline of a lookup.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))  # deepinfer, from a checkout
sys.path.insert(0, os.path.dirname(_HERE))                   # tiny_language

import tiny_language as lang  # noqa: E402

# completion tokens a kind's answer can take: four numbers of up to 3 tokens each; 12 words + newline
MAX_TOKENS = {"count": 12, "copy": 14, "lookup": 3, "long_lookup": 3}


def completions(llm, prompts: list[lang.Prompt], max_tokens: int | None = None) -> list[str]:
    """Greedy completion texts of `prompts`, in order."""
    from deepinfer import SamplingParams
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens or MAX_TOKENS[p.kind], ignore_eos=True)
              for p in prompts]
    outs = llm.generate([p.prompt for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def accuracy(llm, kinds, n: int, seed: int = 0) -> dict[str, dict]:
    """kind -> {"right", "n", "accuracy", "examples": [(prompt, answer, completion)] (the first 3)}."""
    result = {}
    for kind in kinds:
        prompts = lang.heldout_prompts(kind, n, seed)
        texts = completions(llm, prompts)
        right = sum(p.correct(t) for p, t in zip(prompts, texts))
        result[kind] = {"right": right, "n": n, "accuracy": right / n,
                        "examples": [(p.prompt, p.answer, t) for p, t in list(zip(prompts, texts))[:3]]}
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--n", type=int, default=50, help="held-out prompts per kind")
    ap.add_argument("--kinds", default="count,copy,lookup")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    kinds = args.kinds.split(",")
    from deepinfer import LLM
    max_len = 4200 if "long_lookup" in kinds else 256
    llm = LLM(model=args.model, dtype="float32", max_model_len=max_len, max_num_seqs=min(args.n, 32))
    res = accuracy(llm, kinds, args.n, args.seed)
    if args.json:
        print(json.dumps(res))
    for kind, r in res.items():
        print(f"{kind:12s} {r['right']:4d} / {r['n']:4d} right ({100 * r['accuracy']:.1f} %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
