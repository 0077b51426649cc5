"""A lost rank is seen at once, step or no step (executor/local_ranks.py watchdog, executor/rank_liveness.py),
and the server says so: 503 naming the rank and the cause on /health and every endpoint but /metrics,
every request ended, then the --on-rank-failure policy (exit: code 1; serve-503: stays up).

Real processes on the cpu platform: `python -m deepinfer.serve` with cp = ep = 2 (the driver and one follower),
the follower SIGKILLed or SIGSTOPped idle and under load; the offline LLM the same way. Every wait is
bounded, every process reaped, and conftest checks no /dev/shm segment is left. The detection
latencies are printed (run with -s to read them).
"""
from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.distributed.launch import free_port
from deepinfer.executor.rank_liveness import StepClock, exit_text, process_state, silent_follower
from deepinfer.executor.local_ranks import RankFailure
from tests.support.processes import alive, child_env, signal_after_steps, wait_gone
from tests.support.server import MODEL_NAME, ServerProcess, metric_values, parse_sse

DETECT_S = 2.0          # a dead follower is seen within this, idle or not
HANG_TIMEOUT_S = 3      # --rank-step-timeout of the hang tests
EXIT_WAIT_S = 60.0      # the exit policy: the server is gone within this
CLIENT_WAIT_S = 90.0    # every client call ends within this
ENGINE = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=40,
              enforce_eager=True, skip_tokenizer_init=True, dtype="float32")


# ---- the pieces the watchdog reads ------------------------------------------------------------------
def test_exit_text_step_clock_and_the_silent_follower_named():
    assert exit_text(-9) == "was killed by SIGKILL" and exit_text(3) == "exited with status 3"
    clock = StepClock()
    assert clock.overdue(0.05) is None
    clock.begin()
    time.sleep(0.1)
    assert clock.overdue(0.05) > 0.05 and clock.overdue(0) is None and clock.overdue(10) is None
    clock.end()
    assert clock.overdue(0.05) is None

    procs = {r: subprocess.Popen(["sleep", "30"]) for r in (1, 2, 3)}
    try:
        # a reader that has not read the step is named first; else a stopped process
        assert silent_follower(procs, [1], 0) == (2, "it has not read the step")
        os.kill(procs[3].pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while process_state(procs[3].pid) not in ("T", "t") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert silent_follower(procs, [], 0) == (3, "its process is stopped")
        procs[3].kill()
        procs[3].wait(5)
        rank, why = silent_follower(procs, [], 0)
        assert rank == 1 and "first one still running" in why
        assert silent_follower(procs, [], 0, guess=False) is None   # with other hosts: no guess
    finally:
        for p in procs.values():
            p.kill()
            p.wait(5)
    assert silent_follower(procs, [0], 0) is None


def test_host_links_see_a_host_go_and_the_ring_its_lagging_reader():
    from deepinfer.distributed import host_links
    from deepinfer.distributed.step_ring import StepRing
    links = host_links.HostLinks("127.0.0.1")
    try:
        one, two = (host_links.connect("127.0.0.1", links.port, node) for node in (1, 2))
        deadline = time.monotonic() + 5
        while links.nodes != {1, 2} and time.monotonic() < deadline:
            assert links.lost() == []
            time.sleep(0.01)
        assert links.nodes == {1, 2}
        two.close()   # what the kernel does for a process that dies
        lost = []
        while not lost and time.monotonic() < deadline:
            lost = links.lost()
            time.sleep(0.01)
        assert lost == [2] and links.lost() == []
        one.close()
    finally:
        links.close()

    ring = StepRing.create(4, 64, 2)
    readers = [StepRing.open(ring.name, ring.size, i) for i in range(2)]
    try:
        assert ring.lagging_readers() == []
        ring.write(3, [(0, memoryview(b"abc"))])
        assert ring.lagging_readers() == [0, 1]
        assert readers[1].read() == b"abc"
        assert ring.lagging_readers() == [0]
    finally:
        for r in readers:
            r.close()
        ring.close()


def test_rank_step_timeout_defaults_to_its_env_var(monkeypatch):
    from deepinfer.engine_config import EngineConfig
    monkeypatch.delenv("DEEPINFER_RANK_STEP_TIMEOUT", raising=False)
    assert EngineConfig(model="m").rank_step_timeout == 600
    monkeypatch.setenv("DEEPINFER_RANK_STEP_TIMEOUT", "0")
    assert EngineConfig(model="m").rank_step_timeout == 0   # wait forever
    monkeypatch.setenv("DEEPINFER_RANK_STEP_TIMEOUT", "45")
    assert EngineConfig(model="m").rank_step_timeout == 45 and EngineConfig(model="m", rank_step_timeout=5).rank_step_timeout == 5
    with pytest.raises(ValueError, match="rank_step_timeout must be an integer >= 0"):
        EngineConfig(model="m", rank_step_timeout=-1)
    monkeypatch.setenv("DEEPINFER_RANK_STEP_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="DEEPINFER_RANK_STEP_TIMEOUT must be an integer"):
        EngineConfig(model="m")


# ---- the offline LLM ------------------------------------------------------------------------------
def _wait_failed(ranks, t0: float, limit_s: float) -> float:
    while ranks.failed is None:
        if time.monotonic() - t0 > limit_s:
            raise AssertionError(f"no rank failure recorded within {limit_s} s")
        time.sleep(0.01)
    return time.monotonic() - t0


def test_llm_follower_killed_while_idle(tiny_v4_dir):
    """Nothing runs when the follower dies: the watchdog records it within 2 s, and the next call raises
    RankFailure naming the rank at once, leaving no request, block or slot."""
    with LLM(str(tiny_v4_dir), **ENGINE, expert_parallel_size=2) as llm:
        engine = llm.llm_engine
        llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3), use_tqdm=False)
        pid = engine.executor.ranks.pids[1]
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        seen = _wait_failed(engine.executor.ranks, t0, DETECT_S)
        print(f"\nLLM idle SIGKILL: recorded after {seen:.3f} s")
        for _ in range(2):   # this call and the next one
            t1 = time.monotonic()
            with pytest.raises(RankFailure, match=r"rank 1 \(pid \d+\) was killed by SIGKILL") as e:
                llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7]}], SamplingParams(max_tokens=5),
                             use_tqdm=False)
            assert time.monotonic() - t1 < 1.0
            assert e.value.rank == 1 and e.value.cause == "was killed by SIGKILL"
        stats = engine.stats()
        assert (stats.num_running, stats.num_waiting, stats.num_used_blocks, stats.num_used_state_slots) == (0, 0, 0, 0)
    assert not alive(pid)


def test_llm_follower_stopped_mid_generation_is_named_hung(tiny_v4_dir):
    """SIGSTOP while a generate runs: the step outlives rank_step_timeout, the watchdog names the rank and
    kills it, so the driver's collective ends and the call raises RankFailure; so does the next one."""
    llm = LLM(str(tiny_v4_dir), **ENGINE, expert_parallel_size=2, rank_step_timeout=HANG_TIMEOUT_S)
    worker = llm.llm_engine.worker
    pid = llm.llm_engine.executor.ranks.pids[1]
    stopper, stopped = signal_after_steps(worker, pid, signal.SIGSTOP)
    try:
        with pytest.raises(RankFailure, match=rf"rank 1 \(pid {pid}\) hung: did not answer a step within "
                                              rf"{HANG_TIMEOUT_S} s") as e:
            llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=240, ignore_eos=True),
                         use_tqdm=False)
        took = time.monotonic() - stopped[0]
        print(f"\nLLM SIGSTOP mid-generation: RankFailure after {took:.3f} s (timeout {HANG_TIMEOUT_S} s)")
        assert HANG_TIMEOUT_S <= took < HANG_TIMEOUT_S + DETECT_S
        assert e.value.rank == 1 and e.value.cause.startswith("hung")
        with pytest.raises(RankFailure, match="hung"):
            llm.generate({"prompt_token_ids": [5]}, SamplingParams(max_tokens=1), use_tqdm=False)
        assert llm.llm_engine.stats().num_used_blocks == 0
    finally:
        stopper.join()
        llm.close()
    assert not alive(pid)


def _other_host(model, port: int, ep: int = 2) -> subprocess.Popen:
    """`deepinfer follow` as host 1 of two on localhost (ep / 2 ranks a host)."""
    return subprocess.Popen([sys.executable, "-m", "deepinfer.cli", "follow", "--model", str(model),
                             "--expert-parallel-size", str(ep), "--nnodes", "2", "--node-rank", "1",
                             "--master-addr", "127.0.0.1", "--master-port", str(port)], env=child_env())


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(p) for p in f.read().split()]
    return out


def test_llm_follower_on_other_host_killed_while_idle(tiny_v4_dir):
    """ep=4 over two hosts: rank 3 (a follower `deepinfer follow` started on host 1) SIGKILLed while
    nothing runs. Host 1 reports it in the store and exits; the driver names rank 3 within 2 s."""
    port = free_port()
    node1 = _other_host(tiny_v4_dir, port, ep=4)
    try:
        with LLM(str(tiny_v4_dir), **ENGINE, expert_parallel_size=4, nnodes=2, master_port=port) as llm:
            llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3), use_tqdm=False)
            rank3 = _children(node1.pid)
            assert len(rank3) == 1, rank3
            t0 = time.monotonic()
            os.kill(rank3[0], signal.SIGKILL)
            seen = _wait_failed(llm.llm_engine.executor.ranks, t0, DETECT_S)
            print(f"\nfollower on the other host SIGKILL while idle: recorded after {seen:.3f} s")
            with pytest.raises(RankFailure, match=r"rank 3 failed:\s+rank 3 on host 1 was killed by SIGKILL") as e:
                llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=5), use_tqdm=False)
            assert e.value.rank == 3
        assert node1.wait(30) == 1   # host 1 went down with its rank
    finally:
        if node1.poll() is None:
            node1.kill()
        node1.wait(30)
    assert not alive(rank3[0])


def test_llm_other_host_killed_while_idle(tiny_v4_dir):
    """Two "hosts" on localhost (ep=2, one rank each): `deepinfer follow` SIGKILLed while nothing runs.
    Its link to the driver closes (distributed/host_links.py), so the driver names rank 1 within 2 s, and
    the next call raises at once."""
    port = free_port()
    node1 = _other_host(tiny_v4_dir, port)
    try:
        with LLM(str(tiny_v4_dir), **ENGINE, expert_parallel_size=2, nnodes=2, master_port=port) as llm:
            llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3), use_tqdm=False)
            t0 = time.monotonic()
            node1.kill()
            seen = _wait_failed(llm.llm_engine.executor.ranks, t0, DETECT_S)
            print(f"\nother host SIGKILL while idle: recorded after {seen:.3f} s")
            t1 = time.monotonic()
            with pytest.raises(RankFailure, match=r"rank 1 \(`deepinfer follow` on host 1\) is gone") as e:
                llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=5), use_tqdm=False)
            assert time.monotonic() - t1 < 1.0 and e.value.rank == 1
            assert llm.llm_engine.stats().num_used_blocks == 0
    finally:
        if node1.poll() is None:
            node1.kill()
        node1.wait(30)


def test_llm_other_host_frozen_mid_generation(tiny_v4_dir):
    """SIGSTOP `deepinfer follow` (host 1) mid-generation: it can neither answer nor obey the stop word.
    The watchdog names the hang at the rank step timeout; the driver's collective gives up at its own
    timeout (rank_liveness.bound_collectives), so the call raises RankFailure instead of waiting."""
    from deepinfer.executor.rank_liveness import COLLECTIVE_GRACE_S
    port = free_port()
    node1 = _other_host(tiny_v4_dir, port)
    try:
        with LLM(str(tiny_v4_dir), **ENGINE, expert_parallel_size=2, nnodes=2, master_port=port,
                 rank_step_timeout=HANG_TIMEOUT_S) as llm:
            worker = llm.llm_engine.worker
            stopper, stopped = signal_after_steps(worker, node1.pid, signal.SIGSTOP)
            try:
                with pytest.raises(RankFailure, match=rf"no answer to a step within {HANG_TIMEOUT_S} s from a rank "
                                                      r"on another host"):
                    llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=240, ignore_eos=True),
                                 use_tqdm=False)
            finally:
                stopper.join()
            took = time.monotonic() - stopped[0]
            print(f"\nother host SIGSTOP mid-generation: RankFailure after {took:.3f} s "
                  f"(timeout {HANG_TIMEOUT_S} s + collective grace {COLLECTIVE_GRACE_S} s)")
            assert took < HANG_TIMEOUT_S + COLLECTIVE_GRACE_S + DETECT_S
            with pytest.raises(RankFailure, match="another host"):
                llm.generate({"prompt_token_ids": [5]}, SamplingParams(max_tokens=1), use_tqdm=False)
            assert llm.llm_engine.stats().num_used_blocks == 0
    finally:
        node1.kill()   # SIGKILL ends a stopped process too
        node1.wait(30)


# ---- the engine loop over a fake engine ----------------------------------------------------------
class _IdleLostRankEngine:
    """Idle until the test calls lose(): then, as a multi-rank LLMEngine, it calls its rank watcher
    (from another thread, as the watchdog does) and check_ranks raises after failing its requests."""

    def __init__(self):
        from tests.support.fake_engine import FakeEngine
        self._fake = FakeEngine()
        self.failure = None
        self._watchers = []

    def __getattr__(self, name):
        return getattr(self._fake, name)

    def watch_ranks(self, callback):
        self._watchers.append(callback)

    def lose(self):
        self.failure = RankFailure("a rank of the model failed: rank 3 (pid 42) was killed by SIGKILL", 3,
                                   "was killed by SIGKILL")
        threading.Thread(target=lambda: [cb(self.failure) for cb in self._watchers]).start()

    def check_ranks(self):
        if self.failure is not None:
            for rid in list(self._fake.requests):
                self._fake.abort_request(rid)
            raise self.failure


@pytest.mark.parametrize("policy", ["exit", "serve-503"])
def test_engine_loop_idle_rank_loss_fails_every_request_and_applies_the_policy(policy):
    from deepinfer.serve.engine_loop import EngineLoop
    from deepinfer.serve.errors import APIError
    from deepinfer.serve.generation import EnginePrompt, Generation
    from deepinfer.serve.metrics import ServerMetrics

    async def scenario():
        loop = EngineLoop(_IdleLostRankEngine, ServerMetrics(), on_rank_failure=policy)
        fatal = []
        loop.on_fatal = fatal.append
        loop.start(asyncio.get_running_loop())
        while not loop.ready:
            await asyncio.sleep(0.01)
        gen = Generation(loop, "r", [EnginePrompt([1, 2], None)], [SamplingParams(max_tokens=10**6)])
        await gen.start()
        t0 = time.monotonic()
        loop.engine.lose()
        with pytest.raises(APIError) as e:
            await asyncio.wait_for(gen.collect(), 10)
        took = time.monotonic() - t0
        assert e.value.status == 503 and "rank 3" in e.value.message and "SIGKILL" in e.value.message
        assert loop.dead and loop.engine.requests == {} and took < DETECT_S
        with pytest.raises(APIError) as e:
            loop.check_available()
        assert e.value.status == 503 and "rank 3" in e.value.message
        for _ in range(100):
            if fatal or policy != "exit":
                break
            await asyncio.sleep(0.01)
        assert fatal == (["the engine lost a rank: a rank of the model failed: rank 3 (pid 42) was killed by "
                          "SIGKILL"] if policy == "exit" else [])
        page = metric_values(loop.metrics.exposition("m", None, True, True).decode())
        assert page['deepinfer:rank_failures_total{rank="3"}'] == 1
        loop.stop()
    asyncio.run(scenario())


# ---- the server -----------------------------------------------------------------------------------
def _server(model_dir, policy: str, *extra: str) -> ServerProcess:
    srv = ServerProcess(model_dir, "--context-parallel-size", "2", "--expert-parallel-size", "2",
                        "--enforce-eager", "--on-rank-failure", policy, *extra, api_key=None)
    srv.wait_ready()
    return srv


def _health_down_after(srv: ServerProcess, t0: float, limit_s: float) -> tuple[float, int | None, dict | None]:
    """Seconds from t0 until /health is not 200 (503, or no answer: the server is shutting down), its
    status and body (None without an answer)."""
    while True:
        try:
            r = httpx.get(srv.base + "/health", timeout=1.0)
            if r.status_code != 200:
                return time.monotonic() - t0, r.status_code, r.json()
        except httpx.ConnectError:   # the port is closed: the exit policy is under way
            return time.monotonic() - t0, None, None
        if time.monotonic() - t0 > limit_s:
            raise AssertionError(f"/health still 200 after {limit_s} s:\n{srv.read_log()}")
        time.sleep(0.02)


async def _one_request(base: str, i: int, stream: bool, started: asyncio.Event) -> tuple[str, object]:
    """One long completion; ('ok', text) or ('error', error body) as the client saw it."""
    body = {"model": MODEL_NAME, "prompt": [5, 6, 7 + i], "max_tokens": 200, "ignore_eos": True,
            "temperature": 0, "stream": stream}
    async with httpx.AsyncClient(timeout=CLIENT_WAIT_S) as c:
        if not stream:
            r = await c.post(base + "/v1/completions", json=body)
            return ("ok", r.json()) if r.status_code == 200 else ("error", (r.status_code, r.json()))
        async with c.stream("POST", base + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return "error", (r.status_code, await r.aread())
            raw = ""
            async for chunk in r.aiter_text():
                raw += chunk
                if "data: {" in raw:
                    started.set()
            events, _ = parse_sse(raw)
            errors = [e for e in events if "error" in e]
            return ("error", (errors[-1]["error"]["code"], errors[-1])) if errors else ("ok", events)


def _under_load(srv: ServerProcess, act, limit_s: float, requests: int = 6, wait_tokens: bool = True):
    """`requests` long requests (every other one streamed); once tokens flow (unless not wait_tokens),
    act() (the fault), then /health watched while every request ends. Returns the results and
    _health_down_after's (seconds, status, body), counted from act()."""
    async def scenario():
        started = asyncio.Event()
        tasks = [asyncio.create_task(_one_request(srv.base, i, i % 2 == 0, started)) for i in range(requests)]
        if tasks and wait_tokens:
            await asyncio.wait_for(started.wait(), 120)
        t0 = time.monotonic()
        await asyncio.to_thread(act)
        health = asyncio.create_task(asyncio.to_thread(_health_down_after, srv, t0, limit_s))
        results = await asyncio.wait_for(asyncio.gather(*tasks), CLIENT_WAIT_S)
        return results, await health
    return asyncio.run(scenario())


def _assert_all_failed_naming(results, pattern: str) -> None:
    assert results and all(kind == "error" for kind, _ in results), results
    for _, (status, body) in results:
        assert status == 503, (status, body)
        assert re.search(pattern, body["error"]["message"]), body
        assert body["error"]["type"] == "ServiceUnavailableError" and body["error"]["code"] == 503


def _assert_serving_503(srv: ServerProcess, pattern: str) -> None:
    """serve-503: up, answering 503 naming the rank on /health and the API, counting the failure, no
    request, block or slot held."""
    for method, path, body in (("GET", "/health", None), ("GET", "/v1/models", None),
                               ("POST", "/v1/completions", {"model": MODEL_NAME, "prompt": [5], "max_tokens": 1}),
                               ("POST", "/v1/chat/completions",
                                {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]})):
        r = httpx.request(method, srv.base + path, json=body, timeout=10)
        assert r.status_code == 503, (path, r.status_code, r.text)
        assert re.search(pattern, r.json()["error"]["message"]), (path, r.text)
    m = metric_values(httpx.get(srv.base + "/metrics", timeout=10).text)
    assert m['deepinfer:rank_failures_total{rank="1"}'] == 1
    assert m["deepinfer:engine_ready"] == 0
    assert (m["deepinfer:num_requests_running"], m["deepinfer:num_requests_waiting"],
            m["deepinfer:kv_blocks_used"]) == (0, 0, 0)


def _finish(srv: ServerProcess, followers: list[int], policy: str) -> int:
    """The exit code: exit policy, the server's own; serve-503, after SIGTERM. Followers gone either way."""
    if policy == "exit":
        try:
            rc = srv.proc.wait(EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            srv.terminate()
            raise AssertionError(f"the exit policy did not exit within {EXIT_WAIT_S} s:\n{srv.read_log()}")
    else:
        rc = srv.terminate()
    wait_gone(followers, 10.0)
    return rc


def _check_failed(srv, followers, policy, results, status, body, cause: str) -> int:
    """/health's answer (when it had one) and every request's error name the rank and `cause`; under
    serve-503 the server keeps answering so. Returns _finish's exit code."""
    if status is not None:
        assert status == 503 and re.search(cause, body["error"]["message"]), body
    if results:
        _assert_all_failed_naming(results, cause)
    if policy == "serve-503":
        _assert_serving_503(srv, cause)
    return _finish(srv, followers, policy)


@pytest.mark.parametrize("policy", ["exit", "serve-503"])
@pytest.mark.parametrize("when", ["idle", "load"])
def test_server_follower_killed(tiny_v4_dir, when, policy):
    srv = _server(tiny_v4_dir, policy)
    try:
        followers = srv.child_pids()
        assert len(followers) == 1, followers
        results, (down_s, status, body) = _under_load(
            srv, lambda: os.kill(followers[0], signal.SIGKILL), DETECT_S + 5, 6 if when == "load" else 0)
        print(f"\nserver {when} SIGKILL, {policy}: /health {status} after {down_s:.3f} s")
        assert down_s < DETECT_S, srv.read_log()
        rc = _check_failed(srv, followers, policy, results, status, body, r"rank 1 \(pid \d+\) was killed by SIGKILL")
    finally:
        srv.terminate()
    log = srv.read_log()
    assert rc == (1 if policy == "exit" else 0), log
    # the engine's line: which rank, how, how many requests it failed (those it had taken)
    failed = re.search(r"rank 1 lost \(was killed by SIGKILL\): (\d+) request\(s\) failed", log)
    assert failed, log
    assert (1 <= int(failed[1]) <= 6) if when == "load" else int(failed[1]) == 0


@pytest.mark.parametrize("when, policy", [("idle", "serve-503"), ("load", "exit")])
def test_server_follower_stopped_is_named_hung(tiny_v4_dir, when, policy):
    """SIGSTOP: alive but silent. Idle, the next request's step outlives the timeout; under load, the
    running step does. Either way the rank is named hung and killed within the timeout (plus the poll)."""
    srv = _server(tiny_v4_dir, policy, "--rank-step-timeout", str(HANG_TIMEOUT_S))
    try:
        followers = srv.child_pids()
        stop = lambda: os.kill(followers[0], signal.SIGSTOP)  # noqa: E731
        limit = HANG_TIMEOUT_S + DETECT_S + 5
        if when == "idle":
            stop()
            time.sleep(1.0)   # nothing asks the follower anything: the server stays healthy
            assert httpx.get(srv.base + "/health", timeout=5).status_code == 200
            # the request's first step is the one the stopped follower never answers
            results, (down_s, status, body) = _under_load(srv, lambda: None, limit, 1, wait_tokens=False)
        else:
            results, (down_s, status, body) = _under_load(srv, stop, limit)
        print(f"\nserver {when} SIGSTOP, {policy}: /health {status} after {down_s:.3f} s "
              f"(timeout {HANG_TIMEOUT_S} s)")
        assert down_s < HANG_TIMEOUT_S + DETECT_S, srv.read_log()
        hung = rf"rank 1 \(pid {followers[0]}\) hung: did not answer a step within {HANG_TIMEOUT_S} s"
        assert results
        rc = _check_failed(srv, followers, policy, results, status, body, hung)
    finally:
        srv.terminate()
    assert rc == (1 if policy == "exit" else 0), srv.read_log()
