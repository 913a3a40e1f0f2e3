"""The residual stream (SPEC §3): Block Attention Residuals, or the plain PreNorm residual ``none``.

The stream is a pytree threaded through the layers:

    partial   p  [B, T, d] fp32   block AttnRes: the current block's partial sum; none: the running sum
    sources      [N, B, T, d]     block AttnRes: embedding and finished block sums (first ``count``)
    count        int32 scalar     block AttnRes: filled sources

Each sublayer of block AttnRes reads ``Mix(p, sources)`` through its own `AttnRes` pair (a
pseudo-query, zero-initialised, and a key-norm gain, ones); with ``none`` it reads p.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers.params import param
from k3jax.layers.scope import scoped
from k3jax.ops.attnres import append_source, attnres_mix


class ResidualStream(NamedTuple):
    partial: jax.Array
    sources: jax.Array | None = None
    count: jax.Array | None = None

    @classmethod
    def start(cls, embedding: jax.Array, num_sources: int | None) -> "ResidualStream":
        """The stream entering layer 0: p = embedding, and (block AttnRes) an empty source buffer
        with room for ``num_sources`` entries."""
        partial = embedding.astype(jnp.float32)
        if num_sources is None:
            return cls(partial)
        return cls(partial, jnp.zeros((num_sources, *partial.shape), jnp.float32), jnp.zeros((), jnp.int32))

    def close_block(self) -> "ResidualStream":
        """Append p to the sources (a block starts; the caller restarts p)."""
        sources, count = append_source(self.sources, self.count, self.partial)
        return ResidualStream(self.partial, sources, count)


class AttnRes(nnx.Module):
    """One sublayer's depth-attention pair: pseudo-query w [d] (zeros) and key-norm gain [d] (ones)."""

    def __init__(self, d_model: int, *, norm_eps: float = 1e-5, rngs: nnx.Rngs):
        self.query = param(rngs, nnx.initializers.zeros, (d_model,), ("embed",))
        self.key_norm = param(rngs, nnx.initializers.ones, (d_model,), ("embed",))
        self.norm_eps = norm_eps

    @scoped
    def __call__(self, stream: ResidualStream) -> jax.Array:
        """``Mix(p, sources)`` ``[B, T, d]`` fp32."""
        return attnres_mix(stream.partial, stream.sources, stream.count, self.query[...], self.key_norm[...], self.norm_eps)
