"""Neuron host-mode tests: tests/neuron helpers on the path, and one intra-op thread.

Tiny-model ops are microseconds of work; with two OpenMP threads on a 2-core machine that also runs
other jobs, every op pays a spin-wait handoff (a decode step measured 0.1 s with one thread and
1.9 s with two under load). The thread count is restored after each module."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
