"""The server's routes, a module per group, each with ``register(app, server)``; `register` adds them all.

    meta          GET /health, GET /v1/models, GET /metrics
    completions   POST /v1/completions, POST /v1/chat/completions (plain or streamed)
    responses     POST /v1/responses; GET, DELETE /v1/responses/{id}; POST /v1/responses/{id}/fork
    tokens        GET /tokenizer_info, POST /tokenize, POST /detokenize
    adapters      POST /v1/load_lora_adapter, POST /v1/unload_lora_adapter
"""
from __future__ import annotations

from fastapi import FastAPI

from ..server import Server
from . import adapters, completions, meta, responses, tokens


def register(app: FastAPI, server: Server) -> None:
    for group in (meta, completions, responses, tokens, adapters):
        group.register(app, server)
