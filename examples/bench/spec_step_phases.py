"""Where a speculative step's time goes, and a drafter change against its baseline, in one process.

    git show REV:deepinfer/spec/proposer.py > /tmp/proposer_before.py
    python examples/bench/spec_step_phases.py --model <tiny v41> --baseline /tmp/proposer_before.py \
        [--nextn 3] [--output-len 24] [--rounds 2] --out phases.json

Two engines: nextn 0 (plain) and nextn `--nextn`; the speculative engine's DraftProposer runs as the
current class and, alternating with it, as the class of the `--baseline` file (an older
spec/proposer.py), on the same prompts, greedy and sampled (T 0.8, top-k 40, seeded), batch
1 and 4. Per variant: median output tok/s over the rounds (the first round is a warm-up) and ms per
engine step of each phase: main forward (ModelRunner.run), verification (SpecDecoder._verify), the
draft forward (model.draft) and the whole drafter (DraftProposer.propose; minus the draft forward =
per-depth draft sampling), per engine step with decode rows (the prompt steps' share included).
Prints the ratios and whether both variants emitted the same tokens (they must: a cost change is
not a result change).
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import statistics
import sys
import time

import torch


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--baseline", required=True, help="an older deepinfer/spec/proposer.py")
    ap.add_argument("--nextn", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    return ap.parse_args(argv)


def load_baseline(path: str):
    spec = importlib.util.spec_from_file_location("proposer_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def timed(obj, name: str, key: str, acc: dict, bound: bool = True) -> None:
    f = getattr(obj, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[key] += time.perf_counter() - t
    setattr(obj, name, wrapper if bound else (lambda self, *a, **k: wrapper(self, *a, **k)))


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from deepinfer import LLM, SamplingParams
    from deepinfer.spec import decoder, proposer
    baseline = load_baseline(args.baseline)
    common = dict(dtype="float32", max_model_len=16 + args.output_len + 8, max_num_seqs=4, skip_tokenizer_init=True)
    plain, spec = LLM(args.model, **common), LLM(args.model, num_speculative_tokens=args.nextn, **common)
    worker = spec.llm_engine.worker
    acc = collections.defaultdict(float)
    timed(worker.runner, "run", "main_forward", acc)
    timed(worker.model, "draft", "draft_forward", acc)
    for name, key in (("_verify", "verify"), ("execute", "step")):
        timed(decoder.SpecDecoder, name, key, acc, bound=False)
    for cls in (proposer.DraftProposer, baseline.DraftProposer):
        timed(cls, "propose", "drafter", acc, bound=False)
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": [0] + torch.randint(3, 128000, (15,), generator=g).tolist()} for _ in range(4)]
    n = args.output_len
    work = {"greedy": [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)] * 4,
            "sampled": [SamplingParams(temperature=0.8, top_k=40, seed=11 + i, max_tokens=n, ignore_eos=True)
                        for i in range(4)]}
    variants = {"plain": None, "baseline": baseline.DraftProposer, "current": proposer.DraftProposer}
    tok_s, phases, tokens = (collections.defaultdict(list), collections.defaultdict(lambda: collections.defaultdict(list)),
                             {})
    for r in range(args.rounds + 1):
        for wname, params in work.items():
            for bs in (1, 4):
                for vname, cls in variants.items():
                    llm = plain if cls is None else spec
                    if cls is not None:
                        worker.spec.proposer.__class__ = cls
                    acc.clear()
                    steps0 = llm.llm_engine.stats().spec_decode.num_steps
                    t = time.perf_counter()
                    outs = llm.generate(prompts[:bs], params[:bs], use_tqdm=False)
                    dt = time.perf_counter() - t
                    steps = llm.llm_engine.stats().spec_decode.num_steps - steps0
                    tokens[(wname, bs, vname)] = [list(o.outputs[0].token_ids) for o in outs]
                    if r == 0:
                        continue
                    key = (wname, bs, vname)
                    tok_s[key].append(bs * n / dt)
                    for k, v in acc.items():
                        phases[key][k].append(v / max(steps, 1) * 1e3)
    records = []
    for wname in work:
        for bs in (1, 4):
            med = {v: statistics.median(tok_s[(wname, bs, v)]) for v in variants}
            ph = {v: {k: round(statistics.median(x), 2) for k, x in phases[(wname, bs, v)].items()}
                  for v in ("baseline", "current")}
            for p in ph.values():
                if "drafter" in p and "draft_forward" in p:
                    p["draft_sampling"] = round(p["drafter"] - p["draft_forward"], 2)
            same = tokens[(wname, bs, "baseline")] == tokens[(wname, bs, "current")]
            rec = {"sampling": wname, "batch": bs, "tok_s": med, "current_vs_baseline": med["current"] / med["baseline"],
                   "plain_vs_current": med["plain"] / med["current"], "phases_ms_per_step": ph, "same_tokens": same}
            records.append(rec)
            print(f"{wname} batch {bs}: plain {med['plain']:.2f} tok/s, baseline {med['baseline']:.2f}, current "
                  f"{med['current']:.2f} (x{rec['current_vs_baseline']:.3f}); plain / current "
                  f"{rec['plain_vs_current']:.2f}; same tokens {same}")
            for v, p in ph.items():
                print(f"    {v:>8} ms/step: {p}")
    with open(args.out, "w") as f:
        json.dump({"config": vars(args), "records": records}, f, indent=1)
    return 0 if all(r["same_tokens"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
