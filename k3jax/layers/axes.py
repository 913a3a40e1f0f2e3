"""Logical layout constraints on activations: model code names axes, never devices.

    x = with_logical_constraint(x, ("batch", None, None), self.activation_layout)

A module that constrains an activation keeps an ``activation_layout`` attribute: None (the
model as built; the constraint is the identity) or the `ActivationLayout` that
`k3jax.sharding.parallelize` stores there, which maps the logical names to mesh axes with the
run's rules. Being a static attribute, the layout is part of the module's graph definition, so
a program traced for one layout is never reused for another.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import jax


class ActivationLayout(Protocol):
    """``layout(x, logical_axes)``: ``x`` constrained to the layout of these logical axis names
    (one per dimension, None: unsharded). Hashable (it is a static module attribute)."""

    def __call__(self, x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array: ...


def with_logical_constraint(x: jax.Array, logical_axes: Sequence[str | None],
                            layout: ActivationLayout | None) -> jax.Array:
    """``x`` laid out as ``layout`` places ``logical_axes`` (unchanged when ``layout`` is None).

    GSPMD otherwise lets, e.g., the FSDP split of a weight's model width leak into the
    activations it multiplies and reshuffles them back and forth between layers.
    """
    if len(logical_axes) != x.ndim:
        raise ValueError(f"logical axes {tuple(logical_axes)} do not match the shape {x.shape}")
    return x if layout is None else layout(x, logical_axes)
