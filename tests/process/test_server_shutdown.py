"""SIGTERM with requests in flight: the server stops taking requests, lets the short ones finish,
aborts the long ones at --shutdown-timeout (finish_reason "abort", then [DONE]) and exits 0
leaving no child process."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from tests.support.server import API_KEY, MODEL_NAME, ServerProcess, model_dir_fixture, parse_sse

SHUTDOWN_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def model_dir(request, tmp_path_factory):
    return model_dir_fixture(request, tmp_path_factory)


def test_sigterm_drains_then_aborts_and_exits_cleanly(model_dir):
    server = ServerProcess(model_dir, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S))
    try:
        server.wait_ready()
        children_before = server.child_pids()

        async def scenario():
            started = {"short": asyncio.Event(), "long": asyncio.Event()}

            async def stream(kind: str, max_tokens: int):
                async with httpx.AsyncClient(timeout=120) as c:
                    async with c.stream("POST", server.base + "/v1/completions",
                                        headers={"Authorization": f"Bearer {API_KEY}"},
                                        json={"model": MODEL_NAME, "prompt": f"{kind} request",
                                              "max_tokens": max_tokens, "temperature": 0,
                                              "ignore_eos": True, "stream": True}) as r:
                        raw = ""
                        async for chunk in r.aiter_text():
                            raw += chunk
                            if "data: {" in raw:
                                started[kind].set()
                        return parse_sse(raw)

            tasks = [asyncio.create_task(stream("short", 3)),
                     asyncio.create_task(stream("long", 200)),
                     asyncio.create_task(stream("long", 200))]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started.values())), 60)
            t_signal = time.monotonic()
            os.kill(server.proc.pid, signal.SIGTERM)
            await asyncio.sleep(0.5)
            # A new connection is refused (or told 503) once draining started.
            try:
                async with httpx.AsyncClient(timeout=10) as c:
                    r = await c.post(server.base + "/v1/completions", headers=server.headers,
                                     json={"model": MODEL_NAME, "prompt": "late", "max_tokens": 1})
                late = r.status_code
            except httpx.TransportError:
                late = "refused"
            results = await asyncio.gather(*tasks)
            return results, late, time.monotonic() - t_signal

        (short, long_a, long_b), late, drained_s = asyncio.run(scenario())
        rc = server.proc.wait(timeout=30)
    finally:
        server.terminate()

    assert late in ("refused", 503)
    events, done = short
    assert done and [e["choices"][0]["finish_reason"] for e in events][-1] == "length"
    for events, done in (long_a, long_b):
        assert done, "an aborted stream still ends with [DONE]"
        reasons = [e["choices"][0]["finish_reason"] for e in events if e.get("choices")]
        assert reasons[-1] == "abort"
        assert len(events) < 200
    assert drained_s < SHUTDOWN_TIMEOUT_S + 15
    assert rc == 0, server.read_log()
    for pid in children_before:
        assert not os.path.exists(f"/proc/{pid}"), f"child process {pid} outlived the server"
    assert not _processes_mentioning(f"--port {server.port}"), "a server process is still alive"


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(int(entry))
    return found


def test_bad_arguments_and_unloadable_model_exit_nonzero(tmp_path):
    bad_args = ServerProcess(tmp_path, "--max-num-seqs", "0")
    assert bad_args.proc.wait(timeout=60) == 2, bad_args.read_log()
    assert "max_num_seqs" in bad_args.read_log()
    # An empty directory: the engine thread fails to load it, /health never turns 200, exit 1.
    no_model = ServerProcess(tmp_path)
    try:
        with pytest.raises(RuntimeError, match="exited with 1"):
            no_model.wait_ready(timeout_s=120)
        assert 200 not in no_model.health_statuses
    finally:
        no_model.terminate()
