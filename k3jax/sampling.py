"""Sampling from logits, one home for every decoding path (`k3jax.inference.generation`, the session store,
the server, RL rollouts, speculative rounds):

    greedy        temperature == 0: argmax
    temperature   logits / temperature
    top-k         keep the k largest logits
    top-p         keep the smallest set of most likely tokens whose probability reaches p
"""
from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np


def sample_logits(logits: jax.Array, key: jax.Array, temperature, top_k, top_p) -> jax.Array:
    """One token per row of ``logits [B, V]`` -> ``[B]`` int32.

    ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 switch those filters off. All three
    may be traced scalars, so one compiled program serves every sampling setting.
    """
    logits = logits.astype(jnp.float32)
    order = jnp.argsort(-logits, axis=-1)
    ranked = jnp.take_along_axis(logits, order, axis=-1) / jnp.maximum(temperature, 1e-6)
    rank = jnp.arange(logits.shape[-1])
    keep = (rank < top_k) | (top_k <= 0)
    probs = jax.nn.softmax(jnp.where(keep, ranked, -jnp.inf), axis=-1)
    keep = keep & ((jnp.cumsum(probs, axis=-1) - probs < top_p) | (top_p >= 1))   # the top token always stays
    choice = jax.random.categorical(key, jnp.where(keep, ranked, -jnp.inf), axis=-1)
    choice = jnp.where(temperature > 0, choice, 0)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


def log_softmax(logits) -> np.ndarray:
    """``log softmax`` over the last axis of host ``logits``, in float64:
    ``x - max(x) - log(sum(exp(x - max(x))))``."""
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def is_integer(value) -> bool:
    """An int (numpy ints too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def check_sampling(max_new_tokens, temperature, top_k, top_p, seed) -> None:
    """ValueError (one line) unless ``max_new_tokens`` is an integer >= 1, ``temperature`` a finite
    number >= 0, ``top_k`` None or an integer >= 1, ``top_p`` None or a number in (0, 1] and ``seed``
    an integer (what `generate` and `k3jax.sessions.SessionStore.generate` take)."""
    if not is_integer(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not (_is_real(temperature) and temperature >= 0) or not (top_k is None or is_integer(top_k) and top_k >= 1) \
            or not (top_p is None or _is_real(top_p) and 0 < top_p <= 1):
        raise ValueError(f"need a finite temperature >= 0, an integer top_k >= 1 (or None) and 0 < top_p <= 1 "
                         f"(or None); got {temperature!r}, {top_k!r}, {top_p!r}")
    if not is_integer(seed):
        raise ValueError(f"seed must be an integer, got {seed!r}")
