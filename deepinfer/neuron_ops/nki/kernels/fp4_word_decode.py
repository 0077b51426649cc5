"""The fp4 weight decode of `blockquant_fp4_gemm` design "words": nibbles become trn2 fp8 e4m3 codes
by integer operations on 32-bit words, then one multiply per weight applies the 1x32 scale.

Why words. An integer instruction costs its element count a partition (the ISA's per-instruction
formula), so reading a byte tile as uint32 words handles 4 bytes (8 nibbles) an element: the bit
work falls 4x against byte tiles, and the Vector Engine (the only engine that runs bitvec operators)
stops being the bound.

Why e4m3 needs no table. An e2m1 nibble is s.E1E0.m (exponent bias 1, E = 0 subnormal). Shifted
left by 2 under the sign, s00.E1E0.m00 is an e4m3 code with exponent field E and top mantissa bit m:
e4m3's exponent bias is 7 and its E = 0 is subnormal as well, so the code's value is exactly the
nibble's value times 2^-6 for all 16 nibbles (0 and -0 included). Per word:
  low nibbles:  ((w & 0x07070707) << 2) | ((w << 4) & 0x80808080)
  high nibbles: ((w >> 2) & 0x1C1C1C1C) | (w & 0x80808080)
four two-operator tensor_scalar instructions on the Vector Engine, the two ORs on GpSimd.

The scale. A 1x32 ue8m0 scale varies along N and every 16 byte rows along K, so no operand of the
matmul can carry it (x is shared by every column); each decoded weight is multiplied by its scale
once, in x's dtype: the low half on the Vector Engine against the scale rows in PSUM, the high half
on GpSimd against an SBUF copy the Scalar Engine makes (GpSimd does not read PSUM). With the bit
work on the Vector Engine and the ORs on GpSimd this balances the two (any further split costs
GpSimd its 150-cycle start per instruction). The scale rows
the caller passes carry the 2^6 (its one-hot matrix holds 64, exact for powers of two), so a decoded
weight is e2m1 * 2^(e - 127) rounded once to x's dtype: the same weights as the other designs.
"""
from deepinfer.neuron_ops.nki.api import nisa, nl

NIBBLE_SCALE = 64.0            # e4m3 code of a nibble = its e2m1 value * 2^-6; the scale rows carry 2^6
LOW_MAGNITUDE, HIGH_MAGNITUDE, SIGNS = 0x07070707, 0x1C1C1C1C, 0x80808080


def _whole_words(packed):
    """The byte tile widened with zero bytes to whole 32-bit words (only a last N tile of a width
    that is not a multiple of 4 needs it; the V4.1 widths never do)."""
    p, f = packed.shape
    if f % 4 == 0:
        return packed
    padded = nl.zeros((p, -(-f // 4) * 4), dtype=nl.uint8, buffer=nl.sbuf)
    padded[:, 0:f] = nisa.tensor_copy(packed, dtype=nl.uint8, engine=nisa.gpsimd_engine)
    return padded


def _e4m3_halves(packed):
    """uint8 [P, F] nibble pairs -> (low, high) nibbles as e4m3 tiles [P, F] (value * 2^-6)."""
    f = packed.shape[1]
    words = _whole_words(packed).view(nl.uint32)
    u32 = nl.uint32
    lo_mag = nisa.tensor_scalar(words, nl.bitwise_and, LOW_MAGNITUDE, op1=nl.left_shift, operand1=2, dtype=u32)
    lo_sign = nisa.tensor_scalar(words, nl.left_shift, 4, op1=nl.bitwise_and, operand1=SIGNS, dtype=u32)
    hi_mag = nisa.tensor_scalar(words, nl.right_shift, 2, op1=nl.bitwise_and, operand1=HIGH_MAGNITUDE, dtype=u32)
    hi_sign = nisa.tensor_scalar(words, nl.bitwise_and, SIGNS, dtype=u32)
    lo = nisa.tensor_tensor(lo_mag, lo_sign, nl.bitwise_or, dtype=u32, engine=nisa.gpsimd_engine)
    hi = nisa.tensor_tensor(hi_mag, hi_sign, nl.bitwise_or, dtype=u32, engine=nisa.gpsimd_engine)
    return lo.view(nl.float8_e4m3)[:, 0:f], hi.view(nl.float8_e4m3)[:, 0:f]


def decode_words(packed, scale_rows, dtype):
    """Both nibble halves of a byte tile [P, F] as weights in `dtype` times their scales; scale_rows
    (PSUM [P, F] fp32) = 2^6 * the scale of each byte."""
    lo, hi = _e4m3_halves(packed)
    scale_sbuf = nisa.activation(nl.copy, scale_rows, dtype=nl.bfloat16)     # Scalar Engine: PSUM -> SBUF
    w_lo = nisa.tensor_tensor(lo, scale_rows, nl.multiply, dtype=dtype)
    w_hi = nisa.tensor_tensor(hi, scale_sbuf, nl.multiply, dtype=dtype, engine=nisa.gpsimd_engine)
    return w_lo, w_hi
