"""The persistent compile cache directory (docs/neuron.md §5.10): engine option, env var, default
under the user's cache dir; handed to torch-neuronx in device mode, only recorded in host mode."""
import os
from types import SimpleNamespace

import pytest

from deepinfer.engine_config import EngineConfig
from deepinfer.platforms.neuron import compile_cache
from deepinfer.platforms.neuron.platform import FP8_COMPILER_FLAG, NeuronPlatform

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)


def test_directory_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("DEEPINFER_NEURON_COMPILE_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.resolve_dir(None) == str(tmp_path / "home" / ".cache" / "deepinfer" / "neuron-compile")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.resolve_dir(None) == str(tmp_path / "xdg" / "deepinfer" / "neuron-compile")
    monkeypatch.setenv("DEEPINFER_NEURON_COMPILE_CACHE_DIR", str(tmp_path / "env"))
    assert compile_cache.resolve_dir(None) == str(tmp_path / "env")
    assert compile_cache.resolve_dir(str(tmp_path / "opt")) == str(tmp_path / "opt")   # the engine option wins


def test_host_mode_records_the_directory_and_touches_nothing(monkeypatch, tmp_path):
    for name in compile_cache.DEVICE_CACHE_VARS:
        monkeypatch.delenv(name, raising=False)
    p = NeuronPlatform(host=True)
    p.validate_config(SimpleNamespace(compile_cache_dir=str(tmp_path / "cache"), **ENGINE), None)
    p.set_device(0)
    assert p.compile_cache_dir == str(tmp_path / "cache")
    assert not (tmp_path / "cache").exists()
    assert not any(name in os.environ for name in compile_cache.DEVICE_CACHE_VARS)


def test_device_mode_hands_the_directory_to_torch_neuronx(monkeypatch, tmp_path):
    """configure_compiler (set_device, before the runtime starts): both cache variables point at the
    directory, created; a variable the user set is kept. Nothing here imports torch_neuronx."""
    env = {k: v for k, v in os.environ.items() if k not in compile_cache.DEVICE_CACHE_VARS}
    env["NEURON_COMPILE_CACHE_URL"] = "s3://team-cache"
    monkeypatch.setattr(os, "environ", env)
    p = NeuronPlatform(host=False)
    p.validate_config(SimpleNamespace(compile_cache_dir=str(tmp_path / "neff"), **ENGINE), None)
    p.configure_compiler()
    assert env["TORCH_NEURONX_NEFF_CACHE_DIR"] == str(tmp_path / "neff") and (tmp_path / "neff").is_dir()
    assert env["NEURON_COMPILE_CACHE_URL"] == "s3://team-cache"
    assert FP8_COMPILER_FLAG in env["NEURON_CC_FLAGS"].split()


def test_neff_files_are_counted(tmp_path):
    assert compile_cache.neff_files(str(tmp_path / "missing")) == 0
    (tmp_path / "a" / "b").mkdir(parents=True)
    for name in ("a/one.neff", "a/b/two.neff", "a/b/log.txt"):
        (tmp_path / name).write_text("x")
    assert compile_cache.neff_files(str(tmp_path)) == 2


def test_engine_option_is_validated():
    assert EngineConfig(model="m", compile_cache_dir="/tmp/x").compile_cache_dir == "/tmp/x"
    with pytest.raises(ValueError, match="compile_cache_dir"):
        EngineConfig(model="m", compile_cache_dir="")


def test_warm_up_reports_the_cache_without_claiming_device_work(monkeypatch, tmp_path, caplog):
    """Host mode: the cache line says nothing was written; device mode counts the NEFF files the
    compiler added (here written by the test in place of neuronx-cc)."""
    import logging

    from deepinfer.model_executor.static_step import BucketSpec
    from deepinfer.neuron_ops.regions import RegionRunner
    from deepinfer.worker.runners.neuron_regions import NeuronRegionStrategy
    from tests.support.model_helpers import Seqs, tiny_config, tiny_model

    spec = BucketSpec(batch=(2,), contexts=(64,), prefill_tokens=16)
    host = NeuronPlatform(host=True)
    host.validate_config(SimpleNamespace(compile_cache_dir=str(tmp_path / "c"), **ENGINE), None)
    model = tiny_model(tiny_config("v4", 2), host)
    s = Seqs(model, NeuronRegionStrategy, [[0, 5]], platform=host, buckets=spec, regions=RegionRunner("aot_eager"))
    planned = s.strategy.plan.graph_count
    with caplog.at_level(logging.INFO, logger="deepinfer"):
        s.strategy._log_warm_up(planned, 1.0, host.compile_cache_dir, 0)
    assert f"nothing written to the compile cache {tmp_path / 'c'}" in caplog.text
    assert not (tmp_path / "c").exists()
    caplog.clear()
    monkeypatch.setattr(host, "is_host_mode", False)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "g.neff").write_text("x")
    with caplog.at_level(logging.INFO, logger="deepinfer"):
        s.strategy._log_warm_up(planned, 1.0, str(tmp_path / "c"), 0)
    assert "gained 1 NEFF files" in caplog.text and f"{planned - 1} traced graphs were served" in caplog.text
