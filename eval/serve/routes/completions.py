"""``POST /v1/completions`` and ``POST /v1/chat/completions``: the body read into a plan off the
event loop (tokenizing a long prompt must not stall other clients), then answered whole or streamed."""
from __future__ import annotations

from fastapi import FastAPI, Request

from ..completions import ChatPlan, CompletionPlan
from ..server import Server, off_loop, read_body


def register(app: FastAPI, server: Server) -> None:
    async def answer(plan_type, request: Request):
        plan = await off_loop(plan_type, server.served, await read_body(request))
        if plan.stream:
            return server.stream(plan)
        return await server.run(plan, request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(CompletionPlan, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(ChatPlan, request)
