"""The compiled CPU step with every Dynamo guard evaluated against warm guards skipped
(worker/runners/warm_guards.py, DEEPINFER_CPU_SKIP_WARM_GUARDS), two engines in one process,
alternated round by round (these machines are noisy: compare within a run), checking that both
emit the same tokens.

    python examples/bench/bench_warm_guards.py --model DIR [--prompts-file P.jsonl] [--num-prompts 16] \
        [--max-tokens 16] [--nextn 0] [--rounds 3] [--out guards.json]

Prompts: JSON lines {"prompt": ...} (examples/tiny_language.py prints such lines), else random token
ids. Each request runs alone (batch 1), greedy, ignore_eos. Prints the seconds per round of each and
the ratio of medians; writes them as JSON with --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts-file")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--nextn", type=int, default=0, help="num_speculative_tokens (V4.1 checkpoints with drafts)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each setting (after a warm-up)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ["DEEPINFER_CPU_COMPILE"] = "1"
    torch.set_num_threads(1)
    from deepinfer import LLM, SamplingParams
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts = [json.loads(line)["prompt"] for line in f if line.strip()][: args.num_prompts]
    else:
        g = torch.Generator().manual_seed(0)
        prompts = [{"prompt_token_ids": torch.randint(100, 20000, (32,), generator=g).tolist()}
                   for _ in range(args.num_prompts)]
    engines = {}
    for name, value in (("full", "0"), ("warm", "1")):
        os.environ["DEEPINFER_CPU_SKIP_WARM_GUARDS"] = value   # read when the engine builds its runner
        engines[name] = LLM(model=args.model, max_model_len=512, max_num_seqs=1, dtype=args.dtype,
                            num_speculative_tokens=args.nextn)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    def run(llm):
        return [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]

    tokens = {name: run(llm) for name, llm in engines.items()}   # warm-up: compiles, then clean runs
    seconds = {name: [] for name in engines}
    for r in range(args.rounds):
        for name in (("full", "warm") if r % 2 == 0 else ("warm", "full")):
            t0 = time.perf_counter()
            out = run(engines[name])
            seconds[name].append(time.perf_counter() - t0)
            if out != tokens["full"]:
                raise SystemExit(f"round {r}: {name} emitted other tokens than full guards")
    med = {name: statistics.median(v) for name, v in seconds.items()}
    print(f"nextn {args.nextn}, {len(prompts)} prompts x {args.max_tokens} tokens: full guards "
          f"{med['full']:.3f} s {[round(s, 3) for s in seconds['full']]}, warm guards {med['warm']:.3f} s "
          f"{[round(s, 3) for s in seconds['warm']]}, full / warm {med['full'] / med['warm']:.2f}, same tokens")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "nextn": args.nextn, "prompts": len(prompts), "max_tokens": args.max_tokens,
                       "seconds": seconds, "median_s": med, "full_over_warm": med["full"] / med["warm"]}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
