"""KDA forget gate in log space (SPEC §1.3), per value head and key channel, always fp32.

With z the raw low-rank gate pre-activation, a = exp(A_log[h]) and d = dt_bias[h, :]:

    softplus    (Kimi Linear):  g = -a * softplus(z + d)            g in (-inf, 0)
    lower_bound (K3, b < 0):    g =  b * sigmoid(a * (z + d))       g in (b, 0)

Decays below exp(LOG_DECAY_FLOOR) are zero in fp32 and float64 alike, so g is clamped there:
a softplus that overflows (g = -inf) becomes a full reset of that channel with finite
gradients (zero through the clamp, as the true gradient exp(g) * ... is).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

LOG_DECAY_FLOOR = -1.0e4  # exp(-1e4) = 0 in float64; within-chunk sums of it stay finite in fp32


def floor_log_decay(g: jax.Array) -> jax.Array:
    """``max(g, LOG_DECAY_FLOOR)``: the same decays (exp(g) = 0 below the floor), never -inf."""
    return jnp.maximum(g, LOG_DECAY_FLOOR)


def kda_gate(
    raw: jax.Array,
    A_log: jax.Array,
    dt_bias: jax.Array,
    *,
    lower_bound: float | None = None,
) -> jax.Array:
    """Log-space decay ``g`` of shape ``raw.shape`` (``[..., HV, K]``) in fp32.

    Args:
      raw: raw gate pre-activation ``[..., HV, K]``.
      A_log: per-head log decay rate ``[HV]``.
      dt_bias: per-head, per-channel bias ``[HV, K]`` (a flat ``[HV*K]`` is accepted).
      lower_bound: ``None`` for the unbounded softplus form, a negative number ``b`` for the
        bounded sigmoid form.
    """
    heads, key_dim = raw.shape[-2:]
    if A_log.shape != (heads,):
        raise ValueError(f"kda_gate: A_log must have shape ({heads},), got {A_log.shape}")
    if dt_bias.size != heads * key_dim:
        raise ValueError(f"kda_gate: dt_bias must have shape ({heads}, {key_dim}), got {dt_bias.shape}")
    if lower_bound is not None and not lower_bound < 0:
        raise ValueError(f"kda_gate: lower_bound must be negative, got {lower_bound}")
    z = raw.astype(jnp.float32) + dt_bias.reshape(heads, key_dim).astype(jnp.float32)
    rate = jnp.exp(A_log.astype(jnp.float32))[:, None]
    if lower_bound is None:
        return floor_log_decay(-rate * jax.nn.softplus(z))
    return lower_bound * jax.nn.sigmoid(rate * z)
