"""Server metrics on prometheus_client, vLLM's names under `deepinfer:`.

Every ServerMetrics owns a CollectorRegistry (never prometheus_client's process-wide default), so
two servers in one process, as in the tests, count apart. Request latencies and finish reasons are
events the engine does not keep: the engine thread observes them into prometheus_client's Histogram
and Counter (both thread-safe). Gauges and token totals are the engine's own `stats()` snapshot,
read at scrape time rather than mirrored into counters, so nothing is counted twice.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "deepinfer:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Listed up front so a scraper sees each reason at 0 before the first request ends that way.
FINISH_REASONS = ("stop", "length", "abort")
MODEL_LABEL = "model_name"


@dataclass(frozen=True)
class _EngineView:
    """What one scrape reads besides the observed events."""
    model_name: str
    stats: Any  # the engine's EngineStats; None before the engine is built
    ready: bool


class ServerMetrics(Collector):
    """One server's metrics: the events observed here plus, at scrape time, the engine snapshot.
    It is the one collector of its own registry."""

    def __init__(self):
        # In no registry of their own: the served model name is known only at scrape time, so
        # collect() adds the `model_name` label to their samples (prometheus_client has no
        # constant labels).
        self._ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                               "Time from request arrival to its first token.",
                               buckets=TTFT_BUCKETS, registry=None)
        self._itl = Histogram(PREFIX + "inter_token_latency_seconds",
                              "Time between consecutive tokens of a request.",
                              buckets=ITL_BUCKETS, registry=None)
        self._e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                              "Time from request arrival to its end.", buckets=E2E_BUCKETS,
                              registry=None)
        self._finished = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                 ["finished_reason"], registry=None)
        for reason in FINISH_REASONS:
            self._finished.labels(reason)
        self._step_errors = Counter(PREFIX + "engine_step_errors",
                                    "Engine steps that raised (their requests failed).",
                                    registry=None)
        # Labelled by the global rank the engine lost (a model on several ranks); "unknown" when the
        # failure named none.
        self._rank_failures = Counter(PREFIX + "rank_failures",
                                      "Ranks of the model lost (died, killed or hung); the engine fails "
                                      "its requests and takes no more steps.", ["rank"], registry=None)
        self._view: _EngineView | None = None  # set by exposition() for one scrape
        self._scrape_lock = threading.Lock()
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def observe_ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def observe_finished(self, reason: str, e2e_seconds: float) -> None:
        self._finished.labels(reason).inc()
        self._e2e.observe(e2e_seconds)

    def count_step_error(self) -> None:
        self._step_errors.inc()

    def count_rank_failure(self, rank: int | None) -> None:
        self._rank_failures.labels("unknown" if rank is None else str(rank)).inc()

    @property
    def num_step_errors(self) -> int:
        return int(next(s.value for f in self._step_errors.collect() for s in f.samples
                        if s.name.endswith("_total")))

    def exposition(self, model_name: str, stats, ready: bool, dead: bool) -> bytes:
        """The /metrics body (prometheus_client's text format). `stats` is the engine's EngineStats
        (None before it is built)."""
        # The lock keeps concurrent scrapes from reading each other's view.
        with self._scrape_lock:
            self._view = _EngineView(model_name, stats, ready and not dead)
            try:
                return generate_latest(self.registry)
            finally:
                self._view = None

    def collect(self) -> Iterator[Metric]:
        view = self._view
        if view is None:  # collected outside exposition(): nothing to label the samples with
            return
        yield from _engine_families(view)
        for metric in (self._finished, self._step_errors, self._rank_failures, self._ttft, self._itl, self._e2e):
            for family in metric.collect():
                # `_created` timestamps are dropped: the page keeps the series it had before
                # prometheus_client.
                family.samples = [s._replace(labels={MODEL_LABEL: view.model_name, **s.labels})
                                  for s in family.samples if not s.name.endswith("_created")]
                if family.samples:   # rank_failures has none until a rank is lost (ranks are not known up front)
                    yield family


def _engine_families(view: _EngineView) -> Iterator[Metric]:
    s = view.stats

    def one(family_type, name, help_text, value):
        family = family_type(PREFIX + name, help_text, labels=[MODEL_LABEL])
        family.add_metric([view.model_name], value)
        return family

    used, free = (s.num_used_blocks, s.num_free_blocks) if s else (0, 0)
    yield one(GaugeMetricFamily, "engine_ready", "1 when the engine is built and stepping, else 0.",
              int(view.ready))
    yield one(GaugeMetricFamily, "num_requests_running", "Sequences in the running batch.",
              s.num_running if s else 0)
    yield one(GaugeMetricFamily, "num_requests_waiting", "Sequences waiting to be scheduled.",
              s.num_waiting if s else 0)
    yield one(GaugeMetricFamily, "kv_blocks_used",
              "KV cache blocks in use (the reserved block 0 excluded).", used)
    yield one(GaugeMetricFamily, "kv_blocks_free", "KV cache blocks free.", free)
    yield one(GaugeMetricFamily, "kv_cache_usage_perc",
              "Fraction of KV cache blocks in use (0..1).",
              used / (used + free) if used + free else 0.0)
    yield one(CounterMetricFamily, "prompt_tokens", "Prompt tokens prefilled (once per request).",
              s.num_prompt_tokens if s else 0)
    yield one(CounterMetricFamily, "generation_tokens", "Tokens generated.",
              s.num_generation_tokens if s else 0)
    yield one(CounterMetricFamily, "num_preemptions", "Sequences preempted (recomputed later).",
              s.num_preemptions if s else 0)
    yield one(CounterMetricFamily, "prefix_cache_queries",
              "Prompt tokens looked up in the prefix cache (per admission).",
              getattr(s, "prefix_cache_queries", 0) if s else 0)
    yield one(CounterMetricFamily, "prefix_cache_hits",
              "Prompt tokens found in the prefix cache (not prefilled again).",
              getattr(s, "prefix_cache_hits", 0) if s else 0)
    yield one(CounterMetricFamily, "graphs_compiled",
              "Graphs the graph runner compiled (Neuron regions) or captured (CUDA graphs) so far; "
              "0 for the eager runner.", (s.num_graphs or 0) if s else 0)
    yield from _spec_families(view, getattr(s, "spec_decode", None) if s else None)


def _spec_families(view: _EngineView, spec) -> Iterator[Metric]:
    """Speculative decoding (spec/stats.py): decode request-steps, their tokens, drafts
    verified and accepted, in total and per draft depth."""
    def family(name, help_text, value, kind=CounterMetricFamily):
        out = kind(PREFIX + name, help_text, labels=[MODEL_LABEL])
        out.add_metric([view.model_name], value)
        return out

    yield family("spec_decode_steps", "Decode request-steps (one per sequence and decode step).",
                 spec.num_decode_steps if spec else 0)
    yield family("spec_decode_emitted_tokens", "Tokens emitted by decode request-steps.",
                 spec.num_emitted_tokens if spec else 0)
    yield family("spec_decode_num_draft_tokens", "Draft tokens verified.",
                 spec.num_draft_tokens if spec else 0)
    yield family("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                 spec.num_accepted_tokens if spec else 0)
    yield family("spec_decode_num_offered_tokens", "Drafts the decode rows held (verified or not).",
                 spec.num_offered_tokens if spec else 0)
    yield family("spec_decode_verify_steps", "Engine steps with at least one decode row.",
                 spec.num_steps if spec else 0)
    yield family("spec_decode_confidence_error", "Mean |accepted - predicted acceptance| per verified draft.",
                 spec.mean_confidence_error if spec else 0.0, GaugeMetricFamily)
    yield family("spec_decode_verified_per_step", "Drafts verified per engine step with decode rows.",
                 spec.verified_per_step if spec else 0.0, GaugeMetricFamily)
    yield family("spec_decode_tokens_per_step", "Output tokens per decode request-step (1 without drafts).",
                 spec.tokens_per_step if spec else 0.0, GaugeMetricFamily)
    if not spec or not spec.verified_at_depth:  # per-depth families only once drafts were verified
        return
    depth = ["depth"]
    verified = CounterMetricFamily(PREFIX + "spec_decode_verified_at_depth",
                                   "Rows that verified a draft at this depth (0-based).",
                                   labels=[MODEL_LABEL, *depth])
    accepted = CounterMetricFamily(PREFIX + "spec_decode_accepted_at_depth",
                                   "Rows that accepted the draft at this depth (0-based).",
                                   labels=[MODEL_LABEL, *depth])
    rate = GaugeMetricFamily(PREFIX + "spec_decode_accept_rate",
                             "Accepted / verified drafts at this depth (0-based).", labels=[MODEL_LABEL, *depth])
    for j, (v, a) in enumerate(zip(spec.verified_at_depth, spec.accepted_at_depth)):
        verified.add_metric([view.model_name, str(j)], v)
        accepted.add_metric([view.model_name, str(j)], a)
        rate.add_metric([view.model_name, str(j)], a / v if v else 0.0)
    yield verified
    yield accepted
    yield rate
