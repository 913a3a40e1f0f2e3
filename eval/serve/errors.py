"""The server's errors: `ServeError` and its OpenAI-style body.

A request the server refuses is answered with ``{"error": {"message", "type", "param", "code"}}`` and
its HTTP status: 4xx for anything the client can fix, 5xx for the server's own trouble. Request
checking (`eval.serve.protocol`), the plans and the engine all raise `ServeError`; the app turns it
into the response (`error_response`), a stream into its last event (`error_body`).
"""
from __future__ import annotations

from fastapi.responses import JSONResponse

STATUS_KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}


class ServeError(Exception):
    """A request the server answers with an OpenAI-style error: HTTP ``status``, ``kind`` (the
    error body's ``type``), optional ``param`` and extra response ``headers``."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.headers = status, message, kind, param, headers or {}


def bad(param: str, message: str) -> ServeError:
    """A 400 for the request field ``param``; the message starts with its name."""
    return ServeError(400, f"{param}: {message}", param=param)


def error_body(error: ServeError) -> dict:
    return {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": error.status}}


def error_response(error: ServeError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.status, headers=error.headers)
