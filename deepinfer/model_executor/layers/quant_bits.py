"""e4m3 codes by integer arithmetic: the float8-free form of torch's e4m3fn casts, for graphs that
must hold no float8 value and that a device compiles op by op (docs/neuron.md §4 A9, A11).

Codes are int32 (0..255, sign in bit 7) until the caller narrows them in its final store (A9).
`e4m3_to_float(codes)` equals `codes.view(torch.float8_e4m3fn).float()` bit for bit, and
`float_to_e4m3(x)` equals `x.to(torch.float8_e4m3fn).view(torch.uint8)` for every fp32 value of
magnitude at most 448 (callers clamp first, as the quantizers do) and for NaN; the tests compare
them over all 256 codes and every rounding tie.
"""
import torch

_MIN_NORMAL_EXP = 121       # fp32 exponent field of 2^-6, e4m3's smallest normal
_BIAS_SHIFT = 120 << 3      # fp32 (exponent, top 3 mantissa bits) -> e4m3 (exponent, mantissa)
_NAN_CODE = 0x7F


def e4m3_to_float(codes: torch.Tensor) -> torch.Tensor:
    """uint8 / int32 e4m3fn codes -> fp32 values."""
    b = codes.to(torch.int32)
    mag = b & 0x7F
    normal = (mag << 20) + (120 << 23)                             # exponent + 120, mantissa on top
    sub = ((mag & 7).to(torch.float32) * 2.0 ** -9).view(torch.int32)   # m/8 * 2^-6, exact
    bits = torch.where(mag < 8, sub, normal)
    bits = torch.where(mag == _NAN_CODE, torch.full_like(bits, 0x7FF00000), bits)   # the NaN torch decodes to
    return (bits | ((b & 0x80) << 24)).view(torch.float32)


def float_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 values (|x| <= 448 or NaN) -> int32 e4m3fn codes, rounded to nearest even."""
    bits = x.to(torch.float32).view(torch.int32)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # normal range: drop 20 mantissa bits with round-half-even, then rebias the exponent
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - _BIAS_SHIFT
    # below 2^-6: multiples of 2^-9 (a power-of-two scaling, exact; torch.round is half-even)
    sub = torch.round(a.view(torch.float32) * 2.0 ** 9).to(torch.int32)
    mag = torch.where(a < (_MIN_NORMAL_EXP << 23), sub, normal)
    mag = torch.where(a > 0x7F800000, torch.full_like(mag, _NAN_CODE), mag)
    return mag | sign


def ue8m0_exponent(scale: torch.Tensor) -> torch.Tensor:
    """Positive fp32 powers of two -> int32 ue8m0 bytes (the fp32 exponent field)."""
    return (scale.to(torch.float32).view(torch.int32) >> 23) & 0xFF
