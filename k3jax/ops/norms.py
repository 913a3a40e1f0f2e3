"""Normalisations shared by the K3 layers, computed in fp32 and returned in the input dtype.

    rms_norm(x, w)    = w * x / sqrt(mean(x^2) + eps)        (over the last axis)
    l2_normalize(x)   =     x / sqrt(sum(x^2)  + eps)        (over the last axis; eps 1e-6 as KDA uses)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float = 1e-5) -> jax.Array:
    """RMSNorm over the last axis: ``weight * x / sqrt(mean(x**2) + eps)``, statistics in fp32."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * weight.astype(jnp.float32)
    return y.astype(x.dtype)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """L2 normalisation over the last axis with ``eps`` inside the square root: ``x / sqrt(sum(x**2) + eps)``.

    Computed in fp32 (the KDA layer's query/key normalisation); a zero vector maps to zero, not NaN.
    """
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.sum(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return y.astype(x.dtype)
