"""NKI kernels run in the interpreter equal their PyTorch references over decode shape sweeps,
stay within trn2's rules, and report plausible instruction counts."""
import pytest
import torch

from deepinfer.model_executor.layers.quant_gemm import dequant_fp8_rows
from deepinfer.neuron_ops import kernels
from deepinfer.neuron_ops.nki import ops
from deepinfer.neuron_ops.nki.kernels.blockquant_fp8_gemm import K_TILE, N_TILE

GEN = torch.Generator().manual_seed(0)


def _bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of want's bf16 spacing (fp32 summation order may flip the last bit)."""
    w = want.float()
    spacing = torch.ldexp(torch.ones_like(w), torch.frexp(w.abs().clamp_min(1e-30))[1] - 8)
    return (got.float() - w).abs() / spacing


# --- rms_norm ------------------------------------------------------------------------------------
@pytest.mark.parametrize("m", [1, 3, 64, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_reference(m, dtype):
    d = 320
    x = (torch.randn(m, d, generator=GEN) * 3).to(dtype)
    x[m // 2] = 0  # a padded (all-zero) row
    w = torch.randn(d, generator=GEN)
    got = ops.rms_norm(x, w, 1e-6)
    want = kernels.reference("rms_norm")(x, w, 1e-6)
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    else:
        assert _bf16_ulps(got, want).max() <= 1
    assert torch.equal(got[m // 2], torch.zeros(d, dtype=dtype))


def test_rms_norm_without_weight_and_3d():
    x = torch.randn(2, 5, 64, generator=GEN)
    torch.testing.assert_close(ops.rms_norm(x, None, 1e-5), kernels.reference("rms_norm")(x, None, 1e-5),
                               rtol=2e-6, atol=1e-6)


# --- swiglu --------------------------------------------------------------------------------------
@pytest.mark.parametrize("m,width", [(1, 100), (17, 2304), (64, 4100), (129, 96)])
def test_swiglu_equals_reference(m, width):
    gate = torch.randn(m, width, generator=GEN) * 6
    up = torch.randn(m, width, generator=GEN) * 6
    got = ops.swiglu(gate, up, 7.0)
    torch.testing.assert_close(got, kernels.reference("swiglu")(gate, up, 7.0), rtol=2e-6, atol=1e-6)
    gb, ub = gate.bfloat16(), up.bfloat16()
    assert _bf16_ulps(ops.swiglu(gb, ub, 7.0), kernels.reference("swiglu")(gb, ub, 7.0)).max() <= 1


def test_swiglu_clamps():
    gate = torch.tensor([[50.0, -50.0, 3.0]])
    up = torch.tensor([[50.0, -50.0, 3.0]])
    got = ops.swiglu(gate, up, 7.0)
    assert got[0, 0] == pytest.approx(7.0 / (1 + torch.exp(torch.tensor(-7.0)).item()) * 7.0, rel=1e-6)
    assert got[0, 1] == pytest.approx(50 / (1 + torch.exp(torch.tensor(50.0)).item()) * 7.0, abs=1e-12)


# --- blockquant fp8 gemm -------------------------------------------------------------------------
def _gemm_close(got, want, x, codes, scale) -> bool:
    """Equal up to fp32 summation order (bounded by the sum of |products|) and, for bf16 outputs,
    one final rounding."""
    n, k = codes.shape
    bound = x.float().abs() @ dequant_fp8_rows(codes, scale, 32, 32, 0, n).abs().t()
    err = (got.float() - want.float()).abs() - 1e-6 * k ** 0.5 * bound
    if got.dtype == torch.bfloat16:
        return bool((_bf16_ulps(want.float() + err.clamp_min(0), want) <= 1).all())
    return bool((err <= 0).all())


def _fp8_weight(n, k, block=32):
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=GEN)
    codes = torch.where((codes & 0x78) == 0x78, codes & 0xF7, codes)  # stay within trn2 e4m3 (<= 240)
    scale = torch.randint(118, 130, (-(-n // block), -(-k // block)), dtype=torch.uint8, generator=GEN)
    return codes, scale


@pytest.mark.parametrize("m,n,k", [(1, 700, 256), (5, 1300, 300), (64, 96, 64), (33, 1030, 512)])
def test_blockquant_fp8_gemm_equals_reference(m, n, k):
    codes, scale = _fp8_weight(n, k)
    ref = kernels.reference("blockquant_fp8_gemm")
    x = torch.randn(m, k, generator=GEN)
    assert _gemm_close(ops.blockquant_fp8_gemm(x, codes, scale, 32, 32), ref(x, codes, scale, 32, 32), x, codes, scale)
    xb = x.bfloat16()
    got = ops.blockquant_fp8_gemm(xb, codes, scale, 32, 32)
    assert got.dtype == torch.bfloat16
    assert _gemm_close(got, ref(xb, codes, scale, 32, 32), xb, codes, scale)


def test_blockquant_fp8_gemm_padded_rows_and_grid_sizes():
    codes, scale = _fp8_weight(600, 128)
    x = torch.randn(8, 128, generator=GEN)
    x[3:] = 0  # padded decode rows
    want = kernels.reference("blockquant_fp8_gemm")(x, codes, scale, 32, 32)
    for grid in (1, 2):
        got = ops.blockquant_fp8_gemm(x, codes, scale, 32, 32, grid=grid)
        assert _gemm_close(got, want, x, codes, scale)
        assert torch.equal(got[3:], torch.zeros_like(got[3:]))


def test_blockquant_fp8_gemm_counts():
    m, n, k = 4, 1030, 384
    codes, scale = _fp8_weight(n, k)
    ops.blockquant_fp8_gemm(torch.randn(m, k, generator=GEN).bfloat16(), codes, scale, 32, 32)
    s = ops.last_stats().as_dict()
    k_tiles = k // K_TILE
    # per program: N split 2 ways on 32-column blocks (544 + 486) -> 2 + 1 tiles of <= 512 columns
    n_tiles = 3
    assert s["instructions"]["tensor"] == 2 * k_tiles + n_tiles * k_tiles   # transposes + matmuls
    assert s["matmul_flops"] == 2 * m * n * k   # k is a multiple of 128: no padding
    # every weight byte and scale byte is loaded once; x once per program
    assert s["dma_bytes_in"] >= n * k
    assert s["dma_bytes_out"] == m * n * 2
    blocks = sum(-(-nt // 32) for nt in (512, 32, 486)) * k_tiles
    assert s["instructions"]["vector"] >= blocks   # one dequant multiply per 32-column block per K tile
    assert s["peak_psum_banks"] <= 8 and 0 < s["peak_sbuf_bytes"] <= 192 * 1024


def test_blockquant_fp8_gemm_rejects_what_trn2_cannot_read():
    codes, scale = _fp8_weight(64, 64)
    with pytest.raises(ValueError, match="240"):
        ops.blockquant_fp8_gemm(torch.randn(1, 64), torch.full_like(codes, 0x7C), scale, 32, 32)
    with pytest.raises(ValueError, match="must divide"):
        ops.blockquant_fp8_gemm(torch.randn(1, 64), codes, scale, 48, 32)


@pytest.mark.parametrize("m", [1, 64])
def test_blockquant_fp8_gemm_v41_flash_k(m):
    """K at V4.1-Flash width (D = 5120), N not a multiple of 512."""
    n, k = 1100, 5120
    codes, scale = _fp8_weight(n, k)
    x = torch.randn(m, k, generator=GEN).bfloat16()
    got = ops.blockquant_fp8_gemm(x, codes, scale, 32, 32)
    assert _gemm_close(got, kernels.reference("blockquant_fp8_gemm")(x, codes, scale, 32, 32), x, codes, scale)
    assert n % N_TILE
