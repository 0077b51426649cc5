"""layers/bf16_tiles_gemm.py: fp32 rows x a bf16 weight on the AMX unit gives the fp32 GEMM's values to
fp32 rounding (the exact three-part split of h), an output's bits do not depend on the batch, bad
arguments are refused, compiled regions call it, and the cpu platform packs a head for it where it
can. Skipped, with the reason, on a CPU without AMX (the rows kernel's tests still run there)."""
import pytest
import torch

from deepinfer.model_executor.layers import bf16_tiles_gemm as T
from deepinfer.model_executor.layers.head_gemm import head_logits
from deepinfer.platforms.cpu import CpuPlatform, keep_bf16_head
from tests.support.head_kernel_cases import model_with_head, one_thread, operands, within_fp32_rounding  # noqa: F401

pytestmark = pytest.mark.skipif(not T.available(), reason="no usable AMX unit here (CPU flags, compiler or kernel)")


def test_packing_round_trips_and_places_pairs_as_the_unit_reads_them():
    _, w = operands(1, 48, 64, seed=1)
    wt = T.pack_tiles(w)
    assert wt.shape == (3, 2, 16, 16, 2)
    assert torch.equal(T.unpack_tiles(wt), w)
    # tile (1, 1), tile row 5, vocabulary row 7 of the tile: columns 32 + 10 and 32 + 11 of row 16 + 7
    assert torch.equal(wt[1, 1, 5, 7], w[23, 42:44])


@pytest.mark.parametrize("m", [1, 2, 5, 15, 16, 17, 33, 64])
@pytest.mark.parametrize("v,d", [(16, 32), (48, 64), (272, 256), (1008, 96)])
def test_values_are_the_fp32_gemms_to_rounding(m, v, d):
    h, w = operands(m, v, d, seed=m * 1000 + v)
    out = T.bf16_tiles_gemm(h, T.pack_tiles(w))
    assert out.dtype == torch.float32 and out.shape == (m, v)
    assert within_fp32_rounding(out, h, w)
    assert torch.allclose(out, h @ w.float().t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scale", [1e-20, 1e20])
def test_the_split_holds_at_small_and_large_scales(scale):
    # h rounded to bf16 would miss the bound by far: the three parts keep all 24 bits
    h, w = operands(9, 64, 128, seed=4, scale=scale)
    out = T.bf16_tiles_gemm(h, T.pack_tiles(w))
    assert within_fp32_rounding(out, h, w)
    assert not within_fp32_rounding(h.bfloat16().float() @ w.float().t(), h, w)


def test_a_wrong_product_is_caught_by_the_bound():
    # negative control for the bound above: one weight value changed fails it
    h, w = operands(4, 304, 256, seed=7)
    out = T.bf16_tiles_gemm(h, T.pack_tiles(w))
    w2 = w.clone()
    w2[5, 3] += 0.25
    assert not within_fp32_rounding(out, h, w2)


def test_an_output_does_not_depend_on_the_batch():
    h, w = operands(37, 2000, 256, seed=3)
    wt = T.pack_tiles(w)
    whole = T.bf16_tiles_gemm(h, wt)
    alone = torch.cat([T.bf16_tiles_gemm(h[i:i + 1], wt) for i in range(37)])
    assert torch.equal(whole, alone)


def test_bad_arguments_are_refused():
    h, w = operands(2, 32, 64)
    wt = T.pack_tiles(w)
    with pytest.raises(ValueError, match="multiple of 16"):
        T.pack_tiles(w[:20])
    with pytest.raises(ValueError, match="fp32 rows and a bf16 weight"):
        T.bf16_tiles_gemm(h, wt.float())
    with pytest.raises(ValueError, match="fp32 rows and a bf16 weight"):
        T.bf16_tiles_gemm(h.bfloat16(), wt)
    with pytest.raises(ValueError, match="packed weight"):
        T.bf16_tiles_gemm(h, w)
    with pytest.raises(ValueError, match="packed weight"):
        T.bf16_tiles_gemm(h[:, :32].contiguous(), wt)


def test_head_logits_takes_the_tiles_kernel_at_any_row_count_in_a_compiled_region():
    h, w = operands(40, 704, 128, seed=5)
    wt, w32 = T.pack_tiles(w), w.float()
    compiled = torch.compile(head_logits, backend="inductor", dynamic=False, fullgraph=True)
    expect = T.bf16_tiles_gemm(h, wt)
    assert torch.equal(compiled(h, w32, wt), expect)
    assert torch.equal(head_logits(h, w32, wt), expect)
    assert torch.equal(head_logits(h, w32), h @ w32.t())


def test_the_platform_packs_a_bf16_valued_head_for_the_tiles_kernel(monkeypatch, one_thread):
    _, w = operands(1, 320, 64, seed=11)
    model = model_with_head(w.float())
    CpuPlatform().kernel_weight_layouts(model)
    assert model.head.weight_bf16.dim() == 5 and torch.equal(T.unpack_tiles(model.head.weight_bf16), w)
    assert "head.weight_bf16" not in model.state_dict()
    # a vocabulary that is not a multiple of 16 keeps the row-major copy for the rows kernel
    _, w2 = operands(1, 300, 64, seed=12)
    model = model_with_head(w2.float())
    assert keep_bf16_head(model) and torch.equal(model.head.weight_bf16, w2)
    # the rows kernel on request
    monkeypatch.setenv("DEEPINFER_CPU_BF16_HEAD_KERNEL", "rows")
    model = model_with_head(w.float())
    CpuPlatform().kernel_weight_layouts(model)
    assert torch.equal(model.head.weight_bf16, w)
    assert CpuPlatform().signature()["bf16_head_kernel"] == "rows"
    # tiles only: a head it cannot take gets no copy
    assert not keep_bf16_head(model_with_head(w2.float()), "tiles")


@pytest.mark.parametrize("m", [1, 3, 16, 17, 40])
@pytest.mark.parametrize("v", [48, 1008, 16400])
def test_the_argmax_found_while_storing_is_torch_argmax(m, v):
    """bf16_tiles_gemm_argmax: the same logits, and each row's first maximal index: ties at the row's
    maximum (in one of the kernel's 16 lanes and across lanes), +inf / -inf / NaN columns (inf
    weights) and all-NaN rows; 16400 columns at 40 rows run in several spans (past 16 rows)."""
    def check(h, w):
        wt = T.pack_tiles(w)
        out, ids = torch.ops.deepinfer.bf16_tiles_gemm_argmax(h, wt)
        assert torch.allclose(out, T.bf16_tiles_gemm(h, wt), rtol=0, atol=0, equal_nan=True)   # bit for bit
        assert ids.dtype == torch.int64 and torch.equal(ids, out.argmax(dim=-1))
    h, w = operands(m, v, 64, seed=m + v)
    check(h, w)
    # the maximum of every row at three ids: v // 3 and v // 3 + 16 share a lane, v - 1 another
    ties = h.abs() + 0.1
    w[v // 3] = w[v // 3 + 16] = w[v - 1] = 1.0
    check(ties, w)
    w[5] = float("inf")                           # +inf, -inf or NaN by the signs of h's row
    h[0] = float("nan")                           # a row of NaN logits: index 0, as torch.argmax
    check(h, w)


def test_head_logits_argmax_comes_from_the_tiles_kernel_only():
    from deepinfer.model_executor.layers.head_gemm import head_logits_argmax
    h, w = operands(5, 320, 64, seed=2)
    wt, w32 = T.pack_tiles(w), w.float()
    compiled = torch.compile(head_logits_argmax, backend="inductor", dynamic=False, fullgraph=True)
    logits, ids = compiled(h, w32, wt)
    assert torch.equal(logits, T.bf16_tiles_gemm(h, wt)) and torch.equal(ids, logits.argmax(-1))
    logits, ids = head_logits_argmax(h, w32)      # no packed copy: the GEMM, and no argmax
    assert ids is None and torch.equal(logits, h @ w32.t())
