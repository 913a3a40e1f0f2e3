"""Memory-bank decode: one token for each of B sessions whose KDA states and conv tails live in
shared pools, updated in place.

    kda_pool_step(pool [N, HV, K, V], slots [B], q, k [B, H, K], v [B, HV, V], g [B, HV, K], beta [B, HV])
        S = pool[slots[b], j];  S <- Diag(exp g) S;  S <- S + beta k (v - S^T k)^T;  o = S^T (scale q)
        pool[slots[b], j] = S                                  -> (o [B, HV, V] in v.dtype, pool)
    conv_pool_step(pool [N, W-1, C], slots [B], x [B, C], weight [C, W])
        window = [pool[slots[b]] (the last W-1 inputs, oldest first); x_b]
        y_b[c] = sum_i weight[c, i] window[i, c];  pool[slots[b]] = window[1:]   -> (y [B, C] in x.dtype, pool)

Value head j reads query/key head j // (HV / H). Slots not named in ``slots`` are left untouched;
the slots of one call must be distinct (a session is stepped once per call). Donate the pool
(``jax.jit(..., donate_argnums=...)``) so the update happens in place instead of on a copy.

``implementation`` is one of the words of `k3jax.ops.kda` with its one rule (`by_implementation`):
"reference" and "chunk" gather the slots, step them in XLA (`kda_step`; a window sum for the
conv) and scatter them back with ``.at[].set``; "pallas" runs the kernels of `pallas_decode`,
which read and write only the addressed slots of the aliased pool; "auto" (or None) is "pallas"
where lowered for a GPU, the XLA form for a CPU or TPU.
"""
from __future__ import annotations

import jax.numpy as jnp

from k3jax.ops.kda import by_implementation, kda_step
from k3jax.ops.kda.pallas_decode import pallas_conv_pool_step, pallas_kda_pool_step


def kda_pool_step(pool, slots, q, k, v, g, beta, *, scale: float | None = None, implementation: str | None = None):
    """One decode token for the sessions in ``slots`` (see the module docstring).

    Returns ``(o [B, HV, V] in v.dtype, updated pool)``.
    """
    value_heads, key_dim, value_dim = pool.shape[1:]
    batch = slots.shape[0]
    if slots.ndim != 1 or q.shape[0] != batch or v.shape[:2] != (batch, value_heads):
        raise ValueError(f"slots [B], q [B, H, K], v [B, HV, V] must agree with pool [N, HV, K, V] = {pool.shape}; "
                         f"got slots {slots.shape}, q {q.shape}, v {v.shape}")
    scale = key_dim**-0.5 if scale is None else scale

    def xla(pool, slots, q, k, v, g, beta):
        o, states = kda_step(q, k, v, g, beta, pool[slots], scale=scale, implementation="reference")
        return o, pool.at[slots].set(states.astype(pool.dtype))

    def pallas(pool, slots, q, k, v, g, beta):
        return pallas_kda_pool_step(pool, slots, q, k, v, g, beta, scale=scale)

    return by_implementation(implementation, pool, slots, q, k, v, g, beta, path="pooled decode",
                             xla=xla, pallas=pallas)


def conv_pool_step(pool, slots, x, weight, *, implementation: str | None = None):
    """Causal depthwise conv for one new token per session in ``slots`` (see the module docstring).

    ``weight`` is ``[C, W]``; returns ``(y [B, C] in x.dtype, updated pool)``.
    """
    channels, taps = weight.shape
    if pool.shape[1:] != (taps - 1, channels) or x.shape != (slots.shape[0], channels):
        raise ValueError(f"pool must be [N, W-1, C] = [N, {taps - 1}, {channels}] and x [B, C] with B = "
                         f"len(slots); got pool {pool.shape}, x {x.shape}, slots {slots.shape}")

    def xla(pool, slots, x, weight):
        window = jnp.concatenate([pool[slots], x[:, None, :].astype(pool.dtype)], axis=1)   # [B, W, C]
        y = jnp.einsum("bwc,cw->bc", window.astype(jnp.float32), weight.astype(jnp.float32))
        return y.astype(x.dtype), pool.at[slots].set(window[:, 1:])

    return by_implementation(implementation, pool, slots, x, weight, path="pooled decode",
                             xla=xla, pallas=pallas_conv_pool_step)
