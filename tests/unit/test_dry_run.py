"""Full-scale dry run (deepinfer/tools/dry_run.py, examples/neuron/memory_report.py --cp/--ep/--step).

At small scale (tiny V4.1, fake 4-rank worlds) every rank's bytes are checked against a count made
here from the canonical tensor list and the sharding rules of the design (docs/neuron.md §5.5, §5.6),
and each decoder layer's collectives against the design: one lane all-reduce and one MoE combine
(an all-reduce when the EP group holds replicated tokens; an all-gather plus a reduce-scatter when it
spans CP groups). The V4.1-Flash run at cp = ep = 64 is marked slow."""
import json
import math
import re

import pytest
import torch

from deepinfer.config import ModelConfig
from deepinfer.distributed.parallel_layout import ParallelLayout
from deepinfer.tools import dry_run as dr
from deepinfer.tools import memory_report as mr
from deepinfer.model_executor.loader import is_fp32_tensor
from deepinfer.model_executor.checkpoint_schema import tensor_shapes
from deepinfer.model_executor.tiny_checkpoint import v41_tiny_config

from tests.support import REPO
from tests.support.model_helpers import memory_report_cli as _cli, tiny_config

V41_FLASH = REPO / "examples" / "configs" / "v41-flash.json"
GIB = 2 ** 30


_EXPERT = re.compile(r"^(layers|mtp)\.\d+\.ffn\.experts\.(\d+)\.")


def _rank_shape(cfg, layout: ParallelLayout, name: str, shape: tuple) -> tuple | None:
    """The part of a canonical tensor a rank holds by the design's rules, None when it holds none."""
    m = _EXPERT.match(name)
    if m:
        n = cfg.dspark_n_routed_experts if m.group(1) == "mtp" else cfg.n_routed_experts
        per = n // layout.ep
        return shape if layout.ep_rank * per <= int(m.group(2)) < (layout.ep_rank + 1) * per else None
    if name == "head.weight":                       # the rank's vocabulary rows (split over the CP group)
        return (shape[0] // layout.cp, shape[1])
    split = math.gcd(layout.attn_tp, layout.ep)      # the shared expert's units over the lane's part of
    if ".shared_experts.w2." in name:               # the EP group: w2's input columns,
        return (shape[0], shape[1] // split)
    if ".shared_experts.w" in name:                 # w1 / w3's rows
        return (shape[0] // split, shape[1])
    tp, groups = layout.attn_tp, cfg.o_groups
    if name.endswith(("attn.wq_b.weight", "attn.attn_sink")):
        return (shape[0] // tp, *shape[1:])
    if name.endswith("attn.wo_a.weight"):           # a tp-th of the rows x columns, whole groups or not
        return (shape[0] // min(tp, groups), shape[1] // max(1, tp // groups))
    if name.endswith("attn.wo_b.weight"):           # the input columns of the rank's groups
        return (shape[0], shape[1] // min(tp, groups))
    return shape


def _independent_weight_bytes(cfg, layout: ParallelLayout, dtype=torch.bfloat16) -> int:
    """Bytes a rank holds, Engram tables excluded: packed tensors as the checkpoint stores them, the
    others dense (fp32 for docs/model.md §2.1's fp32 tensors, int64 tid2eid, `dtype` otherwise)."""
    fmt = mr.checkpoint_format(cfg)
    packed = mr.config_weight_formats(cfg, fmt)
    size = torch.empty((), dtype=dtype).element_size()
    total = 0
    for name, shape in tensor_shapes(cfg).items():
        if name.endswith("engram.embed.weight"):
            continue
        held = _rank_shape(cfg, layout, name, shape)
        if held is None:
            continue
        if name in packed:
            total += mr.checkpoint_tensor_bytes(cfg, name, held, fmt)
        else:
            per = 8 if name.endswith("tid2eid") else 4 if is_fp32_tensor(name) else size
            total += math.prod(held) * per
    return total


def _engram_table_bytes(cfg) -> int:
    fmt = mr.checkpoint_format(cfg)
    return sum(mr.checkpoint_tensor_bytes(cfg, n, s, fmt) for n, s in tensor_shapes(cfg).items()
               if n.endswith("engram.embed.weight"))


def _check_ranks(cfg, report, cp, ep, attn_tp):
    world = max(cp, ep)
    assert [r["rank"] for r in report["ranks"]] == list(range(world))
    tables = _engram_table_bytes(cfg)
    for row in report["ranks"]:
        layout = ParallelLayout(row["rank"], cp, ep, attn_tp)
        assert row["weights_bytes"] == _independent_weight_bytes(cfg, layout), row
        assert row["engram_bytes"] == -(-tables // world)          # one host: the table / ranks per host
        assert row["kv_bytes"] > 0
    # the ranks of a fake world all size the same KV pool for the same steps
    assert len({r["kv_bytes"] for r in report["ranks"]}) == 1


def _head_gather(cfg, step, cp) -> list[dict]:
    """The step's one collective outside the layers: the all-gather of the head's fp32 vocabulary
    slices over the CP group (whole rows, as the dry run counts it)."""
    return [{"op": "all_gather", "group_size": cp, "bytes": step["rows"] * cfg.vocab_size // cp * 4}] if cp > 1 else []


def _check_layers(cfg, step, tokens, cp, ep, attn_tp):
    """Per decoder layer: the lane all-reduce of the attention output (compute dtype, bf16), then the
    MoE combine: one fp32 all-reduce (tokens replicated in the EP group), or the packed all-gather of
    x (bf16), fp32 weights and int32 ids plus one fp32 reduce-scatter of [ep * T, D] partials; then
    the head's gather."""
    d, k = cfg.hidden_size, cfg.n_experts_per_tok
    assert step["num_layers"] == cfg.num_layers == len(step["per_layer"])
    assert step["outside_layers"] == (1 if cp > 1 else 0)
    lane = [{"op": "all_reduce", "group_size": attn_tp, "bytes": tokens * d * 2}] if attn_tp > 1 else []
    if ep <= cp:
        moe = [{"op": "all_reduce", "group_size": ep, "bytes": tokens * d * 4}]
    else:
        moe = [{"op": "all_gather", "group_size": ep, "bytes": tokens * (d * 2 + 4 * k + 4 * k)},
               {"op": "reduce_scatter", "group_size": ep, "bytes": ep * tokens * d * 4}]
    want = (lane + moe) * cfg.num_layers + _head_gather(cfg, step, cp)
    assert step["collectives"] == want
    assert step["per_layer"] == [len(lane + moe)] * cfg.num_layers


def test_cli_dry_run_at_cp4_ep4(tmp_path, capsys):
    """cp = ep = 4 (lanes of 4: one of the tiny model's 4 heads a rank, half an output group), through
    the CLI: the JSON of the issue, per-rank bytes equal to the count above, 2 collectives a layer."""
    cfg = tiny_config("v41")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(v41_tiny_config(8)))
    out = tmp_path / "out.json"
    _cli().main(["--config", str(config), "--cp", "4", "--ep", "4", "--step", "--output", str(out),
                 "--context", "256", "--prefill-tokens", "32"])
    report = json.loads(out.read_text())
    assert report["sharded"] is True and report["layout"]["attn_tp"] == 4
    _check_ranks(cfg, report, 4, 4, 4)
    assert report["shard_classes"] == [{"ranks": [0, 1, 2, 3]}]
    _check_layers(cfg, report["decode_step"], 8, 4, 4, 4)
    _check_layers(cfg, report["prefill_chunk"], 32, 4, 4, 4)
    for key in ("decode_step", "prefill_chunk"):
        est = report[key]["floor_estimate"]
        assert est["label"].startswith("ESTIMATE") and est["collectives"] == 2 * cfg.num_layers + 1
        assert report[key]["bytes_read"]["weights"] > 0 and report[key]["bytes_read"]["kv"] > 0
    printed = capsys.readouterr().out
    assert "ESTIMATE" in printed and "docs/neuron.md §1.1" in printed
    assert "at most 2 collectives per decoder layer in a decode step: yes" in printed


def test_ep_spanning_cp_groups():
    """cp = 2, ep = 4: two DP attention groups, so the EP group dispatches by all-gather and combines by
    reduce-scatter: 3 collectives a layer (above the 2-a-layer target, which only ep <= cp meets)."""
    cfg = tiny_config("v41", layers=4)
    report = dr.dry_run(cfg, cp=2, ep=4, context=64, prefill_tokens=16)
    _check_ranks(cfg, report, 2, 4, 2)
    _check_layers(cfg, report["decode_step"], 8, 2, 4, 2)
    assert report["decode_step"]["max_collectives_per_layer"] == 3


def test_floor_estimate_arithmetic():
    step = {"bytes_read": {"weights": 7 * 10 ** 9, "kv": 5 * 10 ** 9, "engram": 0}, "kv_bytes_held": 10 ** 9,
            "collectives": [{"op": "all_reduce", "group_size": 8, "bytes": 1}] * 3
            + [{"op": "all_reduce", "group_size": 64, "bytes": 1}] * 2}
    est = dr.floor_estimate(step)
    assert est["bytes_read"] == 8 * 10 ** 9                          # KV at most the cache once
    assert est["hbm_ms"] == pytest.approx(8e9 / 0.7e12 * 1e3)
    assert est["collectives_hw_ms"] == pytest.approx(5 * 10e-3)
    assert est["collectives_seed_ms"] == pytest.approx(3 * 0.1 + 2 * 1.9)
    assert est["floor_hw_ms"] == pytest.approx(est["hbm_ms"] + 0.05)


def test_read_counter_counts_gathered_rows_and_each_weight_once():
    emb = torch.zeros(1000, 16, device="meta")
    w = torch.zeros(32, 16, device="meta")
    v = torch.zeros(8, 16, dtype=torch.bfloat16, device="meta")     # read by a dtype-converting copy
    u = torch.zeros(8, 16, device="meta")                            # only aliased: read nothing
    cache = torch.zeros(64, 16, device="meta")
    cats = {t.untyped_storage()._cdata: "weights" for t in (emb, w, v, u)}
    cats[cache.untyped_storage()._cdata] = "kv"
    with torch.inference_mode(), dr.ReadCounter(cats) as c:   # as in the forward: composite ops seen too
        v.to(torch.float32)
        u.to(torch.float32).contiguous()
        x = emb[torch.zeros(3, dtype=torch.long, device="meta")]      # 3 rows gathered
        y = x @ w.t()                                                    # the whole weight
        y = y + (x @ w.t())                                              # read again: counted once
        cache[torch.zeros(2, dtype=torch.long, device="meta")] = x[:2]  # a write, not a read
        z = cache[:8].sum()                                              # 8 rows of the cache
    del y, z
    got = c.bytes_by_category()
    assert got["weights"] == 3 * 16 * 4 + 32 * 16 * 4 + 8 * 16 * 2
    assert got["kv"] == 8 * 16 * 4


def test_dry_run_refuses_a_layout_the_model_cannot_take():
    with pytest.raises(ValueError, match="must divide"):
        dr.dry_run(tiny_config("v41"), cp=3, ep=3, steps=False)


@pytest.mark.slow
def test_v41_flash_at_cp64_ep64(tmp_path):
    """The issue's run: weights <= 17 GiB a rank, at most 2 collectives a decoder layer in a decode step."""
    cfg = ModelConfig.from_dict(json.loads(V41_FLASH.read_text()))
    report = dr.dry_run(cfg, cp=64, ep=64, nextn=5)
    _check_ranks(cfg, report, 64, 64, 8)
    assert max(r["weights_bytes"] for r in report["ranks"]) <= 17 * GIB
    _check_layers(cfg, report["decode_step"], 8, 64, 64, 8)
    assert report["decode_step"]["max_collectives_per_layer"] <= 2
    assert report["verify_step"]["max_collectives_per_layer"] <= 2 and report["verify_step"]["tokens"] == 48
    assert len(report["draft_block"]["collectives"]) == 2 * cfg.num_nextn_predict_layers + 1   # + the head
    assert 1 < report["speculative_estimate"]["floor_hw_ms"]["break_even_tokens_per_step"] < 6


def test_speculative_steps_at_cp2_ep2():
    """--nextn: the verification step (rows of 1 + B tokens) keeps 2 collectives a decoder layer and
    also reads the draft layers' key weights; the draft block has a lane all-reduce and a MoE combine
    per draft layer; the break-even tokens per step is the floors' ratio."""
    cfg = tiny_config("v41")
    report = dr.dry_run(cfg, cp=2, ep=2, batch=4, context=256, prefill_tokens=32, nextn=3)
    dec, ver, dra = report["decode_step"], report["verify_step"], report["draft_block"]
    assert (ver["tokens"], ver["rows"]) == (16, 4) and ver["max_collectives_per_layer"] <= 2
    assert len(ver["collectives"]) == len(dec["collectives"]) == 2 * cfg.num_layers + 1    # + the head gather
    assert ver["bytes_read"]["weights"] > dec["bytes_read"]["weights"]   # main_proj and the draft wkv
    assert (dra["tokens"], dra["num_layers"]) == (12, cfg.num_nextn_predict_layers)
    assert len(dra["collectives"]) == 2 * cfg.num_nextn_predict_layers + 1
    est = report["speculative_estimate"]
    assert est["label"].startswith("ESTIMATE")
    for key in ("floor_hw_ms", "floor_seed_latency_ms"):
        e = est[key]
        spec = ver["floor_estimate"][key] + dra["floor_estimate"][key]
        assert e["speculative_step"] == pytest.approx(spec)
        assert e["break_even_tokens_per_step"] == pytest.approx(spec / dec["floor_estimate"][key]) and spec > e["plain_step"]
    assert "pays off above" in dr.format_dry_run(report)
