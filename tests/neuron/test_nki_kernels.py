"""NKI kernels run in the interpreter equal their PyTorch references over decode shape sweeps,
stay within trn2's rules, and report plausible instruction counts."""
import pytest
import torch

from deepinfer.neuron_ops import kernel_routing
from deepinfer.neuron_ops.nki import ops
from deepinfer.neuron_ops.nki.kernels.blockquant_fp8_gemm import K_TILE, N_TILE
from tests.support.gemm_close import bf16_ulps as _bf16_ulps
from tests.support.gemm_close import gemm_close as _gemm_close

GEN = torch.Generator().manual_seed(0)


# --- rms_norm ------------------------------------------------------------------------------------
@pytest.mark.parametrize("m", [1, 3, 64, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_reference(m, dtype):
    d = 320
    x = (torch.randn(m, d, generator=GEN) * 3).to(dtype)
    x[m // 2] = 0  # a padded (all-zero) row
    w = torch.randn(d, generator=GEN)
    got = ops.rms_norm(x, w, 1e-6)
    want = kernel_routing.reference("rms_norm")(x, w, 1e-6)
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    else:
        assert _bf16_ulps(got, want).max() <= 1
    assert torch.equal(got[m // 2], torch.zeros(d, dtype=dtype))


def test_rms_norm_without_weight_and_3d():
    x = torch.randn(2, 5, 64, generator=GEN)
    torch.testing.assert_close(ops.rms_norm(x, None, 1e-5), kernel_routing.reference("rms_norm")(x, None, 1e-5),
                               rtol=2e-6, atol=1e-6)


# --- swiglu --------------------------------------------------------------------------------------
@pytest.mark.parametrize("m,width", [(1, 100), (17, 2304), (64, 4100), (129, 96)])
def test_swiglu_equals_reference(m, width):
    gate = torch.randn(m, width, generator=GEN) * 6
    up = torch.randn(m, width, generator=GEN) * 6
    got = ops.swiglu(gate, up, 7.0)
    torch.testing.assert_close(got, kernel_routing.reference("swiglu")(gate, up, 7.0), rtol=2e-6, atol=1e-6)
    gb, ub = gate.bfloat16(), up.bfloat16()
    assert _bf16_ulps(ops.swiglu(gb, ub, 7.0), kernel_routing.reference("swiglu")(gb, ub, 7.0)).max() <= 1


def test_swiglu_clamps():
    gate = torch.tensor([[50.0, -50.0, 3.0]])
    up = torch.tensor([[50.0, -50.0, 3.0]])
    got = ops.swiglu(gate, up, 7.0)
    assert got[0, 0] == pytest.approx(7.0 / (1 + torch.exp(torch.tensor(-7.0)).item()) * 7.0, rel=1e-6)
    assert got[0, 1] == pytest.approx(50 / (1 + torch.exp(torch.tensor(50.0)).item()) * 7.0, abs=1e-12)


# --- blockquant fp8 gemm -------------------------------------------------------------------------
def _fp8_weight(n, k, block=32):
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=GEN)
    codes = torch.where((codes & 0x78) == 0x78, codes & 0xF7, codes)  # stay within trn2 e4m3 (<= 240)
    scale = torch.randint(118, 130, (-(-n // block), -(-k // block)), dtype=torch.uint8, generator=GEN)
    return codes, scale


@pytest.mark.parametrize("m,n,k", [(1, 700, 256), (5, 1300, 300), (64, 96, 64), (33, 1030, 512)])
def test_blockquant_fp8_gemm_equals_reference(m, n, k):
    codes, scale = _fp8_weight(n, k)
    ref = kernel_routing.reference("blockquant_fp8_gemm")
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
    want = kernel_routing.reference("blockquant_fp8_gemm")(x, codes, scale, 32, 32)
    for grid in (1, 2):
        got = ops.blockquant_fp8_gemm(x, codes, scale, 32, 32, grid=grid)
        assert _gemm_close(got, want, x, codes, scale)
        assert torch.equal(got[3:], torch.zeros_like(got[3:]))


def test_blockquant_fp8_gemm_counts():
    m, n, k = 4, 1030, 384
    codes, scale = _fp8_weight(n, k)
    ops.blockquant_fp8_gemm(torch.randn(m, k, generator=GEN).bfloat16(), codes, scale, 32, 32, design="seed")
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


def test_blockquant_fp8_gemm_tensor_design_counts():
    """fp8 codes go to the matmul: one matmul per K tile and 16-block group, no weight-sized vector work."""
    m, n, k = 4, 1030, 384
    codes, scale = _fp8_weight(n, k)
    ops.blockquant_fp8_gemm(torch.randn(m, k, generator=GEN).bfloat16(), codes, scale, 32, 32)
    s = ops.last_stats().as_dict()
    k_tiles = k // K_TILE
    groups = 3             # program 0: 17 blocks (16 + 1), program 1: 16 blocks
    # per program and K tile x spread once; per group and K tile the scale rows spread and the main
    # matmul; per group the selector
    assert s["instructions"]["tensor"] == 2 * k_tiles + groups * (2 * k_tiles + 1)
    # per group: one scaled-x multiply (its K tiles fit one PSUM bank) and the mask multiply; no
    # per-(K tile, row) or per-block instruction
    assert s["instructions"]["vector"] == groups * 2
    assert s["instructions"]["scalar"] == groups + 2      # the output copies, a program's spread x
    # per program 5 small loads (x, 4 0/1 tiles) and one store; per group the codes and the scales
    assert s["instructions"]["dma"] == 2 * 6 + groups * 2
    assert s["matmul_flops"] >= 2 * m * n * k
    assert s["dma_bytes_out"] == m * n * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 7, 8, 9, 17, 64, 127, 128, 129, 130])
def test_blockquant_fp8_gemm_row_sweep_both_designs(m, dtype):
    codes, scale = _fp8_weight(200, 160)
    x = torch.randn(m, 160, generator=GEN).to(dtype)
    want = kernel_routing.reference("blockquant_fp8_gemm")(x, codes, scale, 32, 32)
    for design in ("tensor", "seed", "auto"):
        got = ops.blockquant_fp8_gemm(x, codes, scale, 32, 32, design=design)
        assert got.dtype == dtype and _gemm_close(got, want, x, codes, scale), design


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
    assert _gemm_close(got, kernel_routing.reference("blockquant_fp8_gemm")(x, codes, scale, 32, 32), x, codes, scale)
    assert n % N_TILE


# --- blockquant fp4 gemm -------------------------------------------------------------------------
def _fp4_weight(n, k, group=32, lead=()):
    packed = torch.randint(0, 256, (*lead, n, k // 2), dtype=torch.uint8, generator=GEN)
    scale = torch.randint(118, 130, (*lead, n, k // group), dtype=torch.uint8, generator=GEN)
    return packed, scale


def _close(got, want, bound, k):
    """Equal up to fp32 summation order (bounded by the sum of |products|), plus one bf16 rounding."""
    err = (got.float() - want.float()).abs() - 1e-6 * k ** 0.5 * bound
    if got.dtype == torch.bfloat16:
        return bool((_bf16_ulps(want.float() + err.clamp_min(0), want) <= 1).all())
    return bool((err <= 0).all())


@pytest.mark.parametrize("m,n,k", [(1, 700, 256), (7, 1030, 320), (64, 96, 64), (33, 513, 1024)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blockquant_fp4_gemm_equals_reference(m, n, k, dtype):
    from deepinfer.model_executor.layers.quant import dequant_fp4
    packed, scale = _fp4_weight(n, k)
    x = torch.randn(m, k, generator=GEN).to(dtype)
    x[m // 2:] = 0 if m > 1 else x[m // 2:]   # padded decode rows
    got = ops.blockquant_fp4_gemm(x, packed, scale, 32)
    want = kernel_routing.reference("blockquant_fp4_gemm")(x, packed, scale, 32)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    assert _close(got, want, x.float().abs() @ dequant_fp4(packed, scale, 32).abs().t(), k)
    if m > 1:
        assert torch.equal(got[m // 2:], torch.zeros_like(got[m // 2:]))
    s = ops.last_stats().as_dict()
    assert s["peak_psum_banks"] <= 8 and s["instructions"]["tensor"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 31, 64, 127, 128, 129, 130])
def test_blockquant_fp4_gemm_row_sweep(m, dtype):
    from deepinfer.model_executor.layers.quant import dequant_fp4
    packed, scale = _fp4_weight(96, 256)
    x = torch.randn(m, 256, generator=GEN).to(dtype)
    got = ops.blockquant_fp4_gemm(x, packed, scale, 32)
    want = kernel_routing.reference("blockquant_fp4_gemm")(x, packed, scale, 32)
    assert got.dtype == dtype and _close(got, want, x.float().abs() @ dequant_fp4(packed, scale, 32).abs().t(), 256)


def test_blockquant_fp4_gemm_grid_splits_n_and_every_code_decodes():
    # every byte value once per row: all 16 nibbles in both positions
    packed = torch.arange(256, dtype=torch.uint8).reshape(1, 256).repeat(40, 1)
    scale = torch.full((40, 16), 127, dtype=torch.uint8)
    x = torch.randn(2, 512, generator=GEN)
    want = kernel_routing.reference("blockquant_fp4_gemm")(x, packed, scale, 32)
    for grid in (1, 2):
        assert _close(ops.blockquant_fp4_gemm(x, packed, scale, 32, grid=grid), want,
                      x.abs() @ torch.full((512, 40), 6.0), 512)
    with pytest.raises(ValueError, match="group"):
        ops.blockquant_fp4_gemm(x, packed, scale[:, :5], 100)


@pytest.mark.slow
@pytest.mark.parametrize("m", [1, 64])
def test_blockquant_fp4_gemm_v41_flash_k(m):
    """The seed's expert GEMM shape (64 x 5120 x 4608)."""
    packed, scale = _fp4_weight(4608, 5120)
    x = torch.randn(m, 5120, generator=GEN).bfloat16()
    from deepinfer.model_executor.layers.quant import dequant_fp4
    want = kernel_routing.reference("blockquant_fp4_gemm")(x, packed, scale, 32)
    got = ops.blockquant_fp4_gemm(x, packed, scale, 32)
    assert _close(got, want, x.float().abs() @ dequant_fp4(packed, scale, 32).abs().t(), 5120)


# --- grouped fp8 gemm ----------------------------------------------------------------------------
@pytest.mark.parametrize("t,groups,rows,k", [(1, 2, 64, 128), (5, 4, 96, 160), (64, 2, 544, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blockquant_fp8_grouped_gemm_equals_reference(t, groups, rows, k, dtype):
    codes, scale = _fp8_weight(groups * rows, k)
    x = torch.randn(t, groups, k, generator=GEN).to(dtype)
    got = ops.blockquant_fp8_grouped_gemm(x, codes, scale, 32, 32)
    want = kernel_routing.reference("blockquant_fp8_grouped_gemm")(x, codes, scale, 32, 32)
    assert got.dtype == want.dtype and got.shape == want.shape == (t, groups, rows)
    for g in range(groups):
        w = codes[g * rows:(g + 1) * rows]
        s = scale[g * rows // 32:(g + 1) * rows // 32]
        assert _gemm_close(got[:, g], want[:, g], x[:, g], w, s)
    assert ops.last_stats().launches == groups


# --- fp4 static experts --------------------------------------------------------------------------
@pytest.mark.parametrize("t,experts,dim,inter", [(1, 3, 256, 96), (6, 4, 320, 128), (64, 2, 128, 544)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_static_experts_equals_reference(t, experts, dim, inter, dtype):
    w13, s13 = _fp4_weight(2 * inter, dim, lead=(experts,))
    w2, s2 = _fp4_weight(dim, inter, lead=(experts,))
    x = torch.randn(t, dim, generator=GEN).to(dtype) * 0.05
    if t > 1:
        x[-1] = 0                                   # a padded row
    idx = torch.randint(0, experts, (t, 2), generator=GEN)
    weights = torch.rand(t, 2, generator=GEN)
    got = ops.fp4_static_experts(x, idx, weights, w13, s13, w2, s2, 32, 10.0)
    want = kernel_routing.reference("fp4_static_experts")(x, idx, weights, w13, s13, w2, s2, 32, 10.0)
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = want.float().abs().max()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale.item())
    else:   # bf16 intermediates (gu, h, y) may round a last bit differently after a different fp32 sum order
        assert ((got.float() - want.float()).abs() <= 0.02 * scale + 1e-3).all()
        assert (got.float() - want.float()).abs().mean() <= 2e-3 * scale
    if t > 1:
        assert torch.equal(got[-1], torch.zeros_like(got[-1]))
