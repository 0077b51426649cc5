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
