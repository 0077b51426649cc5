"""DEEPINFER_NEURON_KERNELS=simulate: the kernel table routes every name with an NKI kernel to it (run
in the interpreter, as one custom-op node in compiled regions), the others keep their references, and
the tiny V4.1 checkpoint in host mode gives the CPU platform's greedy tokens with every kernel called."""
import inspect

import pytest
import torch

from deepinfer.config import ModelConfig
from deepinfer.model_executor.static_step import BucketSpec
from deepinfer.neuron_ops import kernel_routing, refs
from deepinfer.neuron_ops.nki import ops, simulation_counts
from deepinfer.neuron_ops.nki.registry import IMPLEMENTED
from deepinfer.neuron_ops.regions import RegionRunner
from deepinfer.platforms.cpu import CpuPlatform
from deepinfer.platforms.neuron.platform import NeuronPlatform
from deepinfer.worker.runners import EagerStrategy, NeuronRegionStrategy
from deepinfer.worker.worker import build_model
from tests.support.model_helpers import Seqs


def test_registry_names_and_argument_lists():
    assert set(IMPLEMENTED) <= set(kernel_routing.KERNEL_NAMES)
    assert {"rms_norm", "swiglu", "blockquant_fp8_gemm", "blockquant_fp8_grouped_gemm", "blockquant_fp4_gemm",
            "fp4_static_experts"} <= set(IMPLEMENTED)
    for name, fn in IMPLEMENTED.items():
        want = list(inspect.signature(refs.PLAIN[name]).parameters.values())
        got = list(inspect.signature(fn).parameters.values())
        assert [p.name for p in got[:len(want)]] == [p.name for p in want], name
        assert all(p.kind is p.KEYWORD_ONLY and p.default is not p.empty for p in got[len(want):]), name


def test_platform_reads_the_variable(monkeypatch):
    monkeypatch.setenv("DEEPINFER_NEURON_KERNELS", "simulate")
    host = NeuronPlatform(host=True)
    assert host.simulate_kernels
    assert host.kernel("rms_norm") is kernel_routing.kernel("rms_norm", simulate=True)
    assert host.kernel("rms_norm") is not kernel_routing.kernel("rms_norm")
    assert host.kernel("rope") is kernel_routing.kernel("rope")          # no NKI kernel: the reference op
    assert host.kernel("fp4_routed_experts") is host.kernel("fp4_static_experts")
    monkeypatch.setenv("DEEPINFER_NEURON_KERNELS", "reference")
    assert not NeuronPlatform(host=True).simulate_kernels
    monkeypatch.setenv("DEEPINFER_NEURON_KERNELS", "bogus")
    with pytest.raises(ValueError, match="DEEPINFER_NEURON_KERNELS"):
        NeuronPlatform(host=True)


def test_device_mode_without_nki_keeps_the_plain_reference():
    assert kernel_routing.kernel("rms_norm", on_device=True, simulate=True) is refs.PLAIN["rms_norm"]


def test_simulated_op_is_one_node_under_aot_eager():
    op = kernel_routing.kernel("rms_norm", simulate=True)
    nodes = []

    def backend(gm, example_inputs):
        nodes.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        from torch._dynamo.backends.common import aot_autograd
        return aot_autograd(fw_compiler=lambda g, _: g)(gm, example_inputs)

    fn = torch.compile(lambda x, w: op(x * 2, w, 1e-6) + 1, backend=backend, fullgraph=True)
    x, w = torch.randn(3, 64), torch.randn(64)
    before = simulation_counts().get("rms_norm", 0)
    got = fn(x, w)
    assert simulation_counts()["rms_norm"] == before + 1
    torch.testing.assert_close(got, refs.PLAIN["rms_norm"](x * 2, w, 1e-6) + 1, rtol=2e-6, atol=1e-6)
    assert sum(1 for t in nodes if "nki_rms_norm" in str(t)) == 1
    torch.testing.assert_close(torch.compile(lambda x, w: op(x, w, 1e-6), backend="aot_eager")(x, w),
                               refs.PLAIN["rms_norm"](x, w, 1e-6), rtol=2e-6, atol=1e-6)


PROMPTS = [[0, 17, 400, 9, 3000, 5, 6, 7, 8, 12, 13], [0, 55, 66, 77, 88]]
SPEC = BucketSpec(batch=(2,), contexts=(64,), prefill_tokens=None)


def test_tiny_v41_simulated_kernels_give_the_cpu_tokens(tiny_v41_dir, monkeypatch):
    cfg = ModelConfig.from_pretrained(tiny_v41_dir)
    cpu = build_model(cfg, str(tiny_v41_dir), torch.float32, progress=False, platform=CpuPlatform())
    golden = Seqs(cpu, EagerStrategy, PROMPTS).greedy(4)
    monkeypatch.setenv("DEEPINFER_NEURON_KERNELS", "simulate")
    host = NeuronPlatform(host=True)
    model = build_model(cfg, str(tiny_v41_dir), torch.float32, progress=False, platform=host,
                        weight_format="packed")
    before = simulation_counts()
    s = Seqs(model, NeuronRegionStrategy, PROMPTS, platform=host, buckets=SPEC, regions=RegionRunner("aot_eager"))
    assert s.greedy(4) == golden
    called = {k: v - before.get(k, 0) for k, v in simulation_counts().items()}
    # swiglu and blockquant_fp4_gemm are called by the expert kernel's wrapper (the model calls neither)
    assert all(called.get(name, 0) > 0 for name in IMPLEMENTED), called
    print(called)
