"""Sampling from logits, one home for every decoding path (`k3jax.inference.generation`, the session store,
the server, RL rollouts, speculative rounds):

    adjustment    a row's logits adjusted first (`adjusted_logits`): repetition penalty, additive
                  biases (logit_bias, presence and frequency penalties: `penalty_bias`), and a
                  grammar's allowed tokens (-inf elsewhere)
    greedy        temperature == 0: argmax
    temperature   logits / temperature
    top-k         keep the k largest logits
    min-p         keep the tokens whose probability is at least min_p times the top token's
    top-p         keep the smallest set of most likely tokens whose probability reaches p

The rules are written once, in `filtered_ranking`, over an array namespace: the compiled sampler
`sample_logits` runs them in jax.numpy (float32, traced settings) and draws a token; the host's
`sampling_probs` runs them in NumPy (float64) and returns the distribution that draw follows (what
speculative decoding's acceptance test needs, `k3jax.speculative`). The adjustment is one function,
`adjusted_logits`, over the same namespaces: a row's `Adjustment` arrays (built on the host from its
history and grammar state, `k3jax.sessions.batching.row_adjustment`) applied in the compiled decode
step and in `sampling_probs` alike.
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Ranking(NamedTuple):
    """Logits ranked and filtered by the sampling rules (`filtered_ranking`), along the last axis:
    ``order`` the token ids by rank, ``ranked`` their temperature-scaled logits, ``keep`` which
    ranks may be sampled, ``top_k_probs`` the softmax of ``ranked`` over the top-k ranks (the mass
    top-p cuts)."""

    order: object
    ranked: object
    keep: object
    top_k_probs: object


class Adjustment(NamedTuple):
    """What changes a row's logits before the ranking (`adjusted_logits`), and its min-p; arrays with
    the rows' leading axes ``[...]`` (one row: none). Bit sets are packed little-endian into int32
    words, token v at bit v % 32 of word v // 32 (llguidance's token bitmask layout, `pack_bits`).

        allowed     [..., W] int32   tokens a grammar allows (every bit set: no constraint)
        seen        [..., W] int32   tokens of the history (prompt and generated): the repetition penalty's
        repetition  [...]    float   the repetition penalty r (1: off)
        bias        [..., V] float   added to the logits (`penalty_bias`)
        min_p       [...]    float   min-p (0: off)
    """

    allowed: object
    seen: object
    repetition: object
    bias: object
    min_p: object


def pack_bits(flags: np.ndarray) -> np.ndarray:
    """Booleans ``[..., V]`` -> int32 words ``[..., ceil(V / 32)]``: token v at bit v % 32 of word v // 32."""
    flags = np.asarray(flags, bool)
    words = -(-flags.shape[-1] // 32)
    padded = np.zeros((*flags.shape[:-1], 32 * words), bool)
    padded[..., : flags.shape[-1]] = flags
    return np.packbits(padded, axis=-1, bitorder="little").view(np.int32)


def unpack_bits(words, vocab: int, xp=np):
    """`pack_bits`' inverse in the namespace ``xp``: ``(words[..., v // 32] >> (v % 32)) & 1`` for v < ``vocab``."""
    ids = xp.arange(vocab)
    return ((xp.take(words, ids // 32, axis=-1) >> (ids % 32).astype(words.dtype)) & 1).astype(bool)


def adjusted_logits(logits, adjustment: Adjustment, xp=np):
    """A row's logits ``z [..., V]`` adjusted, in order:

        repetition   z_v -> z_v / r if z_v > 0 else z_v * r, for v seen in the history (HF / vLLM)
        bias         z_v -> z_v + bias_v
        grammar      z_v -> -inf where the grammar does not allow v
    """
    vocab = logits.shape[-1]
    repetition = xp.expand_dims(xp.asarray(adjustment.repetition, logits.dtype), -1)
    penalised = xp.where(logits > 0, logits / repetition, logits * repetition)
    logits = xp.where(unpack_bits(adjustment.seen, vocab, xp), penalised, logits)
    logits = logits + xp.asarray(adjustment.bias, logits.dtype)
    return xp.where(unpack_bits(adjustment.allowed, vocab, xp), logits, -xp.inf)


def penalty_bias(vocab: int, generated, logit_bias=(), presence: float = 0.0, frequency: float = 0.0) -> np.ndarray:
    """The additive part of a row's adjustment, float64 ``[vocab]`` (OpenAI's formulas, counts c_v
    of token v among the ``generated`` tokens):

        bias_v = logit_bias_v - frequency * c_v - presence * [c_v > 0]

    ``logit_bias``: (token id, bias) pairs."""
    counts = np.bincount(np.asarray(generated, np.int64), minlength=vocab)[:vocab].astype(np.float64)
    bias = -frequency * counts - presence * (counts > 0)
    for token, value in logit_bias:
        bias[token] += value
    return bias


def filtered_ranking(logits, temperature, top_k, top_p, xp=np, min_p=None) -> Ranking:
    """The sampling rules over ``logits [..., V]`` in the array namespace ``xp`` (jax.numpy, traced
    or not, or numpy), in order:

        rank          order = stable argsort(-logits): ties go to the lower id
        temperature   ranked = logits[order] / temperature   (> 0: greedy is the caller's)
        top-k         keep rank < top_k                       (top_k <= 0: every rank)
        min-p         keep exp(ranked - ranked[0]) >= min_p   (p_v >= min_p * p_max; None or 0: every rank)
        top-p         keep the ranks whose preceding top-k mass is below top_p (top_p >= 1: all);
                      the top token always stays

    ``temperature``, ``top_k``, ``top_p`` and ``min_p`` are scalars (traced ones too) of the
    namespace or Python's (``min_p`` may also be ``[..., 1]``).
    """
    order = xp.argsort(-logits, axis=-1, stable=True)
    ranked = xp.take_along_axis(logits, order, axis=-1) / temperature
    rank = xp.arange(logits.shape[-1])
    keep = (rank < top_k) | (top_k <= 0)
    if min_p is not None:
        keep = keep & (xp.exp(ranked - ranked[..., :1]) >= min_p)
    softmax = jax.nn.softmax if xp is jnp else _ranked_softmax
    probs = softmax(xp.where(keep, ranked, -xp.inf), axis=-1)
    keep = keep & ((xp.cumsum(probs, axis=-1) - probs < top_p) | (top_p >= 1))
    return Ranking(order, ranked, keep, probs)


def _ranked_softmax(ranked: np.ndarray, axis: int = -1) -> np.ndarray:
    """NumPy's softmax of ranked logits over the last axis (their first entry is their largest)."""
    assert axis == -1
    weights = np.exp(ranked - ranked[..., :1])
    return weights / weights.sum(axis=-1, keepdims=True)


def sample_logits(logits: jax.Array, key: jax.Array, temperature, top_k, top_p, min_p=None) -> jax.Array:
    """One token per row of ``logits [B, V]`` -> ``[B]`` int32, drawn from `filtered_ranking`'s kept ranks.

    ``temperature`` 0 is greedy; ``top_k`` 0, ``top_p`` 1 and ``min_p`` 0 (or None) switch those filters off.
    All may be traced scalars, so one compiled program serves every sampling setting (a temperature
    below 1e-6 scales as 1e-6, which also keeps the greedy rows' discarded draw finite).
    """
    ranking = filtered_ranking(logits.astype(jnp.float32), jnp.maximum(temperature, 1e-6), top_k, top_p, xp=jnp,
                               min_p=min_p)
    choice = jax.random.categorical(key, jnp.where(ranking.keep, ranking.ranked, -jnp.inf), axis=-1)
    choice = jnp.where(temperature > 0, choice, 0)
    return jnp.take_along_axis(ranking.order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


def sampling_probs(logits, temperature: float, top_k: int | None, top_p: float | None,
                   adjustment: Adjustment | None = None) -> np.ndarray:
    """The distribution `sample_logits` draws from, in float64, for one row of host ``logits [V]``:
    the row's ``adjustment`` (`adjusted_logits`; None: none), then `filtered_ranking` in NumPy, its
    top-k (and min-p) softmax renormalised over the ranks top-p keeps (``top_k`` / ``top_p`` None:
    no such filter); temperature 0 puts all mass on the first argmax."""
    logits = np.asarray(logits, np.float64)
    min_p = None
    if adjustment is not None:
        logits, min_p = adjusted_logits(logits, adjustment), float(adjustment.min_p)
    probs = np.zeros_like(logits)
    if temperature == 0:
        probs[int(np.argmax(logits))] = 1.0
        return probs
    ranking = filtered_ranking(logits, temperature, top_k or 0, 1.0 if top_p is None else top_p, min_p=min_p)
    ranked_probs = ranking.top_k_probs
    if top_p is not None and top_p < 1:
        ranked_probs = np.where(ranking.keep, ranked_probs, 0.0)
        ranked_probs /= ranked_probs.sum()
    probs[ranking.order] = ranked_probs
    return probs


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
