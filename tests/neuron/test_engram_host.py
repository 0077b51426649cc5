"""Engram on the host (layers/engram_host.py, docs/neuron.md §5.9), in neuron host mode on the tiny V4.1
checkpoint: build_model leaves the Engram tables out of the tensors `model.to(device)` moves, the hash
and the row fetch run on host int64 tensors before the copy to the device, and the device forward
only combines the rows it is given. Host mode has no device, so a copy of the model moved to meta
stands in for one: what runs there cannot read a host tensor."""
import pytest
import torch

from deepinfer.config import ModelConfig
from deepinfer.model_executor.forward_meta import SeqChunk, step_to
from deepinfer.model_executor.layers import engram_host
from deepinfer.model_executor.layers.engram_host import engram_device_bytes, host_table_tensors
from deepinfer.platforms.cpu import CpuPlatform
from deepinfer.platforms.neuron.platform import NeuronPlatform
from deepinfer.worker.cache_engine import allocate_cache, cache_layout, default_block_size
from deepinfer.worker.runners.eager import EagerStrategy
from deepinfer.worker.worker import build_model
from tests.support.model_helpers import Seqs

HOST = NeuronPlatform(host=True)
PROMPTS = [[0, 17, 4242, 99, 31000, 5], [0, 8, 77, 1234]]


@pytest.fixture(scope="module")
def cfg(tiny_v41_dir):
    return ModelConfig.from_pretrained(tiny_v41_dir)


@pytest.fixture(scope="module", params=["packed", "dense"])
def weight_format(request):
    return request.param


def _build(ckpt, cfg, weight_format, platform=HOST):
    return build_model(cfg, str(ckpt), torch.float32, progress=False, platform=platform, weight_format=weight_format)


@pytest.fixture(scope="module")
def model(tiny_v41_dir, cfg, weight_format):
    return _build(tiny_v41_dir, cfg, weight_format)


def _table_names(cfg, packed: bool) -> set[str]:
    leaves = ("weight", "scale") if packed else ("weight",)
    return {f"layers.{i}.engram.embed.{leaf}" for i in cfg.engram_layer_ids for leaf in leaves}


def test_device_tensors_hold_no_engram_table(model, cfg, weight_format):
    tables = host_table_tensors(model)
    assert set(tables) == _table_names(cfg, weight_format == "packed") and len(cfg.engram_layer_ids) == 2
    table_storages = {t.untyped_storage().data_ptr() for t in tables.values()}
    device = [*model.named_parameters(), *model.named_buffers()]
    assert device and not [n for n, _ in device if ".embed." in n and "engram" in n]
    assert not [n for n, t in device if t.untyped_storage().data_ptr() in table_storages]
    assert engram_device_bytes(model) == 0
    # the loader, the shared tables and the reports still find them by their checkpoint names
    sd = model.state_dict(keep_vars=True)
    for name, t in tables.items():
        assert sd[name].data_ptr() == t.data_ptr()


def test_moving_the_model_leaves_the_tables_in_host_memory(tiny_v41_dir, cfg, weight_format):
    moved = _build(tiny_v41_dir, cfg, weight_format)
    before = {n: t.clone() for n, t in host_table_tensors(moved).items()}
    moved.to("meta")
    assert all(t.is_meta for t in [*moved.parameters(), *moved.buffers()])
    after = host_table_tensors(moved)
    assert after.keys() == before.keys()
    for name, t in after.items():
        assert t.device.type == "cpu" and torch.equal(t, before[name]), name
    assert engram_device_bytes(moved) == 0
    # negative control: a table registered as a buffer is among the tensors .to moves, and counted
    table = moved.layers[1].engram.embed.weight
    moved.layers[1].engram.register_buffer("leaked_table", table)
    assert engram_device_bytes(moved) == table.untyped_storage().nbytes() > 0


def test_hash_and_row_fetch_run_on_host_tensors_before_the_copy(tiny_v41_dir, cfg, weight_format, monkeypatch):
    device_model = _build(tiny_v41_dir, cfg, weight_format).to("meta")   # the device stand-in; tables stay here
    calls = []
    real = engram_host.engram_indices

    def spy(spec, layer_id, G):
        out = real(spec, layer_id, G)
        calls.append((layer_id, G.device.type, G.dtype, out.device.type, out.dtype))
        return out
    monkeypatch.setattr(engram_host, "engram_indices", spy)
    bs = default_block_size(cfg)
    layout = cache_layout(cfg, 3, bs, device_model.engram_spec)
    cache = allocate_cache(cfg, 3, 8, bs, torch.float32, device="meta")
    strategy = EagerStrategy(device_model, layout, platform=HOST)
    assert strategy.device.type == "meta"
    ids = list(range(3, 13))
    host_step, _ = strategy.prepare_host([SeqChunk(1, 0, len(ids), [1, 2], ids, 1)])
    assert host_step.ngram_ids.device.type == "cpu" and host_step.engram_rows is None
    step = strategy.to_device(host_step, None)
    assert calls == [(lid, "cpu", torch.int64, "cpu", torch.int64) for lid in cfg.engram_layer_ids]
    k = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * cfg.engram_head_dim
    assert step.engram_rows.device.type == "meta" and step.engram_rows.shape == (2, len(ids), k)
    assert step.ngram_ids is None   # nothing on the device reads the n-gram ids
    logits = device_model(step, cache)
    assert logits.shape == (1, cfg.vocab_size) and logits.is_meta
    assert len(calls) == 2          # the device forward hashed nothing
    # a step copied in without its host stage: the device would have to hash, which is refused
    with pytest.raises(ValueError, match="host tensors"):
        device_model(step_to(host_step, "meta"), cache)


def test_host_mode_greedy_tokens_equal_the_cpu_platform(model, tiny_v41_dir, cfg, weight_format):
    cpu = _build(tiny_v41_dir, cfg, weight_format, platform=CpuPlatform())
    golden = Seqs(cpu, EagerStrategy, PROMPTS).greedy(5)
    assert Seqs(model, EagerStrategy, PROMPTS, platform=HOST).greedy(5) == golden
