"""examples/neuron/bench_neuron.py: metric definitions, prompts, stream validation, and a 1x1x2 matrix
run offline (with the transformers baseline) and against a live server on the tiny V4 checkpoint.

Timings on this machine are noise (2 shared cores), so nothing here asserts on a duration beyond
its sign and the definitions tying the numbers together.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import httpx
import pytest

from tests.support import REPO, load_script

# The script puts its own directory on sys.path for its library, bench_lib.
bench_neuron = load_script("examples/neuron/bench_neuron.py")
from bench_lib.metrics import RequestResult, cell_metrics, speedup  # noqa: E402
from bench_lib.prompts import PromptFactory  # noqa: E402
from bench_lib.server import ServerDriver  # noqa: E402

MATRIX = ["--input-lens", "8", "--output-lens", "4", "--concurrency", "1,2", "--num-prompts", "2"]


# ---- metrics: vLLM's definitions on hand-made timings ------------------------------------------
def _req(start, times, n_out, expected=None, prompt_len=8):
    r = RequestResult(prompt_len, n_out if expected is None else expected, start=start)
    r.token_times, r.output_len, r.end = list(times), n_out, times[-1] if times else start
    return r


def test_cell_metrics_follow_vllm_definitions():
    a = _req(0.0, [0.5, 0.7, 0.9, 1.1], 4)       # TTFT 0.5, E2EL 1.1, TPOT 0.2
    b = _req(1.0, [1.2, 1.5, 1.8, 2.1], 4)       # TTFT 0.2, E2EL 1.1, TPOT 0.3
    m = cell_metrics([a, b], duration_s=2.2, concurrency=1)
    assert (m["completed"], m["failed"], m["errors"]) == (2, 0, [])
    assert m["mean_ttft_ms"] == pytest.approx(350.0)
    assert m["median_ttft_ms"] == pytest.approx(350.0)
    assert m["mean_tpot_ms"] == pytest.approx(250.0)
    assert m["mean_e2el_ms"] == pytest.approx(1100.0)
    # ITL: all 6 gaps pooled (3 x 0.2, 3 x 0.3)
    assert m["mean_itl_ms"] == pytest.approx(250.0)
    assert m["p99_itl_ms"] == pytest.approx(300.0)
    assert m["total_input_tokens"] == 16 and m["total_output_tokens"] == 8
    assert m["request_throughput"] == pytest.approx(2 / 2.2)
    assert m["output_throughput"] == pytest.approx(8 / 2.2)
    assert m["total_token_throughput"] == pytest.approx(24 / 2.2)
    assert m["mean_tokens_per_decode_step"] == pytest.approx(1.0)
    assert m["ttfts"] == pytest.approx([0.5, 0.2]) and m["e2els"] == pytest.approx([1.1, 1.1])


def test_failures_are_counted_and_kept_out_of_the_averages():
    good = _req(0.0, [0.1, 0.2], 2)
    short = _req(0.0, [0.1, 0.2], 2, expected=4)  # stopped early: breaks the fixed-length contract
    silent = _req(0.0, [], 0, expected=2)
    broken = _req(0.0, [], 0, expected=2)
    broken.fail("HTTP 500: boom")
    m = cell_metrics([good, short, silent, broken], duration_s=1.0, concurrency=4)
    assert (m["completed"], m["failed"]) == (1, 3)
    assert m["errors"][0].startswith("generated 2 tokens, expected 4")
    assert m["errors"][1:] == ["no token received", "HTTP 500: boom"]
    assert m["mean_ttft_ms"] == pytest.approx(100.0) and m["total_output_tokens"] == 2


def test_multi_token_steps_and_single_token_requests():
    spec = _req(0.0, [0.1, 0.3, 0.5], 5)  # 4 tokens after the first in 2 steps
    one = _req(0.0, [0.4], 1)               # no TPOT for a 1-token output
    m = cell_metrics([spec, one], duration_s=1.0, concurrency=2)
    assert m["mean_tokens_per_decode_step"] == pytest.approx(2.0)
    assert m["mean_tpot_ms"] == pytest.approx(100.0)  # (0.5 - 0.1) / 4, from `spec` only
    assert m["mean_itl_ms"] == pytest.approx(200.0)


def test_no_successes_gives_null_latencies_not_zeros():
    r = _req(0.0, [], 0, expected=2)
    r.fail("ConnectError")
    m = cell_metrics([r], duration_s=0.5, concurrency=1)
    assert m["completed"] == 0 and m["failed"] == 1
    assert m["mean_ttft_ms"] is None and m["p99_e2el_ms"] is None and m["output_throughput"] == 0


def test_speedup_is_oriented_so_that_above_one_means_faster():
    ours = {"output_throughput": 20.0, "mean_ttft_ms": 50.0, "mean_tpot_ms": 10.0, "mean_e2el_ms": 100.0}
    base = {"output_throughput": 10.0, "mean_ttft_ms": 100.0, "mean_tpot_ms": 30.0, "mean_e2el_ms": 100.0}
    assert speedup(ours, base) == pytest.approx(
        {"output_throughput": 2.0, "mean_ttft": 2.0, "mean_tpot": 3.0, "mean_e2el": 1.0})


# ---- prompts ------------------------------------------------------------------------------------
def test_prompts_have_exact_length_are_distinct_and_in_range():
    f = PromptFactory(vocab_size=129280, seed=3)
    a = f.make(50, 5, (1,))
    b = f.make(50, 5, (1,))  # same tag: the salt still makes them differ
    assert all(len(p) == 5 for p in a + b)
    assert len({tuple(p) for p in a + b}) == 100
    assert all(3 <= t < 128000 for p in a + b for t in p)
    assert PromptFactory(129280, seed=3).make(50, 5, (1,)) == a  # reproducible
    small = PromptFactory(vocab_size=10).make(20, 3)
    assert all(3 <= t < 10 for p in small for t in p) and len({tuple(p) for p in small}) == 20


# ---- arguments ----------------------------------------------------------------------------------
@pytest.mark.parametrize("flag, value, message", [
    ("--ep", "0", "--cp / --ep: must be >= 1, got 1 / 0"),
    ("--nextn", "3", "--nextn 3: values > 0 need a deepseek_v41 checkpoint with draft layers"),
    ("--nextn", "0,-1", "expected integers >= 0"),
    ("--num-prompts", "1", "--num-prompts: must be >= the largest concurrency (2)"),
    ("--concurrency", "0", "expected positive integers"),
])
def test_unsupported_or_bad_flags_exit_2_with_the_reason(tmp_path, capsys, flag, value, message):
    (tmp_path / "config.json").write_text("{}")
    argv = ["--model", str(tmp_path), "--out", str(tmp_path / "r.json"), "--concurrency", "1,2", flag, value]
    with pytest.raises(SystemExit) as exc:
        bench_neuron.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_transformers_baseline_refuses_v41_before_running(tmp_path, capsys):
    from bench_lib.hf_baseline import TransformersDriver
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v41"}))
    with pytest.raises(ValueError, match="needs a V4 checkpoint"):
        TransformersDriver(str(tmp_path), "auto")
    with pytest.raises(SystemExit) as exc:
        bench_neuron.parse_args(["--model", str(tmp_path), "--out", str(tmp_path / "r.json"),
                                 "--baseline", "transformers"])
    assert exc.value.code == 2 and "needs a V4 checkpoint" in capsys.readouterr().err


# ---- server stream validation (no server: canned SSE bodies) ------------------------------------
def _chunk(text="x", finish=None):
    return "data: " + json.dumps({"choices": [{"index": 0, "text": text, "finish_reason": finish}]}) + "\n\n"


USAGE = "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 2}}) + "\n\n"
DONE = "data: [DONE]\n\n"


def _read(body: str) -> RequestResult:
    r = RequestResult(8, 2)
    asyncio.run(ServerDriver._read_stream(httpx.Response(200, content=body.encode()), r))
    r.check()
    return r


@pytest.mark.parametrize("body, error", [
    (": ping\n\n" + _chunk() + _chunk(finish="length") + USAGE + DONE, None),
    (_chunk() + _chunk(finish="length") + USAGE, "ended without data: [DONE]"),
    (_chunk() + _chunk(finish="length") + DONE, "no usage chunk"),
    (_chunk() + 'data: {"error": {"message": "engine died"}}\n\n' + USAGE + DONE, "error event: engine died"),
    (_chunk() + "data: {not json\n\n" + USAGE + DONE, "invalid JSON"),
    (_chunk() + _chunk() + _chunk(finish="length") + USAGE.replace(": 2}", ": 3}") + DONE, "generated 3 tokens"),
])
def test_stream_problems_fail_the_request(body, error):
    r = _read(body)
    if error is None:
        assert r.ok and r.output_len == 2 and len(r.token_times) == 2
    else:
        assert not r.ok and error in r.error


# ---- end to end on the tiny checkpoint ------------------------------------------------------------
def _check_records(records: list[dict], backend: str):
    assert [(r["backend"], r["input_len"], r["output_len"], r["concurrency"]) for r in records] == [
        (backend, 8, 4, 1), (backend, 8, 4, 2)]
    for r in records:
        assert (r["completed"], r["failed"], r["errors"]) == (2, 0, [])
        rounds = 2 if backend == "deepinfer-server" else 1
        assert (r["num_warmups"], r["warmup_failed"]) == (rounds * r["concurrency"], 0)
        assert r["input_lens"] == [8, 8] and r["output_lens"] == [4, 4]
        assert r["total_input_tokens"] == 16 and r["total_output_tokens"] == 8
        for key in ("ttft", "tpot", "itl", "e2el"):
            for stat in ("mean", "median", "std", "p90", "p99"):
                assert r[f"{stat}_{key}_ms"] >= 0
            assert r[f"mean_{key}_ms"] > 0
        for ttft, e2el in zip(r["ttfts"], r["e2els"]):
            assert 0 < ttft <= e2el <= r["duration"]
        assert r["p99_ttft_ms"] >= r["median_ttft_ms"] and r["mean_e2el_ms"] >= r["mean_ttft_ms"]
        assert r["request_throughput"] * r["duration"] == pytest.approx(2)
        assert r["output_throughput"] * r["duration"] == pytest.approx(8)
        assert r["mean_tokens_per_decode_step"] == pytest.approx(1.0)  # no speculative decoding
        assert r["config"]["cp"] == 1 and r["config"]["ep"] == 1 and r["config"]["nextn"] == [0]
        assert r["nextn"] == 0
        assert r["versions"]["torch"] and r["versions"]["python"]


def test_offline_matrix_with_transformers_baseline(tiny_v4_dense_dir, tmp_path, capsys, cpu_platform):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = bench_neuron.main(["--model", str(tiny_v4_dense_dir), *MATRIX, "--accelerator", "cpu",
                            "--baseline", "transformers", "--out", str(out), "--plot", str(png)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["failed_requests"] == 0
    ours = [r for r in data["records"] if r["backend"] == "deepinfer-offline"]
    base = [r for r in data["records"] if r["backend"] == "transformers"]
    _check_records(ours, "deepinfer-offline")
    _check_records(base, "transformers")
    for r in ours:
        assert r["config"]["mode"] == "offline" and r["platform"]["name"] == "cpu"
        assert r["config"]["engine"]["max_num_seqs"] == 2
        # 2 requests x 4 tokens: at least 4 steps and at most 8, each with a recorded bucket
        assert 4 <= sum(r["buckets"]["steps_per_bucket"].values()) <= 8
        s = r["speedup_vs_transformers"]
        assert set(s) == {"output_throughput", "mean_ttft", "mean_tpot", "mean_e2el"}
        assert all(v > 0 for v in s.values())
    for r in base:
        assert r["platform"]["name"] == "transformers" and r["platform"]["dtype"] == "float32"
    printed = capsys.readouterr().out
    assert printed.count(" Serving Benchmark Result ") == 2  # one block per deepinfer cell
    assert "deepinfer-offline in=8 out=4 c=2" in printed
    assert "Mean TTFT (ms):" in printed and "deepinfer vs transformers" in printed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def live_server(request, tmp_path_factory):
    from tests.support.server import ServerProcess, model_dir_fixture
    srv = ServerProcess(model_dir_fixture(request, tmp_path_factory))
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.terminate()


def test_server_matrix(live_server, tmp_path, tiny_v4_dir):
    from tests.support.server import API_KEY, MODEL_NAME
    out = tmp_path / "r.json"
    rc = bench_neuron.main(["--model", str(tiny_v4_dir), *MATRIX, "--base-url", live_server.base,
                            "--api-key", API_KEY, "--accelerator", "cpu", "--out", str(out)])
    assert rc == 0
    records = json.loads(out.read_text())["records"]
    _check_records(records, "deepinfer-server")
    server = records[0]["platform"]["server"]
    assert server["served_model"] == MODEL_NAME and server["health_status"] == 200
    assert records[0]["platform"]["name"] == "cpu" and records[0]["buckets"]["steps_per_bucket"] is None
    # read from the server's /metrics: the eager CPU server compiles nothing
    assert records[0]["buckets"]["graphs_compiled_while_measuring"] == 0
    assert "api_key" not in records[0]["config"]


def test_server_errors_are_counted_and_exit_nonzero(live_server, tmp_path, tiny_v4_dir):
    from tests.support.server import API_KEY
    out = tmp_path / "r.json"
    argv = ["--model", str(tiny_v4_dir), "--input-lens", "8", "--output-lens", "2", "--concurrency", "1",
            "--num-prompts", "2", "--base-url", live_server.base, "--api-key", API_KEY,
            "--served-model-name", "no-such-model", "--out", str(out)]
    assert bench_neuron.main(argv) == 1
    data = json.loads(out.read_text())
    r = data["records"][0]
    assert (r["completed"], r["failed"], r["warmup_failed"], data["failed_requests"]) == (0, 2, 2, 4)
    assert all(e.startswith("HTTP 404") for e in r["errors"] + r["warmup_errors"])
    assert r["mean_ttft_ms"] is None


def test_unreachable_server_counts_every_request(tmp_path, tiny_v4_dir):
    from tests.support.server import free_port
    out = tmp_path / "r.json"
    argv = ["--model", str(tiny_v4_dir), "--input-lens", "8", "--output-lens", "2", "--concurrency", "1,2",
            "--num-prompts", "2", "--base-url", f"http://127.0.0.1:{free_port()}", "--out", str(out)]
    assert bench_neuron.main(argv) == 1
    data = json.loads(out.read_text())
    assert data["failed_requests"] == (2 + 2) + (2 + 4)  # measured + 2 warm-up rounds, both cells
    assert all("ConnectError" in e for r in data["records"] for e in r["errors"])
    assert data["records"][0]["platform"]["server"]["probe_errors"]


@pytest.mark.slow
def test_neuron_host_mode_matrix(tiny_v4_dir, tmp_path):
    """Host-mode Neuron (compiled region graphs on CPU): every bucket compiles in the warm-up."""
    out = tmp_path / "r.json"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "neuron" / "bench_neuron.py"),
                           "--model", str(tiny_v4_dir), *MATRIX, "--accelerator", "neuron", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(out.read_text())["records"]
    _check_records(records, "deepinfer-offline")
    for r in records:
        assert r["platform"]["name"] == "neuron" and r["platform"]["is_host_mode"]
        assert "eager" not in r["buckets"]["steps_per_bucket"]
        assert r["buckets"]["graphs_compiled_while_measuring"] == 0


@pytest.mark.slow
def test_neuron_host_mode_speculative_cells(tiny_v41_dir, tmp_path):
    """Host-mode Neuron with drafts: greedy speculative steps run as one device program
    (spec/greedy_step.py), which picks its own bucket; the bench's bucket count follows them."""
    out = tmp_path / "r.json"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "neuron" / "bench_neuron.py"),
                           "--model", str(tiny_v41_dir), "--input-lens", "8", "--output-lens", "6",
                           "--concurrency", "1", "--num-prompts", "2", "--nextn", "3", "--accelerator", "neuron",
                           "--out", str(out)], env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (r,) = json.loads(out.read_text())["records"]
    assert r["nextn"] == 3 and r["completed"] == 2 and r["failed"] == 0
    assert r["spec_decode"]["draft_tokens"] > 0
    assert "eager" not in r["buckets"]["steps_per_bucket"]
