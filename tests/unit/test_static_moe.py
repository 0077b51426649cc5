"""Fixed-shape routed experts (layers/moe.py): equal to the routed CPU form, sync-free, static shapes."""
import pytest
import torch

from deepinfer.model_executor.layers import moe

g = torch.Generator().manual_seed(7)


def _case(dtype, t=9, d=32, e=6, inter=16, k=2):
    x = torch.randn(t, d, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    idx[3] = torch.tensor([5, 0])          # unsorted ids in a row
    idx[4] = torch.tensor([2, 3])
    idx[5] = torch.tensor([2, 3])          # an expert shared by rows, others used by nobody
    w = torch.rand(t, k, generator=g)
    w13 = (torch.randn(e, 2 * inter, d, generator=g) * 0.3).to(dtype)
    w2 = (torch.randn(e, d, inter, generator=g) * 0.3).to(dtype)
    return x, idx, w, w13, w2, 4.0


FORMS = [moe.dense_local_experts, moe.grouped_static_experts, moe.static_routed_experts]


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fixed_shape_forms_equal_routed_experts(form, dtype, tol):
    if form is moe.grouped_static_experts and dtype != torch.bfloat16:
        pytest.skip("torch._grouped_mm is a bf16 kernel on GPU; the dispatcher uses the dense form for fp32")
    args = _case(dtype)
    got, want = form(*args), moe.routed_experts(*args)
    assert got.dtype == dtype and got.shape == want.shape
    assert (got.float() - want.float()).abs().max().item() <= tol * want.float().abs().max().item()
    # a row's output depends on its own experts only
    w = args[2].clone()
    w[0] = 0
    again = form(args[0], args[1], w, *args[3:])
    assert torch.allclose(again[1:].float(), got[1:].float(), atol=tol)


def test_dispatcher_picks_grouped_for_bf16_and_dense_for_fp32(monkeypatch):
    calls = []
    monkeypatch.setattr(moe, "grouped_static_experts", lambda *a: calls.append("grouped") or a[0])
    monkeypatch.setattr(moe, "dense_local_experts", lambda *a: calls.append("dense") or a[0])
    moe.static_routed_experts(*_case(torch.bfloat16))
    moe.static_routed_experts(*_case(torch.float32))
    assert calls == ["grouped", "dense"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixed_shape_form_runs_on_meta_tensors(dtype):
    """Meta tensors have no data: an op that needs a value on the host (.item(), bincount, nonzero)
    raises here, as it would break a CUDA graph capture. The routed CPU form does raise."""
    meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in _case(dtype)]
    out = moe.static_routed_experts(*meta)
    assert out.shape == meta[0].shape and out.dtype == dtype
    with pytest.raises((NotImplementedError, RuntimeError)):
        moe.routed_experts(*meta)


def test_fixed_shape_form_compiles_fullgraph():
    args = _case(torch.float32)
    f = torch.compile(moe.static_routed_experts, backend="aot_eager", fullgraph=True, dynamic=False)
    assert torch.allclose(f(*args), moe.static_routed_experts(*args))
