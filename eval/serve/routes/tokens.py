"""vLLM's tokenizer routes, which lm-evaluation-harness's remote tokenizer reads: ``GET
/tokenizer_info``, ``POST /tokenize`` (a text prompt, or chat messages rendered in K3's chat format
with the generation prompt) and ``POST /detokenize``."""
from __future__ import annotations

from fastapi import FastAPI, Request

from k3jax.data import DataError
from ..errors import ServeError, bad
from ..model import ServedModel
from ..params import chat_reasoning, model_choice
from ..protocol import DetokenizeRequest, TokenizeRequest
from ..server import Server, off_loop, read_body


def tokenize(served: ServedModel, request: TokenizeRequest) -> list[int]:
    if request.messages is not None:
        try:
            thinking, effort = chat_reasoning(None, request.chat_template_kwargs, served.require_chat())
            return served.chat_prompt(request.messages, request.tools or None, thinking, effort).tolist()
        except DataError as error:
            raise ServeError(400, str(error), param="messages") from None
    if request.prompt is None:
        raise bad("prompt", "give a string prompt or messages")
    return served.encode(request.prompt) if request.prompt else []


def register(app: FastAPI, server: Server) -> None:
    served = server.served

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        names, tokenizer = served.special_names, served.tokenizer
        return {"tokenizer_class": type(tokenizer).__name__ if tokenizer is not None else "TokenIds",
                "eos_token": names.get(served.eos_id), "bos_token": names.get(getattr(tokenizer, "bos_id", None)),
                "pad_token": None, "model_max_length": served.max_model_len, "vocab_size": served.vocab_size}

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        return await off_loop(tokenized, served, await read_body(request))

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        return await off_loop(detokenized, served, await read_body(request))


def tokenized(served: ServedModel, body: dict) -> dict:
    """``/tokenize``'s answer to ``body`` (run off the event loop: rendering and tokenizing take time)."""
    request = TokenizeRequest.parse(body)
    model_choice(request, served)
    tokens = tokenize(served, request)
    return {"count": len(tokens), "max_model_len": served.max_model_len, "tokens": tokens}


def detokenized(served: ServedModel, body: dict) -> dict:
    """``/detokenize``'s answer to ``body`` (off the event loop, as `tokenized`)."""
    request = DetokenizeRequest.parse(body)
    model_choice(request, served)
    if request.tokens:
        served.check_ids(request.tokens, "tokens")
    return {"prompt": served.decode(request.tokens)}
