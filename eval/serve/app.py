"""The HTTP side of the server (FastAPI on uvicorn): the app over a `Server`, its API-key check,
request counts and error answers; the routes are `eval.serve.routes`' modules.

Every request body is read and checked (`eval.serve.protocol`) into a plan (`eval.serve.completions`,
`eval.serve.responses`) whose work runs on the engine thread; this side only waits for its events
(`eval.serve.server`). Errors are OpenAI-style bodies ``{"error": {"message", "type", "param",
"code"}}`` with a 4xx status for anything the client can fix (malformed JSON, an unknown field or
model or response, a prompt past the model's limit, bad or unsupported parameters, a full queue: 429
with ``Retry-After``); never FastAPI's 422. A client that disconnects cancels its request, freeing
its sessions. Nothing a request says is used as a path.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException

from .errors import STATUS_KINDS, ServeError, error_response
from .protocol import validation_error
from .routes import register
from .server import DISCONNECT_POLL_SECONDS, MAX_BODY_BYTES, Server  # noqa: F401 (re-exported: cli, tests)

log = logging.getLogger("k3jax.serve")


class AuthenticateAndCount:
    """ASGI middleware: the Host check (with ``server.allowed_hosts``: a 400 for another Host
    header, so a web page cannot drive a key-less local server through DNS rebinding), the API key
    check (401 without ``Authorization: Bearer KEY``), the per-route status counts of ``/metrics``,
    and the last word on errors: anything a route raises unexpectedly is a JSON 500 and the
    connection stays usable. Plain ASGI rather than ``@app.middleware("http")``, whose wrapper hides
    the client's disconnect from the route (`Server.run` waits for it)."""

    def __init__(self, app, server: Server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = None

        async def send_noting_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
        try:
            refusal = self.refusal(scope)
            if refusal is None:
                await self.app(scope, receive, send_noting_status)
            else:
                await error_response(refusal)(scope, receive, send_noting_status)
        except Exception as error:                  # a bug: this request's 500, the server goes on
            log.error("%s %s failed", scope.get("method"), scope.get("path"), exc_info=error)
            if status is None:
                await error_response(ServeError(500, f"internal error: {type(error).__name__}", "server_error"))(
                    scope, receive, send_noting_status)
        finally:
            key = (getattr(scope.get("route"), "path", "other"), status or 500)
            self.server.requests[key] = self.server.requests.get(key, 0) + 1

    def refusal(self, scope) -> ServeError | None:
        """Why the request is refused before any route reads it (a Host not allowed, no valid API key), or None."""
        headers = dict(scope["headers"])
        allowed = self.server.allowed_hosts
        if allowed is not None and host_name(headers.get(b"host", b"").decode("latin-1")) not in allowed:
            return ServeError(400, "the Host header names a host this server does not answer (--allowed-hosts)",
                              param="Host")
        if self.server.api_key is not None and not secrets.compare_digest(
                headers.get(b"authorization", b""), f"Bearer {self.server.api_key}".encode()):
            return ServeError(401, "a valid API key is required (Authorization: Bearer KEY)", "authentication_error")
        return None


def host_name(host: str) -> str:
    """A Host header's host without its port, lower case: ``LocalHost:8000`` -> ``localhost``,
    ``[::1]:8000`` -> ``[::1]``."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def answer_errors(app: FastAPI) -> None:
    """Every error as an OpenAI-style body: `ServeError`s, Starlette's 404 / 405, and (were a route
    to declare typed parameters) FastAPI's validation errors as a 400, not its 422."""
    @app.exception_handler(ServeError)
    async def serve_error(request: Request, error: ServeError):
        return error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        kind = STATUS_KINDS.get(error.status_code, "invalid_request_error")
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(error.status_code, str(error.detail))
        return error_response(ServeError(error.status_code, message, kind))

    @app.exception_handler(RequestValidationError)
    async def request_validation_error(request: Request, error: RequestValidationError):
        details = [{**detail, "loc": tuple(detail["loc"])[1:]} for detail in error.errors()]  # "body", "path"... off
        return error_response(validation_error(details))


def create_app(server: Server, on_shutdown=None) -> FastAPI:
    """The FastAPI app over ``server``; ``on_shutdown()`` runs when uvicorn stops (drain and save)."""
    @asynccontextmanager
    async def lifespan(app):
        yield
        if on_shutdown is not None:
            await asyncio.get_running_loop().run_in_executor(None, on_shutdown)

    app = FastAPI(title="k3jax", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    answer_errors(app)
    app.add_middleware(AuthenticateAndCount, server=server)
    if server.allowed_origins is not None:      # outside the key check: a browser's preflight carries no key
        app.add_middleware(CORSMiddleware, allow_origins=server.allowed_origins, allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["Authorization", "Content-Type"])
    register(app, server)
    return app
