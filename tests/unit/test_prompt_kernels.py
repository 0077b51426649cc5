"""The compiled CPU runner's fused prompt-step kernels (worker/runners/prompt_kernels.py): each equals
the kernel table's reference to rounding at any token count, one graph serves every count (only the
token dimension is dynamic), and the model gets its own kernel table back after the step."""
import pytest
import torch

from deepinfer.model_executor.layers import hc, kernel_table
from deepinfer.worker.runners import prompt_kernels

g = torch.Generator().manual_seed(3)


def rnd(*shape):
    return torch.randn(*shape, generator=g)


def param(t):
    return torch.nn.Parameter(t, requires_grad=False)


def _args(name: str, t: int):
    n, d = 4, 32
    x = rnd(t, n, d)
    if name == "hc_mixes":
        return (x, param(rnd(n * (n + 2), n * d) * 0.1), param(rnd(n * (n + 2))), param(rnd(3)), 1e-6, 1e-6, 20), {}
    if name == "hc_pre":
        return (x, torch.rand(t, n, generator=g)), {}
    if name == "hc_post":
        comb = hc.sinkhorn(rnd(t, n, n), 20, 1e-6)
        return (x, rnd(t, d), torch.rand(t, n, generator=g) * 2, comb), {}
    if name == "hc_head":
        return (x, param(rnd(n, n * d) * 0.1), param(rnd(n)), param(rnd(1)), 1e-6, 1e-6), {}
    if name == "rms_norm":
        return (rnd(t, 3, d), param(rnd(d)), 1e-6), {}
    if name == "rope":
        q, ang = rnd(t, 3, d), rnd(t, 1, 8)
        return (q, ang.cos(), ang.sin()), {"inverse": True}
    if name == "compress_pool":
        return (rnd(t, 8, d), rnd(t, 8, d), torch.rand(t, 8, generator=g) > 0.3), {}
    if name == "sink_attention":
        valid = torch.rand(t, 24, generator=g) > 0.4
        valid[:, 0] = True
        return (rnd(t, 3, d), rnd(t, 24, d), valid, param(rnd(3)), d ** -0.5), {}
    raise AssertionError(name)


class CountingBackend:
    """A compile backend that runs the traced graph as is and counts the graphs it was given."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


@pytest.mark.parametrize("name", [*prompt_kernels.FUSED_PROMPT_KERNELS, "sink_attention"])
def test_fused_kernel_equals_the_reference_at_any_token_count(name):
    backend = CountingBackend()
    fused = getattr(prompt_kernels.fused_kernel_table(kernel_table.KernelTable(), backend), name)
    ref = kernel_table.reference(name)
    # (the attention compiles chunks of at most 256 query rows: 300 rows are a 256 and a 44)
    for t in (7, 300, 45):
        args, kw = _args(name, t)
        got, want = fused(*args, **kw), ref(*args, **kw)
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.dtype == b.dtype
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # the token dimension is symbolic from the first call (maybe_mark_dynamic): one graph for all
    # three counts (without the mark the second count would compile a second graph)
    assert backend.graphs == 1, f"{name}: {backend.graphs} graphs for three token counts"


def test_out_of_place_sinkhorn_and_broadcast_post_equal_the_eager_forms():
    c0 = rnd(33, 4, 4) * 3
    assert torch.equal(hc.sinkhorn_out_of_place(c0, 20, 1e-6), hc.sinkhorn(c0, 20, 1e-6))
    x, y, post = rnd(33, 4, 16), rnd(33, 16), torch.rand(33, 4, generator=g)
    comb = hc.sinkhorn(c0, 20, 1e-6)
    torch.testing.assert_close(hc.hc_post_broadcast(x, y, post, comb), hc.hc_post_apply(x, y, post, comb),
                               rtol=1e-6, atol=1e-6)


def test_the_model_gets_its_kernel_table_back():
    class Model:
        kernels = kernel_table.KernelTable()
    model, fused = Model(), object()
    own = model.kernels
    with prompt_kernels.kernels_of(model, fused):
        assert model.kernels is fused
    assert model.kernels is own
    with pytest.raises(RuntimeError):
        with prompt_kernels.kernels_of(model, fused):
            raise RuntimeError("a failed step")
    assert model.kernels is own


def test_fused_table_replaces_only_the_fused_names():
    base = kernel_table.KernelTable()
    table = prompt_kernels.fused_kernel_table(base, "aot_eager")
    fused = {*prompt_kernels.FUSED_PROMPT_KERNELS, "sink_attention"}
    for name in kernel_table.KERNEL_NAMES:
        same = getattr(table, name) is getattr(base, name)
        assert same != (name in fused), name
