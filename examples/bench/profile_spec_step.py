"""Where a decode step's time goes, plain (nextn 0) against speculative (nextn > 0), in one process.

    python examples/bench/profile_spec_step.py --model TINY_V41_DISTILLED [--nextn 0,3] [--batch 1,8] \
        [--prompt-len 16] [--gen-len 48] [--threads 1] [--out profile.json]

Wall-clock timers (perf_counter) wrap the engine's own objects at run time, nothing is edited:
the engine step, the main forward (ModelRunner.run: prepare, model execute, sample; its LM head
calls counted apart), verification (SpecDecoder._verify), and drafting (DraftProposer.propose: the
draft layers, their LM head call, and the per-depth draft sampling). Prompts are uniform random
token ids from --seed (not the bench's prompt generator). Prints milliseconds per decode step and
per phase (totals over the measured rounds, each round's one prefill step included, divided by the
decode steps), and the output tokens per decode step; writes them as JSON with --out.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))

import torch  # noqa: E402


def timed(obj, name: str, into: dict, key: str) -> None:
    """Replace obj.name by a wrapper adding its wall time to into[key]."""
    fn = getattr(obj, name)

    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            into[key] += time.perf_counter() - t
    setattr(obj, name, wrapper)


def profile(args, nextn: int, batch: int, prompts: list[list[int]]) -> dict:
    from deepinfer import LLM, SamplingParams
    llm = LLM(model=args.model, dtype="float32", max_model_len=args.prompt_len + args.gen_len + 16,
              max_num_seqs=batch, weight_format="dense", enforce_eager=True,
              num_speculative_tokens=nextn)
    engine = llm.llm_engine
    worker, model = engine.worker, engine.worker.model
    params = SamplingParams(temperature=0.0, max_tokens=args.gen_len, min_tokens=args.gen_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:batch]], params, use_tqdm=False)  # warm-up
    t = collections.defaultdict(float)
    timed(model, "compute_logits", t, "lm_head")
    timed(worker.runner, "run", t, "main_forward")
    if worker.spec is not None:
        timed(worker.spec, "_verify", t, "verify")
        timed(worker.spec.proposer, "propose", t, "draft")
        timed(model, "draft", t, "draft_layers")
    steps = [0]
    step = engine.step

    def counted_step():
        t0 = time.perf_counter()
        try:
            return step()
        finally:
            t["step"] += time.perf_counter() - t0
            steps[0] += 1
    engine.step = counted_step
    heads_in_draft = collections.defaultdict(float)
    if worker.spec is not None:  # the draft's own head call, apart from the main forward's
        inner = model.draft

        def draft_with_head(*a, **kw):
            before = t["lm_head"]
            try:
                return inner(*a, **kw)
            finally:
                heads_in_draft["x"] += t["lm_head"] - before
        model.draft = draft_with_head
    n_out = 0
    for r in range(0, len(prompts), batch):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[r:r + batch]], params, use_tqdm=False)
        n_out += sum(len(o.outputs[0].token_ids) for o in outs)
    rounds = -(-len(prompts) // batch)
    decode_steps = steps[0] - rounds  # one prefill step per round (the prompts fit in one chunk)
    ms = {k: 1e3 * v / max(decode_steps, 1) for k, v in t.items()}
    ms["lm_head_in_draft"] = 1e3 * heads_in_draft["x"] / max(decode_steps, 1)
    ms["lm_head_in_main"] = ms["lm_head"] - ms["lm_head_in_draft"]
    if worker.spec is not None:
        ms["draft_sampling"] = ms["draft"] - ms["draft_layers"]
        ms["draft_layers"] -= ms["lm_head_in_draft"]
    ms["main_forward_without_head"] = ms["main_forward"] - ms["lm_head_in_main"]
    ms["other"] = ms["step"] - ms["main_forward"] - ms.get("verify", 0.0) - ms.get("draft", 0.0)
    rec = {"nextn": nextn, "batch": batch, "decode_steps": decode_steps,
           "tokens_per_step_per_seq": (n_out - len(prompts)) / max(decode_steps, 1) / batch,
           "output_tok_s": n_out / t["step"], "ms_per_step": ms}
    del llm
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--nextn", default="0,3")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--gen-len", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=12345)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, 128000, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    recs = []
    for batch in (int(b) for b in args.batch.split(",")):
        for nextn in (int(n) for n in args.nextn.split(",")):
            rec = profile(args, nextn, batch, prompts)
            recs.append(rec)
            parts = " ".join(f"{k} {v:.1f}" for k, v in sorted(rec["ms_per_step"].items()))
            print(f"nextn {nextn} batch {batch}: {rec['tokens_per_step_per_seq']:.2f} tokens/step, "
                  f"{rec['output_tok_s']:.1f} tok/s; ms per decode step: {parts}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(recs, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
