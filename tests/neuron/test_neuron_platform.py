"""NeuronPlatform selection, host mode, lazy imports, kernels and config validation."""
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from deepinfer.neuron_ops import kernel_routing as neuron_kernels
from deepinfer.platforms import current_platform, reset_platform
from deepinfer.platforms.neuron.platform import FP8_COMPILER_FLAG, NeuronPlatform


@pytest.fixture
def fresh_platform():
    reset_platform()
    yield
    reset_platform()


def test_accelerator_env_selects_neuron_host_mode(monkeypatch, fresh_platform):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "neuron")
    monkeypatch.setenv("DEEPINFER_NEURON_HOST", "1")
    p = current_platform()
    assert isinstance(p, NeuronPlatform) and p.is_host_mode
    assert p.device == torch.device("cpu") and p.dist_backend == "gloo"
    assert p.fp8_max == 224.0 <= 240.0 and p.runner_strategy == "neuron_regions"
    assert p.compile_backend == "aot_eager"


def test_env_vars_are_resolved_at_construction(monkeypatch):
    monkeypatch.setenv("DEEPINFER_NEURON_COMPILE_BACKEND", "inductor")
    monkeypatch.setenv("DEEPINFER_NEURON_CTX_BUCKETS", "512,128")
    monkeypatch.setenv("DEEPINFER_NEURON_PREFILL_BUCKET", "64,16")
    monkeypatch.setenv("DEEPINFER_NEURON_REGION_SPLIT", "always")
    monkeypatch.setenv("DEEPINFER_NEURON_ROW_BUCKETS", "8,1,2,4")
    p = NeuronPlatform(host=True)
    monkeypatch.delenv("DEEPINFER_NEURON_CTX_BUCKETS")
    assert (p.compile_backend, p.ctx_buckets, p.prefill_bucket, p.region_split) == ("inductor", [128, 512], [16, 64], "always")
    spec = p.bucket_spec(SimpleNamespace(max_num_seqs=6, max_num_batched_tokens=64, max_model_len=512))
    assert spec.batch == (1, 2, 4, 8) and spec.contexts == (128, 512) and spec.prefill_tokens == (16, 64)


def test_bad_compile_backend_is_rejected(monkeypatch):
    monkeypatch.setenv("DEEPINFER_NEURON_COMPILE_BACKEND", "neuronx")
    with pytest.raises(ValueError, match="DEEPINFER_NEURON_COMPILE_BACKEND"):
        NeuronPlatform(host=True)


def test_bucket_spec_comes_from_the_engine_config_and_bad_buckets_are_rejected(monkeypatch):
    eng = SimpleNamespace(max_num_seqs=3, max_num_batched_tokens=48, max_model_len=300)
    p = NeuronPlatform(host=True)
    p.validate_config(eng, None)
    spec = p.bucket_spec(eng)
    # default buckets (docs/neuron.md §5.10): rows min(8, R) and R = next_pow2(max_num_seqs), one context
    # (the prompt bucket, max_num_batched_tokens, rounded up to a power of two: §4 B3)
    assert spec.batch == (4,) and spec.prefill_tokens == (64,) and spec.max_model_len == 300
    assert spec.contexts == (300,) and spec.pow2_tokens
    monkeypatch.setenv("DEEPINFER_NEURON_ROW_BUCKETS", "4,6")
    with pytest.raises(ValueError, match="DEEPINFER_NEURON_ROW_BUCKETS.*powers of two"):
        NeuronPlatform(host=True).bucket_spec(eng)
    monkeypatch.delenv("DEEPINFER_NEURON_ROW_BUCKETS")
    monkeypatch.setenv("DEEPINFER_NEURON_CTX_BUCKETS", "128,256")
    with pytest.raises(ValueError, match="DEEPINFER_NEURON_CTX_BUCKETS.*max_model_len"):
        NeuronPlatform(host=True).validate_config(eng, None)
    monkeypatch.delenv("DEEPINFER_NEURON_CTX_BUCKETS")
    monkeypatch.setenv("DEEPINFER_NEURON_PREFILL_BUCKET", "64")
    with pytest.raises(ValueError, match="DEEPINFER_NEURON_PREFILL_BUCKET.*max_num_batched_tokens"):
        NeuronPlatform(host=True).validate_config(eng, None)


def test_kernel_table_maps_every_model_kernel():
    from deepinfer.model_executor.layers.kernel_table import KERNEL_NAMES, KernelTable
    p = NeuronPlatform(host=True)
    table = KernelTable(p)
    for name in KERNEL_NAMES:
        # host mode: the reference registered as one custom op; device mode: the plain reference (no NKI)
        assert getattr(table, name) is neuron_kernels.kernel(name)
        assert isinstance(getattr(table, name), torch._library.custom_ops.CustomOpDef)
        assert neuron_kernels.kernel(name, on_device=True) is neuron_kernels.reference(name)
    with pytest.raises(ValueError, match="unknown name"):
        p.kernel("flash_attention")


def test_platform_names_its_runner_strategy():
    from deepinfer.worker.runners import NeuronRegionStrategy, strategy_class
    p = NeuronPlatform(host=True)
    assert strategy_class(p.runner_strategy) is NeuronRegionStrategy


def test_compiler_flags_keep_user_flags(monkeypatch):
    monkeypatch.setenv("NEURON_CC_FLAGS", "--lnc=2")
    p = NeuronPlatform(host=True)
    p.configure_compiler()
    import os
    assert os.environ["NEURON_CC_FLAGS"].split() == ["--lnc=2", FP8_COMPILER_FLAG]
    p.configure_compiler()  # idempotent
    assert os.environ["NEURON_CC_FLAGS"].split() == ["--lnc=2", FP8_COMPILER_FLAG]


def test_device_mode_without_torch_neuronx_says_so():
    p = NeuronPlatform(host=False)
    if p.dist_backend != "neuron":
        pytest.fail("host=False must select device mode")
    try:
        import torch_neuronx  # noqa: F401
        pytest.skip("torch_neuronx is installed here")
    except ImportError:
        pass
    with pytest.raises(RuntimeError, match="torch-neuronx.*DEEPINFER_NEURON_HOST=1"):
        _ = p.device


def test_nothing_device_only_is_imported():
    code = ("import sys, os; os.environ['DEEPINFER_ACCELERATOR']='neuron'; os.environ['DEEPINFER_NEURON_HOST']='1';"
            "import deepinfer.platforms.neuron.platform, deepinfer.worker.runners.neuron_regions, "
            "deepinfer.neuron_ops.regions, deepinfer.neuron_ops.kernel_routing, deepinfer.neuron_ops.fp8_guard;"
            "from deepinfer.platforms import current_platform; p = current_platform(); p.kernel('rms_norm');"
            "bad = [m for m in ('torch_neuronx', 'nki', 'neuronxcc', 'nkilib') if m in sys.modules];"
            "print('BAD', bad) if bad else print('OK', p)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("OK <NeuronPlatform host mode>"), out.stdout
