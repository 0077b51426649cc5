"""Checkpoint number formats: FP8 e4m3 block weights, FP4 e2m1 packed experts, ue8m0 scales.

Decoding follows docs/model.md §2.1 and quantizing follows the TileKernels cast rule of docs/model.md §4.1
(amax clamped below, scale = amax / Q_max rounded *up* to a power of two, q = RNE(x * (1/scale))).
Everything is plain vectorized torch on CPU; these functions run at load time and in the tiny
checkpoint generator, and the `di` numerics mode may reuse them for activation round trips.
"""

from __future__ import annotations

import torch

from deepinfer.model_executor.layers import quant_bits

FP8_E4M3_MAX = 448.0  # OCP e4m3fn; trn2's IEEE e4m3 (max 240) is handled by the platform, not here
FP4_E2M1_MAX = 6.0

# TK `config.py` amax floors: (format, scale stored as e4m3) -> clamp. They keep an all-zero block
# from producing a zero/denormal scale.
AMAX_CLAMP = {
    ("e4m3", False): 1e-4,
    ("e4m3", True): FP8_E4M3_MAX * 2.0**-9,
    ("e2m1", False): FP4_E2M1_MAX * 2.0**-126,
    ("e2m1", True): FP4_E2M1_MAX * 2.0**-9,
}

# Magnitudes of the e2m1 codes 0..7 (bit layout s|e1 e0|m); codes 8..15 are the negatives.
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)
# A byte's two e2m1 values, (low nibble, high nibble) for bytes 0..255: one lookup decodes a byte.
E2M1_PAIRS = torch.stack((E2M1_VALUES.repeat(16), E2M1_VALUES.repeat_interleave(16)), dim=-1)
_E2M1_ON: dict = {}  # device -> E2M1_PAIRS there (made once: graph replays cannot copy host data in)


# ---------------------------------------------------------------------------------------------
# ue8m0 scales
# ---------------------------------------------------------------------------------------------


def ue8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Decode ue8m0 bytes (float8_e8m0fnu or uint8) to fp32: byte b means 2^(b-127), exactly."""
    if scale.dtype == torch.float8_e8m0fnu:
        scale = scale.view(torch.uint8)
    if scale.dtype != torch.uint8:
        raise ValueError(f"scale dtype: expected float8_e8m0fnu or uint8, got {scale.dtype}")
    b = scale.to(torch.int32)
    # The byte is the fp32 exponent field; byte 0 (2^-127) is an fp32 denormal, built separately.
    out = (b << 23).view(torch.float32)
    return torch.where(b == 0, 2.0**-127, out)


def float_to_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """Encode positive fp32 powers of two as float8_e8m0fnu (the exponent byte of the fp32 value)."""
    scale = scale.to(torch.float32)
    bits = scale.view(torch.int32)
    if bool(((bits & 0x007FFFFF) != 0).any()) or bool((scale <= 0).any()):
        raise ValueError("scale: ue8m0 can only hold positive powers of two >= 2^-126")
    return _pow2_to_ue8m0(scale)


def _pow2_to_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """float_to_ue8m0 without the check, for scales that are powers of two by construction
    (_block_scales): the check reads values on the host, which the KV-cache encode inside a graph
    must not do."""
    return ((scale.view(torch.int32) >> 23) & 0xFF).to(torch.uint8).view(torch.float8_e8m0fnu)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """A scale tensor stored as ue8m0 bytes or as a float dtype, returned as fp32."""
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        return ue8m0_to_float(scale)
    if scale.is_floating_point():
        return scale.to(torch.float32)
    raise ValueError(f"scale dtype: expected float8_e8m0fnu, uint8 or a float dtype, got {scale.dtype}")


# ---------------------------------------------------------------------------------------------
# FP8 block weights
# ---------------------------------------------------------------------------------------------


def _block_candidates(size: int, n_blocks: int) -> range:
    """Block edges B with ceil(size / B) == n_blocks, as a range (may be empty)."""
    if n_blocks <= 0 or size <= 0:
        return range(0)
    low = -(-size // n_blocks)  # smallest B with ceil(size/B) <= n_blocks
    high = size if n_blocks == 1 else (size - 1) // (n_blocks - 1)  # largest B with ceil(size/B) >= n_blocks
    if n_blocks == 1:
        high = 1 << 30  # any B >= size maps the whole dim onto the single scale row
    return range(low, high + 1)


def _pick_power_of_two(candidates: range) -> int | None:
    b = 1
    while b <= candidates.stop:
        if b in candidates:
            return b
        b <<= 1
    return None


def infer_block_size(
    weight_shape: tuple[int, ...],
    scale_shape: tuple[int, ...],
    hint: tuple[int, int] | None = None,
) -> tuple[int, int]:
    """Block (rows, cols) that maps a [.., O, I] weight onto a [.., ceil(O/Br), ceil(I/Bc)] scale grid.

    Prefers `hint` (the config's weight_block_size) when it fits, then a square power of two, then a
    power of two per dimension. Ambiguity only arises for dims smaller than one block, where every
    candidate gives the same mapping. Raises ValueError if no block fits.
    """
    if len(weight_shape) < 2 or len(scale_shape) != len(weight_shape):
        raise ValueError(f"scale shape {tuple(scale_shape)} does not match weight shape {tuple(weight_shape)}")
    if tuple(weight_shape[:-2]) != tuple(scale_shape[:-2]):
        raise ValueError(f"scale shape {tuple(scale_shape)} does not match weight shape {tuple(weight_shape)}")
    rows = _block_candidates(weight_shape[-2], scale_shape[-2])
    cols = _block_candidates(weight_shape[-1], scale_shape[-1])
    if hint is not None and hint[0] in rows and hint[1] in cols:
        return int(hint[0]), int(hint[1])
    common = range(max(rows.start, cols.start), min(rows.stop, cols.stop))
    square = _pick_power_of_two(common) if len(common) else None
    if square is not None:
        return square, square
    br, bc = _pick_power_of_two(rows), _pick_power_of_two(cols)
    if br is None or bc is None:
        raise ValueError(
            f"scale shape {tuple(scale_shape)} fits no power-of-two block of weight shape {tuple(weight_shape)}"
        )
    return br, bc


def _expand_scale(scale: torch.Tensor, block: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    return scale.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]


def dequant_fp8_block(
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """W = e4m3(W_q) * S[i // Br, j // Bc] for a [.., O, I] float8_e4m3fn weight (leading dims = experts)."""
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"weight dtype: expected float8_e4m3fn, got {weight.dtype}")
    if block is None:
        block = infer_block_size(tuple(weight.shape), tuple(scale.shape))
    rows, cols = weight.shape[-2], weight.shape[-1]
    want = (*weight.shape[:-2], -(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale.shape) != want:
        raise ValueError(f"scale shape {tuple(scale.shape)} != {want} for weight {tuple(weight.shape)} block {block}")
    s = _expand_scale(scale_to_float(scale), block, rows, cols)
    return (weight.to(torch.float32) * s).to(out_dtype)


def quantize_fp8_block(
    x: torch.Tensor,
    block: tuple[int, int] = (32, 32),
    scale_fmt: str = "ue8m0",
    fp8_max: float = FP8_E4M3_MAX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TK cast rule to e4m3 with one scale per block of the last two dims.

    scale_fmt "ue8m0" returns float8_e8m0fnu scales (rounded up to a power of two), "float" returns
    the same power-of-two scales as fp32. Used for weights (32x32 / 128x128), the Engram table (1x32)
    and per-token activations (1x32). fp8_max: the largest code magnitude written (the platform's
    `fp8_max`: 448 for OCP e4m3fn, 224 on Neuron so the bytes mean the same as IEEE e4m3).
    """
    if scale_fmt not in ("ue8m0", "float"):
        raise ValueError(f"scale_fmt: expected 'ue8m0' or 'float', got {scale_fmt!r}")
    if not 0 < fp8_max <= FP8_E4M3_MAX:
        raise ValueError(f"fp8_max: must be in (0, {FP8_E4M3_MAX}], got {fp8_max}")
    xs, sf = scaled_fp8_block(x, block, fp8_max)
    q = xs.to(torch.float8_e4m3fn)  # torch casts with RNE
    return q, (_pow2_to_ue8m0(sf) if scale_fmt == "ue8m0" else sf)


def scaled_fp8_block(x: torch.Tensor, block: tuple[int, int], fp8_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """What quantize_fp8_block rounds to e4m3: x times its block's power-of-two reciprocal scale,
    clamped to +-fp8_max (fp32), and the fp32 block scales."""
    sf, q_mul = _block_scales(x, block, fp8_max, AMAX_CLAMP[("e4m3", False)])
    xs = x.to(torch.float32) * _expand_scale(q_mul, block, x.shape[-2], x.shape[-1])
    return xs.clamp(-fp8_max, fp8_max), sf


def _block_scales(x: torch.Tensor, block: tuple[int, int], q_max: float, clamp: float):
    """Power-of-two dequant scale per block, and the fp32 reciprocal TK multiplies by."""
    if x.dim() < 2:
        raise ValueError(f"x: expected >= 2 dims, got shape {tuple(x.shape)}")
    br, bc = block
    rows, cols = x.shape[-2], x.shape[-1]
    pr, pc = (-rows) % br, (-cols) % bc
    # Padding with zeros cannot raise a block's amax, so it matches TK's masked max.
    padded = torch.nn.functional.pad(x.to(torch.float32).abs(), (0, pc, 0, pr))
    lead = padded.shape[:-2]
    nr, nc = (rows + pr) // br, (cols + pc) // bc
    # Reduce the contiguous block columns first, then the block rows (a joint reduction is slow on CPU).
    amax = padded.reshape(*lead, nr, br, nc, bc).amax(dim=-1).amax(dim=-2).clamp(min=clamp)
    sf = amax / q_max
    sf = ((sf.view(torch.int32) + 0x007FFFFF) & 0x7F800000).view(torch.float32)  # round up to 2^k
    return sf, 1.0 / sf


# ---------------------------------------------------------------------------------------------
# FP4 e2m1 experts
# ---------------------------------------------------------------------------------------------


def decode_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Unpack int8/uint8 [..., K/2] to fp32 [..., K]; element 2k is the low nibble of byte k."""
    if packed.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"packed dtype: expected int8 or uint8, got {packed.dtype}")
    # one lookup a byte in the (low, high) pair table: 2.8x faster on CPU than masking and shifting
    # the nibbles and looking each up (fp4 dequantization, docs/benchmarks.md)
    b = packed.view(torch.uint8).to(torch.int64)
    table = _E2M1_ON.get(b.device)
    if table is None:
        table = _E2M1_ON[b.device] = E2M1_PAIRS.to(b.device)
    return table[b].flatten(-2)


def dequant_fp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    group: int | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """MXFP4 weight [.., O, I] from packed int8 [.., O, I/2] and scales [.., O, I/group] (ue8m0 or float)."""
    values = decode_e2m1(packed)
    cols = values.shape[-1]
    if group is None:
        if scale.shape[-1] <= 0 or cols % scale.shape[-1]:
            raise ValueError(f"scale shape {tuple(scale.shape)} does not divide fp4 weight width {cols}")
        group = cols // scale.shape[-1]
    want = (*values.shape[:-1], -(-cols // group))
    if tuple(scale.shape) != want:
        raise ValueError(f"scale shape {tuple(scale.shape)} != {want} for fp4 weight {tuple(values.shape)}")
    s = scale_to_float(scale)
    if cols % group == 0:   # each scale broadcast over its group: no repeated copy of the scales
        return (values.view(*want, group) * s.unsqueeze(-1)).view(values.shape).to(out_dtype)
    return (values * s.repeat_interleave(group, dim=-1)[..., :cols]).to(out_dtype)


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8 0..15) of already-scaled values: RNE with steps 0.5 / 1 / 2, saturating at 6."""
    mag = torch.nan_to_num(x.abs(), nan=FP4_E2M1_MAX, posinf=FP4_E2M1_MAX).clamp(max=FP4_E2M1_MAX)
    # Steps 0.5 / 1 / 2 map each binade onto consecutive integer codes: code = round(2m), round(m) + 2,
    # round(m/2) + 4. Adding the even offsets before rounding keeps round-half-to-even exact, so one
    # torch.round (RNE) serves all three ranges.
    code = torch.where(mag < 2, mag * 2, torch.where(mag < 4, mag + 2, mag * 0.5 + 4)).round_()
    return code.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 3)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes [..., K] (K even) into int8 [..., K/2], even element in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"codes: last dim must be even, got {codes.shape[-1]}")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).view(torch.int8)


def quantize_fp4(
    x: torch.Tensor,
    group: int = 32,
    scale_fmt: str = "ue8m0",
    fp8_max: float = FP8_E4M3_MAX,
    int_codes: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TK cast rule to packed e2m1 with one scale per `group` consecutive values of the last dim.

    scale_fmt "ue8m0": power-of-two scale rounded up (MXFP4 experts, index q/K). "e4m3": the scale is
    e4m3_RNE(amax / 6), not a power of two (the FP4 main KV cache); returned as float8_e4m3fn, at most
    `fp8_max` (a larger amax saturates its codes at 6 instead). int_codes: scales as the int32 codes
    of the same bytes, computed without a float8 tensor (layers/quant_bits.py; graphs that hold none).
    """
    if scale_fmt not in ("ue8m0", "e4m3"):
        raise ValueError(f"scale_fmt: expected 'ue8m0' or 'e4m3', got {scale_fmt!r}")
    if x.shape[-1] % 2:
        raise ValueError(f"x: last dim must be even for fp4 packing, got {x.shape[-1]}")
    x2 = x.to(torch.float32).reshape(-1, x.shape[-1])
    if scale_fmt == "ue8m0":
        sf, q_mul = _block_scales(x2, (1, group), FP4_E2M1_MAX, AMAX_CLAMP[("e2m1", False)])
        out_sf = quant_bits.ue8m0_exponent(sf) if int_codes else _pow2_to_ue8m0(sf)
    else:
        cols = x2.shape[-1]
        pad = (-cols) % group
        amax = torch.nn.functional.pad(x2.abs(), (0, pad)).reshape(x2.shape[0], -1, group).amax(-1)
        amax = amax.clamp(min=AMAX_CLAMP[("e2m1", True)])
        sf = (amax / FP4_E2M1_MAX).clamp(max=fp8_max)
        if int_codes:
            out_sf = quant_bits.float_to_e4m3(sf)
            q_mul = 1.0 / quant_bits.e4m3_to_float(out_sf)
        else:
            out_sf = sf.to(torch.float8_e4m3fn)
            q_mul = 1.0 / out_sf.to(torch.float32)
    xs = x2 * q_mul.repeat_interleave(group, dim=-1)[..., : x2.shape[-1]]
    packed = pack_e2m1(encode_e2m1(xs))
    lead = x.shape[:-1]
    return packed.reshape(*lead, -1), out_sf.reshape(*lead, -1)


def fp8_round_trip(x: torch.Tensor, block: tuple[int, int] = (1, 32)) -> torch.Tensor:
    """Quantize to e4m3 with ue8m0 block scales and back, in x's dtype (activation fake-quant)."""
    q, s = quantize_fp8_block(x, block, scale_fmt="float")
    return dequant_fp8_block(q, s, block, out_dtype=x.dtype)


def fp4_round_trip(x: torch.Tensor, group: int = 32, scale_fmt: str = "ue8m0") -> torch.Tensor:
    """Quantize to e2m1 with per-group scales and back, in x's dtype (activation / KV fake-quant)."""
    q, s = quantize_fp4(x, group, scale_fmt)
    return dequant_fp4(q, s.to(torch.float32) if scale_fmt == "e4m3" else s, group, out_dtype=x.dtype)
