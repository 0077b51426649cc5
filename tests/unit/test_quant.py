"""FP8 / FP4 / ue8m0 formats against per-element Python formulas (docs/model.md §2.1, §4.1)."""

import math

import pytest
import torch

from deepinfer.model_executor.layers import quant


def _py_e2m1(code: int) -> float:
    """Nibble s|e1e0|m: e=0 -> 0.5*m, else 2^(e-1)*(1+m/2)."""
    sign = -1.0 if code & 8 else 1.0
    e, m = (code >> 1) & 3, code & 1
    mag = 0.5 * m if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
    return sign * mag


def _py_pow2_ceil(v: float) -> float:
    """Smallest power of two >= v."""
    mant, exp = math.frexp(v)  # v = mant * 2^exp, mant in [0.5, 1)
    return 2.0 ** (exp - 1) if mant == 0.5 else 2.0 ** exp


def test_ue8m0_decode_every_byte():
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = quant.ue8m0_to_float(b.view(torch.float8_e8m0fnu))
    for i in range(255):
        assert got[i].item() == 2.0 ** (i - 127), i
    assert torch.equal(quant.ue8m0_to_float(b), got)  # uint8 bytes decode the same


def test_ue8m0_encode_round_trip_and_rejects_non_powers():
    values = torch.tensor([2.0**-30, 0.25, 1.0, 8.0, 2.0**40])
    enc = quant.float_to_ue8m0(values)
    assert enc.dtype == torch.float8_e8m0fnu
    assert enc.view(torch.uint8).tolist() == [127 - 30, 125, 127, 130, 167]
    assert torch.equal(quant.ue8m0_to_float(enc), values)
    with pytest.raises(ValueError, match="powers of two"):
        quant.float_to_ue8m0(torch.tensor([3.0]))
    with pytest.raises(ValueError, match="powers of two"):
        quant.float_to_ue8m0(torch.tensor([-1.0]))
    with pytest.raises(ValueError, match="scale dtype"):
        quant.ue8m0_to_float(torch.ones(2))


def test_decode_e2m1_every_byte_low_nibble_first():
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.int8)
    got = quant.decode_e2m1(packed)
    assert got.shape == (512,)
    for byte in range(256):
        assert got[2 * byte].item() == _py_e2m1(byte & 0xF)
        assert got[2 * byte + 1].item() == _py_e2m1(byte >> 4)
    assert sorted({abs(_py_e2m1(c)) for c in range(16)}) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]


def test_dequant_fp4_per_element():
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(-128, 128, (3, 2, 32), generator=g, dtype=torch.int8)  # [E, O, I/2], I = 64
    sbytes = torch.randint(120, 135, (3, 2, 2), generator=g, dtype=torch.int32).to(torch.uint8)
    got = quant.dequant_fp4(packed, sbytes.view(torch.float8_e8m0fnu))
    assert got.shape == (3, 2, 64) and got.dtype == torch.float32
    for e in range(3):
        for o in range(2):
            for i in range(64):
                byte = int(packed[e, o, i // 2]) & 0xFF
                code = byte & 0xF if i % 2 == 0 else byte >> 4
                want = _py_e2m1(code) * 2.0 ** (int(sbytes[e, o, i // 32]) - 127)
                assert got[e, o, i].item() == want
    with pytest.raises(ValueError, match="scale shape"):
        quant.dequant_fp4(packed, sbytes[..., :1].view(torch.float8_e8m0fnu), group=32)


def test_dequant_fp8_block_per_element_ragged():
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(40, 70, generator=g) * 50).to(torch.float8_e4m3fn)
    sbytes = torch.randint(110, 140, (2, 3), generator=g, dtype=torch.int32).to(torch.uint8)
    got = quant.dequant_fp8_block(w, sbytes.view(torch.float8_e8m0fnu), (32, 32))
    wf = w.float()
    for i in range(40):
        for j in range(70):
            want = wf[i, j].item() * 2.0 ** (int(sbytes[i // 32, j // 32]) - 127)
            assert got[i, j].item() == want
    # inferred block and f32 scales give the same result
    f32 = quant.ue8m0_to_float(sbytes)
    assert torch.equal(quant.dequant_fp8_block(w, f32), got)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        quant.dequant_fp8_block(wf, f32)


def test_dequant_fp8_block_stacked_experts():
    w = torch.full((2, 64, 64), 1.5).to(torch.float8_e4m3fn)
    s = torch.tensor([[[1.0, 2.0], [4.0, 8.0]], [[0.5, 0.25], [1.0, 1.0]]])
    got = quant.dequant_fp8_block(w, s)
    assert got[0, 0, 0] == 1.5 and got[0, 0, 40] == 3.0 and got[0, 40, 0] == 6.0 and got[0, 63, 63] == 12.0
    assert got[1, 0, 63] == 0.375


@pytest.mark.parametrize("wshape,sshape,hint,want", [
    ((256, 256), (8, 8), None, (32, 32)),
    ((64, 256), (1, 2), None, (128, 128)),
    ((64, 256), (1, 2), (128, 128), (128, 128)),
    ((512, 64), (4, 1), None, (128, 128)),
    ((8, 256, 128), (8, 2, 1), None, (128, 128)),
    ((100, 256), (100, 8), None, (1, 32)),  # 1x32 (Engram table) blocks
])
def test_infer_block_size(wshape, sshape, hint, want):
    assert quant.infer_block_size(wshape, sshape, hint) == want


@pytest.mark.parametrize("wshape,sshape", [((256, 256), (3, 8)), ((256, 256), (8,)), ((2, 64, 64), (3, 1, 1))])
def test_infer_block_size_rejects(wshape, sshape):
    with pytest.raises(ValueError):
        quant.infer_block_size(wshape, sshape)


def test_quantize_fp8_block_follows_cast_rule():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 70, generator=g) * torch.logspace(-3, 2, 70)
    q, s = quant.quantize_fp8_block(x, (32, 32))
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu and s.shape == (2, 3)
    sb = s.view(torch.uint8)
    for bi in range(2):
        for bj in range(3):
            block = x[bi * 32:(bi + 1) * 32, bj * 32:(bj + 1) * 32]
            amax = max(block.abs().max().item(), 1e-4)
            want_sf = _py_pow2_ceil(float(torch.tensor(amax / 448.0, dtype=torch.float32)))
            assert 2.0 ** (int(sb[bi, bj]) - 127) == want_sf
            # RNE cast of x / sf: compare with torch's own e4m3 rounding of the exact quotient
            want_q = (block / want_sf).to(torch.float8_e4m3fn).float()
            assert torch.equal(q[bi * 32:(bi + 1) * 32, bj * 32:(bj + 1) * 32].float(), want_q)
    assert q.float().abs().max() <= 448
    y = torch.randn(64, 64, generator=g).clamp(min=0.05) * 7  # stays in e4m3's normal range
    qy, sy = quant.quantize_fp8_block(y, (32, 32))
    err = (quant.dequant_fp8_block(qy, sy) - y).abs() / y.abs()
    assert err.max() <= 2.0**-4  # 3 mantissa bits: RNE error <= half a step = 1/16 relative


def test_quantize_fp8_zero_block_uses_amax_floor():
    q, s = quant.quantize_fp8_block(torch.zeros(1, 32), (1, 32))
    # 1e-4 / 448 = 2^-22.09 -> rounded up to 2^-22
    assert s.view(torch.uint8).item() == 127 - 22 and q.float().abs().sum() == 0
    _, sf = quant.quantize_fp8_block(torch.zeros(1, 32), (1, 32), scale_fmt="float")
    assert sf.item() == 2.0**-22


def _py_fp4_codes(values: list[float]) -> list[int]:
    """Nearest e2m1 value, ties to the even code, saturating at 6."""
    grid = [(abs(_py_e2m1(c)), c) for c in range(8)]
    out = []
    for v in values:
        mag = min(abs(v), 6.0)
        best = min(grid, key=lambda gc: (abs(gc[0] - mag), gc[1] & 1))
        out.append(best[1] | (8 if math.copysign(1.0, v) < 0 else 0))
    return out


def test_quantize_fp4_matches_python_rule():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 64, generator=g)
    x[0, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0] * 4) * 0.5  # exact ties after scaling
    x[0, 31] = 3.5  # amax of the group -> scale 1.0 (3.5/6 rounds up to 1)
    q, s = quant.quantize_fp4(x, 32)
    assert q.dtype == torch.int8 and q.shape == (3, 32) and s.shape == (3, 2)
    codes = quant.decode_e2m1(q)  # decode is tested independently above
    for r in range(3):
        for grp in range(2):
            vals = x[r, grp * 32:(grp + 1) * 32]
            sf = _py_pow2_ceil(float(torch.tensor(vals.abs().max().item() / 6.0, dtype=torch.float32)))
            assert 2.0 ** (int(s.view(torch.uint8)[r, grp]) - 127) == sf
            want = [_py_e2m1(c) for c in _py_fp4_codes((vals / sf).tolist())]
            assert codes[r, grp * 32:(grp + 1) * 32].tolist() == want
    # scale 1: 0.125 -> 0, 0.375 -> 0.5, 0.625 -> 0.5, 0.875 -> 1; ties to the even code:
    # 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4.0
    assert codes[0, :8].tolist() == [0.0, 0.5, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0]


def test_quantize_fp4_packing_and_zero_floor():
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = 1.0, -6.0
    q, s = quant.quantize_fp4(x, 32)
    assert s.view(torch.uint8).item() == 127  # amax 6 -> scale 1
    assert (int(q[0, 0]) & 0xFF) == (0x2 | (0xF << 4))  # element 0 (1.0, code 2) in the low nibble
    _, s0 = quant.quantize_fp4(torch.zeros(1, 32), 32)
    assert s0.view(torch.uint8).item() == 1  # 6*2^-126 / 6 = 2^-126


def test_quantize_fp4_e4m3_scale():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 32, generator=g)
    q, s = quant.quantize_fp4(x, 16, scale_fmt="e4m3")
    assert s.dtype == torch.float8_e4m3fn and s.shape == (4, 2)
    for r in range(4):
        for grp in range(2):
            amax = x[r, grp * 16:(grp + 1) * 16].abs().max()
            assert s[r, grp].float() == (amax / 6.0).to(torch.float8_e4m3fn).float()
    back = quant.fp4_round_trip(x, 16, "e4m3")
    assert (back - x).abs().max() < 0.35 * x.abs().max()


def test_round_trips_keep_dtype():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    x[0, 5] = 1e-5   # deep in e4m3's subnormal range for its block's scale
    assert quant.fp8_round_trip(x).dtype == torch.bfloat16
    assert quant.fp4_round_trip(x).dtype == torch.bfloat16
    xf = x.float()
    rt = quant.fp8_round_trip(xf)
    # half an e4m3 ulp (2^-4 relative) for normal codes; half the subnormal step (2^-10 of the block's
    # power-of-two scale, which is < amax / 224) below 2^-6 of the scale
    amax = xf.view(4, 2, 32).abs().amax(-1, keepdim=True).expand(4, 2, 32).reshape(4, 64)
    assert ((rt - xf).abs() <= xf.abs() / 16 + amax / 224 / 1024).all()


def test_quantize_rejects_bad_args():
    with pytest.raises(ValueError, match="scale_fmt"):
        quant.quantize_fp8_block(torch.ones(2, 32), scale_fmt="e5m2")
    with pytest.raises(ValueError, match="even"):
        quant.quantize_fp4(torch.ones(2, 31))
    with pytest.raises(ValueError, match="scale_fmt"):
        quant.quantize_fp4(torch.ones(2, 32), scale_fmt="f32")
