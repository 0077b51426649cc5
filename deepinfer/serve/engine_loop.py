"""EngineLoop: one thread owns the LLMEngine and steps it; asyncio handlers talk to it by commands.

LLMEngine is not thread-safe, so every call into it (add, abort, step, stats) happens on the
engine thread. Handlers put commands on a SimpleQueue (its put is reentrant, so the SIGTERM
handler may use it too) and get results back through `loop.call_soon_threadsafe`: an add resolves
an asyncio future, step outputs go to the per-request asyncio queue as (request_id, item) pairs,
where item is a RequestOutput or an APIError. Commands are applied between steps, so a request
added by any client joins the running batch at the next step and an abort frees its KV blocks
before the next step runs.

A lost rank (a model on several ranks: executor/local_ranks.py RankFailure) ends the engine: the ranks'
watchdog marks the loop dead at once (so /health answers 503 within its poll, step or no step) and
wakes the engine thread, which fails every request with a 503 naming the rank, counts it in
/metrics and, under the default policy `on_rank_failure="exit"`, asks the server to shut down.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from deepinfer.serve.errors import APIError
from deepinfer.serve.metrics import ServerMetrics

logger = logging.getLogger(__name__)

# After this many steps in a row raise, the engine is declared dead (/health answers 503).
MAX_CONSECUTIVE_STEP_ERRORS = 3
_IDLE_POLL_S = 0.5
RANK_FAILURE_POLICIES = ("exit", "serve-503")


@dataclass
class _Sink:
    """Where one engine request's outputs go, and its latency bookkeeping."""

    queue: asyncio.Queue
    arrival: float
    num_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None


class EngineLoop:
    def __init__(self, engine_factory: Callable[[], Any], metrics: ServerMetrics | None = None,
                 on_rank_failure: str = "exit"):
        """on_rank_failure: "exit" (fail the requests, then on_fatal: the server exits non-zero) or
        "serve-503" (stay up, answering 503)."""
        if on_rank_failure not in RANK_FAILURE_POLICIES:
            raise ValueError(f"on_rank_failure must be one of {RANK_FAILURE_POLICIES}, got {on_rank_failure!r}")
        self.on_rank_failure = on_rank_failure
        self._factory = engine_factory
        self.metrics = metrics or ServerMetrics()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.engine = None
        self.ready = False
        self.dead = False
        self.dead_reason: str | None = None
        self.draining = False
        self._drain_deadline: float | None = None
        self.stats = None  # the engine's last EngineStats, refreshed every loop iteration
        self.on_fatal: Callable[[str], None] | None = None  # called on the event loop
        self.rank_failure: BaseException | None = None  # the lost rank's RankFailure, once handled

    # ---- called from the event loop ------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)
        self._thread.start()

    def check_available(self) -> None:
        """Raise the 503 a new request gets while the engine cannot take it."""
        if self.dead:
            raise APIError(503, f"the engine is dead: {self.dead_reason}")
        if not self.ready:
            raise APIError(503, "the engine is starting (model loading); retry when /health is 200")
        if self.draining:
            raise APIError(503, "the server is shutting down")

    def submit(self, request_id: str, prompt: dict, params, sink: asyncio.Queue) -> asyncio.Future:
        """Queue an add; the future resolves once the engine accepted it (or holds its error:
        ValueError for a bad request, APIError otherwise)."""
        self.check_available()
        future = self._loop.create_future()
        self._commands.put(("add", request_id, prompt, params, sink, future, time.monotonic()))
        return future

    def abort(self, request_id: str) -> None:
        """Abort a request (unknown or finished ids are ignored); applied before the next step."""
        self._commands.put(("abort", request_id))

    def drain(self, timeout_s: float) -> None:
        """Stop taking requests; abort what is still running after timeout_s. Signal-safe."""
        self.draining = True
        self._commands.put(("drain", time.monotonic() + max(0.0, timeout_s)))

    def stop(self, timeout_s: float = 10.0) -> None:
        """Abort everything, stop the thread and release the engine's resources."""
        self._commands.put(("stop",))
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.error("engine thread did not stop within %.1f s", timeout_s)

    @property
    def num_pending(self) -> int:
        return len(self._sinks)

    # ---- engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine = self._factory()
            self.stats = self.engine.stats()
        except BaseException as e:  # noqa: BLE001 - any failure to build is fatal
            logger.exception("engine failed to start")
            self._die(f"engine failed to start: {e!r}")
            if self.on_fatal is not None:
                self._post(self.on_fatal, self.dead_reason)
            return
        watch = getattr(self.engine, "watch_ranks", None)
        if watch is not None:
            watch(self._rank_lost)
        self.ready = True
        logger.info("engine ready")
        consecutive_errors = 0
        while True:
            busy = not self.dead and self.engine.has_unfinished_requests()
            if not self._apply_commands(block=not busy):
                break
            if self._drain_deadline is not None and time.monotonic() >= self._drain_deadline:
                self._abort_all(deliver=True)
            if not self.dead and self.engine.has_unfinished_requests():
                consecutive_errors = 0 if self._step(consecutive_errors + 1) else consecutive_errors + 1
            self._refresh_stats()
        self._abort_all(deliver=True)
        self._refresh_stats()
        self._close_engine()

    def _close_engine(self) -> None:
        """Stop the engine's follower processes (a model on several ranks) on this thread: they were
        started from it, and die with it (PR_SET_PDEATHSIG)."""
        try:
            close = getattr(self.engine, "close", None)
            if close is not None:
                close()
        except Exception:  # noqa: BLE001
            logger.exception("engine close failed")

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands; False once a stop command arrived."""
        try:
            timeout = _IDLE_POLL_S if self._drain_deadline is None else 0.05
            cmd = self._commands.get(timeout=timeout) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind = cmd[0]
            if kind == "stop":
                return False
            try:
                if kind == "add":
                    self._add(*cmd[1:])
                elif kind == "abort":
                    self._abort(cmd[1], deliver=False)
                elif kind == "rank_lost":
                    self._check_ranks()
                elif kind == "drain":
                    self.draining = True
                    self._drain_deadline = cmd[1]
            except Exception:  # noqa: BLE001 - a bad command must not kill the loop
                logger.exception("engine command %s failed", kind)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, request_id, prompt, params, sink_queue, future, arrival) -> None:
        error: BaseException | None = None
        if self.dead or self.draining:
            error = APIError(503, "the server is shutting down" if self.draining
                             else f"the engine is dead: {self.dead_reason}")
        else:
            try:
                self.engine.add_request(request_id, prompt, params)
            except ValueError as e:  # the engine's validation: a client error
                error = e
            except Exception as e:  # noqa: BLE001 - contained to this request
                logger.exception("add_request(%s) failed", request_id)
                error = APIError(500, f"the engine could not add the request: {e!r}")
            else:
                self._sinks[request_id] = _Sink(sink_queue, arrival)
        self._post(_resolve, future, error)

    def _abort(self, request_id: str, deliver: bool) -> None:
        sink = self._sinks.pop(request_id, None)
        out = self.engine.abort_request(request_id)
        if sink is not None and out is not None:
            self._count_finished(out, sink)
            if deliver:
                self._post(_deliver, [(sink.queue, (request_id, out))])

    def _abort_all(self, deliver: bool) -> None:
        for request_id in list(self._sinks):
            try:
                self._abort(request_id, deliver)
            except Exception:  # noqa: BLE001
                logger.exception("abort of %s failed", request_id)
        if self.engine is not None:
            # Requests whose handler is gone but whose abort is still queued.
            for request_id in list(getattr(self.engine, "requests", {}) or {}):
                try:
                    self.engine.abort_request(request_id)
                except Exception:  # noqa: BLE001
                    logger.exception("abort of %s failed", request_id)

    # ---- a lost rank ------------------------------------------------------------------------
    def _rank_lost(self, failure: BaseException) -> None:
        """On the ranks' watchdog thread: dead now (the /health answer), the rest on the engine thread."""
        self.dead_reason = _first_line(failure)
        self.dead = True
        self._commands.put(("rank_lost",))

    def _check_ranks(self) -> None:
        try:
            self.engine.check_ranks()
        except Exception as e:  # noqa: BLE001 - the RankFailure the engine raises once it failed everything
            if not getattr(e, "engine_dead", False):
                raise
            self._rank_failed(e)

    def _rank_failed(self, failure: BaseException) -> None:
        """Once per engine: fail every request with a 503 naming the rank, count it, apply the policy."""
        if self.rank_failure is not None:
            return
        self.rank_failure = failure
        self.metrics.count_rank_failure(getattr(failure, "rank", None))
        failed = len(self._sinks)
        self._die(_first_line(failure), status=503)
        self._abort_all(deliver=False)   # the engine failed its requests already; anything left goes too
        logger.error("rank %s lost (%s): %d server request(s) failed with 503; policy %s",
                     getattr(failure, "rank", None), getattr(failure, "cause", None) or self.dead_reason,
                     failed, self.on_rank_failure)
        if self.on_rank_failure == "exit" and self.on_fatal is not None:
            self._post(self.on_fatal, f"the engine lost a rank: {self.dead_reason}")

    def _step(self, errors_if_this_fails: int) -> bool:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - fail this batch's requests, keep the loop
            self.metrics.count_step_error()
            if getattr(e, "engine_dead", False):   # a rank of the model is gone: no step can succeed
                self._rank_failed(e)
                return False
            logger.exception("engine step failed")
            if errors_if_this_fails >= MAX_CONSECUTIVE_STEP_ERRORS:
                # mark the engine dead before the failed requests hear about it, so a client that
                # got the error never sees a still-"alive" engine
                self._die(f"{errors_if_this_fails} engine steps in a row raised")
            error = APIError(500, f"the engine failed while generating: {e!r}")
            failed = [(sink.queue, (rid, error)) for rid, sink in self._sinks.items()]
            self._sinks.clear()
            self._abort_all(deliver=False)
            self._post(_deliver, failed)
            return False
        now = time.monotonic()
        batch = []
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:  # aborted by its client meanwhile
                continue
            num_new = sum(len(c.delta_token_ids) for c in out.outputs)
            if num_new:
                if sink.first_token_time is None:
                    sink.first_token_time = now
                    self.metrics.observe_ttft(now - sink.arrival)
                else:
                    self.metrics.observe_itl(now - sink.last_token_time)
                sink.last_token_time = now
                sink.num_tokens += num_new
            batch.append((sink.queue, (out.request_id, out)))
            if out.finished:
                del self._sinks[out.request_id]
                self._count_finished(out, sink)
        if batch:
            self._post(_deliver, batch)
        return True

    def _count_finished(self, out, sink: _Sink) -> None:
        e2e = time.monotonic() - sink.arrival
        for c in out.outputs:
            self.metrics.observe_finished(c.finish_reason or "abort", e2e)

    def _die(self, reason: str, status: int = 500) -> None:
        self.dead_reason = reason
        self.dead = True
        logger.error("engine is dead: %s", reason)
        error = APIError(status, f"the engine is dead: {reason}")
        failed = [(sink.queue, (rid, error)) for rid, sink in self._sinks.items()]
        self._sinks.clear()
        if failed:
            self._post(_deliver, failed)

    def _refresh_stats(self) -> None:
        try:
            self.stats = self.engine.stats()
        except Exception:  # noqa: BLE001
            logger.exception("engine stats failed")

    def _post(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


def _first_line(error: BaseException) -> str:
    return f"{error}".splitlines()[0] if f"{error}" else type(error).__name__


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _deliver(batch) -> None:
    for sink_queue, item in batch:
        sink_queue.put_nowait(item)
