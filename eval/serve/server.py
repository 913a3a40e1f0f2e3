"""The HTTP side's state and its waiting: `Server` submits a plan's job to the engine and waits for
its events, answering with the result (`Server.run`) or streaming its chunks as server-sent events
(`Server.stream`); `read_body` reads a request's JSON body (at most `MAX_BODY_BYTES`).

A client that disconnects cancels its request, freeing its sessions: a plain request looks for its
client every `DISCONNECT_POLL_SECONDS`, a stream notices when it can no longer send.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect

from .engine import Engine
from .latency import Latency
from .errors import ServeError
from .limits import MAX_JSON_DEPTH, check_nesting, clipped
from .model import ServedModel
from .responses import ResponseStore

MAX_BODY_BYTES = 32 * 2**20
DISCONNECT_POLL_SECONDS = 0.1      # how often a waiting plain request checks that its client is still there


async def read_body(request: Request) -> dict:
    """The request's JSON object: a 415 unless its Content-Type is JSON, a 413 past
    `MAX_BODY_BYTES`, a 499 when the client leaves during the upload, a 400 for malformed JSON, a
    body that is not an object, or one nesting deeper than `limits.MAX_JSON_DEPTH` (the decoding
    and the check run off the event loop)."""
    check_json_content_type(request.headers.get("content-type"))
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ServeError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    pieces, size = [], 0
    try:
        async for piece in request.stream():
            pieces.append(piece)
            size += len(piece)
            if size > MAX_BODY_BYTES:
                raise ServeError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    except ClientDisconnect:
        raise ServeError(499, "the client closed the connection during the upload") from None
    return await off_loop(decode_body, b"".join(pieces))


def check_json_content_type(content_type: str | None) -> None:
    """A 415 unless ``content_type`` is ``application/json`` (any parameters, e.g. a charset): a
    body is read as JSON only when its sender says it is (a web page's form cannot pose as one)."""
    media = (content_type or "").split(";")[0].strip().lower()
    if media != "application/json":
        raise ServeError(415, f"the request body must be JSON with Content-Type: application/json, got "
                         f"{clipped(repr(content_type)) if content_type else 'none'}", param="Content-Type")


def decode_body(raw: bytes) -> dict:
    """``raw`` as a JSON object (`read_body`'s checks)."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ServeError(400, f"the request body is not valid JSON: {clipped(str(error), 200)}") from None
    except RecursionError:
        raise ServeError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels of objects and lists") from None
    if not isinstance(body, dict):
        raise ServeError(400, "the request body must be a JSON object")
    check_nesting(body)
    return body


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


def sse(payload: dict, named: bool = False) -> str:
    """One server-sent event: ``data: JSON`` (``named``: after ``event: TYPE``, the payload's type)."""
    data = f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
    return f"event: {payload['type']}\n{data}" if named else data


class Server:
    """The app's state: the model, the engine, stored responses, counters."""

    def __init__(self, served: ServedModel, engine: Engine, responses: ResponseStore, *, api_key: str | None,
                 request_timeout: float, allowed_hosts: frozenset[str] | None = None,
                 allowed_origins: list[str] | None = None):
        """``allowed_hosts``: the Host header names answered (None: any); ``allowed_origins``: the
        web origins CORS lets call it (None: no CORS headers)."""
        self.served, self.engine, self.responses = served, engine, responses
        self.api_key, self.request_timeout, self.allowed_hosts = api_key, request_timeout, allowed_hosts
        self.save_failure: str | None = None      # why the shutdown's save failed
        self.allowed_origins = allowed_origins
        self.requests: dict[tuple[str, int], int] = {}
        self.latency = Latency()
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
        watch = self.latency.watch()
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
                watch.on(event)
                if event[0] == "result":
                    return event[1]
                if event[0] == "error":
                    raise event[1]
        except asyncio.CancelledError:
            self.engine.cancel(job)
            raise

    def stream(self, plan) -> StreamingResponse:
        """Submit ``plan``'s job and answer with server-sent events of its chunks."""
        events, notify = event_queue()
        job = plan.job(notify, self.deadline())
        self.engine.submit(job)          # a full queue is still a plain 429
        return StreamingResponse(self.chunks(plan, job, events, self.latency.watch()), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def chunks(self, plan, job, events: asyncio.Queue, watch):
        """The events of ``plan``'s submitted ``job`` as server-sent events (`plan.stream_chunks`,
        ``event: TYPE`` lines where ``plan.named_events``); the result or an error ends the stream
        (then ``[DONE]`` where ``plan.done_marker``). A stream left before its end (the client went
        away) cancels the job."""
        finished = False
        state = plan.stream_state()
        try:
            for chunk in plan.opening_chunks(state):
                yield sse(chunk, plan.named_events)
            while True:
                event = await events.get()
                watch.on(event)
                for chunk in plan.stream_chunks(state, event):
                    yield sse(chunk, plan.named_events)
                if event[0] in ("result", "error"):
                    finished = True
                    if plan.done_marker:
                        yield "data: [DONE]\n\n"
                    return
        finally:
            if not finished:
                self.engine.cancel(job)
