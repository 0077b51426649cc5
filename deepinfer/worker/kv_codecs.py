"""The byte codecs of the compact KV records (worker/kv_records.py) as torch.library custom ops.

A compiled region holds each codec as one opaque node whose inputs and outputs are record bytes
(uint8) and values (the compute dtype): the float8 views that give the bytes their meaning exist
only inside the op's implementation, as they would inside a device kernel, so no float8 value
reaches a graph (docs/neuron.md §4 A6, A9, A11; §7). The fakes compute shapes only and reject a
float8 carrier, so a caller cannot hand a graph float8 through them either. The implementations
are the record formats' own math, so the bytes and values are the ones every platform computes.

On a device without a kernel for these ops (TRACED_DEVICES) the formats call `fp8_encode` /
`fp8_decode` / `fp4_encode` / `fp4_decode` with int_codes instead: the same math traced into the
graph with the e4m3 codes computed by integer arithmetic (layers/quant_bits.py), bit for bit the
ops' results, and no float8 tensor.
"""
from __future__ import annotations

import torch
from torch import Tensor

from deepinfer.model_executor.layers import quant, quant_bits
from deepinfer.model_executor.layers.quant_gemm import e4m3_values

_NS = "deepinfer_kv"
_FP8_GROUP = 32   # values per ue8m0 scale of an fp8 record
# Device types whose graphs trace the integer forms: torch-neuronx cannot lower an opaque op with
# no NKI kernel behind it, and the graph must still hold no float8 value.
TRACED_DEVICES = ("neuron",)


def traced_on(t: Tensor) -> bool:
    return t.device.type in TRACED_DEVICES


def _values(name: str, x: Tensor) -> None:
    if not x.is_floating_point() or x.element_size() == 1:
        raise ValueError(f"{name}: expected values in a float dtype of 16 or 32 bits, got {x.dtype}")


def _bytes(name: str, rec: Tensor, width: int) -> None:
    if rec.dtype != torch.uint8:
        raise ValueError(f"{name}: expected uint8 record bytes, got {rec.dtype}")
    if rec.shape[-1] != width:
        raise ValueError(f"{name}: expected records of {width} bytes, got {rec.shape[-1]}")


def fp8_record_bytes(width: int) -> int:
    return width + width // _FP8_GROUP


def fp4_record_bytes(width: int, group: int) -> int:
    return width // 2 + width // group


def fp8_encode(x: Tensor, fp8_max: float, int_codes: bool = False) -> Tensor:
    """[..., W] values -> uint8 [..., W + W/32]: e4m3 codes, then one ue8m0 byte per 32 values."""
    _values("fp8_record_encode x", x)
    if int_codes:   # codes and exponents stay int32 until the record is narrowed (§4 A9)
        xs, sf = quant.scaled_fp8_block(x.float(), (1, _FP8_GROUP), fp8_max)
        return torch.cat([quant_bits.float_to_e4m3(xs), quant_bits.ue8m0_exponent(sf)], dim=-1).to(torch.uint8)
    q, s = quant.quantize_fp8_block(x.float(), block=(1, _FP8_GROUP), scale_fmt="ue8m0", fp8_max=fp8_max)
    return torch.cat([q.view(torch.uint8), s.view(torch.uint8)], dim=-1)


def fp8_decode(rec: Tensor, width: int, dtype: torch.dtype, int_codes: bool = False) -> Tensor:
    """uint8 [..., W + W/32] records -> [..., W] values in `dtype`."""
    _bytes("fp8_record_decode rec", rec, fp8_record_bytes(width))
    q = e4m3_values(rec[..., :width].contiguous(), int_codes)
    s = quant.ue8m0_to_float(rec[..., width:].contiguous())
    return (q * s.repeat_interleave(_FP8_GROUP, dim=-1)).to(dtype)


def fp4_encode(x: Tensor, group: int, scale_fmt: str, fp8_max: float, int_codes: bool = False) -> Tensor:
    """[..., W] values -> uint8 [..., W/2 + W/group]: e2m1 pairs (low nibble first), then one scale
    byte per `group` values (e4m3 or ue8m0, `scale_fmt`)."""
    _values("fp4_record_encode x", x)
    packed, s = quant.quantize_fp4(x.float(), group=group, scale_fmt=scale_fmt, fp8_max=fp8_max,
                                   int_codes=int_codes)
    s = s.contiguous().to(torch.uint8) if int_codes else s.contiguous().view(torch.uint8)
    return torch.cat([packed.view(torch.uint8), s], dim=-1)


def fp4_decode(rec: Tensor, width: int, group: int, scale_fmt: str, dtype: torch.dtype,
               int_codes: bool = False) -> Tensor:
    """uint8 [..., W/2 + W/group] records -> [..., W] values in `dtype`."""
    _bytes("fp4_record_decode rec", rec, fp4_record_bytes(width, group))
    values = quant.decode_e2m1(rec[..., : width // 2].contiguous())
    sb = rec[..., width // 2:].contiguous()
    s = e4m3_values(sb, int_codes) if scale_fmt == "e4m3" else quant.ue8m0_to_float(sb)
    return (values * s.repeat_interleave(group, dim=-1)).to(dtype)


@torch.library.custom_op(f"{_NS}::fp8_record_encode", mutates_args=())
def fp8_record_encode(x: Tensor, fp8_max: float) -> Tensor:
    return fp8_encode(x, fp8_max)


@fp8_record_encode.register_fake
def _(x, fp8_max):
    _values("fp8_record_encode x", x)
    return x.new_empty(*x.shape[:-1], fp8_record_bytes(x.shape[-1]), dtype=torch.uint8)


@torch.library.custom_op(f"{_NS}::fp8_record_decode", mutates_args=())
def fp8_record_decode(rec: Tensor, width: int, dtype: torch.dtype) -> Tensor:
    return fp8_decode(rec, width, dtype)


@fp8_record_decode.register_fake
def _(rec, width, dtype):
    _bytes("fp8_record_decode rec", rec, fp8_record_bytes(width))
    return rec.new_empty(*rec.shape[:-1], width, dtype=dtype)


@torch.library.custom_op(f"{_NS}::fp4_record_encode", mutates_args=())
def fp4_record_encode(x: Tensor, group: int, scale_fmt: str, fp8_max: float) -> Tensor:
    return fp4_encode(x, group, scale_fmt, fp8_max)


@fp4_record_encode.register_fake
def _(x, group, scale_fmt, fp8_max):
    _values("fp4_record_encode x", x)
    return x.new_empty(*x.shape[:-1], fp4_record_bytes(x.shape[-1], group), dtype=torch.uint8)


@torch.library.custom_op(f"{_NS}::fp4_record_decode", mutates_args=())
def fp4_record_decode(rec: Tensor, width: int, group: int, scale_fmt: str, dtype: torch.dtype) -> Tensor:
    return fp4_decode(rec, width, group, scale_fmt, dtype)


@fp4_record_decode.register_fake
def _(rec, width, group, scale_fmt, dtype):
    _bytes("fp4_record_decode rec", rec, fp4_record_bytes(width, group))
    return rec.new_empty(*rec.shape[:-1], width, dtype=dtype)
