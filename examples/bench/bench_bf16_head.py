"""The LM head's GEMM by row count: the fp32 GEMM the engine runs on a [D, V]-ordered fp32 head
against the bf16-weight kernels on the same values held as bf16 (the vector kernel of
layers/bf16_rows_gemm.py, and where the CPU has AMX the tiles kernel of layers/bf16_tiles_gemm.py),
alternated in one process (these machines are noisy: compare the ratios).

    python examples/bench/bench_bf16_head.py [--vocab 129280] [--dim 256] [--rows 1,2,4,8,16,32] \
        [--threads 1] [--reps 30] [--out head.json]

Prints, per row count, the median and best ms of each and fp32 / kernel; writes the same as JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from deepinfer.model_executor.layers import bf16_rows_gemm, bf16_tiles_gemm


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if not bf16_rows_gemm.available():
        raise SystemExit("the bf16 rows kernel could not be built here (no C compiler?)")
    g = torch.Generator().manual_seed(0)
    w16 = (torch.randn(args.vocab, args.dim, generator=g) * 0.05).to(torch.bfloat16)
    w32 = w16.float().t().contiguous().t()   # the engine's fp32 head: [V, D] values in [D, V] order
    tiles = bf16_tiles_gemm.pack_tiles(w16) if bf16_tiles_gemm.available() and args.vocab % 16 == 0 else None
    records = []
    for m in (int(r) for r in args.rows.split(",")):
        h = torch.randn(m, args.dim, generator=g)
        fns = {"fp32": lambda: h @ w32.t(), "kernel": lambda: torch.ops.deepinfer.bf16_rows_gemm(h, w16)}
        if tiles is not None:
            fns["tiles"] = lambda: torch.ops.deepinfer.bf16_tiles_gemm(h, tiles)
        times = {k: [] for k in fns}
        for fn in fns.values():
            fn()
        for _ in range(args.reps):
            for k, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                times[k].append((time.perf_counter() - t0) * 1e3)
        rec = {"rows": m, **{f"{k}_ms": statistics.median(v) for k, v in times.items()},
               **{f"{k}_best_ms": min(v) for k, v in times.items()}}
        rec["fp32_over_kernel"] = rec["fp32_ms"] / rec["kernel_ms"]
        line = (f"rows {m:3d}: fp32 {rec['fp32_ms']:6.2f} ms (best {rec['fp32_best_ms']:6.2f}), kernel "
                f"{rec['kernel_ms']:6.2f} ms (best {rec['kernel_best_ms']:6.2f}), fp32 / kernel {rec['fp32_over_kernel']:.2f}")
        if tiles is not None:
            rec["fp32_over_tiles"] = rec["fp32_ms"] / rec["tiles_ms"]
            line += f"; tiles {rec['tiles_ms']:6.2f} ms (best {rec['tiles_best_ms']:6.2f}), fp32 / tiles {rec['fp32_over_tiles']:.2f}"
        records.append(rec)
        print(line)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"vocab": args.vocab, "dim": args.dim, "threads": args.threads, "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
