"""Scripts outside the package that import test helpers by path: the Neuron image's build-time
self-check (docker/neuron/Dockerfile), run as it would run in the image (host mode, every kernel name
resolves, one tiny model decodes through compiled regions, no device-only module imported), and
examples/neuron/bench_host_compile.py. A moved helper breaks them here first rather than in an image
build or a benchmark run."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_dockerfile_self_check_runs_on_the_host(tmp_path):
    dockerfile = (ROOT / "docker" / "neuron" / "Dockerfile").read_text()
    script = re.search(r"python - <<'PY'\n(.*?)\nPY\n", dockerfile, re.S)
    assert script, "Dockerfile: the self-check heredoc is missing"
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", DEEPINFER_NEURON_HOST="1",
               DEEPINFER_ACCELERATOR="neuron", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", script.group(1)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "self-check ok" in out.stdout and "graphs" in out.stdout


@pytest.mark.slow   # a benchmark script; the region compile it times is covered by tests/neuron/test_regions.py
def test_bench_host_compile_runs(tmp_path):
    """examples/neuron/bench_host_compile.py end to end at its smallest (one kind, one timed step)."""
    out_json = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "examples/neuron/bench_host_compile.py", "--kind", "v4", "--batch", "2",
                          "--warmup", "1", "--steps", "1", "--ckpt-dir", str(tmp_path / "ckpt"),
                          "--out", str(out_json)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out_json.read_text())["results"]
    # one decode bucket: a graph a layer kind, and the step's entry and exit graphs (regions.TOP_REGIONS)
    assert rows[0]["kind"] == "v4" and rows[0]["graphs_compiled"] == rows[0]["layer_kinds"] + 2 > 2
    assert rows[0]["tokens_equal"] is True


def test_kernel_report_runs_at_small_shapes(tmp_path):
    out = tmp_path / "kernel_report.json"
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "neuron" / "kernel_report.py"), "--config",
                        str(ROOT / "examples" / "configs" / "v41-flash.json"), "--rows", "1,4", "--scale", "16",
                        "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rep = json.loads(out.read_text())
    names = {k["kernel"] for k in rep["kernels"] if "kernel" in k}
    assert {"blockquant_fp8_gemm", "blockquant_fp8_grouped_gemm", "blockquant_fp4_gemm", "fp4_static_experts"} <= names
    costs = [k for k in rep["kernels"] if "name" in k]
    assert [c["name"] for c in costs] == ["blockquant_fp8_gemm", "blockquant_fp4_gemm"]
    for c in costs:
        assert {"name", "shape", "predicted_ms", "roofline_ms", "seed_measured_ms",
                "seed_design_predicted_ms"} <= set(c)
        assert c["predicted_ms"] > 0 and c["roofline_ms"] > 0 and c["seed_design_predicted_ms"] >= c["predicted_ms"]
    for k in rep["kernels"]:
        if "name" in k:
            continue
        assert k["instructions"]["tensor"] > 0 and k["dma_bytes"] > 0 and k["roofline_estimate_ms"] > 0
        assert k["predicted_ms"] > 0
    assert rep["assumptions"]["hbm_bytes_per_s"] == 2.9e12 / 4
    assert "roofline" in r.stdout
