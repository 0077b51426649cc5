"""The largest intermediate of a graph (deepinfer/tools/intermediates.py, docs/neuron.md §4 B7): the
recorder counts new tensors only, and at V4.1-Flash shapes (a 2048-token chunk of a 16K-token
prompt, on meta) no projections or attention region makes a tensor over 256 MiB."""
import json
from pathlib import Path

import torch

from deepinfer.config import ModelConfig
from deepinfer.tools import intermediates as im

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 256 * im.MiB


def test_recorder_counts_new_tensors_not_views_or_in_place_results():
    x = torch.empty(64, 1024, device="meta")

    def graph(x):
        y = x.view(1024, 64)               # a view: nothing allocated
        x.add_(1.0)                        # in place: nothing allocated
        z = torch.cat([x, x])              # [128, 1024] fp32: 512 KiB
        return (z @ y).sum()
    _, big = im.largest_intermediate(graph, x)
    assert big.bytes == 128 * 1024 * 4 and big.op == "aten.cat.default" and big.shape == (128, 1024)
    assert im.max_intermediate_bytes(lambda t: t[:, :4], x) == 0


def test_v41_flash_prompt_chunk_regions_stay_within_256_mib():
    cfg = ModelConfig.from_dict(json.loads((ROOT / "examples/configs/v41-flash.json").read_text()))
    report = im.prompt_chunk_intermediates(cfg, context=16384, tokens=2048, regions=("projections", "attention"))
    by_region = im.largest_by_region(report)
    assert set(by_region) == {"projections", "attention"}
    # every layer's regions were measured (40 layers, two regions each)
    assert len(report["regions"]) == 2 * cfg.num_layers
    over = [r for r in report["regions"] if r["bytes"] > LIMIT]
    assert not over, im.format_report(report)
    assert report["step"]["bytes"] <= LIMIT
