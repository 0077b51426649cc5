"""/dev/shm segments that name their creator, and the sweep of leftovers whose creator died
(distributed/shm_owner.py): only a dead creator's segment older than the grace period goes; a live
creator's, a young one and a name that is not ours stay."""
import os
import subprocess
import sys
import time

from deepinfer.distributed import shm_owner
from deepinfer.distributed.step_ring import NAME_PREFIX, StepRing

PREFIX = "deepinfer-test-sweep-"


def _dead_process() -> tuple[int, int]:
    """(pid, start) of a process that ran and exited."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    start = shm_owner.process_start(child.pid)
    child.kill()
    child.wait()
    assert start is not None and shm_owner.process_start(child.pid) is None
    return child.pid, start


def _segment(tmp_path, name: str, age_s: float) -> str:
    path = tmp_path / name
    path.write_bytes(b"x" * 64)
    t = time.time() - age_s
    os.utime(path, (t, t))
    return name


def test_a_name_says_its_creator_and_whether_it_runs():
    name = shm_owner.owned_name(PREFIX)
    assert name.startswith(PREFIX) and shm_owner.creator_alive(name, PREFIX) is True
    pid, start = _dead_process()
    assert shm_owner.creator_alive(f"{PREFIX}p{pid}s{start}-00ff", PREFIX) is False
    # our pid with another start time: a reused pid, not the creator
    assert shm_owner.creator_alive(f"{PREFIX}p{os.getpid()}s1-00ff", PREFIX) is False
    assert shm_owner.creator_alive(f"{PREFIX}0123456789abcdef", PREFIX) is None   # not an owned name
    assert shm_owner.creator_alive("something-else", PREFIX) is None


def test_sweep_removes_only_old_segments_of_dead_creators(tmp_path):
    pid, start = _dead_process()
    dead_old = _segment(tmp_path, f"{PREFIX}p{pid}s{start}-aa", age_s=600)
    dead_young = _segment(tmp_path, f"{PREFIX}p{pid}s{start}-bb", age_s=1)
    live_old = _segment(tmp_path, shm_owner.owned_name(PREFIX), age_s=600)
    foreign_old = _segment(tmp_path, f"{PREFIX}0123456789abcdef", age_s=600)
    other_kind = _segment(tmp_path, f"other-p{pid}s{start}-cc", age_s=600)
    assert shm_owner.sweep_stale(PREFIX, stale_after_s=60, shm_dir=str(tmp_path)) == [dead_old]
    assert sorted(os.listdir(tmp_path)) == sorted([dead_young, live_old, foreign_old, other_kind])
    assert shm_owner.sweep_stale(PREFIX, stale_after_s=60, shm_dir=str(tmp_path)) == []


def test_a_new_ring_sweeps_the_leftover_of_a_killed_creator():
    """A ring whose creator was killed before any reader unlinked it: the next ring created on the host
    removes it (once it is older than the grace period), and names its own creator."""
    pid, start = _dead_process()
    path = os.path.join(shm_owner.SHM_DIR, f"{NAME_PREFIX}p{pid}s{start}-deadbeefdeadbeef")
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    old = time.time() - 2 * shm_owner.STALE_AFTER_S
    os.utime(path, (old, old))
    ring = StepRing.create(num_slots=2, slot_size=64, num_readers=1)
    try:
        assert not os.path.exists(path)
        assert shm_owner.creator_alive(ring.name, NAME_PREFIX) is True
    finally:
        ring.unlink()
        ring.close()
        if os.path.exists(path):
            os.unlink(path)


def test_without_proc_nothing_is_swept(tmp_path, monkeypatch):
    pid, start = _dead_process()
    name = _segment(tmp_path, f"{PREFIX}p{pid}s{start}-aa", age_s=600)
    monkeypatch.setattr(shm_owner, "process_start", lambda pid: None)   # a host without /proc
    assert shm_owner.sweep_stale(PREFIX, stale_after_s=60, shm_dir=str(tmp_path)) == []
    assert os.listdir(tmp_path) == [name]
