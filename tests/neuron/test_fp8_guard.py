"""fp8_guard: unsafe float8 ops (docs/neuron.md §4 A2, A3) are reported with their call site; safe forms are not."""
import pytest
import torch

from deepinfer.neuron_ops.fp8_guard import Fp8Guard, graph_fp8_sites


def _fp8(*shape):
    return torch.randn(*shape).to(torch.float8_e4m3fn)


def test_reports_unsafe_float8_ops_with_call_site():
    a, b = _fp8(4, 8), _fp8(4, 8)
    idx = torch.tensor([2, 0])
    with Fp8Guard() as guard:
        torch.cat([a, b])                      # line A
        torch.stack([a, b])
        a[idx]
        try:
            a.gather(0, torch.zeros(1, 8, dtype=torch.long))  # CPU has no float8 gather kernel
        except NotImplementedError:
            pass
        torch.where(torch.ones(4, 8, dtype=torch.bool), a.float(), 0.0)  # float: not reported
        a[1:3]                                 # basic slicing: not reported
    ops = sorted(op for op, _ in guard.report.sites)
    assert ops == ["advanced-index", "cat", "gather", "stack"]
    assert all("test_fp8_guard.py" in site for _, site in guard.report.sites)
    assert guard.report.count == 4 and len(guard.report.lines()) == 4


def test_uint8_views_are_the_safe_form():
    a, b = _fp8(4, 8), _fp8(4, 8)
    with Fp8Guard() as guard:
        c = torch.cat([a.view(torch.uint8), b.view(torch.uint8)]).view(torch.float8_e4m3fn)
        d = a.view(torch.uint8)[torch.tensor([3, 1])].view(torch.float8_e4m3fn)
        e = torch.cat([a.float(), b.float()])
    assert guard.report.count == 0
    assert torch.equal(c.float(), e) and torch.equal(d.float(), a.float()[[3, 1]])


def test_raise_mode():
    with pytest.raises(RuntimeError, match="unsafe float8 op cat"):
        with Fp8Guard(raise_on_site=True):
            torch.cat([_fp8(2, 2), _fp8(2, 2)])


def test_graph_scan_finds_float8_cat():
    captured = []

    def backend(gm, example_inputs):
        captured.append(gm)
        return gm.forward

    @torch.compile(backend=backend, fullgraph=True)
    def f(x, y, z):
        return torch.cat([x.to(torch.float8_e4m3fn), y.to(torch.float8_e4m3fn)]).float() + torch.cat([z, z])

    f(torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 4))
    sites = graph_fp8_sites(captured[0])
    assert len(sites) == 1 and sites[0].startswith("cat")


def test_graph_scan_finds_float8_advanced_index_but_not_slices():
    captured = []

    def backend(gm, example_inputs):
        captured.append(gm)
        return gm.forward

    @torch.compile(backend=backend, fullgraph=True)
    def f(x, idx):
        q = x.to(torch.float8_e4m3fn)
        return q[idx].float() + q[1:3].float() + x[idx]

    f(torch.randn(4, 4), torch.tensor([0, 2]))
    sites = graph_fp8_sites(captured[0])
    assert len(sites) == 1 and sites[0].startswith("advanced-index")
