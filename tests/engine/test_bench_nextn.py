"""bench_neuron.py --nextn sweep on the tiny V4.1 checkpoint: one engine per value, every record
labelled with its nextn, and the speculative rows report the engine's acceptance counters."""
import json

import pytest

from tests.support import load_script

bench_neuron = load_script("examples/neuron/bench_neuron.py")


def test_nextn_sweep_offline(tiny_v41_dir, tmp_path, capsys, cpu_platform):
    out = tmp_path / "r.json"
    rc = bench_neuron.main(["--model", str(tiny_v41_dir), "--input-lens", "8", "--output-lens", "6",
                            "--concurrency", "2", "--num-prompts", "2", "--num-warmups", "0",
                            "--nextn", "0,2", "--accelerator", "cpu", "--dtype", "float32",
                            "--out", str(out)])
    assert rc == 0
    records = json.loads(out.read_text())["records"]
    assert [r["nextn"] for r in records] == [0, 2]
    plain, spec = records
    assert plain["config"]["engine"]["num_speculative_tokens"] == 0
    assert spec["config"]["engine"]["num_speculative_tokens"] == 2
    assert plain["mean_tokens_per_decode_step"] == pytest.approx(1.0)
    assert plain["spec_decode"]["draft_tokens"] == 0
    s = spec["spec_decode"]
    # rows near max_tokens draft fewer than 2
    assert 0 < s["decode_request_steps"] <= s["draft_tokens"] <= 2 * s["decode_request_steps"]
    assert s["draft_tokens"] > 0 and len(s["accept_rate_per_depth"]) == 2
    assert s["tokens_per_decode_step"] == pytest.approx(1 + s["accepted_tokens"] / s["decode_request_steps"])
    assert all(r["completed"] == 2 and r["total_output_tokens"] == 12 for r in records)
    printed = capsys.readouterr().out
    assert "nextn=2" in printed and "Output tokens per decode step:" in printed
