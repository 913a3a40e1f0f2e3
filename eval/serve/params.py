"""A checked request (`eval.serve.protocol`) as the engine takes it: the model's name, sampling
and logits options, each choice's random stream, stop strings and stop ids."""
from __future__ import annotations

import secrets

from k3jax.sessions import Sampling
from .errors import ServeError
from .limits import shown
from .protocol import Choices, Request, Sampled


def check_model(request: Request, served: str) -> None:
    """A 404 unless the request names the served model (or none)."""
    if request.model is not None and request.model != served:
        raise ServeError(404, f"the model {shown(request.model)} does not exist; this server serves {served!r}",
                         "not_found_error", param="model")


def sampling(request: Sampled) -> tuple[float, float | None, int]:
    """(temperature, top_p or None, seed): top_p 1 is no filter; no seed draws one."""
    seed = secrets.randbits(32) if request.seed is None else request.seed
    return request.temperature, (None if request.top_p >= 1.0 else request.top_p), seed


def logits_options(request: Choices, vocab_size: int) -> dict:
    """The `Sampling` keyword arguments of a request's logits options (top_k -1 or 0 is off); a 400
    naming ``logit_bias`` or ``stop_token_ids`` for a token id outside the model's vocabulary."""
    bias = tuple((int(key), value) for key, value in request.logit_bias.items())
    for param, ids in (("logit_bias", [token for token, _ in bias]), ("stop_token_ids", request.stop_token_ids)):
        outside = [token for token in ids if not 0 <= token < vocab_size]
        if outside:
            raise ServeError(400, f"{param}: token id {outside[0]} is outside [0, {vocab_size})", param=param)
    return {"top_k": request.top_k if request.top_k > 0 else None, "min_p": request.min_p, "logit_bias": bias,
            "presence_penalty": request.presence_penalty, "frequency_penalty": request.frequency_penalty,
            "repetition_penalty": request.repetition_penalty}


def choice_sampling(temperature: float, top_p: float | None, seed: int, choice: int, options: dict | None = None,
                    generated_from: int = 0, constraint=None) -> Sampling:
    """Choice ``choice``'s sampling: its own stream of the request's seed, so a request's output
    depends on its seed and parameters, never on the requests it is batched with; ``options``
    (`logits_options`) with the penalties counting the tokens from history position
    ``generated_from``, and the choice's own grammar state ``constraint``."""
    return Sampling(temperature, top_p=top_p, seed=seed % 2**32, stream=choice, generated_from=generated_from,
                    constraint=constraint, **(options or {}))


def text_stop(stops: list[str]):
    """The earliest position where one of ``stops`` starts in a text -> None when there is none."""
    def first(text: str) -> int | None:
        found = [index for index in (text.find(stop) for stop in stops) if index >= 0]
        return min(found) if found else None
    return first
