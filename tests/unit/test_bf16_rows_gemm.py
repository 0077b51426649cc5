"""layers/bf16_rows_gemm.py: fp32 rows x a bf16 weight gives the fp32 GEMM's values to fp32 rounding,
an output's bits do not depend on the batch, bad arguments are refused, compiled
regions call it, and the cpu platform keeps a bf16 head copy only when the head's values are bf16."""
import pytest
import torch
from torch import nn

from deepinfer.model_executor.layers import bf16_rows_gemm as K
from deepinfer.model_executor.layers.head_gemm import BF16_KERNEL_MAX_ROWS, head_logits
from deepinfer.platforms.cpu import CpuPlatform, keep_bf16_head
from tests.support.head_kernel_cases import (model_with_head, one_thread, operands, torch_threads,  # noqa: F401
                                             within_fp32_rounding)

pytestmark = pytest.mark.skipif(not K.available(), reason="no C compiler here to build the kernel")


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 16, 33])
@pytest.mark.parametrize("v,d", [(1, 32), (3, 64), (257, 256), (1000, 96)])
def test_values_are_the_fp32_gemms_to_rounding(m, v, d):
    h, w = operands(m, v, d, seed=m * 1000 + v)
    out = K.bf16_rows_gemm(h, w)
    assert out.dtype == torch.float32 and out.shape == (m, v)
    assert within_fp32_rounding(out, h, w)
    assert torch.allclose(out, h @ w.float().t(), rtol=1e-5, atol=1e-5)


def test_a_wrong_product_is_caught_by_the_bound():
    # negative control for the bound above: one weight value changed fails it
    h, w = operands(4, 300, 256, seed=7)
    out = K.bf16_rows_gemm(h, w)
    w2 = w.clone()
    w2[5, 3] += 0.25
    assert not within_fp32_rounding(out, h, w2)


def test_an_output_does_not_depend_on_the_batch():
    h, w = operands(13, 2000, 256, seed=3)
    whole = K.bf16_rows_gemm(h, w)
    alone = torch.cat([K.bf16_rows_gemm(h[i:i + 1], w) for i in range(13)])
    assert torch.equal(whole, alone)


def test_bad_arguments_are_refused():
    h, w = operands(2, 10, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        K.bf16_rows_gemm(h[:, :48].contiguous(), w[:, :48].contiguous())
    with pytest.raises(ValueError, match="fp32 rows and a bf16 weight"):
        K.bf16_rows_gemm(h, w.float())
    with pytest.raises(ValueError, match="fp32 rows and a bf16 weight"):
        K.bf16_rows_gemm(h.bfloat16(), w)
    with pytest.raises(ValueError, match=r"h \[M, D\]"):
        K.bf16_rows_gemm(h, w[:, :32].contiguous())


def test_head_logits_takes_the_kernel_up_to_the_row_limit_in_a_compiled_region():
    h, w = operands(BF16_KERNEL_MAX_ROWS + 1, 700, 128, seed=5)
    w32 = w.float()
    compiled = torch.compile(head_logits, backend="inductor", dynamic=False, fullgraph=True)
    small = h[:BF16_KERNEL_MAX_ROWS]
    assert torch.equal(compiled(small, w32, w), K.bf16_rows_gemm(small, w))
    assert torch.equal(head_logits(small, w32, w), K.bf16_rows_gemm(small, w))
    # past the limit, the fp32 GEMM (the kernel is slower there: layers/head_gemm.py)
    assert torch.equal(head_logits(h, w32, w), h @ w32.t())
    assert torch.equal(head_logits(small, w32), small @ w32.t())


def test_the_platform_keeps_a_bf16_copy_only_of_a_bf16_valued_head(monkeypatch, one_thread):
    _, w = operands(1, 300, 64, seed=11)
    model = model_with_head(w.float())
    CpuPlatform().kernel_weight_layouts(model)
    assert torch.equal(model.head.weight_bf16, w)
    assert "head.weight_bf16" not in model.state_dict()
    # one value that bf16 cannot hold: no copy (it would change the head)
    off = w.float()
    off[7, 9] += 2.0 ** -20
    assert not keep_bf16_head(model_with_head(off))
    # a rank of two threads keeps the fp32 GEMM (the kernel runs on one)
    with torch_threads(2):
        assert not keep_bf16_head(model_with_head(w.float()))
    # turned off
    monkeypatch.setenv("DEEPINFER_CPU_BF16_HEAD", "0")
    model = model_with_head(w.float())
    CpuPlatform().kernel_weight_layouts(model)
    assert not hasattr(model.head, "weight_bf16")
    assert CpuPlatform().signature()["bf16_head"] is False


def test_the_markov_head_gets_a_copy_too_and_training_takes_the_gemm(one_thread):
    _, w = operands(1, 300, 64, seed=12)
    _, wm = operands(1, 300, 32, seed=13)
    model = model_with_head(w.float())
    blk = nn.Module()
    blk.markov_head = nn.Module()
    blk.markov_head.head = nn.Linear(32, 300, bias=False)
    blk.markov_head.head.weight.data = wm.float()
    model.mtp = nn.ModuleList([blk])
    assert keep_bf16_head(model)
    assert torch.equal(blk.markov_head.head.weight_bf16, wm)
    # with autograd recording (a training step), the GEMM: the kernel has no backward
    h = torch.randn(2, 32, requires_grad=True)
    out = head_logits(h, blk.markov_head.head.weight, blk.markov_head.head.weight_bf16)
    out.sum().backward()
    assert torch.allclose(h.grad, blk.markov_head.head.weight.sum(0).expand(2, -1))
