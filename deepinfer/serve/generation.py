"""One HTTP request's engine requests (one per prompt, each with n samples) as a single stream.

Every way out of a handler (finish, error, client disconnect, cancellation at shutdown) ends in
`Generation.abort()`, which aborts whatever is still running so its KV blocks are freed.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from deepinfer.serve.engine_loop import EngineLoop
from deepinfer.serve.errors import APIError, bad_request, sse_error_event
from deepinfer.serve.responses import SSE_DONE

logger = logging.getLogger(__name__)


@dataclass
class EnginePrompt:
    token_ids: list[int]
    text: str | None  # the prompt as text (echo), None when it came as token ids


class ClientDisconnected(Exception):
    pass


class Generation:
    def __init__(self, engine_loop: EngineLoop, base_id: str, prompts: list[EnginePrompt],
                 params: list):
        assert len(params) == len(prompts), "one SamplingParams per prompt"
        self.engine_loop = engine_loop
        self.prompts = prompts
        self.params = params
        self.request_ids = [f"{base_id}-{i}" for i in range(len(prompts))]
        self._index = {rid: i for i, rid in enumerate(self.request_ids)}
        self._queue: asyncio.Queue = asyncio.Queue()
        self._pending: set[str] = set()

    async def start(self) -> None:
        """Hand every prompt to the engine; a rejected prompt raises (400 for bad input)."""
        futures = []
        try:
            for rid, prompt, params in zip(self.request_ids, self.prompts, self.params):
                # Pending before the await, so an abort covers a request the engine is adding now.
                self._pending.add(rid)
                futures.append(self.engine_loop.submit(
                    rid, {"prompt_token_ids": prompt.token_ids, "prompt": prompt.text}, params,
                    self._queue))
        except BaseException:
            for future in futures:
                future.cancel()  # nobody will await them; the caller's abort() undoes the adds
            raise
        results = await asyncio.gather(*futures, return_exceptions=True)
        for result in results:
            if isinstance(result, APIError):
                raise result
            if isinstance(result, ValueError):
                raise bad_request(str(result), getattr(result, "param", None) or "prompt")
            if isinstance(result, BaseException):
                raise result

    async def outputs(self):
        """Yield (prompt index, RequestOutput) until every request finished."""
        while self._pending:
            rid, item = await self._queue.get()
            if rid not in self._pending:
                continue
            if isinstance(item, BaseException):
                self._pending.discard(rid)
                raise item
            if item.finished:
                self._pending.discard(rid)
            yield self._index[rid], item

    async def collect(self) -> list:
        """The final RequestOutput of every prompt, in prompt order."""
        final = [None] * len(self.request_ids)
        async for index, out in self.outputs():
            if out.finished:
                final[index] = out
        return final

    def abort(self) -> None:
        for rid in self._pending:
            self.engine_loop.abort(rid)
        self._pending.clear()


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client goes away (the body was already read, so only disconnect remains)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, coro):
    """Run coro; if the client disconnects first, cancel it and raise ClientDisconnected.

    Starlette does not cancel a non-streaming handler when its client leaves, so without this a
    dropped request would keep its KV blocks until it finished generating.
    """
    work = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            work.cancel()
        watcher.cancel()
    if work.done() and not work.cancelled():
        return work.result()
    raise ClientDisconnected()


async def respond(request: Request, gen: Generation, stream, full) -> Response:
    """Start `gen`, then answer with `stream(gen)` as SSE (when `stream` is given) or with the JSON
    body `full(finals)` once every output finished. The engine request is aborted however the
    handler ends: start failure, client disconnect, or a stream closed early."""
    try:
        await gen.start()
    except BaseException:
        gen.abort()
        raise
    if stream is not None:
        return StreamingResponse(stream(gen), media_type="text/event-stream",
                                 background=BackgroundTask(gen.abort))
    try:
        finals = await unless_disconnected(request, gen.collect())
    finally:
        gen.abort()
    return JSONResponse(full(finals))


async def sse_body(events, gen: Generation, what: str):
    """A streamed answer's body: the handler's `events`, then [DONE]. The status line is already sent,
    so an error mid-stream becomes one SSE error event; however the stream ends (finished, failed,
    client gone) the generation is aborted and its KV blocks freed."""
    try:
        try:
            async for event in events:
                yield event
        except APIError as e:
            yield sse_error_event(e.status, e.message, e.param)
        except Exception as e:  # noqa: BLE001 - contained to this stream
            logger.exception("%s failed", what)
            yield sse_error_event(500, f"internal error: {e!r}")
        yield SSE_DONE
    finally:
        await events.aclose()
        gen.abort()
