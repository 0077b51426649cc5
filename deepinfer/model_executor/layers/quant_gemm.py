"""GEMMs on weights kept in their checkpoint formats (docs/model.md §2.1): the references of the
named kernels `blockquant_fp8_gemm`, `blockquant_fp8_grouped_gemm`, `blockquant_fp4_gemm`,
`fp4_routed_experts` / `fp4_static_experts` / `fp4_active_experts` and `fp8_table_rows`.

Arguments are what a device kernel reads: codes as uint8 bytes (e4m3 values, or e2m1 pairs with the
low nibble first), ue8m0 scales as uint8 exponent bytes, block shapes as ints; no float8 dtype and no
bitcast of an input reaches a graph (docs/neuron.md §4 A11). The e4m3 codes are read through a
float8 view, or with int_codes through integer arithmetic (layers/quant_bits.py, the same values
bit for bit), the form the Neuron references take so that their graphs hold no float8 value
(§4 A9). On the Neuron platform the packed weights are stored in the NKI kernels' layouts
(layers/kernel_layouts.py, told apart by their shapes); every function here takes those too and
reads them through `kernel_layouts.fp8_checkpoint_view` / `fp4_checkpoint_view`: the same codes and
exponents the kernel reads. Each reference dequantizes one tile at a time inside
the call (a block of output rows, one expert) and accumulates in fp32, so no dense copy of a weight
outlives the call. Outputs are in x's dtype.
"""
from __future__ import annotations

import torch

from deepinfer.model_executor.layers import kernel_layouts, quant, quant_bits
from deepinfer.model_executor.layers.moe import (active_expert_slots, active_slot_sum, combine_weights, looped_experts,
                                                 swiglu)

# Output rows dequantized per tile: bounds the transient dense tile to TILE_ROWS x K fp32 values.
TILE_ROWS = 2048


def _check_codes(name: str, codes: torch.Tensor) -> None:
    if codes.dtype != torch.uint8:
        raise ValueError(f"{name}: expected uint8 code bytes, got {codes.dtype}")


def e4m3_values(codes: torch.Tensor, int_codes: bool = False) -> torch.Tensor:
    """uint8 e4m3 codes -> fp32: a float8 view, or integer arithmetic with no float8 tensor."""
    return quant_bits.e4m3_to_float(codes) if int_codes else codes.view(torch.float8_e4m3fn).to(torch.float32)


def dequant_fp8_rows(codes: torch.Tensor, scale: torch.Tensor, block_rows: int, block_cols: int,
                     row0: int, row1: int, int_codes: bool = False) -> torch.Tensor:
    """fp32 rows [row0, row1) of a [N, K] e4m3 weight with a ue8m0 [ceil(N/br), ceil(K/bc)] grid."""
    rows = e4m3_values(codes[row0:row1], int_codes)
    s = quant.ue8m0_to_float(scale[row0 // block_rows: -(-row1 // block_rows)])
    n, k = rows.shape
    if row0 % block_rows == 0 and n % block_rows == 0 and k % block_cols == 0:
        # whole blocks: each scale broadcast over its block, not repeated into a [n, k] copy
        grid = rows.view(n // block_rows, block_rows, k // block_cols, block_cols)
        return (grid * s[:, None, :, None]).view(n, k)
    s = s.repeat_interleave(block_rows, dim=0)[row0 % block_rows: row0 % block_rows + (row1 - row0)]
    return rows * s.repeat_interleave(block_cols, dim=1)[:, : rows.shape[1]]


def _row_tiles(n: int, block_rows: int):
    step = max(block_rows, TILE_ROWS // block_rows * block_rows)
    return [(r, min(n, r + step)) for r in range(0, n, step)]


def blockquant_fp8_gemm(x: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor, block_rows: int,
                        block_cols: int, *, int_codes: bool = False) -> torch.Tensor:
    """y = x @ W^T. x: [M, K]; w_codes: uint8 e4m3 [N, K]; w_scale: uint8 ue8m0 [ceil(N/br), ceil(K/bc)]
    (or the kernel layout of both)."""
    _check_codes("blockquant_fp8_gemm w_codes", w_codes)
    if kernel_layouts.fp8_is_kernel_layout(w_codes):
        w_codes, w_scale = kernel_layouts.fp8_checkpoint_view(w_codes, w_scale, x.shape[-1], block_cols)
    xf = x.float()
    outs = [xf @ dequant_fp8_rows(w_codes, w_scale, block_rows, block_cols, r0, r1, int_codes).t()
            for r0, r1 in _row_tiles(w_codes.shape[0], block_rows)]
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)).to(x.dtype)


def blockquant_fp8_grouped_gemm(x: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor, block_rows: int,
                                block_cols: int, *, int_codes: bool = False) -> torch.Tensor:
    """Per-group GEMM of a weight whose rows are G equal groups: x: [T, G, K]; w_codes: uint8 [G * R, K];
    y[t, g] = x[t, g] @ W[g * R:(g + 1) * R]^T -> [T, G, R] (the attention output's grouped low rank)."""
    _check_codes("blockquant_fp8_grouped_gemm w_codes", w_codes)
    if kernel_layouts.fp8_is_kernel_layout(w_codes):
        w_codes, w_scale = kernel_layouts.fp8_checkpoint_view(w_codes, w_scale, x.shape[-1], block_cols)
    groups, rows = x.shape[1], w_codes.shape[0] // x.shape[1]
    xf = x.float()
    outs = [torch.einsum("tk,rk->tr", xf[:, g],
                         dequant_fp8_rows(w_codes, w_scale, block_rows, block_cols, g * rows, (g + 1) * rows,
                                          int_codes))
            for g in range(groups)]
    return torch.stack(outs, dim=1).to(x.dtype)


def blockquant_fp4_gemm(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, group: int) -> torch.Tensor:
    """y = x @ W^T. x: [M, K]; w_packed: uint8 e2m1 pairs [N, K/2]; w_scale: uint8 ue8m0 [N, K/group]."""
    _check_codes("blockquant_fp4_gemm w_packed", w_packed)
    if kernel_layouts.fp4_is_kernel_layout(w_packed, w_scale):
        w_packed, w_scale = kernel_layouts.fp4_checkpoint_view(w_packed, w_scale)
    xf = x.float()
    outs = [xf @ quant.dequant_fp4(w_packed[r0:r1], w_scale[r0:r1], group).t()
            for r0, r1 in _row_tiles(w_packed.shape[0], 1)]
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)).to(x.dtype)


def _checkpoint_experts(w13, w13_scale, w2, w2_scale):
    """Stacked expert weights as checkpoint-layout views (kernel-layout stacks read as the kernel does)."""
    if not kernel_layouts.fp4_is_kernel_layout(w13, w13_scale):
        return w13, w13_scale, w2, w2_scale
    return (*kernel_layouts.fp4_checkpoint_view(w13, w13_scale), *kernel_layouts.fp4_checkpoint_view(w2, w2_scale))


def _fp4_expert(w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, e: int, group: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert e's dense [2I, D] and [D, I] weights in the compute dtype (one tile: one expert)."""
    return (quant.dequant_fp4(w13[e], s13[e], group, out_dtype=dtype),
            quant.dequant_fp4(w2[e], s2[e], group, out_dtype=dtype))


def fp4_routed_experts(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                       w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, group: int,
                       limit: float) -> torch.Tensor:
    """Routed experts on packed fp4 weights, only the experts that got tokens (eager: the routing's
    counts reach the host). x: [T, D]; w13: uint8 [E, 2I, D/2] (gate rows first); w2: uint8 [E, D, I/2];
    scales uint8 ue8m0 [.., rows, cols / group]; idx / weights: [T, k]."""
    _check_codes("fp4_routed_experts w13", w13)
    w13, w13_scale, w2, w2_scale = _checkpoint_experts(w13, w13_scale, w2, w2_scale)
    return looped_experts(x, idx, weights, w13.shape[0],
                          lambda e: _fp4_expert(w13, w13_scale, w2, w2_scale, e, group, x.dtype), limit)


def fp4_static_experts(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                       w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, group: int,
                       limit: float) -> torch.Tensor:
    """Fixed-shape form of `fp4_routed_experts` (padded steps, graphs): every expert runs on every row,
    weighted by the [T, E] combine matrix, one expert dequantized at a time; no host sync, shapes
    depend only on (T, k, E). Same rounding points as the routed form."""
    _check_codes("fp4_static_experts w13", w13)
    w13, w13_scale, w2, w2_scale = _checkpoint_experts(w13, w13_scale, w2, w2_scale)
    n_experts, inter = w13.shape[0], w2.shape[2] * 2
    comb = combine_weights(idx, weights, n_experts)                   # [T, E]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in range(n_experts):
        g13, g2 = _fp4_expert(w13, w13_scale, w2, w2_scale, e, group, x.dtype)
        gu = x @ g13.t()
        y = swiglu(gu[:, :inter], gu[:, inter:], limit) @ g2.t()
        out = out + comb[:, e:e + 1] * y.float()
    return out.to(x.dtype)


def fp4_active_experts(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                       w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, group: int,
                       limit: float) -> torch.Tensor:
    """Fixed-shape form of `fp4_routed_experts` that reads only the experts hit by a pair of non-zero
    weight (layers/moe.py `active_slot_sum`: a compacted id list of static length, a runtime count);
    same arguments, results and rounding points as `fp4_static_experts`."""
    _check_codes("fp4_active_experts w13", w13)
    w13, w13_scale, w2, w2_scale = _checkpoint_experts(w13, w13_scale, w2, w2_scale)
    inter = w2.shape[2] * 2
    comb = combine_weights(idx, weights, w13.shape[0])
    ids, count = active_expert_slots(idx, weights, w13.shape[0])

    def expert_out(e):
        g13 = quant.dequant_fp4(w13.index_select(0, e)[0], w13_scale.index_select(0, e)[0], group, out_dtype=x.dtype)
        g2 = quant.dequant_fp4(w2.index_select(0, e)[0], w2_scale.index_select(0, e)[0], group, out_dtype=x.dtype)
        gu = x @ g13.t()
        return swiglu(gu[:, :inter], gu[:, inter:], limit) @ g2.t()
    return active_slot_sum(x, ids, count, comb, expert_out).to(x.dtype)


def fp8_table_rows(codes: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor, group: int,
                   dtype: torch.dtype, *, int_codes: bool = False) -> torch.Tensor:
    """Gathered rows of an e4m3 table with one ue8m0 scale per `group` values of a row (the Engram
    table): codes uint8 [R, d], scale uint8 [R, d / group], rows int [T, K] (-1 = no lookup -> zeros)
    -> [T, K * d] in `dtype`. Only the gathered rows are dequantized; the gather reads bytes."""
    _check_codes("fp8_table_rows codes", codes)
    safe = rows.clamp(min=0)
    v = e4m3_values(codes[safe], int_codes)                                 # [T, K, d]
    s = quant.ue8m0_to_float(scale[safe]).repeat_interleave(group, dim=-1)  # [T, K, d]
    e = (v * s).masked_fill((rows < 0)[..., None], 0)
    return e.reshape(rows.shape[0], -1).to(dtype)
