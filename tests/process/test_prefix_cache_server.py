"""The server reports prefix-cache hits: usage.prompt_tokens_details.cached_tokens (streamed and not)
and the deepinfer:prefix_cache_queries / _hits counters of /metrics, read back with
prometheus_client's parser; --no-enable-prefix-caching turns it off."""
from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.server import MODEL_NAME, ServerProcess, model_dir_fixture, parse_sse


@pytest.fixture(scope="module")
def model_dir(request, tmp_path_factory):
    return model_dir_fixture(request, tmp_path_factory)


def _complete(srv, prompt: list[int], stream: bool = False) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    r = httpx.post(srv.base + "/v1/completions", json=body, headers=srv.headers, timeout=120)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["usage"]
    events, done = parse_sse(r.text)
    assert done
    return events[-1]["usage"]


def _counters(srv) -> dict[str, float]:
    text = httpx.get(srv.base + "/metrics", headers=srv.headers, timeout=30).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("deepinfer:prefix_cache_")}


def test_cached_tokens_in_usage_and_metrics(model_dir):
    prefix = list(range(1000, 1040))   # 2 full blocks of 16 shared
    srv = ServerProcess(model_dir)
    try:
        srv.wait_ready()
        first = _complete(srv, prefix + [5, 6, 7])
        assert first["prompt_tokens"] == 43 and first["prompt_tokens_details"] == {"cached_tokens": 0}
        second = _complete(srv, prefix + [8, 9])
        assert second["prompt_tokens_details"] == {"cached_tokens": 32}
        streamed = _complete(srv, prefix + [10], stream=True)
        assert streamed["prompt_tokens_details"] == {"cached_tokens": 32}
        assert _counters(srv) == {"deepinfer:prefix_cache_queries_total": 43 + 42 + 41,
                                  "deepinfer:prefix_cache_hits_total": 64}
    finally:
        srv.terminate()


def test_no_enable_prefix_caching_reports_no_hits(model_dir):
    prefix = list(range(2000, 2040))
    srv = ServerProcess(model_dir, "--no-enable-prefix-caching")
    try:
        srv.wait_ready()
        _complete(srv, prefix + [5])
        assert _complete(srv, prefix + [6])["prompt_tokens_details"] == {"cached_tokens": 0}
        assert _counters(srv) == {"deepinfer:prefix_cache_queries_total": 0,
                                  "deepinfer:prefix_cache_hits_total": 0}
    finally:
        srv.terminate()
