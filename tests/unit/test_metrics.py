"""/metrics on prometheus_client, read back with prometheus_client's own parser: names, types,
labels, bucket bounds and values, from ServerMetrics alone and from the app over a fake engine."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import httpx
import prometheus_client
import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from deepinfer.serve.app import build_app
from deepinfer.serve.engine_loop import EngineLoop
from deepinfer.serve.metrics import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS, ServerMetrics
from deepinfer.serve.state import ServerConfig, ServerState

from tests.support.fake_engine import FakeEngine

MODEL = "tiny"
# family name as the parser reports it (counters without `_total`) -> type
FAMILIES = {
    "deepinfer:engine_ready": "gauge",
    "deepinfer:num_requests_running": "gauge",
    "deepinfer:num_requests_waiting": "gauge",
    "deepinfer:kv_blocks_used": "gauge",
    "deepinfer:kv_blocks_free": "gauge",
    "deepinfer:kv_cache_usage_perc": "gauge",
    "deepinfer:prompt_tokens": "counter",
    "deepinfer:generation_tokens": "counter",
    "deepinfer:num_preemptions": "counter",
    "deepinfer:graphs_compiled": "counter",
    "deepinfer:prefix_cache_queries": "counter",
    "deepinfer:prefix_cache_hits": "counter",
    "deepinfer:spec_decode_steps": "counter",
    "deepinfer:spec_decode_emitted_tokens": "counter",
    "deepinfer:spec_decode_num_draft_tokens": "counter",
    "deepinfer:spec_decode_num_accepted_tokens": "counter",
    "deepinfer:spec_decode_tokens_per_step": "gauge",
    "deepinfer:spec_decode_num_offered_tokens": "counter",
    "deepinfer:spec_decode_verify_steps": "counter",
    "deepinfer:spec_decode_confidence_error": "gauge",
    "deepinfer:spec_decode_verified_per_step": "gauge",
    "deepinfer:request_success": "counter",
    "deepinfer:engine_step_errors": "counter",
    "deepinfer:time_to_first_token_seconds": "histogram",
    "deepinfer:inter_token_latency_seconds": "histogram",
    "deepinfer:e2e_request_latency_seconds": "histogram",
}


def _stats(**overrides):
    base = dict(num_running=2, num_waiting=1, num_used_blocks=3, num_free_blocks=5,
                num_prompt_tokens=40, num_generation_tokens=9, num_preemptions=4, num_graphs=12,
                prefix_cache_queries=50, prefix_cache_hits=32)
    return SimpleNamespace(**{**base, **overrides})


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(families, family, sample, **labels) -> float:
    """The one sample `sample` of `family` whose labels include `labels`."""
    found = [s.value for s in families[family].samples
             if s.name == sample and labels.items() <= s.labels.items()]
    assert len(found) == 1, (family, sample, labels, found)
    return found[0]


def _page(m: ServerMetrics, stats=None, ready=True, dead=False) -> dict:
    return _families(m.exposition(MODEL, stats, ready, dead).decode())


def test_page_has_every_family_with_its_type_and_the_model_label():
    fams = _page(ServerMetrics(), _stats())
    assert {name: f.type for name, f in fams.items()} == FAMILIES
    for f in fams.values():
        assert f.samples and all(s.labels["model_name"] == MODEL for s in f.samples), f.name
        # no `_created` series: the page keeps the names the hand-written renderer had
        assert not any(s.name.endswith("_created") for s in f.samples), f.name
    for name, buckets in [("time_to_first_token_seconds", TTFT_BUCKETS),
                          ("inter_token_latency_seconds", ITL_BUCKETS),
                          ("e2e_request_latency_seconds", E2E_BUCKETS)]:
        bounds = [float(s.labels["le"]) for s in fams[f"deepinfer:{name}"].samples
                  if s.name.endswith("_bucket")]
        assert bounds == [*buckets, math.inf]
    reasons = {s.labels["finished_reason"] for s in fams["deepinfer:request_success"].samples}
    assert reasons == {"stop", "length", "abort"}


def test_engine_values_are_read_from_the_snapshot_at_scrape_time():
    m = ServerMetrics()
    for _ in range(2):  # a second scrape of the same snapshot must not add it again
        fams = _page(m, _stats())
        assert _value(fams, "deepinfer:kv_blocks_used", "deepinfer:kv_blocks_used") == 3
        assert _value(fams, "deepinfer:kv_blocks_free", "deepinfer:kv_blocks_free") == 5
        assert _value(fams, "deepinfer:kv_cache_usage_perc",
                      "deepinfer:kv_cache_usage_perc") == pytest.approx(3 / 8)
        assert _value(fams, "deepinfer:num_requests_running", "deepinfer:num_requests_running") == 2
        assert _value(fams, "deepinfer:num_requests_waiting", "deepinfer:num_requests_waiting") == 1
        assert _value(fams, "deepinfer:prompt_tokens", "deepinfer:prompt_tokens_total") == 40
        assert _value(fams, "deepinfer:generation_tokens", "deepinfer:generation_tokens_total") == 9
        assert _value(fams, "deepinfer:num_preemptions", "deepinfer:num_preemptions_total") == 4
        assert _value(fams, "deepinfer:graphs_compiled", "deepinfer:graphs_compiled_total") == 12
        assert _value(fams, "deepinfer:prefix_cache_queries", "deepinfer:prefix_cache_queries_total") == 50
        assert _value(fams, "deepinfer:prefix_cache_hits", "deepinfer:prefix_cache_hits_total") == 32
        assert _value(fams, "deepinfer:engine_ready", "deepinfer:engine_ready") == 1
    fams = _page(m, _stats(num_graphs=None, num_generation_tokens=11))  # eager runner: None
    assert _value(fams, "deepinfer:graphs_compiled", "deepinfer:graphs_compiled_total") == 0
    assert _value(fams, "deepinfer:generation_tokens", "deepinfer:generation_tokens_total") == 11


def test_speculative_decoding_counters_and_per_depth_accept_rates():
    from deepinfer.spec.stats import SpecDecodeStats
    spec = SpecDecodeStats()
    spec.record(3, 2, 3, confidences=[1.0, 0.5, 0.5])  # estimates 1, .5, .25: errors 0, .5, .25
    spec.record(3, 0, 1, num_offered=4)
    spec.record(2, 2, 2)  # a stop inside the run: 2 emitted
    spec.record_step()
    spec.record_step()
    fams = _page(ServerMetrics(), _stats(spec_decode=spec))
    assert _value(fams, "deepinfer:spec_decode_num_offered_tokens",
                  "deepinfer:spec_decode_num_offered_tokens_total") == 9
    assert _value(fams, "deepinfer:spec_decode_verify_steps", "deepinfer:spec_decode_verify_steps_total") == 2
    assert _value(fams, "deepinfer:spec_decode_verified_per_step", "deepinfer:spec_decode_verified_per_step") == 4
    assert _value(fams, "deepinfer:spec_decode_confidence_error",
                  "deepinfer:spec_decode_confidence_error") == pytest.approx(0.75 / 8)
    assert _value(fams, "deepinfer:spec_decode_steps", "deepinfer:spec_decode_steps_total") == 3
    assert _value(fams, "deepinfer:spec_decode_emitted_tokens", "deepinfer:spec_decode_emitted_tokens_total") == 6
    assert _value(fams, "deepinfer:spec_decode_num_draft_tokens",
                  "deepinfer:spec_decode_num_draft_tokens_total") == 8
    assert _value(fams, "deepinfer:spec_decode_num_accepted_tokens",
                  "deepinfer:spec_decode_num_accepted_tokens_total") == 4
    assert _value(fams, "deepinfer:spec_decode_tokens_per_step", "deepinfer:spec_decode_tokens_per_step") == 2
    rates = [_value(fams, "deepinfer:spec_decode_accept_rate", "deepinfer:spec_decode_accept_rate", depth=str(j))
             for j in range(3)]
    assert rates == pytest.approx([2 / 3, 2 / 3, 0.0])
    assert _value(fams, "deepinfer:spec_decode_verified_at_depth", "deepinfer:spec_decode_verified_at_depth_total",
                  depth="2") == 2


def test_before_the_engine_is_built_and_after_it_died():
    m = ServerMetrics()
    fams = _page(m, None, ready=False)
    assert _value(fams, "deepinfer:engine_ready", "deepinfer:engine_ready") == 0
    assert _value(fams, "deepinfer:kv_cache_usage_perc", "deepinfer:kv_cache_usage_perc") == 0
    assert _value(fams, "deepinfer:graphs_compiled", "deepinfer:graphs_compiled_total") == 0
    fams = _page(m, _stats(), ready=True, dead=True)
    assert _value(fams, "deepinfer:engine_ready", "deepinfer:engine_ready") == 0


def test_observed_latencies_finish_reasons_and_step_errors():
    m = ServerMetrics()
    ttft = "deepinfer:time_to_first_token_seconds"
    before = _page(m, _stats())
    assert _value(before, ttft, ttft + "_count") == 0
    m.observe_ttft(0.03)
    m.observe_itl(0.2)
    m.observe_itl(0.02)
    m.observe_finished("length", 1.0)
    m.count_step_error()
    fams = _page(m, _stats())
    assert _value(fams, ttft, ttft + "_count") == 1
    assert _value(fams, ttft, ttft + "_bucket", le="0.04") == 1
    assert _value(fams, ttft, ttft + "_bucket", le="0.02") == 0
    assert _value(fams, ttft, ttft + "_sum") == pytest.approx(0.03)
    itl = "deepinfer:inter_token_latency_seconds"
    assert _value(fams, itl, itl + "_bucket", le="+Inf") == 2
    assert _value(fams, itl, itl + "_bucket", le="0.025") == 1
    assert _value(fams, itl, itl + "_sum") == pytest.approx(0.22)
    e2e = "deepinfer:e2e_request_latency_seconds"
    assert _value(fams, e2e, e2e + "_bucket", le="0.8") == 0
    assert _value(fams, e2e, e2e + "_bucket", le="1.0") == 1
    ok = "deepinfer:request_success"
    assert _value(fams, ok, ok + "_total", finished_reason="length") == 1
    assert _value(fams, ok, ok + "_total", finished_reason="stop") == 0
    errors = "deepinfer:engine_step_errors"
    assert _value(fams, errors, errors + "_total") == 1 and m.num_step_errors == 1


def test_each_server_has_its_own_registry():
    a, b = ServerMetrics(), ServerMetrics()
    a.observe_finished("stop", 0.5)
    a.count_step_error()
    ok = "deepinfer:request_success"
    assert _value(_page(a), ok, ok + "_total", finished_reason="stop") == 1
    assert _value(_page(b), ok, ok + "_total", finished_reason="stop") == 0
    assert a.registry is not b.registry and b.num_step_errors == 0
    assert not any(f.name.startswith("deepinfer:") for f in prometheus_client.REGISTRY.collect())


class GraphCountingEngine(FakeEngine):
    """The fake engine with a full stats snapshot, as if its runner had compiled 7 graphs."""

    def stats(self):
        return SimpleNamespace(num_running=len(self.requests), num_waiting=0,
                               num_used_blocks=len(self.requests), num_free_blocks=10,
                               num_prompt_tokens=5, num_generation_tokens=6, num_preemptions=0,
                               num_graphs=7)


def test_app_serves_the_page_of_its_own_engine():
    async def scenario():
        served = ServerState(ServerConfig(served_model_name="m"),
                             EngineLoop(GraphCountingEngine, ServerMetrics()))
        idle = ServerState(ServerConfig(served_model_name="other"),
                           EngineLoop(GraphCountingEngine, ServerMetrics()))
        served.engine_loop.start(asyncio.get_running_loop())
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(build_app(served)),
                                         base_url="http://t") as c:
                for _ in range(200):
                    if served.engine_loop.ready:
                        break
                    await asyncio.sleep(0.01)
                for prompt in ("ab", "cd"):
                    r = await c.post("/v1/completions",
                                     json={"model": "m", "prompt": prompt, "max_tokens": 3})
                    assert r.status_code == 200
                r = await c.get("/metrics")
        finally:
            served.engine_loop.stop()
        assert r.headers["content-type"] == CONTENT_TYPE_LATEST
        fams = _families(r.text)
        assert all(s.labels["model_name"] == "m" for f in fams.values() for s in f.samples)
        assert _value(fams, "deepinfer:graphs_compiled", "deepinfer:graphs_compiled_total") == 7
        assert _value(fams, "deepinfer:generation_tokens", "deepinfer:generation_tokens_total") == 6
        ttft, itl = "deepinfer:time_to_first_token_seconds", "deepinfer:inter_token_latency_seconds"
        assert _value(fams, ttft, ttft + "_count") == 2
        assert _value(fams, itl, itl + "_count") == 4  # 3 tokens each: 2 gaps per request
        ok = "deepinfer:request_success"
        assert _value(fams, ok, ok + "_total", finished_reason="length") == 2
        # a second server in the same process saw none of it (and has no engine yet)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(build_app(idle)),
                                     base_url="http://t") as c:
            other = _families((await c.get("/metrics")).text)
        assert _value(other, ttft, ttft + "_count") == 0
        assert _value(other, "deepinfer:engine_ready", "deepinfer:engine_ready") == 0
        assert {s.labels["model_name"] for f in other.values() for s in f.samples} == {"other"}
    asyncio.run(scenario())
