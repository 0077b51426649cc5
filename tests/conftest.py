"""Shared fixtures: tiny checkpoints built once per session, the tier markers, and the neuron_device skip.

Each test carries the marker of its tier, the directory it is in (tests/unit, tests/engine,
tests/process, tests/neuron, tests/repo; pytest.ini lists them), so `-m process` selects a tier; the
tests listed in tests/support/slow_tests.py (by measured cost) are marked slow, so `make test` leaves
them to `make test-all`.

The suite runs torch with one intra-op thread (and passes OMP_NUM_THREADS=1 to the server
subprocesses it starts): the tiny model's ops are microseconds of work, and two OpenMP threads on a
2-core machine that also runs another process pay a spin-wait handoff on every op (a decode step
measured 0.1 s with one thread and 1.9 s with two under load). Benchmarks keep the default."""
import glob
import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.support import TIERS  # noqa: E402
from tests.support.slow_tests import SLOW  # noqa: E402

torch.set_num_threads(1)

TESTS = Path(__file__).resolve().parent


def _listed_slow(path: str, name: str) -> bool:
    function = name.split("[", 1)[0]
    return bool({path, f"{path}::{function}", f"{path}::{name}"} & SLOW.keys())


@pytest.hookimpl(tryfirst=True)   # before -m deselects: a tier marker must be there when it does
def pytest_collection_modifyitems(config, items):
    for item in items:
        rel = item.path.resolve().relative_to(TESTS)
        if len(rel.parts) < 2 or rel.parts[0] not in TIERS:
            raise pytest.UsageError(f"tests/{rel}: a test file belongs in one of the tiers tests/{{{','.join(TIERS)}}}")
        item.add_marker(getattr(pytest.mark, rel.parts[0]))
        if _listed_slow(rel.as_posix(), item.name):
            item.add_marker(pytest.mark.slow)
    if glob.glob("/dev/neuron*"):
        return
    skip = pytest.mark.skip(reason="needs a Neuron device (no /dev/neuron* here)")
    for item in items:
        if "neuron_device" in item.keywords:
            item.add_marker(skip)


def _build(tmp_path_factory, name: str, kind: str, unquantized: bool = False, layers: int | None = None):
    # Lazy import: collecting tests must not require the checkpoint writer.
    from deepinfer.model_executor.tiny_checkpoint import make_tiny_checkpoint

    out = tmp_path_factory.mktemp(name)
    make_tiny_checkpoint(kind, out, seed=0, unquantized=unquantized, layers=layers)
    return out


@pytest.fixture(scope="session")
def tiny_v4_dir(tmp_path_factory):
    """Tiny V4 checkpoint in the real layout (fp8 block weights, fp4 experts, real tokenizer)."""
    return _build(tmp_path_factory, "tiny-v4", "v4")


@pytest.fixture(scope="session")
def tiny_v4_dense_dir(tmp_path_factory):
    """Tiny V4 checkpoint with dense fp32 weights (loadable by transformers for golden tests)."""
    return _build(tmp_path_factory, "tiny-v4-dense", "v4", unquantized=True)


@pytest.fixture(scope="session")
def tiny_v41_dir(tmp_path_factory):
    """Tiny V4.1 checkpoint (always fp8/fp4 quantized like the real one)."""
    return _build(tmp_path_factory, "tiny-v41", "v41")


@pytest.fixture(scope="session")
def tiny_v41_l4_dir(tmp_path_factory):
    """Tiny V4.1 with 4 layers (SWA, Engram, C2 kv / index source, C2 sharing), for multi-rank tests."""
    return _build(tmp_path_factory, "tiny-v41-l4", "v41", layers=4)


@pytest.fixture(scope="session")
def tiny_v4_l3_dir(tmp_path_factory):
    """Tiny V4 with 3 layers (SWA, CSA, HCA; hash routing; fp8 128x128 blocks), for multi-rank tests."""
    return _build(tmp_path_factory, "tiny-v4-l3", "v4", layers=3)


@pytest.fixture(autouse=True)
def no_ring_segment_left():
    """No test leaves a /dev/shm segment of ours behind (the multi-rank step rings,
    distributed/step_ring.py, and the shared Engram tables, distributed/shared_tables.py): each must
    be unlinked after any run, abort or crash."""
    def ours():
        try:
            return {n for n in os.listdir("/dev/shm") if n.startswith("deepinfer-")}
        except FileNotFoundError:
            return set()
    before = ours()
    yield
    left = sorted(ours() - before)
    assert not left, f"/dev/shm segments left behind: {left}"


@pytest.fixture
def cpu_platform(monkeypatch):
    """--accelerator writes DEEPINFER_ACCELERATOR into this process: restore it and the platform after."""
    from deepinfer.platforms import reset_platform
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "cpu")
    reset_platform()
    yield
    monkeypatch.undo()
    reset_platform()
