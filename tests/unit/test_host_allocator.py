"""platforms/host_allocator.py: with the thresholds raised, a step's freed buffers are reused without
page faults; the cpu platform applies them when a rank starts, unless turned off. Each case runs in a
child process: the thresholds are process-wide."""
import json
import subprocess
import sys

import pytest

from deepinfer.platforms.host_allocator import glibc_version

pytestmark = pytest.mark.skipif(glibc_version() is None, reason="mallopt thresholds exist on glibc only")

# Two 40 MiB buffers a step: above the 32 MiB cap of glibc's own dynamic mmap threshold, so with the
# defaults each is a fresh mapping, faulted in page by page every step, whatever the heap held before
# (smaller blocks fault too, but only when the trim threshold happens to be crossed, which depends on
# the heap's state: not a stable negative control). Measured here: 20,482 faults a step with the
# defaults, 1,536 with the thresholds raised.
_CHILD = r"""
import json, resource, sys, torch
torch.set_num_threads(1)
from deepinfer.platforms import host_allocator
keep = sys.argv[1] == "1"
if keep:
    assert host_allocator.keep_freed_memory()
def step():
    a = torch.empty(10 << 20, dtype=torch.float32).fill_(1.0)   # 40 MiB
    b = a * 2.0
    return float(b[-1])
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(json.dumps({"faults_per_step": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20}))
"""


def _faults_per_step(keep: bool) -> float:
    out = subprocess.run([sys.executable, "-c", _CHILD, "1" if keep else "0"], capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["faults_per_step"]


def test_freed_buffers_are_reused_without_faulting_pages_in_again():
    pages = 2 * (40 << 20) // 4096          # two 40 MiB buffers a step
    default = _faults_per_step(keep=False)
    kept = _faults_per_step(keep=True)
    assert default > 0.9 * pages, f"negative control: glibc's defaults should map fresh pages ({default:.0f} faults)"
    assert kept < pages / 4, f"{kept:.0f} page faults a step with freed memory kept"


_PLATFORM_CHILD = r"""
import json
from deepinfer.platforms import host_allocator
from deepinfer.platforms.cpu import CpuPlatform
CpuPlatform().set_device(0)
print(json.dumps({"applied": host_allocator._applied}))
"""


@pytest.mark.parametrize("setting, applied", [("1", True), ("0", False)])
def test_cpu_rank_start_applies_the_thresholds_unless_turned_off(setting, applied, monkeypatch):
    monkeypatch.setenv("DEEPINFER_CPU_KEEP_FREED_MEMORY", setting)
    out = subprocess.run([sys.executable, "-c", _PLATFORM_CHILD], capture_output=True, text=True, timeout=120,
                         check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"applied": applied}
