"""Host-mode Neuron: compiled region graphs vs eager decode step time on the tiny checkpoints.

    python examples/neuron/bench_host_compile.py                       # both tiny checkpoints, aot_eager
    python examples/neuron/bench_host_compile.py --kind v4 --backend inductor --steps 30

For each checkpoint, three runners decode the same batch in lockstep (one step of each in turn, so
load changes on the machine hit all three alike):
  compiled  NeuronRegionStrategy, layer regions compiled (DEEPINFER_NEURON_COMPILE_BACKEND / --backend)
  eager     NeuronRegionStrategy without compilation (same buckets, padding and kernels)
  cpu       the CPU platform's EagerStrategy (no padding, CPU kernels)
It prints a table (median / mean decode step ms, ratio compiled/eager, graphs compiled, compile time)
and writes JSON. Host-mode times say nothing about Trainium: they measure graph overhead on a CPU.
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def bench_kind(kind: str, args) -> dict:
    import torch

    from deepinfer.config import ModelConfig
    from deepinfer.model_executor.tiny_checkpoint import make_tiny_checkpoint
    from deepinfer.neuron_ops.regions import RegionRunner
    from deepinfer.platforms.cpu import CpuPlatform
    from deepinfer.platforms.neuron.platform import NeuronPlatform
    from deepinfer.worker.runners import EagerStrategy, NeuronRegionStrategy
    from deepinfer.model_executor.static_step import BucketSpec
    from deepinfer.worker.worker import build_model
    from tests.support.model_helpers import Seqs, tiny_model

    ckpt = Path(args.ckpt_dir) / f"tiny-{kind}"
    if not (ckpt / "config.json").exists():
        make_tiny_checkpoint(kind, ckpt, seed=0)
    cfg = ModelConfig.from_pretrained(ckpt)
    cpu_model = build_model(cfg, str(ckpt), torch.float32, progress=False, platform=CpuPlatform())
    host = NeuronPlatform(host=True)
    host_model = tiny_model(cfg, host, like=cpu_model)

    g = torch.Generator().manual_seed(0)
    prompts = [[0] + torch.randint(3, 128000, (args.prompt_len - 1,), generator=g).tolist() for _ in range(args.batch)]
    spec = BucketSpec(batch=(args.batch,), contexts=(args.context,), prefill_tokens=None)
    regions = RegionRunner(args.backend)
    kw = dict(num_slots=args.batch + 1, num_blocks=args.batch * (args.context // 16 + 1) + 1)
    runs = {
        "compiled": Seqs(host_model, NeuronRegionStrategy, prompts, platform=host, buckets=spec, regions=regions, **kw),
        "eager": Seqs(host_model, NeuronRegionStrategy, prompts, platform=host, buckets=spec, compile=False, **kw),
        "cpu": Seqs(cpu_model, EagerStrategy, prompts, **kw),
    }
    times = {name: [] for name in runs}
    tokens = {name: [] for name in runs}
    compile_s = 0.0
    prefill = {i: len(p) for i, p in enumerate(prompts)}
    decode = {i: 1 for i in range(len(prompts))}
    for step in range(args.warmup + args.steps + 1):
        sizes = prefill if step == 0 else decode
        for name, s in runs.items():
            t0 = time.perf_counter()
            logits = s.step(sizes)
            dt = time.perf_counter() - t0
            if name == "compiled" and 1 <= step <= args.warmup:
                compile_s += dt
            if step > args.warmup:
                times[name].append(dt)
            for row, i in enumerate(sizes):
                tok = int(logits[row].argmax())
                s.tokens[i].append(tok)
                tokens[name].append(tok)
    res = {"kind": kind, "checkpoint": str(ckpt), "layers": cfg.num_layers, "backend": args.backend,
           "batch": args.batch, "context_bucket": args.context, "decode_steps": args.steps,
           "graphs_compiled": regions.stats.total_graphs, "layer_kinds": regions.num_kinds,
           "warmup_s": round(compile_s, 3),
           "tokens_equal": tokens["compiled"] == tokens["eager"] == tokens["cpu"]}
    for name, ts in times.items():
        res[f"{name}_median_ms"] = round(1e3 * statistics.median(ts), 2)
        res[f"{name}_mean_ms"] = round(1e3 * statistics.fmean(ts), 2)
    res["ratio_compiled_over_eager"] = round(res["compiled_median_ms"] / res["eager_median_ms"], 3)
    res["ratio_compiled_over_cpu"] = round(res["compiled_median_ms"] / res["cpu_median_ms"], 3)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", choices=("v4", "v41", "both"), default="both")
    ap.add_argument("--backend", choices=("aot_eager", "inductor", "eager"), default="aot_eager")
    ap.add_argument("--batch", type=int, default=4, help="decode rows (one batch bucket)")
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--context", type=int, default=128, help="context bucket")
    ap.add_argument("--warmup", type=int, default=2, help="decode steps before timing (compiles happen here)")
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per runner")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: see tests/conftest.py)")
    ap.add_argument("--ckpt-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "deepinfer-tiny"))
    ap.add_argument("--out", default="bench_host_compile.json")
    args = ap.parse_args(argv)
    if args.prompt_len + args.warmup + args.steps + 1 > args.context:
        ap.error("--context must hold prompt-len + warmup + steps + 1 positions")
    import torch
    torch.set_num_threads(args.threads)
    kinds = ("v4", "v41") if args.kind == "both" else (args.kind,)
    results = [bench_kind(k, args) for k in kinds]
    cols = ["kind", "graphs_compiled", "layer_kinds", "warmup_s", "compiled_median_ms", "eager_median_ms",
            "cpu_median_ms", "ratio_compiled_over_eager", "tokens_equal"]
    print(" | ".join(cols))
    for r in results:
        print(" | ".join(str(r[c]) for c in cols))
    meta = {"torch": torch.__version__, "threads": args.threads, "cpus": os.cpu_count(),
            "loadavg": os.getloadavg(), "note": "host mode on CPU; not a Trainium measurement"}
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(r["tokens_equal"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
