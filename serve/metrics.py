"""Server metrics in the Prometheus text format (version 0.0.4), vLLM's names under `deepinfer:`.

Latency histograms are observed by the engine thread and read by the HTTP thread, hence the lock.
Gauges and token counters come from the engine's own `stats()` snapshot.
"""

from __future__ import annotations

import bisect
import threading

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # last slot: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1


class ServerMetrics:
    """Request-level metrics the engine does not keep: latencies and finish reasons."""

    def __init__(self):
        self._lock = threading.Lock()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.finished: dict[str, int] = {}
        self.num_step_errors = 0

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        with self._lock:
            self.itl.observe(seconds)

    def observe_finished(self, reason: str, e2e_seconds: float) -> None:
        with self._lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.e2e.observe(e2e_seconds)

    def count_step_error(self) -> None:
        with self._lock:
            self.num_step_errors += 1

    def render(self, model_name: str, stats, ready: bool, dead: bool) -> str:
        """The /metrics body. `stats` is the engine's EngineStats (None before it is built)."""
        label = f'model_name="{_escape(model_name)}"'
        out: list[str] = []

        def metric(name, kind, help_text, samples):
            out.append(f"# HELP deepinfer:{name} {help_text}")
            out.append(f"# TYPE deepinfer:{name} {kind}")
            for suffix, labels, value in samples:
                out.append(f"deepinfer:{name}{suffix}{{{labels}}} {_num(value)}")

        def gauge(name, help_text, value):
            metric(name, "gauge", help_text, [("", label, value)])

        def counter(name, help_text, value):
            metric(name, "counter", help_text, [("", label, value)])

        s = stats
        gauge("engine_ready", "1 when the engine is built and stepping, else 0.", int(ready and not dead))
        gauge("num_requests_running", "Sequences in the running batch.", s.num_running if s else 0)
        gauge("num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting if s else 0)
        gauge("kv_blocks_used", "KV cache blocks in use (the reserved block 0 excluded).",
              s.num_used_blocks if s else 0)
        gauge("kv_blocks_free", "KV cache blocks free.", s.num_free_blocks if s else 0)
        total = (s.num_used_blocks + s.num_free_blocks) if s else 0
        gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).",
              (s.num_used_blocks / total) if total else 0.0)
        counter("prompt_tokens_total", "Prompt tokens prefilled (once per request).",
                s.num_prompt_tokens if s else 0)
        counter("generation_tokens_total", "Tokens generated.", s.num_generation_tokens if s else 0)
        counter("num_preemptions_total", "Sequences preempted (recomputed later).",
                s.num_preemptions if s else 0)
        counter("graphs_compiled_total", "Graphs the graph runner compiled (Neuron regions) or captured "
                "(CUDA graphs) so far; 0 for the eager runner.", (s.num_graphs or 0) if s else 0)
        with self._lock:
            finished = dict(self.finished)
            step_errors = self.num_step_errors
            hists = [(h, _snapshot(h)) for h in (self.ttft, self.itl, self.e2e)]
        metric("request_success_total", "counter", "Finished requests by finish reason.",
               [("", f'{label},finished_reason="{_escape(r)}"', n) for r, n in sorted(finished.items())]
               or [("", f'{label},finished_reason="stop"', 0)])
        counter("engine_step_errors_total", "Engine steps that raised (their requests failed).",
                step_errors)
        names = [("time_to_first_token_seconds", "Time from request arrival to its first token."),
                 ("inter_token_latency_seconds", "Time between consecutive tokens of a request."),
                 ("e2e_request_latency_seconds", "Time from request arrival to its end.")]
        for (name, help_text), (hist, (counts, total_sum, count)) in zip(names, hists):
            out.append(f"# HELP deepinfer:{name} {help_text}")
            out.append(f"# TYPE deepinfer:{name} histogram")
            running = 0
            for bound, c in zip(hist.buckets, counts):
                running += c
                out.append(f'deepinfer:{name}_bucket{{{label},le="{_num(bound)}"}} {running}')
            out.append(f'deepinfer:{name}_bucket{{{label},le="+Inf"}} {count}')
            out.append(f"deepinfer:{name}_sum{{{label}}} {_num(total_sum)}")
            out.append(f"deepinfer:{name}_count{{{label}}} {count}")
        return "\n".join(out) + "\n"


def _snapshot(h: Histogram):
    return list(h.counts), h.sum, h.count


def _num(v) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, int):
        return str(v)
    return repr(float(v))


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def parse_metrics(text: str) -> dict[str, float]:
    """{'name{labels}': value} of a Prometheus text body (for tests and tools)."""
    values = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        values[key] = float(value)
    return values
