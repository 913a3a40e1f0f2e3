"""Reading an OpenAI request body: each field checked, a bad one a `ServeError` 400 naming it."""
from __future__ import annotations

import math
import secrets
from typing import Any

from k3jax.sessions import Sampling
from .engine import ServeError

MAX_N = 64              # choices per request
MAX_TOP_LOGPROBS = 20   # as OpenAI
MAX_STOP = 8            # stop strings per request


def bad(param: str, message: str) -> ServeError:
    return ServeError(400, f"{param}: {message}", param=param)


def body_object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise ServeError(400, "the request body must be a JSON object")
    return body


def chat_tools(body: dict) -> list | None:
    """``tools`` of a chat request: function tools ``{"type": "function", "function": {"name", ...}}``
    (None when absent or empty)."""
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(
            isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("function"), dict)
            and isinstance(tool["function"].get("name"), str) and tool["function"]["name"] for tool in tools):
        raise bad("tools", 'must be a list of {"type": "function", "function": {"name": ...}} objects')
    return tools


def integer(body: dict, name: str, default, low: int, high: int | None = None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        raise bad(name, f"must be an integer in [{low}, {'inf' if high is None else high}], got {value!r}")
    return value


def number(body: dict, name: str, default: float, low: float, high: float, *, open_low: bool = False) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < low or value > high or (open_low and value == low):
        interval = f"{'(' if open_low else '['}{low}, {high}]"
        raise bad(name, f"must be a number in {interval}, got {value!r}")
    return float(value)


def flag(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(name, f"must be true or false, got {value!r}")
    return value


def model_name(body: dict, served: str) -> None:
    name = body.get("model", served)
    if not isinstance(name, str):
        raise bad("model", f"must be a string, got {name!r}")
    if name != served:
        raise ServeError(404, f"the model {name!r} does not exist; this server serves {served!r}", "not_found_error",
                         param="model")


def stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop", f"must be a non-empty string or a list of at most {MAX_STOP} of them")
    return stop


def sampling(body: dict, top_p_name: str = "top_p") -> tuple[float, float | None, int]:
    """(temperature, top_p or None, seed): OpenAI's defaults are temperature 1 and top_p 1; no seed
    draws one."""
    temperature = number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = number(body, top_p_name, 1.0, 0.0, 1.0, open_low=True)
    seed = body.get("seed")
    if seed is None:
        seed = secrets.randbits(32)
    elif isinstance(seed, bool) or not isinstance(seed, int):
        raise bad("seed", f"must be an integer, got {seed!r}")
    return temperature, (None if top_p >= 1.0 else top_p), seed


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
