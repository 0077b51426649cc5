"""Faults of a model on several ranks (executor/local_ranks.py): a follower killed mid-generation, the driver
killed, a follower host that cannot start. Real processes; /dev/shm is checked after every test
(conftest.no_ring_segment_left)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.distributed.launch import free_port
from deepinfer.executor.local_ranks import RankFailure
from tests.support.processes import alive, child_env, signal_after_steps, wait_gone

ENGINE = dict(max_model_len=256, max_num_seqs=2, max_num_batched_tokens=64, num_kv_blocks=40,
              enforce_eager=True, skip_tokenizer_init=True, dtype="float32")
LONG = SamplingParams(max_tokens=240, ignore_eos=True)


def test_follower_killed_mid_generation(tiny_v4_dir):
    """ep=2: two data-parallel groups, so the driver waits in the logits all-gather every step when
    the follower dies; the step raises RankFailure naming rank 1 within 10 s."""
    llm = LLM(str(tiny_v4_dir), **ENGINE, expert_parallel_size=2)
    worker = llm.llm_engine.worker
    pid = llm.llm_engine.executor.ranks.pids[1]
    killer, killed = signal_after_steps(worker, pid, signal.SIGKILL)
    try:
        with pytest.raises(RankFailure, match=r"rank 1 \(pid \d+\) was killed by SIGKILL"):
            llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}], LONG, use_tqdm=False)
        assert time.monotonic() - killed[0] < 10
        # the engine is dead, and says so at once on the next step
        with pytest.raises(RankFailure):
            llm.generate({"prompt_token_ids": [5]}, SamplingParams(max_tokens=1), use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()   # the failed requests were aborted
    finally:
        killer.join()
        llm.close()
    assert not alive(pid)


DRIVER = """
import atexit, os, sys
from deepinfer import LLM, SamplingParams
followers = []
# registered before the engine's own handler, so it runs after it (atexit is last in, first out)
atexit.register(lambda: print("AT_EXIT_RUNNING", [p for p in followers if os.path.exists(f"/proc/{p}")], flush=True))
llm = LLM(sys.argv[1], max_model_len=256, max_num_seqs=2, max_num_batched_tokens=64, num_kv_blocks=40,
          enforce_eager=True, skip_tokenizer_init=True, dtype="float32", context_parallel_size=2)
followers += llm.llm_engine.executor.ranks.pids.values()
print("FOLLOWERS", *followers, flush=True)
while True:
    llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=200, ignore_eos=True), use_tqdm=False)
    if sys.argv[2] == "once":
        break   # exit without llm.close(): atexit stops the followers
"""


def _start_driver(model, mode: str):
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(model), mode], env=child_env(), stdout=subprocess.PIPE,
                            text=True)
    line = proc.stdout.readline()
    assert line.startswith("FOLLOWERS"), line
    followers = [int(p) for p in line.split()[1:]]
    assert len(followers) == 1 and all(alive(p) for p in followers)
    return proc, followers


def test_driver_killed_followers_exit(tiny_v4_dir):
    proc, followers = _start_driver(tiny_v4_dir, "loop")
    try:
        time.sleep(1.0)   # generating
        proc.kill()
        proc.wait()
        assert wait_gone(followers, 10.0) < 10.0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_exit_without_close_stops_followers(tiny_v4_dir):
    proc, followers = _start_driver(tiny_v4_dir, "once")
    try:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0
        assert "AT_EXIT_RUNNING []" in out   # the engine's atexit close stopped and reaped them
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_follower_host_with_a_missing_checkpoint_fails_the_start(tiny_v4_dir, tmp_path):
    """Host 1 (`deepinfer follow`) names a checkpoint that is not there: the driver's LLM(...) fails
    with that host's error, and host 1 exits."""
    port = free_port()
    missing = tmp_path / "no-such-checkpoint"
    node1 = subprocess.Popen([sys.executable, "-m", "deepinfer.cli", "follow", "--model", str(missing),
                              "--expert-parallel-size", "2", "--nnodes", "2", "--node-rank", "1",
                              "--master-port", str(port)], env=child_env(), stderr=subprocess.DEVNULL)
    try:
        t0 = time.monotonic()
        with pytest.raises(RankFailure, match=r"(?s)rank 1 failed:.*no-such-checkpoint"):
            LLM(str(tiny_v4_dir), **ENGINE, expert_parallel_size=2, nnodes=2, master_port=port)
        assert time.monotonic() - t0 < 60
        assert node1.wait(20) == 1
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def test_follower_killed_while_the_driver_waits_for_the_engram_tables(tiny_v41_dir, monkeypatch):
    """ep 2 on one host: the driver creates the shared Engram tables and waits for rank 1 to reach and
    map them; rank 1 is SIGKILLed then (no chance to say why). The rank watchdog sees the death and the
    wait ends with a RankFailure naming rank 1, not after the tables' 900 s timeout; nothing is left."""
    from deepinfer.distributed.shared_tables import SharedEngramTables
    real, killed = SharedEngramTables._wait_count, []

    def wait_count(self, key, want, what):
        if not killed:
            for pid in _children():
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        return real(self, key, want, what)
    monkeypatch.setattr(SharedEngramTables, "_wait_count", wait_count)
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 \(pid \d+\) was killed by SIGKILL"):
        LLM(str(tiny_v41_dir), **ENGINE, expert_parallel_size=2)
    assert killed and time.monotonic() - t0 < 120
    assert not any(alive(p) for p in killed)


def _children() -> list[int]:
    """Pids of this process's live child processes (the engine's followers)."""
    me, out = str(os.getpid()), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == me and fields[0] != "Z":
                out.append(int(entry))
    return out


def test_a_follower_on_another_platform_fails_the_start(tiny_v4_dir, monkeypatch):
    """The driver resolved its platform (Neuron host mode) before the environment went back to CPU, so
    its followers start on another platform: they would load other weights and run other graphs. The
    first follower stops at start-up and LLM(...) fails naming the difference, instead of meeting the
    driver in mismatched collectives."""
    from deepinfer.platforms import current_platform, reset_platform
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "neuron")
    monkeypatch.setenv("DEEPINFER_NEURON_HOST", "1")
    reset_platform()
    try:
        assert current_platform().name == "neuron"          # resolved now, kept by this process
        monkeypatch.setenv("DEEPINFER_ACCELERATOR", "cpu")    # what the followers will see
        t0 = time.monotonic()
        with pytest.raises(RankFailure, match=r"(?s)rank 1 runs another platform setup than the driver.*"
                                              r"platform: driver 'neuron', this rank 'cpu'"):
            LLM(str(tiny_v4_dir), **ENGINE, context_parallel_size=2)
        assert time.monotonic() - t0 < 60
    finally:
        reset_platform()
