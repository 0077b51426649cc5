"""Torch entry points of the NKI kernels, with their references' argument lists
(deepinfer/neuron_ops/refs PLAIN): each launches its kernel and returns a torch tensor in the
reference's output dtype. Packed weights arrive in the layout the kernel reads, stored at load on the
Neuron platform (model_executor/layers/kernel_layouts.py); the wrappers hand them to the kernel as
they are and prepare only the activations (K padding, the fp4 kernels' even / odd columns) and cached
0/1 constants. A weight in the checkpoint layout (tests, the cost model's calibration) is laid out
per call instead; on a device that is refused.

Where a launch runs (`_run`): in the NumPy interpreter when the real `nki` is absent; in NKI's own
simulator where it is installed; on the NeuronCore through torch-neuronx inside `on_device()`
(nki/device.py). `last_stats()` sums the interpreter's counts over every
launch of the latest wrapper call (a wrapper may launch several kernels); `counts.simulation_counts()`
counts wrapper calls by kernel-table name, an expert call's own GEMM and SwiGLU calls included."""
from __future__ import annotations

import contextlib
import functools
from typing import Optional

import numpy as np
import torch

from deepinfer.model_executor.layers import kernel_layouts
from deepinfer.neuron_ops.nki import api, counts
from deepinfer.neuron_ops.nki.kernels.blockquant_fp4_gemm import K_ROWS as FP4_K_ROWS
from deepinfer.neuron_ops.nki.kernels.blockquant_fp4_gemm import DESIGNS as FP4_DESIGNS
from deepinfer.neuron_ops.nki.kernels.blockquant_fp4_gemm import ROWS_MAX as FP4_ROWS_MAX
from deepinfer.neuron_ops.nki.kernels.blockquant_fp4_gemm import blockquant_fp4_gemm_kernel
from deepinfer.neuron_ops.nki.kernels.blockquant_fp4_gemm import onehot_value as fp4_onehot_value
from deepinfer.neuron_ops.nki.kernels.fp4_active_experts import fp4_active_experts_kernel
from deepinfer.neuron_ops.nki.kernels.blockquant_fp8_gemm import (K_TILE, N_TILE, ROWS_TENSOR_DESIGN,
                                                                 blockquant_fp8_gemm_kernel,
                                                                 blockquant_fp8_gemm_seed_kernel, group_blocks)
from deepinfer.neuron_ops.nki.kernels.rms_norm import rms_norm_kernel
from deepinfer.neuron_ops.nki.kernels.swiglu import swiglu_kernel

_TORCH_TO_NL = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                torch.uint8: "uint8", torch.int32: "int32"}
_NL_TO_TORCH = {v: k for k, v in _TORCH_TO_NL.items()}

_ON_DEVICE = False   # inside on_device(): launches go to the NeuronCore with torch tensors


@contextlib.contextmanager
def on_device():
    """Launch kernels through torch-neuronx (tensors stay torch XLA tensors)."""
    global _ON_DEVICE
    prev, _ON_DEVICE = _ON_DEVICE, True
    try:
        yield
    finally:
        _ON_DEVICE = prev


def _hbm(t: torch.Tensor):
    """An HBM input of the kernel: the tensor's values with its dtype (on a device: the tensor)."""
    if _ON_DEVICE:  # pragma: no cover - device only
        return t
    name = _TORCH_TO_NL.get(t.dtype)
    if name is None:
        raise TypeError(f"nki kernels: unsupported input dtype {t.dtype}")
    dt = getattr(api.nl, name)
    values = t.detach().cpu()
    values = (values.float() if dt.is_float else values).contiguous().numpy()
    return api.nki.hbm(values, dt) if api.INTERPRETED else values  # pragma: no branch


def _torch(out) -> torch.Tensor:
    if _ON_DEVICE:  # pragma: no cover - device only: torch-neuronx returns a torch tensor
        return out
    if not api.INTERPRETED:  # pragma: no cover - real simulator returns NumPy in the output dtype
        return torch.from_numpy(np.asarray(out))
    return torch.from_numpy(out.numpy()).to(_NL_TO_TORCH[out.dtype.name])


# stats of the launches of the wrapper call in progress / the latest one
_call_depth = 0
_call_stats: list = []
_last_call_stats: list = []


def _run(kernel, grid, *args):
    """Launch `kernel[grid](*args)`; args are `_hbm` inputs (or torch tensors) and scalars."""
    args = [_hbm(a) if isinstance(a, torch.Tensor) else a for a in args]
    if _ON_DEVICE:  # pragma: no cover - device only
        return kernel[grid](*args)
    if api.INTERPRETED:
        out = kernel[grid](*args)
        _call_stats.append(api.nki.last_stats())
        return out
    return api.nki.simulate_kernel(kernel[grid], *args)  # pragma: no cover


def _grid(grid: int):
    return api.nl.nc(grid) if grid > 1 else 1


def wrapper(name: str):
    """Mark a torch entry point of kernel-table name `name`: counts its calls, gathers its launches' stats."""
    def deco(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            global _call_depth, _call_stats, _last_call_stats
            counts.record(name)
            if _call_depth == 0:
                _call_stats = []
            _call_depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                _call_depth -= 1
                if _call_depth == 0:
                    _last_call_stats = _call_stats
        return call
    return deco


def last_stats():
    """The interpreter's counts (instructions per engine, DMA bytes, FLOPs, the cost model's predicted
    seconds; peaks as maxima) summed over the launches of the latest wrapper call; None before any
    (or off the interpreter)."""
    if not api.INTERPRETED or not _last_call_stats:
        return None
    total = api.nki.Stats()
    for s in _last_call_stats:
        total.instructions.update(s.instructions)
        total.dma_bytes_in += s.dma_bytes_in
        total.dma_bytes_out += s.dma_bytes_out
        total.matmul_flops += s.matmul_flops
        total.peak_sbuf_bytes = max(total.peak_sbuf_bytes, s.peak_sbuf_bytes)
        total.peak_psum_banks = max(total.peak_psum_banks, s.peak_psum_banks)
        total.hbm_reads.update(s.hbm_reads)   # each launch reads its own HBM inputs
        total.predicted_s += s.predicted_s   # launches of one call run one after another
        for e, v in s.engine_s.items():
            total.engine_s[e] = total.engine_s.get(e, 0.0) + v
    total.launches = len(_last_call_stats)
    return total


@wrapper("rms_norm")
def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    w = (torch.ones(shape[-1], dtype=torch.float32) if weight is None else weight).reshape(1, -1)
    out = _run(rms_norm_kernel, 1, x2, w, float(eps))
    return _torch(out).reshape(shape)


@wrapper("swiglu")
def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    shape = gate.shape
    out = _run(swiglu_kernel, 1, gate.reshape(-1, shape[-1]), up.reshape(-1, shape[-1]), float(limit))
    return _torch(out).reshape(shape)


# Activation rows per launch: x^T tiles are the stationary operand (free size <= 128); a prompt step
# with more rows runs in chunks.
_ROWS_MAX = 128


def _on_device_needs_layout(name: str) -> None:
    if _ON_DEVICE:  # pragma: no cover - device only
        raise ValueError(f"{name}: on a device the weight must be stored in the kernel layout at load "
                         "(platforms/neuron/weight_layouts.py lay_out_model)")


@wrapper("blockquant_fp8_gemm")
def blockquant_fp8_gemm(x: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor, block_rows: int,
                        block_cols: int, *, grid: int = 2, design: str = "auto") -> torch.Tensor:
    """y = x @ W^T with the reference's arguments (quant_gemm.blockquant_fp8_gemm); x: [M, K].
    The weight in the kernel layout (layers/kernel_layouts.py fp8_linear: what the Neuron platform
    stores at load, its codes checked against trn2's range there) goes to the tensor design as it is
    stored, whatever M. In the checkpoint layout (uint8 [N, K] codes and exponents: tests, the cost
    model's calibration) it is checked and laid out here, per call; design: "tensor" (fp8 codes into
    the matmul, scales folded into x), "seed" (Vector Engine dequantization, then the matmul) or
    "auto" (tensor up to ROWS_TENSOR_DESIGN rows; see the kernel's docstring for why)."""
    if design not in ("auto", "tensor", "seed"):
        raise ValueError(f"blockquant_fp8_gemm: design {design!r} is not auto, tensor or seed")
    _fp8_check_block(block_rows, block_cols)
    if kernel_layouts.fp8_is_kernel_layout(w_codes):
        if design == "seed":
            raise ValueError("blockquant_fp8_gemm: the seed design reads the checkpoint layout")
        return _fp8_tensor(x, w_codes, w_scale, block_rows, grid, 0, kernel_layouts.fp8_columns(w_codes))
    _on_device_needs_layout("blockquant_fp8_gemm")
    if w_codes.dtype != torch.uint8 or w_scale.dtype != torch.uint8:
        raise ValueError("blockquant_fp8_gemm: w_codes and w_scale must be uint8 bytes")
    kernel_layouts.check_trn2_codes("blockquant_fp8_gemm kernel w_codes", w_codes)
    if x.shape[0] > _ROWS_MAX:
        return torch.cat([blockquant_fp8_gemm(x[r:r + _ROWS_MAX], w_codes, w_scale, block_rows, block_cols, grid=grid,
                                              design=design) for r in range(0, x.shape[0], _ROWS_MAX)])
    if design == "seed" or (design == "auto" and x.shape[0] > ROWS_TENSOR_DESIGN):
        return _fp8_seed(x, w_codes, w_scale, block_rows, block_cols, grid)
    w_p, s_bk = kernel_layouts.fp8_linear(w_codes, w_scale, block_cols)
    return _fp8_tensor(x, w_p, s_bk, block_rows, grid, 0, w_codes.shape[0])


def _fp8_check_block(block_rows: int, block_cols: int) -> None:
    if N_TILE % block_rows or K_TILE % block_cols:
        raise ValueError(f"blockquant_fp8_gemm kernel: block {block_rows}x{block_cols} must divide "
                         f"{N_TILE}x{K_TILE}")


def _fp8_seed(x, w_codes, w_scale, block_rows, block_cols, grid):
    """The seed design on a checkpoint-layout weight (x: at most _ROWS_MAX rows), laid out K-major
    for it (per call)."""
    m, k = x.shape
    n = w_codes.shape[0]
    kp = -(-k // K_TILE) * K_TILE
    w_kn = torch.zeros(kp, n, dtype=torch.uint8)
    w_kn[:k] = w_codes.t()
    s_kn = torch.full((kp, w_scale.shape[0]), 127, dtype=torch.uint8)
    s_kn[:k] = w_scale.t().repeat_interleave(block_cols, dim=0)[:k]
    return _torch(_run(blockquant_fp8_gemm_seed_kernel, _grid(grid), _pad_k(x, kp), w_kn, s_kn, int(block_rows)))


def _pad_k(x: torch.Tensor, kp: int) -> torch.Tensor:
    """x [M, K] with zero columns up to kp (the activations; the weight is padded at load)."""
    if x.shape[1] == kp:
        return x.contiguous()
    x_p = torch.zeros(x.shape[0], kp, dtype=x.dtype)
    x_p[:, :x.shape[1]] = x
    return x_p


def _fp8_tensor(x, w_p, s_bk, block_rows, grid, col0, cols):
    """The tensor design on kernel-layout (w_p, s_bk), columns [col0, col0 + cols): nothing here
    touches the weight; it reaches the kernel as stored."""
    if x.shape[0] > _ROWS_MAX:
        return torch.cat([_fp8_tensor(x[r:r + _ROWS_MAX], w_p, s_bk, block_rows, grid, col0, cols)
                          for r in range(0, x.shape[0], _ROWS_MAX)])
    x_p = _pad_k(x, w_p.shape[1] * K_TILE)
    return _torch(_run(blockquant_fp8_gemm_kernel, _grid(grid), x_p, w_p, s_bk,
                       *_fp8_tensor_tiles(x.shape[0], int(block_rows)), int(block_rows), int(col0), int(cols)))


@functools.lru_cache(maxsize=None)
def _fp8_tensor_tiles(m: int, block_rows: int):
    """The tensor design's 0/1 tiles (bf16): mask [g*M, g*block_rows] keeps row block j against
    column block j; sel [g*M, M] sums the g row blocks of each activation row; rep_x [M, g*M] copies
    x row i to column j*M + i of every block j; rep_s [g, g*M] copies scale row j to block j's M columns."""
    g = group_blocks(m, block_rows)
    col = torch.arange(g * m)
    mask = ((col // m)[:, None] == torch.arange(g * block_rows)[None, :] // block_rows).to(torch.bfloat16)
    sel = (col[:, None] % m == torch.arange(m)[None, :]).to(torch.bfloat16)
    rep_x = (torch.arange(m)[:, None] == (col % m)[None, :]).to(torch.bfloat16)
    rep_s = (torch.arange(g)[:, None] == (col // m)[None, :]).to(torch.bfloat16)
    return mask, sel, rep_x, rep_s


@wrapper("blockquant_fp8_grouped_gemm")
def blockquant_fp8_grouped_gemm(x: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor, block_rows: int,
                                block_cols: int, *, grid: int = 2) -> torch.Tensor:
    """Per-group GEMM (quant_gemm.blockquant_fp8_grouped_gemm): x [T, G, K], w_codes [G * R, K] ->
    [T, G, R]; one fp8 GEMM launch per group on that group's rows (R a multiple of block_rows, so a
    group's scale rows are whole rows of w_scale); a kernel-layout weight is read in place, each
    launch given its group's column window."""
    groups = x.shape[1]
    kernel_layout = kernel_layouts.fp8_is_kernel_layout(w_codes)
    rows = (kernel_layouts.fp8_columns(w_codes) if kernel_layout else w_codes.shape[0]) // groups
    if rows % block_rows:
        raise ValueError(f"blockquant_fp8_grouped_gemm kernel: group rows {rows} must be a multiple of "
                         f"block_rows {block_rows}")
    if kernel_layout:   # each group's columns of the stored weight, no slice of it
        _fp8_check_block(block_rows, block_cols)
        outs = [_fp8_tensor(x[:, g], w_codes, w_scale, block_rows, grid, g * rows, rows) for g in range(groups)]
    else:
        per = rows // block_rows
        outs = [blockquant_fp8_gemm(x[:, g], w_codes[g * rows:(g + 1) * rows], w_scale[g * per:(g + 1) * per],
                                    block_rows, block_cols, grid=grid) for g in range(groups)]
    return torch.stack(outs, dim=1)


@functools.lru_cache(maxsize=None)
def _fp4_onehot(group: int, design: str = "words") -> torch.Tensor:
    """[128, T, 128] bf16 (T = K tiles per 128 scale rows): [r, j, p] is onehot_value(design) (1, or
    2^6 for the word decode) where byte row p of a chunk's j-th K tile is covered by scale row r."""
    per = group // 2                      # byte rows per scale row
    tiles = 128 // (FP4_K_ROWS // per)    # K tiles a chunk of 128 scale rows covers
    r = torch.arange(128)[:, None, None]
    row = torch.arange(tiles)[None, :, None] * FP4_K_ROWS + torch.arange(FP4_K_ROWS)[None, None, :]
    return ((row // per == r).to(torch.float32) * fp4_onehot_value(design)).to(torch.bfloat16)


def _fp4_check(name: str, w_packed: torch.Tensor, w_scale: torch.Tensor, group: int) -> bool:
    """Check the arguments; True when the weight is in the kernel layout (K-major)."""
    if w_packed.dtype != torch.uint8 or w_scale.dtype != torch.uint8:
        raise ValueError(f"{name}: packed codes and scales must be uint8 bytes")
    kernel_layout = kernel_layouts.fp4_is_kernel_layout(w_packed, w_scale)
    if group % 2 or (2 * FP4_K_ROWS) % group:
        raise ValueError(f"{name} kernel: group {group} must be even and divide {2 * FP4_K_ROWS}")
    if not kernel_layout:
        _on_device_needs_layout(name)
    return kernel_layout


@wrapper("blockquant_fp4_gemm")
def blockquant_fp4_gemm(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, group: int, *,
                        grid: int = 2, design: str = "words") -> torch.Tensor:
    """y = x @ W^T with the reference's arguments (quant_gemm.blockquant_fp4_gemm): x [M, K],
    w_packed uint8 [N, K/2], w_scale uint8 [N, K/group], or the kernel layout the Neuron platform
    stores at load (layers/kernel_layouts.py fp4_experts: [K/2, N] pairs, [K/g, N] exponents),
    which reaches the kernel as stored; a checkpoint-layout weight is transposed here, per call. x is
    split into its even and odd columns. design: e4m3
    codes by integer ops on 32-bit words ("words", kernels/fp4_word_decode.py), the float decode
    over three engines ("spread") or on the Vector Engine alone ("vector", the seed's way); all
    give the same weights (kernels/blockquant_fp4_gemm.py)."""
    kernel_layout = _fp4_check("blockquant_fp4_gemm", w_packed, w_scale, group)
    if design not in FP4_DESIGNS:
        raise ValueError(f"blockquant_fp4_gemm: design {design!r} is not one of {FP4_DESIGNS}")
    if x.shape[0] > FP4_ROWS_MAX:
        return torch.cat([blockquant_fp4_gemm(x[r:r + FP4_ROWS_MAX], w_packed, w_scale, group, grid=grid,
                                              design=design) for r in range(0, x.shape[0], FP4_ROWS_MAX)])
    w_t, s_t = (w_packed, w_scale) if kernel_layout else (w_packed.t().contiguous(), w_scale.t().contiguous())
    out = _run(blockquant_fp4_gemm_kernel, _grid(grid), x[:, 0::2].contiguous(), x[:, 1::2].contiguous(),
               w_t, s_t, _fp4_onehot(group, design), int(group), design)
    return _torch(out)


@wrapper("fp4_static_experts")
def fp4_static_experts(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                       w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, group: int,
                       limit: float) -> torch.Tensor:
    """Fixed-shape routed experts on packed fp4 weights (quant_gemm.fp4_static_experts): for every
    expert, the w13 fp4 GEMM, SwiGLU and the w2 fp4 GEMM as NKI launches (outputs in x's dtype, as
    the reference rounds them), then the [T, E] combine weights applied in fp32 on the host."""
    from deepinfer.model_executor.layers.moe import combine_weights
    kernel_layout = _fp4_check("fp4_static_experts", w13, w13_scale, group)
    n_experts, inter = w13.shape[0], w2.shape[1 if kernel_layout else 2] * 2
    comb = combine_weights(idx, weights, n_experts)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
    for e in range(n_experts):
        gu = blockquant_fp4_gemm(x, w13[e], w13_scale[e], group)
        h = swiglu(gu[:, :inter].contiguous(), gu[:, inter:].contiguous(), limit)
        y = blockquant_fp4_gemm(h, w2[e], w2_scale[e], group)
        out = out + comb[:, e:e + 1] * y.float()
    return out.to(x.dtype)


@wrapper("fp4_active_experts")
def fp4_active_experts(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                       w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, group: int,
                       limit: float, *, grid: int = 2) -> torch.Tensor:
    """Routed experts on packed fp4 weights reading only the hit experts
    (quant_gemm.fp4_active_experts): the compacted ids and count as the reference makes them, the
    gate/up projection of every hit expert in one launch over them (kernels/fp4_active_experts.py),
    SwiGLU on the slots' rows, the down projection in a second launch, then the combine weights of
    the slots below the count applied in fp32 on the host in ascending expert order (the order the
    all-experts wrapper adds in). The weight stacks reach the kernels as stored in the kernel layout
    (K-major, layers/kernel_layouts.py; a checkpoint-layout stack is transposed here, per call); the
    kernels' DMAs read the hit experts' tiles alone."""
    from deepinfer.model_executor.layers.moe import active_expert_slots, combine_weights
    kernel_layout = _fp4_check("fp4_active_experts", w13, w13_scale, group)
    if x.shape[0] > FP4_ROWS_MAX:
        step = FP4_ROWS_MAX
        return torch.cat([fp4_active_experts(x[r:r + step], idx[r:r + step], weights[r:r + step],
                                             w13, w13_scale, w2, w2_scale, group, limit, grid=grid)
                          for r in range(0, x.shape[0], step)])
    n_experts, inter, m = w13.shape[0], w2.shape[1 if kernel_layout else 2] * 2, x.shape[0]
    comb = combine_weights(idx, weights, n_experts)
    ids, count = active_expert_slots(idx, weights, n_experts)
    slots = ids.shape[0]
    ids_in = ids.to(torch.int32).reshape(slots, 1, 1)
    count_in = count.to(torch.int32).reshape(1, 1)
    onehot = _fp4_onehot(group)

    def project(rows, w, s):   # rows [Sx, M, K] -> [S, M, N]
        w_t, s_t = (w, s) if kernel_layout else (w.transpose(1, 2).contiguous(), s.transpose(1, 2).contiguous())
        return _torch(_run(fp4_active_experts_kernel, _grid(grid), rows[..., 0::2].contiguous(),
                           rows[..., 1::2].contiguous(), w_t, s_t, onehot, ids_in, count_in, int(group)))
    gu = project(x[None], w13, w13_scale)                                         # [S, M, 2I]
    h = swiglu(gu[..., :inter].reshape(slots * m, inter).contiguous(),
               gu[..., inter:].reshape(slots * m, inter).contiguous(), limit).reshape(slots, m, inter)
    y = project(h, w2, w2_scale)                                                  # [S, M, D]
    out = torch.zeros(m, x.shape[1], dtype=torch.float32)
    for j in range(int(count)):   # host side of the wrapper: the count is a value here
        e = int(ids[j])
        out = out + comb[:, e:e + 1] * y[j].float()
    return out.to(x.dtype)
