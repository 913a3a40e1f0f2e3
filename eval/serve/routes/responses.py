"""``/v1/responses``: a new turn (`eval.serve.responses.ResponsePlan`), and a stored response read,
deleted or forked on the engine thread, which owns the stored sessions."""
from __future__ import annotations

from fastapi import FastAPI, Request

from ..responses import ResponsePlan
from ..server import Server, off_loop, read_body


def register(app: FastAPI, server: Server) -> None:
    stored = server.responses

    @app.post("/v1/responses")
    async def create_response(request: Request):
        plan = await off_loop(ResponsePlan, server.served, await read_body(request), stored)
        if plan.stream:
            return server.stream(plan)
        return await server.run(plan, request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        return await server.on_engine(lambda store: stored.get(response_id, "response_id").body)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        return await server.on_engine(lambda store: stored.delete(store, response_id))

    @app.post("/v1/responses/{response_id}/fork")
    async def fork_response(response_id: str):
        return await server.on_engine(lambda store: stored.fork(store, response_id))
