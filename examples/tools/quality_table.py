"""What each of the engine's approximations costs on a trained tiny checkpoint: greedy accuracy per
kind of docs/tiny_language.md on held-out prompts, and the mean KL of the next-token distribution
against the fp32 plain-KV CPU run, one row per configuration (README "Trained tiny model").

    python examples/tools/quality_table.py --model checkpoints/trained-v41 [--n 200] [--long 0] \\
        [--configs fp32,bf16,compact,neuron,simulate,cp2ep2] [--json out.json]

Configurations (each builds its own engine; the environment variables are read when the platform
is made, docs/neuron.md):
- fp32: CPU, fp32, plain KV (the reference of the KL column);
- bf16: CPU, bf16 compute;
- compact: CPU, fp32, DeepSeek's compact KV records (fp8 window, fp4 entries and index keys);
- neuron: Neuron host mode (DEEPINFER_ACCELERATOR=neuron: region graphs, the trn2 e4m3 rescale of
  the fp8 weights, docs/neuron.md §7), reference kernels;
- simulate: Neuron host mode with DEEPINFER_NEURON_KERNELS=simulate (the NKI kernels in the NumPy
  interpreter);
- cp2ep2: CPU, fp32, context parallel 2 x expert parallel 2 (four ranks, gloo).

KL: the raw next-token distribution (prompt_logprobs: the model's own softmax, before any sampling
transform) at every position of the right answer, teacher-forced: each configuration reads the
prompt followed by the language's right answer, so every configuration sees the same contexts
whatever it generates. Over the reference's top 20 tokens (the engine returns at most 20 logprobs a
token): sum p_ref (log p_ref - log p_cfg), a token missing from the configuration's top 20 taking
the configuration's 20th logprob (an upper bound on its probability); the mean over those
positions. (The sampled tokens' logprobs would not do: a greedy request's logprobs come from its
processed distribution, the logits over a temperature of 1e-5, which multiplies every logit
difference by 1e5.)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))  # deepinfer, from a checkout
sys.path.insert(0, os.path.dirname(_HERE))                   # tiny_language

import tiny_language as lang  # noqa: E402

MAX_TOKENS = {"count": 12, "copy": 14, "lookup": 3, "long_lookup": 3}
TOP = 20

CONFIGS = {
    "fp32": ({}, dict(dtype="float32")),
    "bf16": ({}, dict(dtype="bfloat16")),
    "compact": ({}, dict(dtype="float32", kv_cache_mode="compact")),
    "neuron": ({"DEEPINFER_ACCELERATOR": "neuron"}, dict(dtype="float32")),
    "simulate": ({"DEEPINFER_ACCELERATOR": "neuron", "DEEPINFER_NEURON_KERNELS": "simulate"}, dict(dtype="float32")),
    "cp2ep2": ({}, dict(dtype="float32", context_parallel_size=2, expert_parallel_size=2)),
}
DESCRIPTION = {
    "fp32": "CPU, fp32, plain KV (reference)", "bf16": "CPU, bf16, plain KV",
    "compact": "CPU, fp32, compact KV records", "neuron": "Neuron host mode (trn2 fp8 rescale), reference kernels",
    "simulate": "Neuron host mode, simulated NKI kernels", "cp2ep2": "CPU, fp32, cp 2 x ep 2 (4 ranks)",
}


def run_here(name: str, model: str, prompts: list, max_len: int) -> dict:
    """{"texts", "dists" (top-20 raw logprobs at each teacher-forced answer position), "seconds"} of one
    configuration, in this process (whose environment already holds the configuration's variables)."""
    from deepinfer import LLM, SamplingParams
    t0 = time.perf_counter()
    llm = LLM(model=model, max_model_len=max_len, max_num_seqs=min(len(prompts), 16), **CONFIGS[name][1])
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[p.kind], ignore_eos=True) for p in prompts]
    outs = llm.generate([p.prompt for p in prompts], params, use_tqdm=False)
    # teacher-forced: the prompt and its right answer, the raw distribution at each answer position
    tok = llm.get_tokenizer()
    forced = [tok.encode(p.prompt + p.answer) for p in prompts]
    starts = [len(tok.encode(p.prompt)) for p in prompts]
    for ids, start, p in zip(forced, starts, prompts):
        if ids[:start] != tok.encode(p.prompt):
            raise ValueError(f"the answer changes the prompt's tokens: {p.prompt!r} + {p.answer!r}")
    teach = llm.generate([{"prompt_token_ids": ids} for ids in forced],
                         SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=TOP), use_tqdm=False)
    llm.close()
    return {"texts": [o.outputs[0].text for o in outs],
            "dists": [[{str(t): lp.logprob for t, lp in pos.items()} for pos in o.prompt_logprobs[start:]]
                      for o, start in zip(teach, starts)],
            "seconds": time.perf_counter() - t0}


def run_config(name: str, args) -> dict:
    """One configuration in its own process: the platform reads its environment variables once."""
    import subprocess
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".json") as dump:
        cmd = [sys.executable, os.path.abspath(__file__), "--model", args.model, "--n", str(args.n),
               "--long", str(args.long), "--seed", str(args.seed), "--threads", str(args.threads),
               "--configs", name, "--only", name, "--dump", dump.name]
        subprocess.run(cmd, check=True, env={**os.environ, **CONFIGS[name][0]})
        with open(dump.name) as f:
            res = json.load(f)
    res["dists"] = [[{int(t): lp for t, lp in pos.items()} for pos in d] for d in res["dists"]]
    return res


def kl(ref: dict[int, float], got: dict[int, float]) -> float:
    floor = min(got.values())
    return sum(math.exp(lp) * (lp - got.get(t, floor)) for t, lp in ref.items())


def table(results: dict, prompts: list, kinds: list[str]) -> tuple[list[dict], str]:
    ref = results["fp32"]
    rows = []
    for name, res in results.items():
        row = {"config": name, "what": DESCRIPTION[name], "seconds": round(res["seconds"], 1)}
        for kind in kinds:
            idx = [i for i, p in enumerate(prompts) if p.kind == kind]
            row[kind] = sum(prompts[i].correct(res["texts"][i]) for i in idx) / len(idx)
        kls = [kl(a, b) for i in range(len(prompts)) for a, b in zip(ref["dists"][i], res["dists"][i])]
        row["kl"] = sum(kls) / len(kls)
        row["kl_positions"] = len(kls)
        rows.append(row)
    head = "| configuration | " + " | ".join(kinds) + " | mean KL vs fp32 plain |\n"
    head += "|---|" + "---|" * len(kinds) + "---|\n"
    body = "".join(f"| {r['what']} | " + " | ".join(f"{100 * r[k]:.1f} %" for k in kinds)
                   + f" | {r['kl']:.2e} |\n" for r in rows)
    return rows, head + body


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--n", type=int, default=200, help="held-out prompts of count, copy and lookup each")
    ap.add_argument("--long", type=int, default=0, help="held-out long-lookup prompts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", default="fp32,bf16,compact,neuron,simulate,cp2ep2")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default=None, help=argparse.SUPPRESS)   # one configuration, in this process
    ap.add_argument("--dump", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    names = args.configs.split(",")
    bad = [c for c in names if c not in CONFIGS]
    if bad or ("fp32" not in names and not args.only):
        ap.error(f"--configs: choose from {sorted(CONFIGS)}, fp32 (the reference) included; got {args.configs}")
    if not args.only:
        names = ["fp32"] + [c for c in names if c != "fp32"]
    import torch
    torch.set_num_threads(args.threads)
    kinds = ["count", "copy", "lookup"] + (["long_lookup"] if args.long else [])
    prompts = [p for kind in kinds[:3] for p in lang.heldout_prompts(kind, args.n, args.seed)]
    prompts += lang.heldout_prompts("long_lookup", args.long, args.seed) if args.long else []
    max_len = 4200 if args.long else 256
    if args.only:
        with open(args.dump, "w") as f:
            json.dump(run_here(args.only, args.model, prompts, max_len), f)
        return 0
    results = {}
    for name in names:
        results[name] = run_config(name, args)
        print(f"{name}: {results[name]['seconds']:.0f} s", flush=True)
    rows, md = table(results, prompts, kinds)
    print(md)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"n": args.n, "long": args.long, "seed": args.seed, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
