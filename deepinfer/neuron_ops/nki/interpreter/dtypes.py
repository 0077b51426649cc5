"""NKI data types in NumPy: each value is held in a NumPy storage type (float32 for every float
format, the integer type itself for integers) and rounded to its format on every write, so a bf16
tile holds exactly the bf16 values the hardware would. `view` reinterprets bits (across item sizes the last axis rescales).

float8_e4m3 is trn2's IEEE-style e4m3 (largest finite 240, exponent field 15 = inf/NaN);
float8_e4m3fn is the OCP variant (largest finite 448, only S.1111.111 is NaN).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DType:
    name: str
    itemsize: int
    storage: type          # NumPy type the values live in
    is_float: bool
    bits: type             # unsigned NumPy type of the same size (for view)

    def __repr__(self) -> str:
        return f"nl.{self.name}"


float32 = DType("float32", 4, np.float32, True, np.uint32)
tfloat32 = DType("tfloat32", 4, np.float32, True, np.uint32)
bfloat16 = DType("bfloat16", 2, np.float32, True, np.uint16)
float16 = DType("float16", 2, np.float32, True, np.uint16)
float8_e4m3 = DType("float8_e4m3", 1, np.float32, True, np.uint8)
float8_e4m3fn = DType("float8_e4m3fn", 1, np.float32, True, np.uint8)
float8_e5m2 = DType("float8_e5m2", 1, np.float32, True, np.uint8)
int32 = DType("int32", 4, np.int32, False, np.uint32)
uint32 = DType("uint32", 4, np.uint32, False, np.uint32)
int16 = DType("int16", 2, np.int16, False, np.uint16)
uint16 = DType("uint16", 2, np.uint16, False, np.uint16)
int8 = DType("int8", 1, np.int8, False, np.uint8)
uint8 = DType("uint8", 1, np.uint8, False, np.uint8)

ALL = {d.name: d for d in (float32, tfloat32, bfloat16, float16, float8_e4m3, float8_e4m3fn, float8_e5m2,
                           int32, uint32, int16, uint16, int8, uint8)}
MATMUL_DTYPES = {float32, tfloat32, bfloat16, float16, float8_e4m3, float8_e4m3fn, float8_e5m2}

_NUMPY = {np.dtype(np.float32): float32, np.dtype(np.float16): float16, np.dtype(np.int32): int32,
          np.dtype(np.uint32): uint32, np.dtype(np.int16): int16, np.dtype(np.uint16): uint16,
          np.dtype(np.int8): int8, np.dtype(np.uint8): uint8}


def from_numpy(dt) -> DType:
    try:
        return _NUMPY[np.dtype(dt)]
    except KeyError:
        raise TypeError(f"nki interpreter: no NKI dtype for numpy {dt}") from None


def _fp8_table(exp_bits: int, man_bits: int, ieee: bool) -> np.ndarray:
    """Value of each of the 256 codes of a 1-sign fp8 format (bias 2^(E-1) - 1)."""
    bias = (1 << (exp_bits - 1)) - 1
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    e = (codes >> man_bits) & ((1 << exp_bits) - 1)
    m = codes & ((1 << man_bits) - 1)
    frac = m / float(1 << man_bits)
    val = np.where(e == 0, frac * 2.0 ** (1 - bias), (1 + frac) * 2.0 ** (e - bias)) * sign
    top = e == (1 << exp_bits) - 1
    if ieee:
        val = np.where(top & (m == 0), sign * np.inf, np.where(top, np.nan, val))
    else:  # OCP fn: only the all-ones mantissa of the top exponent is NaN
        val = np.where(top & (m == (1 << man_bits) - 1), np.nan, val)
    return val.astype(np.float32)


_FP8 = {float8_e4m3: _fp8_table(4, 3, True), float8_e4m3fn: _fp8_table(4, 3, False),
        float8_e5m2: _fp8_table(5, 2, True)}


def _round_fp8(x: np.ndarray, dt: DType) -> np.ndarray:
    """Round fp32 values to the nearest code (ties to the even code); beyond the largest finite
    value: inf for the IEEE formats, NaN for e4m3fn (no saturation, as a plain cast)."""
    table = _FP8[dt]
    finite = np.isfinite(table)
    pos = np.unique(table[finite & (table >= 0)])           # sorted non-negative finite values
    a = np.abs(x)
    hi = np.clip(np.searchsorted(pos, a), 1, len(pos) - 1)
    lo_v, hi_v = pos[hi - 1], pos[hi]
    # ties go to the value whose code is even: for these formats, the lower index when its index is even
    pick_hi = (a - lo_v > hi_v - a) | ((a - lo_v == hi_v - a) & ((hi - 1) % 2 == 1))
    r = np.where(pick_hi, hi_v, lo_v)
    top = pos[-1]
    half_ulp = (pos[-1] - pos[-2]) / 2
    over = a > top + half_ulp
    r = np.where(over, np.inf if dt is not float8_e4m3fn else np.nan, np.where(a >= top, top, r))
    r = np.where(np.isnan(x), np.nan, r)
    return np.where(np.signbit(x), -r, r).astype(np.float32)


def round_to(x: np.ndarray, dt: DType) -> np.ndarray:
    """x (any NumPy values) as dtype `dt`'s values, in its storage type."""
    x = np.asarray(x)
    if not dt.is_float:
        if x.dtype.kind == "f":
            x = np.rint(x)  # float -> int conversions round to nearest
            info = np.iinfo(dt.storage)
            x = np.clip(x, info.min, info.max)
        return x.astype(dt.storage)
    f = x.astype(np.float32)
    if dt in (float32, tfloat32):
        return f
    if dt is bfloat16:
        b = f.view(np.uint32).astype(np.uint64)
        rounded = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16).astype(np.uint32).view(np.float32)
        return np.where(np.isnan(f), f, rounded)
    if dt is float16:
        return f.astype(np.float16).astype(np.float32)
    return _round_fp8(f, dt)


def to_bits(values: np.ndarray, dt: DType) -> np.ndarray:
    """The stored bit patterns of `values` (already in dtype dt) as dt.bits integers."""
    if not dt.is_float:
        return values.astype(dt.storage).view(dt.bits)
    if dt in (float32, tfloat32):
        return values.astype(np.float32).view(np.uint32)
    if dt is bfloat16:
        return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    if dt is float16:
        return values.astype(np.float16).view(np.uint16)
    table = _FP8[dt]
    keys = table.copy()
    keys[np.isnan(keys)] = np.nan  # one canonical NaN pattern
    key_bits = keys.view(np.uint32)
    order = np.argsort(key_bits, kind="stable")   # the first code of equal keys wins (the first NaN code)
    sorted_bits = key_bits[order]
    v = values.astype(np.float32)
    v = np.where(np.isnan(v), np.float32(np.nan), v).view(np.uint32)
    idx = np.clip(np.searchsorted(sorted_bits, v), 0, 255)
    if not np.array_equal(sorted_bits[idx], v):
        raise ValueError(f"to_bits: values are not {dt.name} values")
    return order[idx].astype(np.uint8)


def from_bits(bits: np.ndarray, dt: DType) -> np.ndarray:
    """Values of dtype dt whose bit patterns are `bits` (unsigned, dt.itemsize bytes)."""
    bits = bits.astype(dt.bits)
    if not dt.is_float:
        return bits.view(dt.storage)
    if dt in (float32, tfloat32):
        return bits.view(np.float32).copy()
    if dt is bfloat16:
        return (bits.astype(np.uint32) << 16).view(np.float32)
    if dt is float16:
        return bits.view(np.float16).astype(np.float32)
    return _FP8[dt][bits]


def promote(*dts: DType) -> DType:
    """Result type of an elementwise op over tiles of these dtypes: the widest float, else the widest int."""
    floats = [d for d in dts if d.is_float]
    pool = floats or list(dts)
    return max(pool, key=lambda d: (d.itemsize, d is bfloat16))
