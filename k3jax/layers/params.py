"""Parameter creation with logical axis names.

Every parameter carries ``logical_axes`` metadata: one name per dimension (``"embed"``,
``"heads"``, ``"mlp"``, ...). Model code never mentions devices; `k3jax.sharding` maps these
names to mesh axes with a rules table from the config.

Logical axis names used by the model:

    vocab       vocabulary                     embed       model width d
    heads       attention / KDA heads          head_dim    per-head key or value width
    value_heads KDA value heads (grouped)      conv        short-convolution taps
    q_lora      MLA query low rank             kv_lora     MLA latent KV width (+ rope dims)
    gate_rank   low-rank gate width            mlp         dense / shared FFN width
    experts     routed experts                 expert_mlp  routed expert width
    latent      LatentMoE latent width         layers      stacked (scanned) layer axis
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

Initializer = Callable[[jax.Array, Sequence[int], jnp.dtype], jax.Array]


def truncated_normal(std: float) -> Initializer:
    """Truncated normal in [-2 std, 2 std] (the K3 / torchtitan linear init)."""
    return nnx.initializers.truncated_normal(stddev=std, lower=-2.0, upper=2.0)


def param(
    rngs: nnx.Rngs,
    init: Initializer,
    shape: Sequence[int],
    axes: Sequence[str | None],
    dtype=jnp.float32,
    variable_type: type[nnx.Variable] = nnx.Param,
) -> nnx.Variable:
    """A variable of ``shape`` initialised by ``init``, tagged with one logical axis name per dimension."""
    shape, axes = tuple(shape), tuple(axes)
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {axes} do not match shape {shape}")
    return variable_type(init(rngs.params(), shape, dtype), logical_axes=axes)


def logical_axes(variable: nnx.Variable) -> tuple[str | None, ...]:
    """The logical axis names of a variable (``()`` for scalars or untagged variables)."""
    return tuple(variable.get_metadata().get("logical_axes", ()))
