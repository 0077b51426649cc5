"""Predicted decode steps of the dry run (tools/step_prediction.py; memory_report.py --step --rows):
bytes read expected under uniform routing and worst case, the collectives, a predicted time from the
kernel cost model, the HBM bandwidth and the given collective latency, all labelled ESTIMATE; the
bytes are measured on the rank's meta model, so they follow its shard plan."""
import json

import pytest

from deepinfer.tools import dry_run as dr
from deepinfer.model_executor.tiny_checkpoint import v41_tiny_config
from deepinfer.tools.step_prediction import predictor
from tests.support.model_helpers import memory_report_cli, tiny_config


def _expert_bytes(cfg) -> int:
    d, i = cfg.hidden_size, cfg.moe_inter_size
    return 2 * i * (d // 2 + d // 32) + d * (i // 2 + i // 32)     # fp4 nibbles + one ue8m0 byte per 32


def _check_steps(cfg, steps):
    assert set(steps) == {"1", "8"}
    n_local, k, e, layers = cfg.n_routed_experts // 2, cfg.n_experts_per_tok, cfg.n_routed_experts, cfg.num_layers
    for rows, st in steps.items():
        rows = int(rows)
        assert st["label"].startswith("ESTIMATE") and st["assumptions"]["collective_latency_s"] == pytest.approx(25e-6)
        # 2 a decoder layer, and at cp > 1 the vocabulary-split head's one gather of its rows
        assert st["collective_count"] == 2 * layers + 1 and st["max_collectives_per_layer"] == 2
        assert st["predicted_ms_parts"]["collectives"] == pytest.approx((2 * layers + 1) * 25e-3)
        assert st["predicted_ms"] == pytest.approx(sum(st["predicted_ms_parts"].values()))
        assert st["bytes_read_expected"] <= st["bytes_read_worst"]
        re = st["routed_experts"]
        assert re["bytes_per_expert"] == _expert_bytes(cfg) and re["layers"] == layers
        parts = st["bytes_read_parts"]
        if rows * k < e:                       # the active form: a held expert is hit with 1 - (1 - k/E)^rows
            p = 1 - (1 - k / e) ** rows
            assert re["form"] == ["active"] and re["hit_probability"] == pytest.approx(p)
            assert parts["routed_experts_expected"] == round(layers * n_local * p * _expert_bytes(cfg))
            assert parts["routed_experts_worst"] == layers * min(n_local, rows * k) * _expert_bytes(cfg)
        else:                                  # every held expert, every step
            assert re["form"] == ["all_experts"]
            assert parts["routed_experts_expected"] == parts["routed_experts_worst"] == layers * n_local * _expert_bytes(cfg)
        assert st["bytes_read_expected"] == parts["routed_experts_expected"] + parts["weights_other"] + parts["kv"] \
            + parts["engram"]
    assert steps["1"]["bytes_read_expected"] < steps["8"]["bytes_read_expected"]


def test_decode_steps_at_cp2_ep2():
    cfg = tiny_config("v41", layers=2)
    report = dr.dry_run(cfg, cp=2, ep=2, context=64, prefill_tokens=16, ranks=[0], decode_steps=predictor((1, 8), 25e-6))
    _check_steps(cfg, report["decode_steps"])
    assert "predicted decode step, 8 row(s)" in dr.format_dry_run(report)


def test_cli_decode_steps(tmp_path, capsys):
    """The command line of the issue at small scale: --rows, --collective-latency-us, --json."""
    cfg = tiny_config("v41")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(v41_tiny_config(8)))
    out = tmp_path / "out.json"
    memory_report_cli().main(["--config", str(config), "--cp", "2", "--ep", "2", "--step", "--rows", "1,8",
                 "--collective-latency-us", "25", "--json", str(out), "--context", "256", "--prefill-tokens", "32"])
    _check_steps(cfg, json.loads(out.read_text())["decode_steps"])
    printed = capsys.readouterr().out
    assert "predicted decode step, 1 row(s)" in printed and "ESTIMATE" in printed


def test_bytes_follow_the_shard_plan_and_time_the_bandwidth_without_kernels():
    """Lanes of 2 hold half of wq_b / wo_a / the sinks: the measured per-rank bytes drop; without the
    kernel model the time is bytes / bandwidth plus the collectives."""
    cfg = tiny_config("v41", layers=2)
    steps = predictor((1,), use_kernel_model=False)
    one = dr.dry_run(cfg, cp=1, ep=2, context=64, prefill_tokens=16, decode_steps=steps)["decode_steps"]["1"]
    two = dr.dry_run(cfg, cp=2, ep=2, context=64, prefill_tokens=16, decode_steps=steps)["decode_steps"]["1"]
    assert two["bytes_read_parts"]["weights_other"] < one["bytes_read_parts"]["weights_other"]
    for st in (one, two):
        want = st["bytes_read_expected"] / dr.TRN2_HBM_BYTES_PER_S_PER_RANK * 1e3 + st["predicted_ms_parts"]["collectives"]
        assert st["predicted_ms"] == pytest.approx(want) and st["predicted_ms_parts"]["fp8_kernels"] == 0


def test_rows_need_the_step(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(v41_tiny_config(2)))
    for bad in (["--rows", "1,8"], ["--step", "--rows", "0"], ["--step", "--rows", "x"]):
        with pytest.raises(SystemExit):
            memory_report_cli().main(["--config", str(config), "--cp", "2", "--ep", "2", *bad])
