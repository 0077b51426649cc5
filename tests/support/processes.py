"""Helpers of the multi-process tests (tests/process/): whether a process is still running, waiting
for processes to go, and the environment of a child process that imports this tree, and a signal sent to
a follower mid-generation."""
from __future__ import annotations

import os
import threading
import time

from tests.support import REPO


def alive(pid: int) -> bool:
    """Running (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids, timeout_s: float) -> float:
    """Seconds until none of `pids` runs; AssertionError naming the survivors after timeout_s."""
    t0 = time.monotonic()
    while any(alive(p) for p in pids):
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"still running after {timeout_s} s: {[p for p in pids if alive(p)]}")
        time.sleep(0.05)
    return time.monotonic() - t0


def child_env() -> dict:
    """os.environ with this tree first on PYTHONPATH."""
    return dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def signal_after_steps(worker, pid: int, sig: int, steps: int = 5, timeout_s: float = 120.0) -> tuple[threading.Thread, list]:
    """A started thread that sends `sig` to `pid` once the driver's fanout published `steps` steps (or
    after timeout_s), and the list it appends the sending time (monotonic) to."""
    sent: list[float] = []

    def run():
        deadline = time.monotonic() + timeout_s
        while worker.runner.transport.steps_published < steps and time.monotonic() < deadline:
            time.sleep(0.01)
        sent.append(time.monotonic())
        os.kill(pid, sig)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, sent
