"""examples/soak.py for 12 s against a real tiny server: mixed traffic, disconnects and malformed
requests leave no failed request and no KV block in use, and the report has every figure; with
--shared-prefix-len the prefix cache is hit, and a pool small enough to evict ends with every block
free again (cached idle blocks count as free)."""
import json

import pytest

from tests.support import load_script
from tests.support.server import API_KEY, ServerProcess, model_dir_fixture


@pytest.fixture(scope="module")
def model_dir(request, tmp_path_factory):
    return model_dir_fixture(request, tmp_path_factory)


def test_soak_leaves_no_failures_and_no_kv_blocks(model_dir, tmp_path):
    soak = load_script("examples/soak.py")
    srv = ServerProcess(model_dir)
    try:
        srv.wait_ready()
        out = tmp_path / "soak.json"
        rc = soak.main(["--base-url", srv.base, "--duration", "12", "--concurrency", "8",
                        "--api-key", API_KEY, "--json", str(out), "--seed", "1"])
        report = json.loads(out.read_text())
    finally:
        srv.terminate()
    assert rc == 0, report
    assert report["requests_failed"] == 0 and report["failed_by_cause"] == {}
    assert report["requests_ok"] >= 10 and report["malformed_refused_correctly"] >= 1
    assert report["disconnects"] >= 1
    assert report["kv_blocks_used_after_drain"] == 0
    assert report["server_pid"] == srv.proc.pid  # found from the port
    assert report["server_rss_kib_start"] > 0 and report["server_rss_kib_end"] > 0
    lat = report["latency_s"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]


def test_soak_refuses_a_non_loopback_server():
    soak = load_script("examples/soak.py")
    with pytest.raises(SystemExit):
        soak.parse_args(["--base-url", "http://10.0.0.1:8000", "--duration", "1"])


def test_soak_with_shared_prefixes_hits_and_leaks_nothing(model_dir, tmp_path):
    soak = load_script("examples/soak.py")
    # 40 blocks of 16: a few 130-token prompts in flight fill it, so idle cached blocks get reclaimed
    srv = ServerProcess(model_dir, "--num-kv-blocks", "40")
    try:
        srv.wait_ready()
        out = tmp_path / "soak.json"
        rc = soak.main(["--base-url", srv.base, "--duration", "12", "--concurrency", "6",
                        "--api-key", API_KEY, "--json", str(out), "--seed", "2",
                        "--shared-prefix-len", "120", "--num-shared-prefixes", "3"])
        report = json.loads(out.read_text())
    finally:
        srv.terminate()
    assert rc == 0, report
    assert report["requests_failed"] == 0
    assert report["kv_blocks_used_after_drain"] == 0
    assert report["kv_blocks_free_after_drain"] == 39
    pc = report["prefix_cache"]
    assert pc["queried_tokens"] > 0 and pc["hit_tokens"] > 0 and 0 < pc["hit_rate"] < 1
