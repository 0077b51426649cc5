"""trn2 fp8: IEEE e4m3 (max 240), not OCP e4m3fn (max 448) (docs/neuron.md §4 A1).

- Activations and KV quantize to ACT_FP8_MAX = 224 (headroom below 240, as in the seed).
- Checkpoint e4m3fn weights are rescaled once at load: every value halved (|v| <= 224) and the
  ue8m0 block exponent raised by one, so dequantized weights are unchanged. For |v| < 256 the byte
  of an e4m3fn value equals the IEEE e4m3 byte of the same value, so the rescaled bytes read
  correctly on trn2 (with --experimental-unsafe-fp8e4m3fn-as-fp8e4m3).
- Halving is exact except in the two lowest binades (|v| < 2^-5), where v/2 needs a mantissa bit
  e4m3 does not have there; those codes round to nearest even (`inexact_codes()` lists them).
All byte work goes through uint8 views and a 256-entry table: no cat/index on float8 (A2, A3).
"""
import torch

from deepinfer.model_executor.layers import quant

TRN2_FP8_MAX = 240.0
ACT_FP8_MAX = 224.0
OCP_FP8_MAX = 448.0


def _halving_table() -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    half = codes.view(torch.float8_e4m3fn).to(torch.float32) / 2
    return half.to(torch.float8_e4m3fn).view(torch.uint8)


_HALF = _halving_table()


def inexact_codes() -> torch.Tensor:
    """e4m3fn codes whose halved value is not exactly representable (uint8)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    v = codes.view(torch.float8_e4m3fn).float()
    back = _HALF.view(torch.float8_e4m3fn).float() * 2
    bad = (v != back) & ~torch.isnan(v)
    return codes[bad]


def rescale_weight_for_trn2(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3fn weight, ue8m0 block scale) -> (halved weight bytes as uint8, scale exponent + 1 as uint8).

    weight: float8_e4m3fn or its uint8 bytes; scale: float8_e8m0fnu or uint8 exponent bytes."""
    w = weight.view(torch.uint8) if weight.dtype == torch.float8_e4m3fn else weight
    s = scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale
    if w.dtype != torch.uint8 or s.dtype != torch.uint8:
        raise ValueError(f"rescale_weight_for_trn2: expected e4m3fn/uint8 weight and e8m0/uint8 scale, "
                         f"got {weight.dtype} and {scale.dtype}")
    if bool((s >= 254).any()):
        raise ValueError("scale: ue8m0 exponent byte >= 254 cannot be raised by one (2^127 is the largest scale)")
    return _HALF[w.long()], s + 1


def quantize_activation(x: torch.Tensor, block: int = 128, fp8_max: float = ACT_FP8_MAX):
    """Per-row blocks of `block` values -> (e4m3fn codes as uint8, fp32 power-of-two scales).

    The TK cast rule (scale = amax / fp8_max rounded up to 2^k) with trn2's 224 ceiling, so every
    code is a valid IEEE e4m3 value."""
    if fp8_max > TRN2_FP8_MAX:
        raise ValueError(f"fp8_max: must be <= {TRN2_FP8_MAX} on trn2, got {fp8_max}")
    sf, q_mul = quant._block_scales(x, (1, block), fp8_max, quant.AMAX_CLAMP[("e4m3", False)])
    xs = x.float() * q_mul.repeat_interleave(block, dim=-1)[..., : x.shape[-1]]
    q = xs.clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), sf


def dequantize_activation(codes: torch.Tensor, scale: torch.Tensor, block: int = 128,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    v = codes.view(torch.float8_e4m3fn).float()
    return (v * scale.repeat_interleave(block, dim=-1)[..., : v.shape[-1]]).to(dtype)


def trn2_representable(codes: torch.Tensor) -> bool:
    """Whether every byte decodes to a finite IEEE e4m3 value (|v| <= 240)."""
    v = codes.view(torch.float8_e4m3fn).float() if codes.dtype == torch.uint8 else codes.float()
    return bool(torch.isfinite(v).all() and (v.abs() <= TRN2_FP8_MAX).all())
