"""Device tier (docs/neuron.md §5.8): needs a Trainium NeuronCore and torch-neuronx; every test here is
marked `neuron_device` and skipped elsewhere (tests/conftest.py; where they have run: docs/status.md).
They check the kernels and region graphs on the device against
the host references, and the device primitives the seed found broken (docs/neuron.md §4 A2-A4)."""
import pytest
import torch

from deepinfer.neuron_ops import kernel_routing

pytestmark = pytest.mark.neuron_device


@pytest.fixture(scope="module")
def platform():
    from deepinfer.platforms.neuron.platform import NeuronPlatform
    p = NeuronPlatform(host=False)
    p.set_device(0)
    return p


def _to(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, tuple):
        return tuple(_to(v, device) for v in x)
    return x


@pytest.mark.parametrize("name", sorted(kernel_routing.KERNEL_NAMES))
def test_device_kernel_matches_host_reference(platform, name):
    from tests.support.neuron_cases import kernel_case
    args, kw = kernel_case(name)
    want = kernel_routing.reference(name)(*args, **kw)
    fn = torch.compile(platform.kernel(name), backend="neuron", fullgraph=True, dynamic=False)
    got = fn(*_to(args, platform.device), **kw)
    for a, b in zip(*(v if isinstance(v, tuple) else (v,) for v in (got, want))):
        assert torch.allclose(a.cpu().float(), b.float(), atol=2e-3, rtol=2e-3), name


def test_region_graphs_compile_on_device_and_match_host(platform):
    from deepinfer.model_executor.static_step import BucketSpec
    from deepinfer.worker.runners.neuron_regions import NeuronRegionStrategy
    from deepinfer.platforms.neuron.platform import NeuronPlatform
    from tests.support.model_helpers import Seqs, tiny_config, tiny_model
    cfg = tiny_config("v4", 2)
    host = tiny_model(cfg, NeuronPlatform(host=True))
    dev = tiny_model(cfg, platform, like=host).to(platform.device)
    spec = BucketSpec(batch=(2,), contexts=(64,), prefill_tokens=16)
    prompts = [[0, 17, 400, 9, 3000, 5, 6], [0, 55, 66, 77, 88]]
    want = Seqs(host, NeuronRegionStrategy, prompts, platform=NeuronPlatform(host=True), buckets=spec,
                compile=False).greedy(4)
    s = Seqs(dev, NeuronRegionStrategy, prompts, platform=platform, buckets=spec)
    s.cache = _cache_to(s.cache, platform.device)
    assert s.greedy(4) == want
    assert s.runner.num_graphs == 2 * 2 and not s.strategy.regions.stats.fp8_sites


def _cache_to(cache, device):
    for d in (cache.swa, cache.comp_state, cache.entries, cache.index_keys):
        for k in d:
            d[k] = d[k].to(device)
    return cache


def test_float8_concatenation_through_uint8_views_is_exact(platform):
    a = torch.randn(64, 32).to(torch.float8_e4m3fn)
    b = torch.randn(64, 32).to(torch.float8_e4m3fn)
    want = torch.cat([a.view(torch.uint8), b.view(torch.uint8)])
    got = torch.cat([a.to(platform.device).view(torch.uint8), b.to(platform.device).view(torch.uint8)])
    assert torch.equal(got.cpu(), want)


def test_strided_float8_index_through_uint8_view_is_exact(platform):
    a = torch.randn(64, 64).to(torch.float8_e4m3fn)
    idx = torch.tensor([5, 1, 63, 7])
    want = a.view(torch.uint8)[:, ::2][idx]
    got = a.to(platform.device).view(torch.uint8)[:, ::2][idx.to(platform.device)]
    assert torch.equal(got.cpu(), want)


def test_int64_sentinel_survives_a_compiled_graph(platform):
    """docs/neuron.md §4 A4: int64 constants are narrowed; in-range sentinels (a vocabulary bound) survive."""
    def f(x):
        return torch.where(x > 0, x, torch.full_like(x, 129280))
    x = torch.tensor([3, -1, 7], dtype=torch.int64)
    got = torch.compile(f, backend="neuron", fullgraph=True)(x.to(platform.device))
    assert torch.equal(got.cpu(), f(x))
