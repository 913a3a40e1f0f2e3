"""vLLM's routes for LoRA adapters at run time, open with ``--runtime-lora-updates``: ``POST
/v1/load_lora_adapter`` (``{"lora_name", "lora_path"}``: a LoRA run of the served base, into a free
slot of the banks `k3jax.inference.adapters` sized at start) and ``POST /v1/unload_lora_adapter``
(``{"lora_name"}``). Both run on the engine thread between steps, so no batch ever sees a half-loaded
adapter; an adapter that an admitted request is running on is not unloaded (409), and a stored
response whose adapter is gone is refused when continued (400), never the batch it would join."""
from __future__ import annotations

from fastapi import FastAPI, Request

from k3jax.inference import InputError
from ..errors import ServeError, bad
from ..server import Server, read_body


def _text(body: dict, field: str) -> str:
    value = body.get(field)
    if not isinstance(value, str) or not value.strip():
        raise bad(field, "give a non-empty string")
    return value.strip()


def register(app: FastAPI, server: Server) -> None:
    served = server.served

    def adapters():
        if not served.runtime_lora_updates:
            raise ServeError(403, "loading and unloading LoRA adapters is off: start the server with "
                             "--runtime-lora-updates (and --max-loras for room)", "permission_error")
        return served.adapters

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        bank = adapters()
        body = await read_body(request)
        name, path = _text(body, "lora_name"), _text(body, "lora_path")
        if name == served.name:
            raise bad("lora_name", f"{name!r} is the base model's name")

        def load(store):
            try:
                adapter = bank.load(name, path)
            except InputError as error:
                raise ServeError(400, str(error), param="lora_path") from None
            store.serve_adapters(bank.tags())
            return {"object": "lora_adapter", "id": adapter.name, "root": adapter.path, "step": adapter.step,
                    "rank": adapter.rank, "lora_alpha": adapter.alpha, "parent": served.name}
        return await server.on_engine(load)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        bank = adapters()
        name = _text(await read_body(request), "lora_name")

        def unload(store):
            loaded = bank.adapters.get(name)
            if loaded is None:
                raise ServeError(404, f"no LoRA adapter named {name!r} is loaded", "not_found_error", param="lora_name")
            if server.engine.uses_adapter(loaded.tag):
                raise ServeError(409, f"LoRA adapter {name!r} is serving running requests; unload it when they end",
                                 "conflict_error", param="lora_name")
            bank.unload(name)
            store.serve_adapters(bank.tags())
            return {"object": "lora_adapter", "id": name, "deleted": True}
        return await server.on_engine(unload)
