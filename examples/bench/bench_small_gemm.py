"""Small-row GEMMs on this CPU: which orientation of y = h @ W^T is fastest at 1-16 rows.

    python examples/bench/bench_small_gemm.py [--shapes 129280x256,1024x256] [--rows 1,2,4,8,16]
        [--rounds 15] [--threads N] [--out r.json]

For each weight shape V x D (fp32) and row count M, four orientations of the same product:
- `linear_vd`: F.linear(h, W) with W row-major [V, D] (nn.Linear's own layout);
- `h_at_dv`: h @ W.t() with W in [D, V] memory order (a contiguous [D, V] matrix: what post_load gives
  the fp32 linears and the LM head, models/deepseek_v4.py);
- `w_at_ht`: (W @ h.T).T with W row-major [V, D] (a GEMM with the weight as the left operand);
- `mv_vd` (M = 1 only): torch.mv(W, h[0]).
Every round runs every orientation twice, interleaved, so machine load hits all alike; the figure
is the median per-call time over the rounds, and GB/s counts the weight bytes read once.
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F


def orientations(w_vd: torch.Tensor, w_dv: torch.Tensor, h: torch.Tensor) -> dict:
    fns = {"linear_vd": lambda: F.linear(h, w_vd), "h_at_dv": lambda: h @ w_dv.t(),
           "w_at_ht": lambda: (w_vd @ h.t()).t()}
    if h.shape[0] == 1:
        fns["mv_vd"] = lambda: torch.mv(w_vd, h[0])[None]
    return fns


def measure(v: int, d: int, rows: list[int], rounds: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    w_vd = torch.randn(v, d, generator=g)
    w_dv = w_vd.t().contiguous().t()   # the same [V, D] values, [D, V] memory order
    out = []
    for m in rows:
        h = torch.randn(m, d, generator=g)
        fns = orientations(w_vd, w_dv, h)
        ref = fns["linear_vd"]()
        for name, f in fns.items():   # same values: the orientations differ only in speed
            torch.testing.assert_close(f(), ref, rtol=1e-4, atol=1e-4, msg=name)
        times = {k: [] for k in fns}
        for _ in range(rounds):
            for k, f in fns.items():
                t0 = time.perf_counter()
                f()
                f()
                times[k].append((time.perf_counter() - t0) / 2)
        med = {k: statistics.median(v_) for k, v_ in times.items()}
        best = min(med, key=med.get)
        out.append({"shape": [v, d], "rows": m, "ms": {k: t * 1e3 for k, t in med.items()}, "fastest": best,
                    "gb_per_s": {k: v * d * 4 / t / 1e9 for k, t in med.items()}})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="129280x256")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    records = []
    for shape in args.shapes.split(","):
        v, d = (int(x) for x in shape.lower().split("x"))
        for rec in measure(v, d, rows, args.rounds):
            records.append(rec)
            print(f"{v}x{d} rows {rec['rows']:3d}: " + "  ".join(f"{k} {t:7.2f} ms" for k, t in rec["ms"].items())
                  + f"  -> {rec['fastest']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "torch": torch.__version__, "records": records}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
