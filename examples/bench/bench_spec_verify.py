"""Which drafts to verify: speculative_verify="all" against "confidence", in one process.

    python examples/bench/bench_spec_verify.py --model PATH [--nextn 3] [--batch 1,4] \
        [--prompts random|distilled] [--num-prompts 8] [--output-len 32] [--rounds 3] --out r.json

Three engines on the same checkpoint: no drafts (nextn 0), nextn drafts verified in full, nextn
drafts verified by confidence (spec/verify_plan.py). Every round runs every (engine, batch)
cell once, greedy, on the same prompts, cells interleaved so machine load hits all alike; the first
round only warms up (and gives the confidence engine's step-time model its first measurements).
Per cell: median output tok/s over the rounds, tokens per decode step, drafts verified per step,
accept rate, confidence error, and whether the tokens equal the nextn 0 engine's (they must:
greedy). Prints ratios against "all" and writes one JSON record per cell.

--prompts distilled replays the first training prompts of `distill_tiny_drafts.py` (its default seed
and prompt length): a checkpoint distilled on few continuations (`--prompts 64`) memorises them and
accepts many drafts there and none on random prompts, so the two cover both ends (docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))  # distill_tiny_drafts
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="V4.1 checkpoint with draft layers")
    ap.add_argument("--nextn", type=int, default=3)
    ap.add_argument("--batch", default="1,4", help="requests at once, a comma list")
    ap.add_argument("--prompts", choices=("random", "distilled"), default="random")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds (plus one warm-up)")
    ap.add_argument("--uncalibrated", action="store_true",
                    help="one more engine: confidence scheduling on the raw estimates (no AcceptanceCalibration)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    args.batch = [int(b) for b in args.batch.split(",")]
    if args.nextn < 1 or args.rounds < 1 or min(args.batch) < 1:
        ap.error("--nextn, --rounds and --batch must be positive")
    return args


def make_prompts(args, vocab: int) -> list[list[int]]:
    if args.prompts == "distilled":
        from distill_tiny_drafts import training_prompts
        return training_prompts(0, 64, 16, vocab)[:args.num_prompts]
    g = torch.Generator().manual_seed(12345)
    return [[0] + torch.randint(3, min(vocab, 128000), (args.prompt_len - 1,), generator=g).tolist()
            for _ in range(args.num_prompts)]


def run_cell(llm, prompts, batch: int, params):
    """(seconds, outputs, spec counters before, after) of the prompts in groups of `batch`."""
    eng = llm.llm_engine
    before = eng.stats().spec_decode
    outs = []
    t = time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs += llm.generate([{"prompt_token_ids": p} for p in prompts[i:i + batch]], params, use_tqdm=False)
    return time.perf_counter() - t, outs, before, eng.stats().spec_decode


_COUNTERS = ("num_decode_steps", "num_emitted_tokens", "num_draft_tokens", "num_accepted_tokens",
             "num_offered_tokens", "num_steps", "confidence_error_sum")  # spec/stats.py


def summary(d: dict) -> dict:
    return {"tokens_per_decode_step": d["num_emitted_tokens"] / d["num_decode_steps"] if d["num_decode_steps"] else None,
            "verified_per_step": d["num_draft_tokens"] / d["num_steps"] if d["num_steps"] else None,
            "verified_fraction": d["num_draft_tokens"] / d["num_offered_tokens"] if d["num_offered_tokens"] else None,
            "accept_rate": d["num_accepted_tokens"] / d["num_draft_tokens"] if d["num_draft_tokens"] else None,
            "confidence_error": d["confidence_error_sum"] / d["num_draft_tokens"] if d["num_draft_tokens"] else None}


class _NoCalibration:
    """Stands in for spec/verify_plan.AcceptanceCalibration: factors of 1 (the raw estimates)."""
    factors = ()

    def record(self, *args) -> None:
        pass

    def step(self) -> None:
        pass


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from deepinfer import LLM, SamplingParams
    from deepinfer.config import ModelConfig
    prompts = make_prompts(args, int(ModelConfig.from_pretrained(args.model).vocab_size))
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    common = dict(dtype="float32", max_model_len=args.prompt_len + args.output_len + 8,
                  max_num_seqs=max(args.batch), skip_tokenizer_init=True)
    engines = {"nextn0": LLM(args.model, **common),
               "all": LLM(args.model, num_speculative_tokens=args.nextn, speculative_verify="all", **common),
               "confidence": LLM(args.model, num_speculative_tokens=args.nextn,
                                 speculative_verify="confidence", **common)}
    if args.uncalibrated:
        raw = LLM(args.model, num_speculative_tokens=args.nextn, speculative_verify="confidence", **common)
        raw.llm_engine.scheduler.spec_policy.calibration = _NoCalibration()
        engines["confidence-raw"] = raw
    times = {(e, b): [] for e in engines for b in args.batch}
    stats, tokens = {}, {}
    for r in range(args.rounds + 1):
        for b in args.batch:
            for name, llm in engines.items():
                dt, outs, before, after = run_cell(llm, prompts, b, params)
                tokens[(name, b)] = [list(o.outputs[0].token_ids) for o in outs]
                if r == 0:
                    continue
                times[(name, b)].append(len(prompts) * args.output_len / dt)
                deltas = stats.setdefault((name, b), {})
                for f in _COUNTERS:  # this cell's share of the engine's counters, summed over rounds
                    deltas[f] = deltas.get(f, 0) + getattr(after, f) - getattr(before, f)
    records = []
    for b in args.batch:
        base = statistics.median(times[("all", b)])
        for name in engines:
            tok_s = statistics.median(times[(name, b)])
            rec = {"engine": name, "nextn": 0 if name == "nextn0" else args.nextn, "batch": b,
                   "prompts": args.prompts, "output_tok_s": tok_s, "vs_all": tok_s / base,
                   "same_tokens_as_nextn0": tokens[(name, b)] == tokens[("nextn0", b)], **summary(stats[(name, b)])}
            records.append(rec)
            fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
            print(f"batch {b} {name:>14}: {tok_s:7.2f} tok/s  x{rec['vs_all']:.3f} of 'all'  "
                  f"tok/step {fmt(rec['tokens_per_decode_step'])}  verified/step {fmt(rec['verified_per_step'])}  "
                  f"verified {fmt(rec['verified_fraction'])} of offered  accept {fmt(rec['accept_rate'])}  "
                  f"conf err {fmt(rec['confidence_error'])}  same tokens {rec['same_tokens_as_nextn0']}")
    with open(args.out, "w") as f:
        json.dump({"config": vars(args), "records": records}, f, indent=1)
    return 0 if all(r["same_tokens_as_nextn0"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
