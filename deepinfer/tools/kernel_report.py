"""Per NKI kernel at V4.1-Flash decode shapes: instruction counts by engine and bytes moved, counted
by the NKI interpreter while it runs the kernel on random weights, and a roofline estimate of its
trn2 time, next to the seed's measured kernel figures
(the command line: examples/neuron/kernel_report.py).

The roofline is labelled an estimate: time >= max(HBM bytes / bandwidth, TensorE FLOPs / peak) for
one logical core at LNC = 2 (the grid-2 launch), from docs/neuron.md section 1.1 (Trainium2 chip:
2.9 TB/s HBM, 667 BF16 / 181 FP32 dense TFLOPS, 8 NeuronCores): per logical core (2 physical
cores) 2.9 / 4 = 0.725 TB/s, 667 / 4 = 166.75 BF16 TFLOPS, 181 / 4 = 45.25 FP32 TFLOPS. It leaves
out the Vector Engine, which dequantizes every weight element and which the seed's figures suggest
is what bounds these kernels (compare the two columns); the vector instruction count is printed so
the gap can be read against it. `cost_report` adds the interpreter's cost model (every engine,
interpreter/cost.py; docs/neuron.md section 3.7) at the seed's two measured shapes.
"""
from __future__ import annotations

import torch

from deepinfer.neuron_ops.nki import ops

HBM_BYTES_PER_S = 2.9e12 / 4
PEAK_FLOPS = {torch.bfloat16: 667e12 / 4, torch.float32: 181e12 / 4}
ASSUMPTIONS = {"hbm_bytes_per_s": HBM_BYTES_PER_S, "bf16_flops_per_s": PEAK_FLOPS[torch.bfloat16],
               "fp32_flops_per_s": PEAK_FLOPS[torch.float32],
               "source": "docs/neuron.md 1.1 (trn2 chip: 2.9 TB/s, 667 BF16 / 181 FP32 TFLOPS, 8 cores), "
                         "one LNC=2 logical core = 1/4 chip"}
# The seed's measured kernel times on trn2 (kernel name, M, K, N) -> ms
SEED_MS = {("blockquant_fp8_gemm", 1, 1280, 36864): 1.17, ("blockquant_fp4_gemm", 64, 5120, 4608): 0.40}

GEN = torch.Generator().manual_seed(0)


def _fp8(n, k):
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=GEN)
    codes = torch.where((codes & 0x78) == 0x78, codes & 0xF7, codes)     # trn2 e4m3 (<= 240)
    return codes, torch.randint(120, 128, (-(-n // 32), -(-k // 32)), dtype=torch.uint8, generator=GEN)


def _fp4(n, k, lead=()):
    return (torch.randint(0, 256, (*lead, n, k // 2), dtype=torch.uint8, generator=GEN),
            torch.randint(120, 128, (*lead, n, -(-k // 32)), dtype=torch.uint8, generator=GEN))


def _x(m, k):
    return torch.randn(m, k, generator=GEN).to(torch.bfloat16)


def cases(cfg, rows, scale):
    """(label, kernel name, M, K, N, per-call multiplier, thunk) at decode shapes."""
    d = cfg.hidden_size // scale
    q_rank, heads_dim = cfg.q_lora_rank // scale, cfg.num_heads * cfg.head_dim // scale
    groups, o_rank, inter = cfg.o_groups, cfg.o_lora_rank // scale, cfg.moe_inter_size // scale
    out = []
    for m in rows:
        w = _fp8(heads_dim, q_rank)
        out.append(("wq_b", "blockquant_fp8_gemm", m, q_rank, heads_dim, 1,
                    lambda m=m, w=w: ops.blockquant_fp8_gemm(_x(m, q_rank), *w, 32, 32)))
        seed_n = 36864 // scale
        w = _fp8(seed_n, q_rank)
        out.append(("seed fp8 shape", "blockquant_fp8_gemm", m, q_rank, seed_n, 1,
                    lambda m=m, w=w: ops.blockquant_fp8_gemm(_x(m, q_rank), *w, 32, 32)))
        k_g = heads_dim // groups
        w = _fp8(groups * o_rank, k_g)
        out.append(("wo_a (grouped)", "blockquant_fp8_grouped_gemm", m, k_g, groups * o_rank, 1,
                    lambda m=m, w=w: ops.blockquant_fp8_grouped_gemm(
                        torch.randn(m, groups, k_g, generator=GEN).bfloat16(), *w, 32, 32)))
        w = _fp8(d, groups * o_rank)
        out.append(("wo_b", "blockquant_fp8_gemm", m, groups * o_rank, d, 1,
                    lambda m=m, w=w: ops.blockquant_fp8_gemm(_x(m, groups * o_rank), *w, 32, 32)))
        w = _fp8(2 * inter, d)
        out.append(("shared expert w13", "blockquant_fp8_gemm", m, d, 2 * inter, 1,
                    lambda m=m, w=w: ops.blockquant_fp8_gemm(_x(m, d), *w, 32, 32)))
        w = _fp4(2 * inter, d)
        out.append(("routed expert w13", "blockquant_fp4_gemm", m, d, 2 * inter, 1,
                    lambda m=m, w=w: ops.blockquant_fp4_gemm(_x(m, d), *w, 32)))
        w13, w2 = _fp4(2 * inter, d, (1,)), _fp4(d, inter, (1,))
        idx = torch.zeros(m, 1, dtype=torch.long)
        # the fixed-shape form runs every expert on every row: one expert measured, times E
        out.append((f"static experts (1 of {cfg.n_routed_experts}) x E", "fp4_static_experts", m, d, 2 * inter,
                    cfg.n_routed_experts,
                    lambda m=m, w13=w13, w2=w2, idx=idx: ops.fp4_static_experts(
                        _x(m, d) * 0.05, idx, torch.ones(m, 1), w13[0], w13[1], w2[0], w2[1], 32, cfg.swiglu_limit)))
    return out


def run(cfg, rows, scale):
    report = []
    for label, name, m, k, n, mult, thunk in cases(cfg, rows, scale):
        thunk()
        s = ops.last_stats().as_dict()
        bytes_moved = s["dma_bytes_in"] + s["dma_bytes_out"]
        t_dma = bytes_moved / HBM_BYTES_PER_S
        t_pe = s["matmul_flops"] / PEAK_FLOPS[torch.bfloat16]
        report.append({
            "label": label, "kernel": name, "M": m, "K": k, "N": n, "multiplier": mult,
            "instructions": {e: v * mult for e, v in s["instructions"].items()},
            "dma_bytes": bytes_moved * mult, "matmul_flops": s["matmul_flops"] * mult,
            "launches": getattr(ops.last_stats(), "launches", 1) * mult,
            "peak_sbuf_bytes": s["peak_sbuf_bytes"], "peak_psum_banks": s["peak_psum_banks"],
            "roofline_estimate_ms": max(t_dma, t_pe) * mult * 1e3,
            "predicted_ms": s["predicted_s"] * mult * 1e3,   # cost model, ESTIMATE (interpreter/cost.py)
            "roofline_bound": "HBM" if t_dma >= t_pe else "TensorE",
            "seed_measured_ms": SEED_MS.get((name, m, k, n)) if scale == 1 else None,
        })
    return report


def format_table(report) -> str:
    """The report as the table the command line prints."""
    head = (f"{'case':34} {'kernel':28} {'M':>3} {'K':>6} {'N':>6} {'tensor':>8} {'vector':>9} {'scalar':>7} "
            f"{'gpsimd':>7} {'dma':>7} {'MB moved':>9} {'roofline ms':>11} {'bound':>7} {'model ms':>9} {'seed ms':>8}")
    lines = [head]
    for r in report:
        i = r["instructions"]
        seed = f"{r['seed_measured_ms']:.2f}" if r["seed_measured_ms"] is not None else "-"
        lines.append(f"{r['label']:34} {r['kernel']:28} {r['M']:>3} {r['K']:>6} {r['N']:>6} {i['tensor']:>8} "
                     f"{i['vector']:>9} {i['scalar']:>7} {i['gpsimd']:>7} {i['dma']:>7} "
                     f"{r['dma_bytes'] / 1e6:>9.2f} {r['roofline_estimate_ms']:>11.4f} {r['roofline_bound']:>7} "
                     f"{r['predicted_ms']:>9.4f} {seed:>8}")
    lines.append("roofline estimate = max(HBM bytes / 0.725 TB/s, TensorE FLOPs / 166.75 BF16 TFLOPS), one LNC=2 "
                 "logical core (docs/neuron.md 1.1); Vector Engine dequantization not in it; model ms = the cost "
                 "model's ESTIMATE over every engine (docs/neuron.md 3.7); seed ms = measured on trn2.")
    return "\n".join(lines)


# --- cost model predictions (ESTIMATE; interpreter/cost.py, docs/neuron.md section 1.1) -------------
def _engine_seconds(thunk) -> dict:
    thunk()
    s = ops.last_stats()
    return dict(s.engine_s)


def predicted_seconds(make_thunk, n: int, step: int) -> dict:
    """The cost model's time of a GEMM of width n, found without running it at full width: the
    kernels' N loop runs identical tiles of `step` columns (both programs' shares together), so each
    engine's busy time is linear in the tile count; it is measured at the smallest width with the
    same last partial tile and at one tile more, and extended to n. Returns per-engine seconds and
    "total" (their max, cost.py's overlap rule)."""
    n_a = n % step + step if n > step else n
    e_a = _engine_seconds(make_thunk(n_a))
    if n_a == n:
        return {**e_a, "total": max(e_a.values())}
    e_b = _engine_seconds(make_thunk(n_a + step))
    tiles = (n - n_a) // step
    full = {e: e_a[e] + tiles * (e_b[e] - e_a[e]) for e in e_a}
    return {**full, "total": max(full.values())}


def roofline_seconds(m: int, k: int, n: int, weight_bytes: float) -> float:
    """max(HBM bytes / bandwidth, TensorE FLOPs / BF16 peak) of one LNC = 2 logical core."""
    x_bytes, out_bytes = m * k * 2, m * n * 2
    return max((weight_bytes + x_bytes + out_bytes) / HBM_BYTES_PER_S, 2 * m * k * n / PEAK_FLOPS[torch.bfloat16])


def _fp8_thunk(m, k, design):
    def make(n):
        w = _fp8(n, k)
        x = _x(m, k)
        return lambda: ops.blockquant_fp8_gemm(x, *w, 32, 32, design=design)
    return make


def _fp4_thunk(m, k, design="words"):
    def make(n):
        w = _fp4(n, k)
        x = _x(m, k)
        return lambda: ops.blockquant_fp4_gemm(x, *w, 32, design=design)
    return make


# (name, M, K, N): the seed's two measured kernels
SEED_SHAPES = (("blockquant_fp8_gemm", 1, 1280, 36864), ("blockquant_fp4_gemm", 64, 5120, 4608))
N_STEP = 2 * 512     # both programs' N tiles of 512 columns


def cost_report(scale: int = 1) -> list:
    """The kernel-cost rows of kernel_report --json: predicted, roofline, the seed's measurement and
    the seed design's prediction, at the seed's shapes (K and N divided by `scale`; the measurement
    only at scale 1)."""
    rows = []
    for name, m, k_full, n_full in SEED_SHAPES:
        k, n = k_full // scale, n_full // scale
        if name == "blockquant_fp8_gemm":
            weight_bytes = n * k + n * k / 32          # codes + K-major row-expanded exponents
            now = predicted_seconds(_fp8_thunk(m, k, "auto"), n, N_STEP)
            seed = predicted_seconds(_fp8_thunk(m, k, "seed"), n, N_STEP)
        else:
            weight_bytes = n * k / 2 + n * k / 32       # nibbles + one exponent per 32
            now = predicted_seconds(_fp4_thunk(m, k, "words"), n, N_STEP)
            seed = predicted_seconds(_fp4_thunk(m, k, "vector"), n, N_STEP)
        rows.append({"name": name, "shape": [m, k, n], "predicted_ms": now["total"] * 1e3,
                     "predicted_engine_ms": {e: v * 1e3 for e, v in now.items() if e != "total"},
                     "roofline_ms": roofline_seconds(m, k, n, weight_bytes) * 1e3,
                     "seed_measured_ms": SEED_MS[(name, m, k, n)] if scale == 1 else None,
                     "seed_design_predicted_ms": seed["total"] * 1e3, "estimate": True})
    return rows
