"""EngineLoop and the app over a scripted fake engine: failures stay contained, the loop survives,
/health follows the engine's life. (The real engine is covered by tests/process/test_server.py.)"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from deepinfer.serve.app import build_app
from deepinfer.serve.engine_loop import MAX_CONSECUTIVE_STEP_ERRORS, EngineLoop
from deepinfer.serve.errors import APIError
from deepinfer.serve.generation import EnginePrompt, Generation
from deepinfer.serve.metrics import ServerMetrics
from deepinfer.serve.state import ServerConfig, ServerState

from tests.support.fake_engine import POISON, FakeEngine


def _params(max_tokens):
    from deepinfer.sampling_params import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


async def _started_loop(factory=FakeEngine) -> EngineLoop:
    loop = EngineLoop(factory, ServerMetrics())
    loop.start(asyncio.get_running_loop())
    for _ in range(200):
        if loop.ready or loop.dead:
            break
        await asyncio.sleep(0.01)
    return loop


async def _generate(loop, name, ids, max_tokens=3):
    gen = Generation(loop, name, [EnginePrompt(ids, None)], [_params(max_tokens)])
    try:
        await gen.start()
        return await gen.collect()
    finally:
        gen.abort()


def test_step_error_fails_its_batch_and_the_loop_keeps_serving():
    async def scenario():
        loop = await _started_loop()
        try:
            with pytest.raises(APIError) as e:
                await _generate(loop, "bad", [1, POISON])
            assert e.value.status == 500 and "kernel exploded" in e.value.message
            out = (await _generate(loop, "good", [1, 2], max_tokens=3))[0]
            assert out.outputs[0].token_ids == [10, 11, 12]
            assert not loop.dead and loop.metrics.num_step_errors == 1
            assert loop.engine.requests == {}
        finally:
            loop.stop()
    asyncio.run(scenario())


def test_engine_rejection_is_a_400_and_abort_frees_the_request():
    async def scenario():
        loop = await _started_loop()
        try:
            with pytest.raises(APIError) as e:
                await _generate(loop, "r", [1, 999])
            assert e.value.status == 400 and e.value.param == "prompt"
            gen = Generation(loop, "long", [EnginePrompt([1, 2], None)], [_params(10_000)])
            await gen.start()
            assert "long-0" in loop.engine.requests
            gen.abort()
            for _ in range(100):
                if "long-0" not in loop.engine.requests:
                    break
                await asyncio.sleep(0.01)
            assert loop.engine.aborted == ["long-0"] and loop.num_pending == 0
        finally:
            loop.stop()
    asyncio.run(scenario())


def test_repeated_step_errors_kill_the_engine():
    async def scenario():
        loop = await _started_loop()
        try:
            for i in range(MAX_CONSECUTIVE_STEP_ERRORS):
                with pytest.raises(APIError):
                    await _generate(loop, f"bad{i}", [POISON])
            assert loop.dead
            with pytest.raises(APIError) as e:
                loop.check_available()
            assert e.value.status == 503
        finally:
            loop.stop()
    asyncio.run(scenario())


class _LostRankEngine(FakeEngine):
    """A multi-rank engine whose follower died: the step raises executor/local_ranks.py RankFailure; close()
    is what the engine thread calls on its way out."""
    closed = 0

    def step(self):
        from deepinfer.executor.local_ranks import RankFailure
        raise RankFailure("a rank of the model failed: rank 1 (pid 42) was killed by SIGKILL")

    def close(self):
        type(self).closed += 1


def test_a_lost_rank_kills_the_engine_at_once_and_stop_closes_it():
    async def scenario():
        loop = await _started_loop(_LostRankEngine)
        try:
            with pytest.raises(APIError) as e:
                await _generate(loop, "r", [1, 2])
            # 503, the status of every request once a rank is lost, with the rank and cause named
            assert e.value.status == 503 and "rank 1" in e.value.message and "SIGKILL" in e.value.message
            assert loop.dead and "rank 1" in loop.dead_reason   # one failed step, not three
        finally:
            loop.stop()
        assert _LostRankEngine.closed == 1
    asyncio.run(scenario())


def test_drain_aborts_what_is_left_after_the_timeout():
    async def scenario():
        loop = await _started_loop()
        try:
            task = asyncio.create_task(_generate(loop, "slow", [1], max_tokens=10_000))
            await asyncio.sleep(0.1)
            loop.drain(0.2)
            out = (await asyncio.wait_for(task, 5))[0]
            assert out.outputs[0].finish_reason == "abort" and out.outputs[0].token_ids
            with pytest.raises(APIError) as e:
                loop.check_available()
            assert e.value.status == 503
        finally:
            loop.stop()
    asyncio.run(scenario())


def test_app_health_errors_and_failed_engine_start():
    def broken():
        raise RuntimeError("no such checkpoint")

    async def scenario():
        good = ServerState(ServerConfig(served_model_name="m", api_key="k"),
                           EngineLoop(FakeEngine, ServerMetrics()))
        bad = ServerState(ServerConfig(served_model_name="m"), EngineLoop(broken, ServerMetrics()))
        fatal = []
        bad.engine_loop.on_fatal = fatal.append
        async with httpx.AsyncClient(transport=httpx.ASGITransport(build_app(good)),
                                     base_url="http://t") as c:
            assert (await c.get("/health")).status_code == 503  # not started yet
            good.engine_loop.start(asyncio.get_running_loop())
            for _ in range(200):
                if good.engine_loop.ready:
                    break
                await asyncio.sleep(0.01)
            assert (await c.get("/health")).status_code == 200
            auth = {"Authorization": "Bearer k"}
            # An unexpected exception while handling one request is a 500 for that request only.
            r = await c.post("/v1/completions", headers=auth,
                             json={"model": "m", "prompt": "explode", "max_tokens": 2})
            assert r.status_code == 500 and r.json()["error"]["code"] == 500
            r = await c.post("/v1/completions", headers=auth,
                             json={"model": "m", "prompt": "ok", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "<10><11>"
            good.engine_loop.stop()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(build_app(bad)),
                                     base_url="http://t") as c:
            bad.engine_loop.start(asyncio.get_running_loop())
            for _ in range(200):
                if fatal:
                    break
                await asyncio.sleep(0.01)
            assert fatal and "no such checkpoint" in fatal[0]
            r = await c.get("/health")
            assert r.status_code == 503 and "dead" in r.json()["error"]["message"]
            r = await c.post("/v1/completions", json={"prompt": "x"})
            assert r.status_code == 503
    asyncio.run(scenario())
