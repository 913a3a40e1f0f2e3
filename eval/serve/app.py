"""The HTTP side of the server (FastAPI on uvicorn): routes, API keys, errors, streaming, metrics.

Every request body is read here and turned into a plan (`eval.serve.completions`,
`eval.serve.responses`) whose work runs on the engine thread; this side only waits for its events.
Errors are OpenAI-style bodies ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status
for anything the client can fix (malformed JSON, unknown model or response, a prompt past the
model's limit, bad parameters, a full queue: 429 with ``Retry-After``). A client that disconnects
cancels its request, freeing its sessions. Nothing a request says is used as a path.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from k3jax.data import DataError

from .completions import ChatPlan, CompletionPlan
from .engine import Engine, ServeError
from .model import ServedModel
from .responses import ResponsePlan, ResponseStore
from . import params

MAX_BODY_BYTES = 32 * 2**20
DISCONNECT_POLL_SECONDS = 0.1      # how often a waiting plain request checks that its client is still there
STATUS_KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}


def error_body(error: ServeError) -> dict:
    return {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": error.status}}


def error_response(error: ServeError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.status, headers=error.headers)


async def read_body(request: Request) -> dict:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ServeError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    raw = b""
    async for piece in request.stream():
        raw += piece
        if len(raw) > MAX_BODY_BYTES:
            raise ServeError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ServeError(400, f"the request body is not valid JSON: {error}") from None
    except RecursionError:
        raise ServeError(400, "the request body nests too deeply") from None
    return params.body_object(body)


class Server:
    """The app's state: the model, the engine, stored responses, counters."""

    def __init__(self, served: ServedModel, engine: Engine, responses: ResponseStore, *, api_key: str | None,
                 request_timeout: float):
        self.served, self.engine, self.responses = served, engine, responses
        self.api_key, self.request_timeout = api_key, request_timeout
        self.requests: dict[tuple[str, int], int] = {}
        self.started = time.time()

    def deadline(self) -> float:
        return time.monotonic() + self.request_timeout

    async def on_engine(self, function):
        """``function(store)`` on the engine thread, awaited."""
        return await asyncio.wrap_future(self.engine.call(function))

    async def run(self, plan, request: Request) -> Any:
        """Submit ``plan``'s job and wait for its result, cancelling it if the client goes away."""
        events, notify = event_queue()
        job = plan.job(notify, self.deadline())
        self.engine.submit(job)
        loop = asyncio.get_running_loop()
        next_check = loop.time() + DISCONNECT_POLL_SECONDS
        try:
            while True:
                try:
                    event = await asyncio.wait_for(events.get(), timeout=max(0.0, next_check - loop.time()))
                except asyncio.TimeoutError:
                    event = ("waiting",)
                if loop.time() >= next_check:         # on time even while token events keep coming
                    if await request.is_disconnected():
                        self.engine.cancel(job)
                        raise ServeError(499, "the client closed the connection") from None
                    next_check = loop.time() + DISCONNECT_POLL_SECONDS
                if event[0] == "result":
                    return event[1]
                if event[0] == "error":
                    raise event[1]
        except asyncio.CancelledError:
            self.engine.cancel(job)
            raise

    def stream(self, plan, include_usage: bool) -> StreamingResponse:
        """Submit ``plan``'s job and answer with server-sent events of its chunks, then ``[DONE]``."""
        events, notify = event_queue()
        job = plan.job(notify, self.deadline())
        self.engine.submit(job)          # a full queue is still a plain 429
        state = plan.stream_state()
        chat = isinstance(plan, ChatPlan)

        async def chunks():
            finished = False
            try:
                if chat:
                    for index in range(plan.n):
                        yield sse(plan.chunk(index, {"role": "assistant", "content": ""}))
                while True:
                    event = await events.get()
                    if event[0] == "token":
                        _, index, token, logprob = event
                        delta = state.advance(index, token)
                        if chat:
                            logprobs = {"content": plan.logprob_entries([token], [logprob])} if logprob else None
                            if delta or logprobs:
                                yield sse(plan.chunk(index, delta, logprobs))
                        else:
                            yield sse(plan.chunk(index, delta, logprob, token))
                    elif event[0] == "end":
                        _, index, reason = event
                        delta = state.advance(index, None, final=True)
                        if chat:
                            message, reason = plan.message(state.tokens[index], reason)
                            if message.get("tool_calls"):
                                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
                            yield sse(plan.chunk(index, delta, None, reason))
                        else:
                            yield sse(plan.chunk(index, delta, finish_reason=reason))
                    elif event[0] == "result":
                        if include_usage:
                            yield sse({"id": plan.id, "object": "chat.completion.chunk" if chat else plan.object,
                                       "created": plan.created, "model": plan.served.name, "choices": [],
                                       "usage": event[1]["usage"]})
                        finished = True
                        yield "data: [DONE]\n\n"
                        return
                    elif event[0] == "error":
                        finished = True
                        yield sse(error_body(event[1]))
                        yield "data: [DONE]\n\n"
                        return
            finally:
                if not finished:
                    self.engine.cancel(job)

        return StreamingResponse(chunks(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def off_loop(function, *args):
    """``function(*args)`` on a worker thread: tokenizing a long prompt must not stall other clients."""
    return await asyncio.get_running_loop().run_in_executor(None, function, *args)


def event_queue():
    """An asyncio queue and a thread-safe ``notify`` that puts into it (dropped once the loop is gone)."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def notify(event) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:          # the event loop has closed (shutdown)
            pass
    return events, notify


class AuthenticateAndCount:
    """ASGI middleware: the API key check (401 without ``Authorization: Bearer KEY``) and the
    per-route status counts of ``/metrics``. Plain ASGI rather than ``@app.middleware("http")``,
    whose wrapper hides the client's disconnect from the route (`Server.run` waits for it)."""

    def __init__(self, app, server: Server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def send_noting_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
        try:
            if self.authorised(scope):
                await self.app(scope, receive, send_noting_status)
            else:
                response = error_response(ServeError(401, "a valid API key is required (Authorization: Bearer KEY)",
                                                     "authentication_error"))
                await response(scope, receive, send_noting_status)
        finally:
            key = (getattr(scope.get("route"), "path", "other"), status)
            self.server.requests[key] = self.server.requests.get(key, 0) + 1

    def authorised(self, scope) -> bool:
        if self.server.api_key is None:
            return True
        given = dict(scope["headers"]).get(b"authorization", b"")
        return secrets.compare_digest(given, f"Bearer {self.server.api_key}".encode())


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def create_app(server: Server, on_shutdown=None) -> FastAPI:
    """The FastAPI app over ``server``; ``on_shutdown()`` runs when uvicorn stops (drain and save)."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        yield
        if on_shutdown is not None:
            await asyncio.get_running_loop().run_in_executor(None, on_shutdown)

    app = FastAPI(title="k3jax", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    served = server.served

    @app.exception_handler(ServeError)
    async def serve_error(request: Request, error: ServeError):
        return error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        kind = STATUS_KINDS.get(error.status_code, "invalid_request_error")
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(error.status_code, str(error.detail))
        return error_response(ServeError(error.status_code, message, kind))

    app.add_middleware(AuthenticateAndCount, server=server)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": int(server.started),
                                            "owned_by": "k3jax", "max_model_len": served.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request)
        plan = await off_loop(CompletionPlan, served, body)
        if plan.stream:
            return server.stream(plan, _include_usage(body))
        return await server.run(plan, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_body(request)
        plan = await off_loop(ChatPlan, served, body)
        if plan.stream:
            return server.stream(plan, _include_usage(body))
        return await server.run(plan, request)

    @app.post("/v1/responses")
    async def create_response(request: Request):
        return await server.run(ResponsePlan(served, await read_body(request), server.responses), request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        return await server.on_engine(lambda store: server.responses.get(response_id, "response_id").body)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        return await server.on_engine(lambda store: server.responses.delete(store, response_id))

    @app.post("/v1/responses/{response_id}/fork")
    async def fork_response(response_id: str):
        return await server.on_engine(lambda store: server.responses.fork(store, response_id))

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        names = served.special_names
        tokenizer = served.tokenizer
        return {"tokenizer_class": type(tokenizer).__name__ if tokenizer is not None else "TokenIds",
                "eos_token": names.get(served.eos_id), "bos_token": names.get(getattr(tokenizer, "bos_id", None)),
                "pad_token": None, "model_max_length": served.max_model_len, "vocab_size": served.vocab_size}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await read_body(request)
        params.model_name(body, served.name)
        if "messages" in body:
            tools = params.chat_tools(body)
            try:
                tokens = served.chat_prompt(body["messages"], tools).tolist()
            except DataError as error:
                raise ServeError(400, str(error), param="messages") from None
        elif isinstance(body.get("prompt"), str):
            tokens = served.encode(body["prompt"]) if body["prompt"] else []
        else:
            raise params.bad("prompt", "give a string prompt or messages")
        return {"count": len(tokens), "max_model_len": served.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await read_body(request)
        params.model_name(body, served.name)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise params.bad("tokens", "must be a list of token ids")
        if tokens:
            served.check_ids(tokens, "tokens")
        return {"prompt": served.decode(tokens)}

    @app.get("/metrics")
    async def metrics():
        stats, speculation = await server.on_engine(lambda store: (store.stats(), server.engine.speculation()))
        return PlainTextResponse(prometheus_text(server, stats, speculation), media_type="text/plain; version=0.0.4")

    return app


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise params.bad("stream_options", "must be an object")
    return bool(options.get("include_usage"))


def prometheus_text(server: Server, stats: dict, speculation: dict | None = None) -> str:
    """The server's counters and gauges in Prometheus's text format; ``speculation`` (the engine's
    `Engine.speculation`) adds the ``k3jax_speculation_*`` ones, which a server without
    speculative decoding leaves out."""
    engine = server.engine
    lines = []

    def metric(name, kind, help_text, samples):
        lines.append(f"# HELP k3jax_{name} {help_text}")
        lines.append(f"# TYPE k3jax_{name} {kind}")
        for labels, value in samples:
            label_text = ",".join(f'{key}="{value_}"' for key, value_ in labels.items())
            lines.append(f"k3jax_{name}{{{label_text}}} {value}" if label_text else f"k3jax_{name} {value}")

    metric("requests_total", "counter", "HTTP requests by route and status",
           [({"route": route, "status": status}, count) for (route, status), count in sorted(server.requests.items())])
    metric("prompt_tokens_total", "counter", "prompt tokens of admitted requests", [({}, engine.counters["prompt_tokens"])])
    metric("generation_tokens_total", "counter", "tokens generated (/ decode steps: the mean tokens per step)", [({}, engine.counters["generation_tokens"])])
    metric("decode_steps_total", "counter", "engine steps (a batched decode step or speculative round)", [({}, engine.counters["decode_steps"])])
    metric("request_timeouts_total", "counter", "requests past their deadline", [({}, engine.counters["timeouts"])])
    metric("batch_size", "gauge", "sequences in the latest decode step", [({}, engine.last_batch)])
    metric("queue_depth", "gauge", "requests waiting to be admitted", [({}, engine.queue_depth)])
    hits, misses = stats["prefix_hits"], stats["prefix_misses"]
    metric("prefix_cache_hits_total", "counter", "prefills that resumed from a cached prefix", [({}, hits)])
    metric("prefix_cache_misses_total", "counter", "prefills that found no cached prefix", [({}, misses)])
    metric("prefix_cache_hit_rate", "gauge", "hits / (hits + misses)", [({}, hits / (hits + misses) if hits + misses else 0.0)])
    metric("prefill_tokens_total", "counter", "prompt tokens prefilled", [({}, stats["prefill_tokens"])])
    metric("prefix_tokens_reused_total", "counter", "prompt tokens not prefilled thanks to the cache",
           [({}, stats["prefix_tokens_reused"])])
    metric("tier_bytes", "gauge", "bytes of session state per tier",
           [({"tier": tier}, stats[f"{tier}_bytes"]) for tier in ("device", "host", "disk")])
    metric("sessions", "gauge", "open sessions (running requests and stored responses)", [({}, stats["sessions"])])
    metric("stored_responses", "gauge", "responses kept for previous_response_id", [({}, len(server.responses.items))])
    if speculation is not None:
        for name, kind, key, help_text in SPECULATION_METRICS:
            metric(f"speculation_{name}", kind, help_text, [({}, speculation[key])])
    return "\n".join(lines) + "\n"


SPECULATION_METRICS = [      # (name after k3jax_speculation_, kind, `SpeculationStats.as_dict` key, help)
    ("rounds_total", "counter", "rounds", "speculative rounds, one per sequence and engine step"),
    ("drafted_tokens_total", "counter", "drafted", "draft tokens proposed"),
    ("accepted_tokens_total", "counter", "accepted", "draft tokens accepted"),
    ("acceptance_rate", "gauge", "acceptance_rate", "accepted / drafted"),
    ("mean_accepted_length", "gauge", "mean_accepted_length", "accepted draft tokens per round"),
    ("draft_seconds_total", "counter", "draft_seconds", "seconds spent drafting"),
    ("verify_seconds_total", "counter", "verify_seconds", "seconds spent verifying, rolling back and replaying"),
]
