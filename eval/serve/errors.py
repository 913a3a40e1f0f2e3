"""The server's errors: `ServeError` and its OpenAI-style body.

A request the server refuses is answered with ``{"error": {"message", "type", "param", "code"}}`` and
its HTTP status: 4xx for anything the client can fix, 5xx for the server's own trouble. Request
checking (`eval.serve.protocol`), the plans and the engine all raise `ServeError`; the app turns it
into the response (`error_response`), a stream into its last event (`error_body`).
"""
from __future__ import annotations

from fastapi.responses import JSONResponse

from k3jax.sessions import DiskTierError

STATUS_KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
                429: "rate_limit_error"}


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


def job_error(error: Exception) -> ServeError:
    """What a request is answered when its own work (its preparation, stop rule or finishing)
    raised ``error``: a `ServeError` as it is; a structure too deep to render a 400; a ValueError
    (the store's, the sampler's and the chat format's checks) a 400 with its message; anything
    else as `server_error` (a full disk tier a 507, a bug a 500): this request's alone."""
    if isinstance(error, ServeError):
        return error
    if isinstance(error, RecursionError):
        return ServeError(400, "the request nests too deeply to render")
    if isinstance(error, ValueError):
        return ServeError(400, str(error))
    return server_error(error)


def server_error(error: Exception) -> ServeError:
    """The answer to requests whose shared work (a batched decode step) raised ``error``: a 507 for
    a full or unwritable disk tier, else a 500 naming the error."""
    if isinstance(error, DiskTierError):
        return ServeError(507, str(error), "server_error")
    return ServeError(500, f"internal error: {type(error).__name__}: {error}"[:500], "server_error")


def error_body(error: ServeError) -> dict:
    return {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": error.status}}


def error_response(error: ServeError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.status, headers=error.headers)
