"""The FastAPI app: routes, error mapping, and the engine loop's lifetime."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from deepinfer.serve.chat import create_chat_completion
from deepinfer.serve.completions import create_completion
from deepinfer.serve.errors import APIError, api_error_response, error_response
from deepinfer.serve.generation import ClientDisconnected
from deepinfer.serve.middleware import ApiKeyMiddleware, BodyLimitMiddleware
from deepinfer.serve.state import ServerState

logger = logging.getLogger(__name__)


def build_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine_loop.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            # Runs after uvicorn stopped serving: abort what is left and stop the engine thread.
            await asyncio.to_thread(state.engine_loop.stop)

    app = FastAPI(title="deepinfer", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = state

    def dead_response() -> Response | None:
        # A dead engine (a lost rank, a failed start) answers every endpoint but /metrics with 503.
        loop = state.engine_loop
        return error_response(503, f"the engine is dead: {loop.dead_reason}") if loop.dead else None

    async def guarded(handler, request: Request) -> Response:
        dead = dead_response()
        if dead is not None:
            return dead
        try:
            return await handler(request, state)
        except APIError as e:
            return api_error_response(e)
        except ClientDisconnected:
            # Nobody reads this; the request's engine work was already aborted.
            return error_response(499, "client closed the request")
        except Exception as e:  # noqa: BLE001 - one request's failure stays with that request
            logger.exception("unhandled error in %s", request.url.path)
            return error_response(500, f"internal error: {e!r}")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await guarded(create_completion, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await guarded(create_chat_completion, request)

    @app.get("/v1/models")
    async def models() -> Response:
        dead = dead_response()
        if dead is not None:
            return dead
        loop = state.engine_loop
        card = {"id": state.config.served_model_name, "object": "model",
                "created": state.config.created, "owned_by": "deepinfer",
                "root": state.config.served_model_name, "parent": None, "permission": []}
        if loop.ready:
            card["max_model_len"] = state.max_model_len
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/health")
    async def health() -> Response:
        loop = state.engine_loop
        dead = dead_response()
        if dead is not None:
            return dead
        if not loop.ready:
            return error_response(503, "the engine is starting")
        if loop.draining:
            return error_response(503, "the server is shutting down")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        loop = state.engine_loop
        body = loop.metrics.exposition(state.config.served_model_name, loop.stats, loop.ready,
                                       loop.dead)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail))

    app.add_middleware(BodyLimitMiddleware, max_bytes=state.config.max_body_bytes)
    app.add_middleware(ApiKeyMiddleware, api_key=state.config.api_key)  # outermost: runs first
    return app
