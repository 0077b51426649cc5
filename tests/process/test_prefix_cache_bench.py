"""bench_neuron.py --shared-prefix-len: the shared-prefix record (both TTFTs, their ratio, the cached
tokens the engine reported) in the JSON; nothing here asserts on a duration (2 shared cores)."""
import json

from tests.support import load_script

bench_neuron = load_script("examples/neuron/bench_neuron.py")

MATRIX = ["--input-lens", "8", "--output-lens", "2", "--concurrency", "1", "--num-prompts", "1",
          "--num-warmups", "0", "--accelerator", "cpu"]


def _shared(model_dir, tmp_path, *extra):
    out = tmp_path / "r.json"
    rc = bench_neuron.main(["--model", str(model_dir), *MATRIX, "--shared-prefix-len", "40",
                            "--shared-suffix-len", "5", "--out", str(out), *extra])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["failed_requests"] == 0
    (rec,) = data["shared_prefix"]
    assert rec["shared_prefix_len"] == 40 and rec["suffix_len"] == 5 and rec["failed"] == 0
    assert rec["ttft_first_ms"] > 0 and rec["ttft_second_ms"] > 0
    assert rec["ttft_ratio"] == rec["ttft_second_ms"] / rec["ttft_first_ms"]
    return rec, data


def test_shared_prefix_record(tiny_v41_dir, tmp_path, cpu_platform):
    rec, data = _shared(tiny_v41_dir, tmp_path)
    # 40 shared tokens: 2 full blocks of 16 are found again; the first request shares nothing
    assert rec["cached_tokens_first"] == 0 and rec["cached_tokens_second"] == 32
    assert data["records"][0]["config"]["engine"]["enable_prefix_caching"] is True


def test_shared_prefix_record_with_caching_off(tiny_v41_dir, tmp_path, cpu_platform):
    rec, data = _shared(tiny_v41_dir, tmp_path, "--no-enable-prefix-caching")
    assert rec["cached_tokens_second"] == 0 and rec["enable_prefix_caching"] is False
