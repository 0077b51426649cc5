"""Weight memory report (deepinfer/tools/memory_report.py, examples/neuron/memory_report.py)."""
import importlib.util
import json
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from deepinfer.config import ModelConfig
from deepinfer.tools import memory_report as mr

from tests.support import REPO

V41_FLASH = REPO / "examples" / "configs" / "v41-flash.json"


def _cli():
    path = REPO / "examples" / "neuron" / "memory_report.py"
    spec = importlib.util.spec_from_file_location("memory_report_cli", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _file_bytes_by_component(model_dir: Path) -> dict[str, int]:
    """Data bytes of every tensor in the checkpoint's safetensors files, grouped by component."""
    counts = mr.empty_counts()
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                counts[mr.component_of(key.removeprefix("model."))] += t.numel() * t.element_size()
    return {**counts, "total": sum(counts.values())}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("fixture", ["tiny_v41_dir", "tiny_v4_dir"])
def test_checkpoint_bytes_match_the_written_files(fixture, request):
    """The format rules (fp8 blocks, fp4 pairs, table scales, fp32 / int tensors) give each component
    the bytes the tiny writer's real quantized tensors take, and the files' size within 2%."""
    model_dir = request.getfixturevalue(fixture)
    cfg = ModelConfig.from_pretrained(str(model_dir))
    computed = mr.checkpoint_bytes(cfg)
    assert computed == _file_bytes_by_component(model_dir)
    on_disk = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    assert computed["total"] <= on_disk <= 1.02 * computed["total"]


@pytest.mark.parametrize("fixture", ["tiny_v41_dir", "tiny_v4_dir"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_resident_columns_cover_the_canonical_tensors(fixture, dtype, request):
    """The dense model holds exactly the canonical tensors (§2.1 fp32 ones in fp32): resident bytes
    per component equal the canonical list's dense bytes, so both columns count the same tensors."""
    cfg = ModelConfig.from_pretrained(str(request.getfixturevalue(fixture)))
    report = mr.memory_report(cfg, dtype, weight_format="dense")
    assert report["resident_bytes"] == mr.dense_canonical_bytes(cfg, dtype)
    for column in ("resident_bytes", "checkpoint_bytes"):
        counts = report[column]
        assert set(counts) == {*mr.COMPONENTS, "total"}
        assert sum(counts[c] for c in mr.COMPONENTS) == counts["total"] > 0
    # the tiny V4.1 model has every component
    if fixture == "tiny_v41_dir":
        assert all(report["checkpoint_bytes"][c] > 0 for c in mr.COMPONENTS)


@pytest.mark.parametrize("fixture", ["tiny_v41_dir", "tiny_v4_dir"])
def test_packed_weights_hold_the_checkpoint_bytes(fixture, request):
    """weight_format="packed" keeps every quantized tensor as the checkpoint stores it: those
    components hold exactly their checkpoint bytes, stacked experts included (post_load)."""
    cfg = ModelConfig.from_pretrained(str(request.getfixturevalue(fixture)))
    report = mr.memory_report(cfg, torch.bfloat16, post_load=True, weight_format="packed")
    res, ck = report["resident_bytes"], report["checkpoint_bytes"]
    for c in ("attention_linears", "shared_expert", "routed_experts", "engram_tables"):
        assert res[c] == ck[c], c
    assert report["meets_target"] and report["ratio"] <= mr.TARGET_RATIO


def test_v41_flash_builds_on_meta_without_allocating():
    cfg = ModelConfig.from_dict(json.loads(V41_FLASH.read_text()))
    before = _rss_bytes()
    dense = mr.build_meta_model(cfg, torch.bfloat16, weight_format="dense")
    packed = mr.build_meta_model(cfg, torch.bfloat16, post_load=True, weight_format="packed")
    grown = _rss_bytes() - before
    for model in (dense, packed):
        tensors = mr.model_tensors(model)
        assert tensors and all(t.is_meta for t in tensors.values())
    assert grown < 1 << 30, f"RSS grew by {grown / 2**20:.0f} MiB building on meta"
    report = mr.memory_report(cfg, torch.bfloat16, model=dense)
    assert report["resident_bytes"]["total"] > report["checkpoint_bytes"]["total"] > 0
    assert report["resident_bytes"] == mr.dense_canonical_bytes(cfg, torch.bfloat16)
    assert report["meets_target"] == (report["ratio"] <= mr.TARGET_RATIO) is False
    # the target, on the engine's default form for neuron / cuda
    packed_report = mr.memory_report(cfg, torch.bfloat16, model=packed)
    assert packed_report["meets_target"] and packed_report["ratio"] <= mr.TARGET_RATIO


def test_buffers_count_under_their_module_path():
    """Packed storage under new names (`<linear>.weight_codes`, `experts.w13_codes`, stacks kept on
    the MoE module) is counted and lands in its module's component."""
    root = nn.Module()
    attn = nn.Module()
    attn.wq_a = nn.Module()
    attn.wq_a.register_buffer("weight_codes", torch.zeros(4, 8, dtype=torch.uint8))
    attn.wq_a.register_buffer("weight_scale", torch.zeros(1, 1, dtype=torch.uint8))
    attn.attn_sink = nn.Parameter(torch.zeros(3))
    ffn = nn.Module()
    ffn.experts = nn.Module()
    ffn.experts.register_buffer("w13_codes", torch.zeros(2, 16, 4, dtype=torch.uint8))
    ffn.register_buffer("_w2", torch.zeros(2, 4, 4, dtype=torch.bfloat16))
    ffn.shared_experts = nn.Module()
    ffn.shared_experts.w1 = nn.Module()
    ffn.shared_experts.w1.register_buffer("weight_scale", torch.zeros(5, dtype=torch.uint8))
    layer = nn.Module()
    layer.attn, layer.ffn = attn, ffn
    root.layers = nn.ModuleList([layer])
    root.register_buffer("_head_t", torch.zeros(2, 3))
    got = mr.resident_bytes(root)
    assert got["attention_linears"] == 32 + 1
    assert got["norms_hc_other"] == 12
    assert got["routed_experts"] == 128 + 64
    assert got["shared_expert"] == 5
    assert got["embed_head"] == 24
    assert got["total"] == 32 + 1 + 12 + 128 + 64 + 5 + 24


@pytest.mark.parametrize("name,component", [
    ("layers.3.attn.indexer.compressor.wkv.weight", "attention_linears"),
    ("layers.3.attn.compressor.wgate.scale", "attention_linears"),
    ("layers.3.attn.compressor.ape", "norms_hc_other"),
    ("layers.3.attn.indexer.k_norm.weight", "norms_hc_other"),
    ("layers.1.engram.embed.weight_scale", "engram_tables"),
    ("layers.1.engram.wkv.weight", "other_linears"),
    ("layers.1.engram.q_weight", "norms_hc_other"),
    ("mtp.2.markov_head.head.weight", "embed_head"),
    ("mtp.0.main_proj.scale", "other_linears"),
    ("layers.0.ffn.gate.tid2eid", "norms_hc_other"),
    ("layers.0.ffn.experts.7.w2.weight", "routed_experts"),
    ("hc_head_fn", "norms_hc_other"),
    ("head.weight", "embed_head"),
])
def test_component_of(name, component):
    assert mr.component_of(name) == component


def test_cli_writes_the_documented_json(tiny_v41_dir, tmp_path, capsys):
    out = tmp_path / "report.json"
    _cli().main(["--config", str(tiny_v41_dir), "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["config"] == str(tiny_v41_dir) and data["dtype"] == "bfloat16"
    for column in ("resident_bytes", "checkpoint_bytes"):
        assert set(data[column]) == {*mr.COMPONENTS, "total"}
        assert all(isinstance(v, int) for v in data[column].values())
    assert isinstance(data["meets_target"], bool)
    cfg = ModelConfig.from_pretrained(str(tiny_v41_dir))
    assert data["checkpoint_bytes"] == mr.checkpoint_bytes(cfg)
    printed = capsys.readouterr().out
    assert "routed experts" in printed and "resident / checkpoint" in printed
