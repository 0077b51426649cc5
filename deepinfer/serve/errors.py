"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with code = HTTP status."""

from __future__ import annotations

import json

from starlette.responses import JSONResponse

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    499: "ClientClosedRequest",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error answered to one client; never disturbs other requests or the engine loop."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def not_implemented(message: str, param: str | None = None) -> APIError:
    return APIError(501, message, param)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "APIError"),
                      "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def api_error_response(exc: APIError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.param)


def sse_error_event(status: int, message: str, param: str | None = None) -> str:
    """A mid-stream error: the status line is already sent, so the error travels as an event."""
    return f"data: {json.dumps(error_body(status, message, param))}\n\n"
