"""bench_offline.py on the tiny checkpoints: every record carries the repeated figures (median and
spread), the GEMM floor of its step and, with --oracle-drafts, the verification step against the plain
one, with the oracle run's tokens equal to the plain run's (greedy). The runs are benchmarks: slow."""
import json

import pytest

from tests.support import load_script

bench_offline = load_script("examples/bench/bench_offline.py")


def _records(path):
    return json.loads(path.read_text())["records"]


@pytest.mark.slow
def test_oracle_drafts_verify_step_fields(tiny_v41_dir, tmp_path, cpu_platform):
    out = tmp_path / "r.json"
    assert bench_offline.main(["--model", str(tiny_v41_dir), "--batches", "1,2", "--dtypes", "float32",
                               "--input-len", "8", "--output-len", "9", "--repeats", "2", "--nextn", "2",
                               "--oracle-drafts", "--out", str(out)]) == 0
    records = _records(out)
    assert [r["batch"] for r in records] == [1, 2]
    for r in records:
        assert r["repeats"] == 2 and r["nextn"] == 2 and "transformers" not in r
        assert r["step_ms"] > 0 and r["gemm_floor_ms"] > 0 and r["num_matmuls_per_step"] > 0
        assert r["step_over_floor"] == pytest.approx(r["step_ms"] / r["gemm_floor_ms"])
        assert len(r["step_over_floor_per_round"]) == 2 and r["step_ms_spread"] >= 0
        # 9 tokens, 3 a verification step: the steps after the first token verify 2 drafts each
        assert r["oracle_tokens_equal_plain"] is True and min(r["verify_steps_per_round"]) >= 1
        assert r["verify_step_over_plain"] == pytest.approx(r["verify_step_ms"] / r["step_ms"])
        assert r["oracle_tokens_per_s_over_plain"] == pytest.approx(r["oracle_tokens_per_s"] / r["tokens_per_s"])


@pytest.mark.slow
def test_transformers_baseline_fields(tiny_v4_dense_dir, tmp_path, cpu_platform):
    out = tmp_path / "r.json"
    assert bench_offline.main(["--model", str(tiny_v4_dense_dir), "--batches", "2", "--dtypes", "float32",
                               "--input-len", "8", "--output-len", "5", "--repeats", "1", "--out", str(out)]) == 0
    (r,) = _records(out)
    hf = r["transformers"]
    assert hf["tokens_per_s"] > 0 and hf["step_ms"] > 0
    assert r["speedup"] == pytest.approx(r["tokens_per_s"] / hf["tokens_per_s"])
    assert r["decode_speedup"] == pytest.approx(hf["step_ms"] / r["step_ms"])
    assert len(r["speedup_per_round"]) == 1 and "verify_step_ms" not in r


def test_oracle_drafts_need_nextn(tiny_v41_dir, tmp_path):
    with pytest.raises(SystemExit):
        bench_offline.main(["--model", str(tiny_v41_dir), "--oracle-drafts", "--out", str(tmp_path / "r.json")])


@pytest.mark.slow
def test_compiled_runner_records_its_gemm_floor(tiny_v4_dense_dir, tmp_path, cpu_platform, monkeypatch):
    """The floor is recorded from a compiled strategy's packed step too (its PackedStep unpacked on the
    host): aot_eager regions, so the cell compiles in seconds."""
    monkeypatch.setenv("DEEPINFER_CPU_COMPILE_BACKEND", "aot_eager")
    monkeypatch.setenv("DEEPINFER_CPU_COMPILE", "0")   # the bench sets it; teardown restores it
    out = tmp_path / "r.json"
    assert bench_offline.main(["--model", str(tiny_v4_dense_dir), "--batches", "2", "--dtypes", "float32",
                               "--input-len", "8", "--output-len", "5", "--repeats", "1", "--no-baseline",
                               "--runners", "cpu_compiled", "--out", str(out)]) == 0
    (r,) = _records(out)
    assert r["runner"] == "cpu_compiled" and r["compile_s"] > 0
    assert r["gemm_floor_ms"] > 0 and r["num_matmuls_per_step"] > 0
    assert r["step_over_floor"] == pytest.approx(r["step_ms"] / r["gemm_floor_ms"])
