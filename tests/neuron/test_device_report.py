"""The full-scale device report (tools/device_report.py, docs/neuron.md §5.11): every planned graph traced
on meta under the fake process group, with its largest intermediate and its float8 / int64 sites, each
rank's HBM bytes, the op census of a decode step and the device rules; the schema on the tiny V4.1
config (fast) and the targets that hold at V4.1-Flash cp = ep = 64 (slow)."""
import json
from pathlib import Path

import pytest

from deepinfer.platforms.neuron.device_rules import report_rules
from deepinfer.tools.device_report import REPORT_FIELDS, device_report
from tests.support.model_helpers import tiny_config

ROOT = Path(__file__).resolve().parents[2]
GRAPH_KEYS = {"name", "kind", "tokens", "context", "max_intermediate_bytes", "float8_sites", "int64_sites"}
HBM_KEYS = {"weights", "kv", "engram", "peak_intermediate", "total"}


def _field(report: dict, path: str):
    """The values at a REPORT_FIELDS path ("a[].b.c": b.c of every element of a)."""
    values = [report]
    for part in path.split("."):
        if part.endswith("[]"):
            values = [x for v in values for x in v[part[:-2]]]
        else:
            values = [v[part] for v in values]
    return values


def _check_schema(report: dict) -> None:
    assert report["graphs"] and all(GRAPH_KEYS <= set(g) for g in report["graphs"])
    assert all(isinstance(g["max_intermediate_bytes"], int) and g["max_intermediate_bytes"] > 0
               for g in report["graphs"])
    assert report["graph_count"] == len(report["graphs"]) == report["planned_graph_count"]
    assert [set(r["hbm_bytes"]) for r in report["ranks"]] == [HBM_KEYS]
    hbm = report["ranks"][0]["hbm_bytes"]
    assert hbm["total"] == hbm["weights"] + hbm["kv"] + hbm["engram"] + hbm["peak_intermediate"]
    assert hbm["peak_intermediate"] == max(g["max_intermediate_bytes"] for g in report["graphs"])
    assert set(report["decode_step"]) >= {"eager_ops", "host_to_device_copies", "device_to_host_copies"}
    assert report["rules"] == report_rules()
    for path in REPORT_FIELDS:
        assert _field(report, path), path
    json.dumps(report)


def test_tiny_v41_report_traces_every_planned_graph():
    cfg, nextn = tiny_config("v41", 2), 2
    report = device_report(cfg, cp=2, ep=2, nextn=nextn, max_num_seqs=2, max_model_len=64,
                           max_num_batched_tokens=32)
    _check_schema(report)
    regions = {g["kind"] for g in report["graphs"]}
    assert {"entry", "exit"} <= regions and (("draft" in regions) == bool(nextn))
    # a decode step: the packed inputs in, the logits out, nothing eagerly (the Engram hash is host work
    # before the copy, layers/engram_host.py)
    step = report["decode_step"]
    assert step["host_to_device_copies"] == 1 and step["device_to_host_copies"] == 1
    assert step["eager_ops"] == 0 and not step["ops"], step["ops"]
    # a speculative step of greedy rows: the verification forward, then the acceptance and the draft
    # block with its heads in one region (the vocabulary-split logits gathered in the region, cp 2):
    # one device program, the step's inputs in and the tokens and drafts out, nothing eager
    spec = report["speculative_step"]
    draft = spec["by_phase"]["draft"]
    assert "host_to_device" not in draft and draft["device_to_host"] == 1 and "eager_ops" not in draft
    assert spec["eager_ops"] == 0 and spec["phases"] == ["step", "draft"], spec
    assert spec["host_to_device_copies"] == spec["device_to_host_copies"] == 1
    checks = report["checks"]
    assert checks["speculative_eager_ops"] and checks["speculative_copies_a_program"]
    assert checks["speculative_copies_a_step"]
    assert any(g["kind"] == "verify_draft" for g in report["graphs"])
    # host-sampled drafts: the block's rows come back and the heads run eagerly, two copies back a depth
    host = report["speculative_step_host_draws"]
    assert host["phases"] == ["step", "draft"] + ["heads"] * nextn
    assert host["by_phase"]["heads"]["device_to_host"] == 2 * nextn and host["by_phase"]["heads"]["eager_ops"] > 0


@pytest.mark.parametrize("nextn", [0, 5])
def test_v41_flash_report_at_cp64_ep64(nextn, tmp_path):
    import importlib.util
    spec = importlib.util.spec_from_file_location("device_report_script", ROOT / "examples/neuron/device_report.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "report.json"
    args = ["--config", str(ROOT / "examples/configs/v41-flash.json"), "--cp", "64", "--ep", "64", "--json", str(out)]
    assert script.main(args + (["--nextn", str(nextn)] if nextn else [])) == 0
    report = json.loads(out.read_text())
    _check_schema(report)
    checks = report["checks"]
    assert checks["graphs_match_plan"] and checks["int64_sites_zero"] and checks["float8_sites_zero"]
    assert checks["copies"]
    assert checks["graph_count"] and report["graph_count"] == (64 if nextn else 61)
    if nextn:
        assert checks["speculative_eager_ops"] and checks["speculative_copies_a_program"]
        assert checks["speculative_copies_a_step"]   # one device program: spec/greedy_step.py
