"""Softmax attention with a boolean mask, and the causal / packed-document masks (SPEC §2).

    scores[b,h,t,s] = scale * q[b,t,h] . k[b,s,g(h)]          g(h) = h // (H / G)
    p = softmax_s(where(mask[b,t,s], scores, -inf))          (fp32)
    o[b,t,h] = sum_s p[b,h,t,s] v[b,s,g(h)]

G key/value heads serve H query heads (G = H: multi-head; G = 1: one shared latent, the absorbed
MLA form). Masks: query at absolute position i sees key position j iff j <= i and both belong to the same segment. Every query sees at least itself, so no row is empty.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, scale: float) -> jax.Array:
    """q ``[B, T, H, D]``, k ``[B, S, G, D]``, v ``[B, S, G, Dv]``, mask ``[B, T, S]`` bool
    -> ``[B, T, H, Dv]`` in v.dtype. Scores and softmax in fp32."""
    batch, length, heads, dim = q.shape
    groups = k.shape[2]
    q = q.reshape(batch, length, groups, heads // groups, dim)
    scores = jnp.einsum("btgmd,bsgd->bgmts", q, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    o = jnp.einsum("bgmts,bsgd->btgmd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(batch, length, heads, -1).astype(v.dtype)


def causal_mask(query_positions: jax.Array, key_positions: jax.Array,
                query_segments: jax.Array | None = None, key_segments: jax.Array | None = None) -> jax.Array:
    """``[B, T, S]``: key j visible to query i iff pos_j <= pos_i and both are in the same segment.

    Positions ``[B, T]`` / ``[B, S]`` (or broadcastable over B), segments ``[B, T]`` / ``[B, S]``.
    Cache slots past the newest token have larger positions than every query, so they are never seen.
    """
    mask = key_positions[:, None, :] <= query_positions[:, :, None]
    if query_segments is not None:
        mask = mask & (key_segments[:, None, :] == query_segments[:, :, None])
    return mask
