"""Attention Residuals' Mix (SPEC §3): a learned softmax over depth, one weight per source and token.

Sources v_0..v_{n-1} (the embedding and finished block sums) and the current partial sum p:

    score_i = ((w * gamma) . v_i) / sqrt(mean(v_i^2) + eps)       w: pseudo-query, gamma: key-norm gain
    a = softmax_i(score)                                          over the n sources and p
    Mix = sum_i a_i v_i                                           on the raw, un-normalised sources

All in fp32. The sources live in a fixed-size buffer ``[N, B, T, d]`` of which the first ``count``
entries are filled (so a scanned depth carries a static shape); the rest are ignored.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.ops.precision import einsum


def attnres_mix(
    partial: jax.Array,
    sources: jax.Array,
    count: jax.Array,
    query: jax.Array,
    key_gain: jax.Array,
    eps: float = 1e-5,
) -> jax.Array:
    """partial ``[B, T, d]``, sources ``[N, B, T, d]`` (first ``count`` filled), query and key_gain
    ``[d]`` -> ``[B, T, d]`` fp32."""
    direction = query.astype(jnp.float32) * key_gain.astype(jnp.float32)

    def score(v):
        v = v.astype(jnp.float32)
        return einsum("...d,d->...", v, direction) * jax.lax.rsqrt(jnp.mean(jnp.square(v), axis=-1) + eps)

    filled = jnp.arange(sources.shape[0]) < count
    source_scores = jnp.where(filled[:, None, None], score(sources), -jnp.inf)      # [N, B, T]
    weights = jax.nn.softmax(jnp.concatenate([source_scores, score(partial)[None]], axis=0), axis=0)
    return einsum("nbt,nbtd->btd", weights[:-1], sources.astype(jnp.float32)) + weights[-1][..., None] * partial.astype(jnp.float32)


def append_source(sources: jax.Array, count: jax.Array, value: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Store ``value`` as source number ``count``; returns the buffer and the new count."""
    return jax.lax.dynamic_update_index_in_dim(sources, value.astype(sources.dtype), count, axis=0), count + 1
