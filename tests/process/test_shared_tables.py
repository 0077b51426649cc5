"""Engram tables once per host in shared memory (deepinfer/distributed/shared_tables.py).

Real processes (tests/support/shared_tables_rank.py) join a gloo group through env:// on a free port and build
the tiny V4.1 checkpoint with build_model(..., shared_tables=...): the tables must be one file mapped by
every rank (same segment, same inode behind each rank's tensor), equal to a single-process load, and
/dev/shm must hold nothing of ours afterwards, also when a rank is SIGKILLed after mapping or dies
before mapping."""
import os
import socket
import subprocess
import sys

import pytest
import torch

from deepinfer.config import ModelConfig
from deepinfer.distributed.parallel_layout import ParallelLayout
from deepinfer.distributed.shared_tables import SEGMENT_PREFIX, SHM_DIR, SharedEngramTables, table_layouts
from deepinfer.platforms import make_platform
from deepinfer.worker.worker import build_model

from tests.support import REPO
from tests.support.shared_tables_rank import engram_outputs

CHILD = "tests.support.shared_tables_rank"


def _ours() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(SEGMENT_PREFIX)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(world, model_dir, out_dir, platform, weight_format, mode="ok", timeout_s=60.0):
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", CHILD, str(r), str(world), str(model_dir), str(out_dir),
                               platform, weight_format, mode, str(timeout_s)], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(world)]
    codes, logs = [], []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=120)
            codes.append(p.returncode)
            logs.append(out.decode(errors="replace")[-3000:])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return codes, logs


def _reference(model_dir, platform, weight_format):
    cfg = ModelConfig.from_pretrained(str(model_dir))
    return build_model(cfg, str(model_dir), torch.float32, progress=False, platform=make_platform(platform),
                       weight_format=weight_format)


@pytest.fixture
def shm_clean():
    before = _ours()
    yield
    assert _ours() == before, f"left in {SHM_DIR}: {sorted(_ours() - before)}"


def _check_ranks_against_reference(model_dir, out_dir, ranks, platform, weight_format):
    """Every listed rank mapped one shared segment per table (the same file: one inode behind each
    rank's tensor, read-only), and holds the single-process tables and Engram outputs exactly."""
    ref = _reference(model_dir, platform, weight_format)
    ref_out = engram_outputs(ref)
    ref_tables = {p.name: ref.get_submodule(t.module).get_parameter(p.name.rsplit(".", 1)[1])
                  if weight_format == "dense" else ref.get_submodule(t.module).get_buffer(p.name.rsplit(".", 1)[1])
                  for t in table_layouts(ref) for p in t.parts}
    assert len(ref_tables) == 2 * (2 if weight_format == "packed" else 1)   # two Engram layers
    recs = [torch.load(out_dir / f"rank{r}.pt") for r in ranks]
    # one segment per table, the same for every rank
    assert len({tuple(sorted(r["segments"].items())) for r in recs}) == 1
    assert len(recs[0]["segments"]) == 2
    for name in ref_tables:
        lines = [r["maps"][name] for r in recs]
        for line in lines:
            assert f"{SHM_DIR}/{SEGMENT_PREFIX}" in line and line.endswith("(deleted)"), line
            assert line.split()[1].startswith("r") and line.split()[1][1] == "-", f"not read-only: {line}"
        # same device and inode behind every rank's tensor: one file, mapped by every rank
        assert len({tuple(line.split()[3:6]) for line in lines}) == 1, lines
        for r in recs:
            assert torch.equal(r["tables"][name], ref_tables[name]), name
    for r in recs:
        assert r["outputs"].keys() == ref_out.keys()
        for layer, y in ref_out.items():
            assert torch.equal(r["outputs"][layer], y), layer


def test_three_ranks_share_one_mapped_table(tiny_v41_dir, tmp_path, shm_clean):
    """Packed tables on the neuron platform (host mode): the creator writes the trn2 byte layout
    (halved codes, exponents + 1) once and no rank converts a private copy."""
    codes, logs = _run_ranks(3, tiny_v41_dir, tmp_path, "neuron", "packed")
    assert codes == [0, 0, 0], logs
    _check_ranks_against_reference(tiny_v41_dir, tmp_path, [0, 1, 2], "neuron", "packed")


def test_rank_killed_after_mapping_leaves_nothing(tiny_v41_dir, tmp_path, shm_clean):
    """Two ranks of a split model (lanes of 2, experts over 2; build_model turns the sharing on by
    itself on rank 0), dense tables on cpu; rank 1 is SIGKILLed once it holds the mapped tables: the
    survivor still reads them and nothing is left in /dev/shm."""
    codes, logs = _run_ranks(2, tiny_v41_dir, tmp_path, "cpu", "dense", mode="die_after_map")
    assert codes == [0, -9], logs
    _check_ranks_against_reference(tiny_v41_dir, tmp_path, [0], "cpu", "dense")


def test_rank_that_never_maps_fails_the_host_and_leaves_nothing(tiny_v41_dir, tmp_path, shm_clean):
    codes, logs = _run_ranks(3, tiny_v41_dir, tmp_path, "cpu", "packed", mode="die_before_map", timeout_s=4.0)
    assert codes == [2, 2, 3], logs
    creator = (tmp_path / "rank0.err").read_text()
    # the creator waits for every local rank before creating anything: rank 2 never comes
    assert "only 1 of the 2 other local ranks of node 0 reached the Engram tables within 4 s" in creator, creator
    # rank 1 is told the creator failed instead of waiting for a segment never published
    follower = (tmp_path / "rank1.err").read_text()
    assert "failed: only 1 of the 2" in follower, follower


def test_a_rank_with_another_model_fails_the_host_at_once(tiny_v41_dir, tmp_path, shm_clean):
    """Rank 2 builds dense tables where the creator made packed ones: it cannot map them and says so in
    the store, so the creator fails with its reason at once (a 600 s table timeout, while the ranks
    are given 120 s to exit) and every rank exits with an error; nothing is left in /dev/shm."""
    codes, logs = _run_ranks(3, tiny_v41_dir, tmp_path, "cpu", "packed", mode="mismatch", timeout_s=600.0)
    assert codes == [2, 2, 2], logs
    creator = (tmp_path / "rank0.err").read_text()
    assert "local rank 2: " in creator and "the ranks built different models" in creator, creator


def test_single_rank_shares_nothing():
    assert SharedEngramTables.for_layout(ParallelLayout()) is None
    # two nodes of one rank each: every rank is alone on its host
    assert SharedEngramTables.for_layout(ParallelLayout(rank=1, cp=2, nnodes=2)) is None
    with pytest.raises(ValueError, match="nothing to share"):
        SharedEngramTables(ParallelLayout(), store=object())
