"""Offline generation with the vLLM-style API: a few prompts in, prompts and completions out.

    python examples/offline_inference.py --model checkpoints/tiny-v41

A tiny checkpoint has random weights, so its completions are gibberish; the point is the path.
Set DEEPINFER_ACCELERATOR=neuron to run the Neuron platform (host mode without a device).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepinfer import LLM, SamplingParams  # noqa: E402

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "用一句话介绍你自己：",
    "def fibonacci(n):",
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory (config.json, safetensors, tokenizer)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=256)
    args = ap.parse_args(argv)

    llm = LLM(model=args.model, max_model_len=args.max_model_len, max_num_seqs=len(PROMPTS))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    outputs = llm.generate(PROMPTS, params)
    for out in outputs:
        completion = out.outputs[0]
        print(f"prompt:     {out.prompt!r}")
        print(f"completion: {completion.text!r}  ({len(completion.token_ids)} tokens, "
              f"finish_reason={completion.finish_reason})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
