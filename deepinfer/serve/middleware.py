"""Pure-ASGI guards in front of the routes: API key and request body size.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and disconnect messages pass through
untouched.
"""

from __future__ import annotations

import hmac

from deepinfer.serve.errors import error_response


class ApiKeyMiddleware:
    """With a key configured, /v1/* needs `Authorization: Bearer KEY` (/health and /metrics stay
    open for probes and scrapers, as in vLLM)."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if self.expected is None or scope["type"] != "http" or not scope["path"].startswith("/v1"):
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            response = error_response(401, "invalid or missing API key (expected an "
                                           "'Authorization: Bearer <key>' header)")
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Reads the whole body first and answers 413 past `max_bytes`, whether or not the client
    sent Content-Length; the route then gets the buffered body, and later receive() calls reach
    the server (that is how handlers see a disconnect)."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        too_large = error_response(413, f"request body exceeds the limit of {self.max_bytes} bytes")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await too_large(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                return await too_large(scope, receive, send)
            chunks.append(body)
            if not message.get("more_body", False):
                break
        buffered = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():
            return buffered.pop() if buffered else await receive()

        return await self.app(scope, replay, send)
