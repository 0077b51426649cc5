"""The fast dequantizations (one pair lookup a fp4 byte, scales broadcast over their blocks) equal the
plain formulas element by element: nibbles looked up one at a time, scales repeated to full size."""
import torch

from deepinfer.model_executor.layers import quant, quant_gemm


def _plain_fp4(packed, scale, group):
    b = packed.to(torch.int64)
    codes = torch.stack((b & 0x0F, b >> 4), dim=-1).flatten(-2)
    values = quant.E2M1_VALUES[codes]
    s = quant.ue8m0_to_float(scale).repeat_interleave(group, dim=-1)[..., : values.shape[-1]]
    return values * s


def _plain_fp8(codes, scale, br, bc, row0, row1):
    rows = codes[row0:row1].view(torch.float8_e4m3fn).to(torch.float32)
    s = quant.ue8m0_to_float(scale).repeat_interleave(br, dim=0).repeat_interleave(bc, dim=1)
    return rows * s[row0:row1, : rows.shape[1]]


def test_fp4_every_byte_and_scale_equal_the_plain_formula():
    g = torch.Generator().manual_seed(0)
    packed = torch.arange(256, dtype=torch.uint8).repeat(3, 2).view(3, 2, 256)   # every byte value
    scale = torch.randint(100, 140, (3, 2, 512 // 32), dtype=torch.uint8, generator=g)
    assert torch.equal(quant.dequant_fp4(packed, scale, 32), _plain_fp4(packed, scale, 32))


def test_fp8_aligned_and_ragged_row_ranges_equal_the_plain_formula():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 256, (96, 80), dtype=torch.uint8, generator=g)
    codes[(codes & 0x7F) == 0x7F] = 0          # no NaN codes: torch.equal compares values
    scale = torch.randint(110, 135, (3, 3), dtype=torch.uint8, generator=g)   # 32 x 32 blocks, a ragged last column
    for r0, r1 in ((0, 96), (32, 64), (5, 70)):
        got = quant_gemm.dequant_fp8_rows(codes, scale, 32, 32, r0, r1)
        assert torch.equal(got, _plain_fp8(codes, scale, 32, 32, r0, r1)), (r0, r1)
    aligned = torch.randint(0, 120, (64, 64), dtype=torch.uint8, generator=g)
    s2 = scale[:2, :2].contiguous()
    assert torch.equal(quant_gemm.dequant_fp8_rows(aligned, s2, 32, 32, 0, 64), _plain_fp8(aligned, s2, 32, 32, 0, 64))
