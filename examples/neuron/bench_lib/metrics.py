"""Per-request timings and the per-cell metrics, with the definitions of `vllm bench serve`.

- TTFT: first token (first non-empty `choices` chunk, or the first engine step that produced a
  token) minus the send time.
- E2EL: last token minus the send time.
- TPOT: (E2EL - TTFT) / (output tokens - 1), per request, for requests with more than one token.
- ITL: the gaps between consecutive token arrivals (a chunk or step carrying k tokens counts once).
- Throughputs divide by the cell's duration: first send to last finish.
JSON keys follow vLLM's --save-result (mean_ttft_ms, median_tpot_ms, p99_itl_ms, ...).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

_PERCENTILES = (90, 99)


@dataclass
class RequestResult:
    """One request's timings (time.perf_counter() seconds) and outcome."""

    prompt_len: int
    expected_output_len: int
    start: float = 0.0
    token_times: list[float] = field(default_factory=list)  # arrival of each chunk/step with new tokens
    output_len: int = 0  # tokens generated (engine count, or the server's usage.completion_tokens)
    end: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def fail(self, message: str) -> None:
        if self.error is None:  # keep the first cause
            self.error = message

    def check(self) -> None:
        """Turn a finished request that broke the bench's contract into a failure."""
        if self.error is not None:
            return
        if not self.token_times:
            self.fail("no token received")
        elif self.output_len != self.expected_output_len:
            self.fail(f"generated {self.output_len} tokens, expected {self.expected_output_len} "
                      f"(ignore_eos with max_tokens = min_tokens)")

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def e2el(self) -> float:
        return self.token_times[-1] - self.start

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def tpot(self) -> float | None:
        if self.output_len < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_len - 1)

    @property
    def tokens_per_step(self) -> float | None:
        """Output tokens per decode step after the first token (1.0 without speculative decoding)."""
        if self.output_len < 2 or len(self.token_times) < 2:
            return None
        return (self.output_len - 1) / (len(self.token_times) - 1)


def _summary(name: str, values_s: list[float]) -> dict:
    """mean/median/std/p90/p99 in milliseconds; None when no request contributed a value."""
    keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms"] + [f"p{p}_{name}_ms" for p in _PERCENTILES]
    if not values_s:
        return dict.fromkeys(keys)
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    stats = [ms.mean(), np.median(ms), ms.std()] + [np.percentile(ms, p) for p in _PERCENTILES]
    return {k: float(v) for k, v in zip(keys, stats)}


def cell_metrics(results: list[RequestResult], duration_s: float, concurrency: int) -> dict:
    """The metrics of one measured cell (failed requests are counted, never averaged in)."""
    for r in results:
        r.check()
    good = [r for r in results if r.ok]
    total_in = sum(r.prompt_len for r in good)
    total_out = sum(r.output_len for r in good)
    duration_s = max(float(duration_s), 1e-9)
    steps = [r.tokens_per_step for r in good if r.tokens_per_step is not None]
    out = {
        "completed": len(good),
        "failed": len(results) - len(good),
        "errors": [r.error for r in results if not r.ok],
        "max_concurrency": concurrency,
        "duration": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(good) / duration_s,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "mean_tokens_per_decode_step": float(np.mean(steps)) if steps else None,
    }
    out.update(_summary("ttft", [r.ttft for r in good]))
    out.update(_summary("tpot", [r.tpot for r in good if r.tpot is not None]))
    out.update(_summary("itl", [x for r in good for x in r.itls]))
    out.update(_summary("e2el", [r.e2el for r in good]))
    # Per-request lists (seconds / tokens, successful requests in send order), as vLLM saves them.
    out["input_lens"] = [r.prompt_len for r in good]
    out["output_lens"] = [r.output_len for r in good]
    out["ttfts"] = [r.ttft for r in good]
    out["e2els"] = [r.e2el for r in good]
    return out


def speedup(ours: dict, base: dict) -> dict:
    """How many times better deepinfer is than the baseline (>1: deepinfer better), per metric."""
    def ratio(num, den):
        return num / den if num is not None and den else None
    return {"output_throughput": ratio(ours["output_throughput"], base["output_throughput"]),
            "mean_ttft": ratio(base["mean_ttft_ms"], ours["mean_ttft_ms"]),
            "mean_tpot": ratio(base["mean_tpot_ms"], ours["mean_tpot_ms"]),
            "mean_e2el": ratio(base["mean_e2el_ms"], ours["mean_e2el_ms"])}
