"""Bounds on what one request may carry, checked on the HTTP side before any rendering or
tokenizing, so that no request can exhaust the recursion depth, the memory or the time of the
thread that renders it (and of every request sharing that thread).

    MAX_JSON_DEPTH        objects and lists nested inside the request body (a tool's schema, a
                          message's content, metadata): deeper is a 400 naming the field
    MAX_CHARS_PER_TOKEN   a text longer than ``max_model_len`` × this many characters cannot fit
                          the context whatever it tokenizes to, and is refused before tokenizing
                          (the bound, generous for any tokenizer, keeps a 10 MB prompt off the CPU)
    MAX_SHOWN             characters of a client's value an error message repeats
"""
from __future__ import annotations

from typing import Any

from .errors import ServeError

MAX_JSON_DEPTH = 64
MAX_CHARS_PER_TOKEN = 64
MAX_SHOWN = 80


def clipped(text: str, limit: int = MAX_SHOWN) -> str:
    """``text`` cut to ``limit`` characters, "..." marking a cut (an error never echoes a whole body)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def shown(value: Any, limit: int = MAX_SHOWN) -> str:
    """``repr(value)``, `clipped`."""
    return clipped(repr(value), limit)


def check_nesting(body: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """A 400 naming the first field of the decoded JSON ``body`` whose objects and lists nest
    deeper than ``max_depth`` (the body itself is depth 1). Iterative: a deep body cannot make
    the check itself recurse; a field's path is spelled out only for the error."""
    pending = [(body, 1, None)]          # (value, depth, trail: (parent trail, key or index) or None)
    while pending:
        value, depth, trail = pending.pop()
        if not isinstance(value, (dict, list)):
            continue
        if depth > max_depth:
            path = _path(trail)
            raise ServeError(400, f"{clipped(path, 120) if path else 'the request body'}: nests deeper than "
                             f"{max_depth} levels of objects and lists", param=clipped(path, 120) or None)
        items = value.items() if isinstance(value, dict) else enumerate(value)
        pending += [(child, depth + 1, (trail, key)) for key, child in items]


def _path(trail) -> str:
    """A trail of keys and indices -> ``tools[0].function.parameters``."""
    parts = []
    while trail is not None:
        trail, key = trail
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    return "".join(reversed(parts)).lstrip(".")


def check_text_length(text: str, max_model_len: int, param: str) -> None:
    """A 400 for a ``text`` too long to fit ``max_model_len`` tokens at any tokenization (more than
    `MAX_CHARS_PER_TOKEN` characters a token), before spending time tokenizing it."""
    limit = max_model_len * MAX_CHARS_PER_TOKEN
    if len(text) > limit:
        raise ServeError(400, f"{param}: {len(text)} characters cannot fit this model's maximum context length of "
                         f"{max_model_len} tokens (at most {limit} characters are read)", param=param)
