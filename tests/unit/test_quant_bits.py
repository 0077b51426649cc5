"""layers/quant_bits.py: e4m3 codes by integer arithmetic equal torch's float8_e4m3fn casts bit for
bit (every code; every value, rounding tie and its neighbours; subnormals, signed zeros, NaN), so
graphs that hold no float8 tensor compute the same bytes and values."""
import torch

from deepinfer.model_executor.layers import quant, quant_bits

CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8)


def _torch_values() -> torch.Tensor:
    return CODES.view(torch.float8_e4m3fn).float()


def test_decode_equals_the_float8_view_for_every_code():
    want = _torch_values()
    for codes in (CODES, CODES.to(torch.int32)):
        got = quant_bits.e4m3_to_float(codes)
        assert got.dtype == torch.float32
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))   # NaNs and -0.0 included


def test_encode_equals_the_float8_cast_on_values_ties_and_neighbours():
    v = _torch_values()
    v = v[~torch.isnan(v)].unique().sort().values                      # every finite e4m3 value
    mid = ((v[:-1].double() + v[1:].double()) / 2).float()             # exact in fp32: the rounding ties
    up = torch.nextafter(mid, torch.full_like(mid, float("inf")))
    down = torch.nextafter(mid, torch.full_like(mid, -float("inf")))
    g = torch.Generator().manual_seed(0)
    x = torch.cat([v, mid, up, down, torch.randn(50_000, generator=g) * 60,
                   (torch.rand(50_000, generator=g) - 0.5) * 2 ** -5,   # the subnormal range
                   torch.tensor([0.0, -0.0, 1e-45, -1e-45, 2 ** -10, 448.0, -448.0, float("nan"), -float("nan")])])
    x = x[(x.abs() <= 448) | torch.isnan(x)]
    got = quant_bits.float_to_e4m3(x)
    assert got.dtype == torch.int32
    assert torch.equal(got, x.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int32))


def test_round_trip_and_ue8m0_exponent():
    v = _torch_values()
    finite = ~torch.isnan(v)
    assert torch.equal(quant_bits.float_to_e4m3(v[finite]), CODES[finite].to(torch.int32))
    scales = 2.0 ** torch.arange(-126, 128, dtype=torch.float32)
    want = quant.float_to_ue8m0(scales).view(torch.uint8).to(torch.int32)
    assert torch.equal(quant_bits.ue8m0_exponent(scales), want)
