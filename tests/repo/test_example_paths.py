"""The scripts users, the Makefile and the design name run at those paths: examples/neuron/ keeps
forwarding scripts for the tools that moved to examples/tools/ and examples/bench/."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO

NAMED_PATHS = [
    "examples/neuron/bench_neuron.py",
    "examples/neuron/bench_offline.py",
    "examples/neuron/make_tiny_checkpoint.py",
    "examples/neuron/memory_report.py",
    "examples/neuron/kernel_report.py",
    "examples/soak.py",
    "examples/offline_inference.py",
]


def test_makefile_runs_scripts_that_exist():
    scripts = re.findall(r"(examples/\S+\.py)", (REPO / "Makefile").read_text())
    assert "examples/tools/make_tiny_checkpoint.py" in scripts and "examples/offline_inference.py" in scripts
    assert [s for s in scripts if not (REPO / s).is_file()] == []


@pytest.mark.parametrize("path", ["examples/neuron/bench_offline.py", "examples/neuron/make_tiny_checkpoint.py"])
def test_forwarding_script_runs_the_moved_one(path):
    """--help through the old path prints the moved script's own options."""
    old = subprocess.run([sys.executable, path, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert old.returncode == 0, old.stderr
    name = Path(path).name
    new_path = next(p for p in (REPO / "examples" / "tools" / name, REPO / "examples" / "bench" / name) if p.is_file())
    new = subprocess.run([sys.executable, str(new_path), "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert new.returncode == 0, new.stderr
    # argparse names the program by sys.argv[0]'s file name, the same for both paths
    assert old.stdout == new.stdout and "--" in old.stdout


@pytest.mark.parametrize("path", NAMED_PATHS)
def test_named_entry_points_exist(path):
    assert (REPO / path).is_file()
