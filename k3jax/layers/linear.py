"""Projection of activations by a stored weight in the compute dtype."""
from __future__ import annotations

import jax

from k3jax.ops.products import product


def project(x: jax.Array, weight: jax.Array, dtype, contract: int = 1) -> jax.Array:
    """``y[..., out] = sum_in x[..., in] W[in, out]``, contracting the last ``contract`` axes of x
    with the first ``contract`` axes of W (e.g. x [B,T,H,V] with W [H,V,d]); both cast to ``dtype``
    (`k3jax.ops.products.product`: the weight gradient on XLA:CPU's fast path)."""
    return product(x.astype(dtype), weight.astype(dtype), contract)
