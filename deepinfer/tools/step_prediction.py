"""A predicted decode step on trn2 (ESTIMATE; nothing here ran on a device), for the dry run's
`decode_steps` (tools/dry_run.py, examples/neuron/memory_report.py --step --rows 1,8).

For each row count R, one decode step of R rows runs on the rank's model as built on meta (its own
shard: whatever the shard plan gives it, head and shared expert included), through the fixed-shape
path, recording every collective, the bytes each category of tensors is read (dry_run.ReadCounter;
by memory_report component) and every call of a kernel-table name with its argument shapes. Then:

- routed experts: on meta the active-experts form runs every slot (layers/moe.py), so the measured
  routed bytes are the worst case (min(local experts, pairs) experts a layer), checked against the
  count made here from each MoE's stacks. Expected bytes assume uniform routing: a row's top-k picks k
  distinct experts of E, so a held expert is hit with p = 1 - (1 - k/E)^rows and a layer reads
  n_local * p experts on average; a layer whose step takes the all-experts form reads all n_local.
- bytes_read_expected / _worst: everything else as measured (KV at most the cache once, as the
  floor estimate counts it) plus the routed experts expected / worst.
- predicted_ms: the kernel cost model (interpreter/cost.py, docs/neuron.md §3.7) for the calls that
  have an NKI kernel with weights (fp8 GEMMs at each call's shape; the routed experts as the fp4 GEMM
  pair per hit expert), the remaining bytes at one rank's HBM bandwidth, and the collectives one after
  another at the given latency. Kernels and transfers are added, not overlapped; compute of the
  kernel-less ops, launch costs and collective payload time are left out.
"""
from __future__ import annotations

import functools
import math

import torch

from deepinfer.tools import dry_run as dr

LABEL = "ESTIMATE (not measured)"
COLLECTIVE_LATENCY_S = 25e-6     # docs/neuron.md §6.1: NxDI DeepSeek-V3's in-model figure (3 ms over ~120)
SOURCES = ("HBM bandwidth per rank: docs/neuron.md §1.1; kernel cost model: docs/neuron.md §3.7 "
           "(neuron_ops/nki/interpreter/cost.py); collective latency: the command line's "
           "--collective-latency-us (default 25 us: NxDI DeepSeek-V3's in-model figure, docs/neuron.md §6.1)")
FP8_KERNELS = ("blockquant_fp8_gemm", "blockquant_fp8_grouped_gemm")
EXPERT_KERNELS = ("fp4_active_experts", "fp4_static_experts", "moe_experts_active", "moe_experts_static")


class KernelCalls:
    """Wraps a model's KernelTable so every call records (name, argument shapes, weight bytes)."""

    def __init__(self, table, weight_keys: set):
        self.table, self.weight_keys, self.calls, self._saved = table, weight_keys, [], {}

    def __enter__(self):
        from deepinfer.model_executor.layers.kernel_table import KERNEL_NAMES
        for name in KERNEL_NAMES:
            fn = getattr(self.table, name)
            self._saved[name] = fn
            setattr(self.table, name, self._recorder(name, fn))
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(self.table, name, fn)

    def _recorder(self, name, fn):
        def call(*args, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            weights = sum(t.numel() * t.element_size() for t in tensors
                          if t.untyped_storage()._cdata in self.weight_keys)
            self.calls.append({"kernel": name, "shapes": [tuple(t.shape) for t in tensors],
                               "ints": [a for a in args if isinstance(a, int)], "weight_bytes": weights})
            return fn(*args, **kwargs)
        return call


def moe_layers(model) -> list:
    """The MoE modules a decode step runs (the main decoder layers; draft layers run only in drafts)."""
    return [layer.ffn for layer in model.layers]


def expert_bytes(moe) -> int:
    """Bytes of one held expert: its slices of the stacked weights (and scales)."""
    stacks = [t for t in (moe._w13, moe._w13_scale, moe._w2, moe._w2_scale) if t is not None]
    return sum(t.numel() * t.element_size() for t in stacks) // moe.n_local


def routed_expectation(model, rows: int, ep_size: int, cp: int) -> list[dict]:
    """Per MoE layer: the form its step takes, the hit probability under uniform routing, expected
    and worst experts read and the bytes of one expert (see the module docstring)."""
    from deepinfer.model_executor.layers.moe import use_active_experts
    out = []
    for moe in moe_layers(model):
        kernel_rows = rows if moe.tokens_replicated or ep_size == 1 else rows * ep_size
        distinct = rows if moe.tokens_replicated or ep_size == 1 else rows * max(1, ep_size // cp)
        active = use_active_experts(kernel_rows, moe.topk, moe.n_experts)
        p_hit = 1.0 - (1.0 - moe.topk / moe.n_experts) ** distinct
        slots = min(moe.n_local, kernel_rows * moe.topk)
        out.append({"form": "active" if active else "all_experts", "local_experts": moe.n_local,
                    "hit_probability": p_hit,
                    "expected_experts": moe.n_local * p_hit if active else moe.n_local,
                    "worst_experts": min(moe.n_local, distinct * moe.topk) if active else moe.n_local,
                    "slots_on_meta": slots if active else moe.n_local,
                    "kernel_rows": kernel_rows, "bytes_per_expert": expert_bytes(moe),
                    "dim": moe.cfg.hidden_size, "inter": moe.cfg.moe_inter_size})
    return out


# --- kernel cost model at a call's shape (cached: the interpreter is slow at full width) ---------------
@functools.lru_cache(maxsize=None)
def fp8_gemm_seconds(m: int, k: int, n: int) -> float:
    from deepinfer.tools import kernel_report as kr
    return kr.predicted_seconds(kr._fp8_thunk(m, k, "auto"), n, kr.N_STEP)["total"]


@functools.lru_cache(maxsize=None)
def fp4_expert_seconds(m: int, dim: int, inter: int) -> float:
    """One hit expert: the fp4 gate/up GEMM [m, dim] x [dim, 2 inter], SwiGLU, the down GEMM."""
    from deepinfer.neuron_ops.nki import ops
    from deepinfer.tools import kernel_report as kr
    up = kr.predicted_seconds(kr._fp4_thunk(m, dim), 2 * inter, kr.N_STEP)["total"]
    down = kr.predicted_seconds(kr._fp4_thunk(m, inter), dim, kr.N_STEP)["total"]
    ops.swiglu(torch.zeros(m, inter, dtype=torch.bfloat16), torch.zeros(m, inter, dtype=torch.bfloat16), 10.0)
    return up + down + ops.last_stats().predicted_s


def fp8_call_seconds(call: dict) -> float:
    x, codes = call["shapes"][0], call["shapes"][1]
    if call["kernel"] == "blockquant_fp8_grouped_gemm":     # one launch per group: [T, K] x [R, K]
        groups = x[1]
        return groups * fp8_gemm_seconds(math.prod(x[:1]), x[2], codes[0] // groups)
    return fp8_gemm_seconds(math.prod(x[:-1]), x[-1], codes[0])


def predict(model, cache, layout, chunks, bucket, rows: int, ep_size: int, cp: int, latency_s: float,
            hbm_bytes_per_s: float, use_kernel_model: bool = True) -> dict:
    """The `decode_steps` entry of one row count (keys in the module docstring)."""
    cats = dr.storage_categories(model, cache, by_component=True)
    weight_keys = {k for k, c in cats.items() if c not in ("kv", "engram")}
    with KernelCalls(model.kernels, weight_keys) as rec:
        step = dr.run_step(model, cache, layout, chunks, bucket, logits_rows=rows, categories=cats)
    br = step["bytes_read"]
    layers = routed_expectation(model, rows, ep_size, cp)
    worst_on_meta = sum(m["slots_on_meta"] * m["bytes_per_expert"] for m in layers)
    if br.get("routed_experts", 0) != worst_on_meta:
        raise RuntimeError(f"decode step of {rows} rows read {br.get('routed_experts', 0)} routed-expert bytes, "
                           f"the slot count gives {worst_on_meta}: the step reads experts the count does not know")
    routed_expected = sum(m["expected_experts"] * m["bytes_per_expert"] for m in layers)
    routed_worst = sum(m["worst_experts"] * m["bytes_per_expert"] for m in layers)
    kv = min(br.get("kv", 0), step["kv_bytes_held"])
    by_component = {c: v for c, v in sorted(br.items()) if c not in ("kv", "engram", "routed_experts")}
    weights_other = sum(by_component.values())
    other = weights_other + br.get("engram", 0) + kv
    # kernel-model time for the fp8 GEMMs (their weight bytes leave the bandwidth term)
    fp8_calls = [c for c in rec.calls if c["kernel"] in FP8_KERNELS] if use_kernel_model else []
    fp8_bytes = sum(c["weight_bytes"] for c in fp8_calls)
    fp8_s = sum(fp8_call_seconds(c) for c in fp8_calls)
    packed = any(c["kernel"].startswith("fp4") for c in rec.calls if c["kernel"] in EXPERT_KERNELS)
    if use_kernel_model and packed:
        per = [fp4_expert_seconds(m["kernel_rows"], m["dim"], m["inter"]) for m in layers]
        experts_expected_s = sum(p * m["expected_experts"] for p, m in zip(per, layers))
        experts_worst_s = sum(p * m["worst_experts"] for p, m in zip(per, layers))
    else:
        experts_expected_s, experts_worst_s = routed_expected / hbm_bytes_per_s, routed_worst / hbm_bytes_per_s
    bandwidth_s = (other - fp8_bytes) / hbm_bytes_per_s
    collectives = step["collectives"]
    coll_s = len(collectives) * latency_s
    ms = 1e3
    return {
        "label": LABEL, "rows": rows, "context": step["context"],
        "bytes_read_expected": int(round(other + routed_expected)), "bytes_read_worst": int(other + routed_worst),
        "bytes_read_parts": {"routed_experts_expected": int(round(routed_expected)),
                             "routed_experts_worst": int(routed_worst), "weights_other": weights_other,
                             "weights_other_by_component": by_component, "kv": kv, "engram": br.get("engram", 0)},
        "routed_experts": {"layers": len(layers), "form": sorted({m["form"] for m in layers}),
                           "local_experts": layers[0]["local_experts"] if layers else 0,
                           "hit_probability": layers[0]["hit_probability"] if layers else 0.0,
                           "expected_experts_per_layer": layers[0]["expected_experts"] if layers else 0.0,
                           "worst_experts_per_layer": layers[0]["worst_experts"] if layers else 0,
                           "bytes_per_expert": layers[0]["bytes_per_expert"] if layers else 0},
        "collectives": dr.collective_summary(collectives), "collective_count": len(collectives),
        "max_collectives_per_layer": step["max_collectives_per_layer"], "outside_layers": step["outside_layers"],
        "predicted_ms": (fp8_s + experts_expected_s + bandwidth_s + coll_s) * ms,
        "predicted_ms_worst": (fp8_s + experts_worst_s + bandwidth_s + coll_s) * ms,
        "predicted_ms_parts": {"fp8_kernels": fp8_s * ms, "routed_experts": experts_expected_s * ms,
                               "bandwidth": bandwidth_s * ms, "collectives": coll_s * ms},
        "kernel_model": {"fp8_calls": len(fp8_calls), "fp8_weight_bytes": fp8_bytes,
                         "routed_experts": "fp4 kernel cost model per hit expert" if use_kernel_model and packed
                         else "bytes / HBM bandwidth"},
        "assumptions": {"collective_latency_s": latency_s, "hbm_bytes_per_s_per_rank": hbm_bytes_per_s,
                        "routing": "uniform: each row's top-k picks k distinct experts",
                        "overlap": "none: kernels, transfers and collectives added one after another",
                        "sources": SOURCES},
    }


def predictor(rows_list, latency_s: float = COLLECTIVE_LATENCY_S, use_kernel_model: bool = True,
              cache_slots: int | None = None):
    """The dry run's decode_steps hook: {str(R): predict(...)} for each R in rows_list, each step with
    its own cache on meta (of cache_slots state slots: dry_run.dry_run_cache)."""
    from deepinfer.model_executor.static_step import Bucket

    def decode_steps(model, cfg, layout, context: int, dtype, kv_cache_mode: str, log=None) -> dict:
        out = {}
        for r in rows_list:
            if log:
                log(f"predicted decode step: {r} row(s)")
            cache, cache_layout, bs = dr.dry_run_cache(cfg, r, context, dtype, kv_cache_mode, model.engram_spec,
                                                       slots=cache_slots)
            out[str(r)] = predict(model, cache, cache_layout, dr.decode_chunks(r, context, bs), Bucket(r, r, context),
                                  r, layout.ep, layout.cp, latency_s, dr.TRN2_HBM_BYTES_PER_S_PER_RANK,
                                  use_kernel_model)
        return out
    return decode_steps
