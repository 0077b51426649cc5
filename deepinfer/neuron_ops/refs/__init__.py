"""PyTorch references of the Neuron kernels, with the kernels' exact argument lists.

Each reference is registered as a `torch.library` custom op (namespace `deepinfer_neuron`) with a
fake (shape-only) implementation, so a host-mode region graph holds one node per kernel, as a device
graph holds one NKI call for a name with an NKI kernel, and tracing never runs the reference's math on
fake tensors (tests/neuron/test_neuron_kernels.py checks every fake against the reference with
opcheck). The fakes of the packed-weight kernels take their codes as uint8 only and their scales as
uint8 exponents (or, for the fp8 GEMMs, the bf16 scale values of the kernels' layout,
layers/kernel_layouts.py), and
reject a float8 carrier: fp8 / fp4 bytes cross a graph as uint8 and get their meaning inside the
kernel (docs/neuron.md §4 A9, A11). Device mode traces the plain functions of `PLAIN` instead;
the fp8 ones read e4m3 codes by integer arithmetic (`int_codes`, layers/quant_bits.py), so even
traced they hold no float8 value, while the host-mode ops read them through a float8 view inside
the op (`HOST_FORMS`: the same values bit for bit, faster on a CPU). The math is not
copied: the model's layer functions are the references; the routed MoE is the fixed-shape dense form
(layers/moe.py `dense_local_experts`, and `fp4_static_experts` on packed experts), the one a Neuron
graph can hold.
"""
import functools
from typing import Optional

import torch
from torch import Tensor

from deepinfer.model_executor.layers import (attention, compressor, engram, hc, indexer, kernel_layouts, moe, norm,
                                             quant_gemm, rope)

_NS = "deepinfer_neuron"


def _op(name: str, fn, fake):
    op = torch.library.custom_op(f"{_NS}::{name}", mutates_args=())(fn)
    op.register_fake(fake)
    return op


def _f32(x: Tensor, *shape) -> Tensor:
    return x.new_empty(shape, dtype=torch.float32)


def _bytes_at(fake, codes: tuple, scales: tuple = ()):
    """`fake`, first checking that its arguments at `codes` are uint8 and at `scales` uint8 exponent
    bytes or bf16 scale values (the fp8 kernel layout, layers/kernel_layouts.py)."""
    def checked(*args, **kwargs):
        for i in (*codes, *scales):
            ok = (torch.uint8, torch.bfloat16) if i in scales else (torch.uint8,)
            if args[i].dtype not in ok:
                raise ValueError(f"argument {i}: expected uint8 code / scale bytes, got {args[i].dtype} "
                                 "(fp8 / fp4 bytes enter a graph as uint8; docs/neuron.md §4 A11)")
        return fake(*args, **kwargs)
    return checked


def _fp8_cols(w_codes: Tensor) -> int:
    """N of an fp8 weight: [N, K] codes, or the kernel layout's [128, K tiles, N]."""
    return w_codes.shape[-1] if w_codes.dim() == 3 else w_codes.shape[0]


def _fp4_cols(w_packed: Tensor, w_scale: Tensor) -> int:
    """N of an fp4 weight: [N, K/2] pairs, or the kernel layout's [K/2, N] (layers/kernel_layouts.py)."""
    return w_packed.shape[1] if kernel_layouts.fp4_is_kernel_layout(w_packed, w_scale) else w_packed.shape[0]


# Output shapes and dtypes of each reference (the `*_` arguments are not needed for the shape).
FAKES = {
    "rms_norm": lambda x, weight, eps: torch.empty_like(x),
    "rope": lambda x, cos, sin, inverse=False: torch.empty_like(x),
    "hc_mixes": lambda x, fn, base, scale, norm_eps, hc_eps, iters: (
        _f32(x, x.shape[0], x.shape[1]), _f32(x, x.shape[0], x.shape[1]), _f32(x, x.shape[0], x.shape[1], x.shape[1])),
    "hc_pre": lambda x, pre: x.new_empty(x.shape[0], x.shape[2]),
    "hc_post": lambda x, y, post, comb: torch.empty_like(x),
    "hc_head": lambda x, fn, base, scale, norm_eps, hc_eps: _f32(x, x.shape[0], fn.shape[0]),
    "sink_attention": lambda q, keys, valid, sink, scale: torch.empty_like(q),
    "index_scores": lambda q, keys, weights, valid, key_scale=1.0: _f32(q, q.shape[0], keys.shape[-2]),
    "compress_pool": lambda c, z, valid: c.new_empty(c.shape[0], c.shape[2]),
    "moe_experts": lambda x, idx, weights, w13, w2, limit: torch.empty_like(x),
    "moe_experts_active": lambda x, idx, weights, w13, w2, limit: torch.empty_like(x),
    "expert_mlp": lambda x, w1, w3, w2, limit: x.new_empty(x.shape[0], w2.shape[0]),
    "engram_gate": lambda x, kv, q_weight, k_weight, eps: torch.empty_like(x),
    "swiglu": lambda gate, up, limit: torch.empty_like(gate),
    "blockquant_fp8_gemm": _bytes_at(lambda x, w_codes, w_scale, block_rows, block_cols: x.new_empty(
        x.shape[0], _fp8_cols(w_codes)), (1,), (2,)),
    "blockquant_fp8_grouped_gemm": _bytes_at(lambda x, w_codes, w_scale, block_rows, block_cols: x.new_empty(
        x.shape[0], x.shape[1], _fp8_cols(w_codes) // x.shape[1]), (1,), (2,)),
    "blockquant_fp4_gemm": _bytes_at(lambda x, w_packed, w_scale, group: x.new_empty(
        x.shape[0], _fp4_cols(w_packed, w_scale)), (1, 2)),
    "fp4_static_experts": _bytes_at(lambda x, idx, weights, w13, w13_scale, w2, w2_scale, group, limit:
                                    torch.empty_like(x), (3, 4, 5, 6)),
    "fp4_active_experts": _bytes_at(lambda x, idx, weights, w13, w13_scale, w2, w2_scale, group, limit:
                                    torch.empty_like(x), (3, 4, 5, 6)),
    "fp8_table_rows": _bytes_at(lambda codes, scale, rows, group, dtype: codes.new_empty(
        rows.shape[0], rows.shape[1] * codes.shape[1], dtype=dtype), (0, 1)),
}


def _rms_norm(x: Tensor, weight: Optional[Tensor], eps: float) -> Tensor:
    return norm.rms_norm(x, weight, eps)


def _rope(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
    return rope.apply_rope(x, cos, sin, inverse)


def _hc_mixes(x: Tensor, fn: Tensor, base: Tensor, scale: Tensor, norm_eps: float, hc_eps: float,
              iters: int) -> tuple[Tensor, Tensor, Tensor]:
    return hc.hc_mixes(x, fn, base, scale, norm_eps, hc_eps, iters)


def _hc_pre(x: Tensor, pre: Tensor) -> Tensor:
    return hc.hc_pre_apply(x, pre)


def _hc_post(x: Tensor, y: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    return hc.hc_post_apply(x, y, post, comb)


def _hc_head(x: Tensor, fn: Tensor, base: Tensor, scale: Tensor, norm_eps: float, hc_eps: float) -> Tensor:
    return hc.hc_head_weights(x, fn, base, scale, norm_eps, hc_eps)


def _sink_attention(q: Tensor, keys: Tensor, valid: Tensor, sink: Tensor, scale: float) -> Tensor:
    return attention.sink_attention(q, keys, valid, sink, scale)


def _index_scores(q: Tensor, keys: Tensor, weights: Tensor, valid: Tensor, key_scale: float = 1.0) -> Tensor:
    return indexer.index_scores(q, keys, weights, valid, key_scale)


def _compress_pool(c: Tensor, z: Tensor, valid: Tensor) -> Tensor:
    return compressor.pool_entries(c, z, valid)


def _moe_experts(x: Tensor, idx: Tensor, weights: Tensor, w13: Tensor, w2: Tensor, limit: float) -> Tensor:
    return moe.dense_local_experts(x, idx, weights, w13, w2, limit)


def _moe_experts_active(x: Tensor, idx: Tensor, weights: Tensor, w13: Tensor, w2: Tensor, limit: float) -> Tensor:
    return moe.active_local_experts(x, idx, weights, w13, w2, limit)


def _expert_mlp(x: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, limit: float) -> Tensor:
    return moe.expert_mlp(x, w1, w3, w2, limit)


def _engram_gate(x: Tensor, kv: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float) -> Tensor:
    return engram.engram_gate(x, kv, q_weight, k_weight, eps)


def _swiglu(gate: Tensor, up: Tensor, limit: float) -> Tensor:
    return moe.swiglu(gate, up, limit)


def _blockquant_fp8_gemm(x: Tensor, w_codes: Tensor, w_scale: Tensor, block_rows: int, block_cols: int) -> Tensor:
    return quant_gemm.blockquant_fp8_gemm(x, w_codes, w_scale, block_rows, block_cols, int_codes=True)


def _blockquant_fp8_grouped_gemm(x: Tensor, w_codes: Tensor, w_scale: Tensor, block_rows: int,
                                 block_cols: int) -> Tensor:
    return quant_gemm.blockquant_fp8_grouped_gemm(x, w_codes, w_scale, block_rows, block_cols, int_codes=True)


def _blockquant_fp4_gemm(x: Tensor, w_packed: Tensor, w_scale: Tensor, group: int) -> Tensor:
    return quant_gemm.blockquant_fp4_gemm(x, w_packed, w_scale, group)


def _fp4_static_experts(x: Tensor, idx: Tensor, weights: Tensor, w13: Tensor, w13_scale: Tensor, w2: Tensor,
                        w2_scale: Tensor, group: int, limit: float) -> Tensor:
    return quant_gemm.fp4_static_experts(x, idx, weights, w13, w13_scale, w2, w2_scale, group, limit)


def _fp4_active_experts(x: Tensor, idx: Tensor, weights: Tensor, w13: Tensor, w13_scale: Tensor, w2: Tensor,
                        w2_scale: Tensor, group: int, limit: float) -> Tensor:
    return quant_gemm.fp4_active_experts(x, idx, weights, w13, w13_scale, w2, w2_scale, group, limit)


def _fp8_table_rows(codes: Tensor, scale: Tensor, rows: Tensor, group: int, dtype: torch.dtype) -> Tensor:
    return quant_gemm.fp8_table_rows(codes, scale, rows, group, dtype, int_codes=True)


# name -> plain reference (what device mode traces when no NKI kernel is written for a name)
PLAIN = {
    "rms_norm": _rms_norm,
    "rope": _rope,
    "hc_mixes": _hc_mixes,
    "hc_pre": _hc_pre,
    "hc_post": _hc_post,
    "hc_head": _hc_head,
    "sink_attention": _sink_attention,
    "index_scores": _index_scores,
    "compress_pool": _compress_pool,
    "moe_experts": _moe_experts,
    "moe_experts_active": _moe_experts_active,
    "expert_mlp": _expert_mlp,
    "engram_gate": _engram_gate,
    "swiglu": _swiglu,
    "blockquant_fp8_gemm": _blockquant_fp8_gemm,
    "blockquant_fp8_grouped_gemm": _blockquant_fp8_grouped_gemm,
    "blockquant_fp4_gemm": _blockquant_fp4_gemm,
    "fp4_static_experts": _fp4_static_experts,
    "fp4_active_experts": _fp4_active_experts,
    "fp8_table_rows": _fp8_table_rows,
}

# name -> what the host-mode custom op runs where it is not the PLAIN reference: the CPU reference
# that reads e4m3 codes through a float8 view (inside the op, where the graph does not see it).
HOST_FORMS = {
    "blockquant_fp8_gemm": quant_gemm.blockquant_fp8_gemm,
    "blockquant_fp8_grouped_gemm": quant_gemm.blockquant_fp8_grouped_gemm,
    "fp8_table_rows": quant_gemm.fp8_table_rows,
}


def _host_impl(name: str):
    if name not in HOST_FORMS:
        return PLAIN[name]
    form = HOST_FORMS[name]
    return functools.wraps(PLAIN[name])(lambda *args, **kwargs: form(*args, **kwargs))   # PLAIN's schema


_OPS: dict = {}


def custom_op(name: str):
    """The reference of `name` as a registered custom op (one graph node under torch.compile)."""
    if name not in PLAIN:
        raise ValueError(f"kernel: unknown name {name!r}; known: {', '.join(PLAIN)}")
    if name not in _OPS:
        _OPS[name] = _op(name, _host_impl(name), FAKES[name])
    return _OPS[name]
