"""Projection of activations by a stored weight in the compute dtype."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def project(x: jax.Array, weight: jax.Array, dtype, contract: int = 1) -> jax.Array:
    """``y[..., out] = sum_in x[..., in] W[in, out]``, contracting the last ``contract`` axes of x
    with the first ``contract`` axes of W (e.g. x [B,T,H,V] with W [H,V,d]); both cast to ``dtype``."""
    return jnp.tensordot(x.astype(dtype), weight.astype(dtype), axes=contract)
