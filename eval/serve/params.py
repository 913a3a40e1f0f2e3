"""A checked request (`eval.serve.protocol`) as the engine takes it: the model's name, sampling,
each choice's random stream, stop strings."""
from __future__ import annotations

import secrets

from k3jax.sessions import Sampling
from .errors import ServeError
from .limits import shown
from .protocol import Request, Sampled


def check_model(request: Request, served: str) -> None:
    """A 404 unless the request names the served model (or none)."""
    if request.model is not None and request.model != served:
        raise ServeError(404, f"the model {shown(request.model)} does not exist; this server serves {served!r}",
                         "not_found_error", param="model")


def sampling(request: Sampled) -> tuple[float, float | None, int]:
    """(temperature, top_p or None, seed): top_p 1 is no filter; no seed draws one."""
    seed = secrets.randbits(32) if request.seed is None else request.seed
    return request.temperature, (None if request.top_p >= 1.0 else request.top_p), seed


def choice_sampling(temperature: float, top_p: float | None, seed: int, choice: int) -> Sampling:
    """Choice ``choice``'s sampling: its own stream of the request's seed, so a request's output
    depends on its seed and parameters, never on the requests it is batched with."""
    return Sampling(temperature, None, top_p, seed % 2**32, stream=choice)


def text_stop(stops: list[str]):
    """The earliest position where one of ``stops`` starts in a text -> None when there is none."""
    def first(text: str) -> int | None:
        found = [index for index in (text.find(stop) for stop in stops) if index >= 0]
        return min(found) if found else None
    return first
