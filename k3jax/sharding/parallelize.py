"""Parallelism applied to a built model from outside: the model names logical axes only.

    model = parallelize(K3Model(config.model, rngs=...), mesh, config.mesh)   # in place; returns it

stores, as static module attributes (part of ``nnx.split``'s graph definition, so jit never
reuses a program traced for another mesh or dispatch):

    activation_layout   on the model and each decoder layer: a `MeshLayout` mapping the logical
                        names of constrained activations (`k3jax.layers.axes`) to ``mesh`` axes
                        with ``mesh_config.rules``
    expert_dispatch     on each MoE layer: the `ExpertDispatch` of ``mesh_config.moe_dispatch``
                        (None for "local": experts computed where the tokens are)
    context_parallel    on each KDA and MLA layer, when ``mesh`` has a ``context`` axis of size > 1:
                        a `ContextParallel` splitting the sequence over it, MLA by
                        ``mesh_config.context_attention`` (None otherwise); batches and the residual
                        stream then split their sequence over it too (the "sequence" rule)
    head_parallel       on each KDA and MLA layer of a mesh of several devices whose context axis
                        does not split the sequence: a `HeadParallel` running its KDA ops, and MLA's
                        splash attention, on each device's rows and heads (XLA cannot split a
                        Pallas kernel); None otherwise

Parameters are not moved: their placement comes from the same rules (`step_shardings`).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from k3jax.config import AxisRules, MeshConfig
from k3jax.layers.kda import KDALayer
from k3jax.layers.mla import MLALayer
from k3jax.layers.moe import MoE
from k3jax.model import DecoderLayer, K3Model
from k3jax.sharding.context import ContextParallel
from k3jax.sharding.expert_parallel import expert_dispatch
from k3jax.sharding.heads import head_parallel_for, mla_head_parallel
from k3jax.sharding.mesh import partition_spec


@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """Activations laid out on ``mesh`` by ``rules`` (an `k3jax.layers.axes.ActivationLayout`)."""

    mesh: Mesh
    rules: AxisRules

    def __call__(self, x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
        """``x`` constrained to ``partition_spec(logical_axes, x.shape, rules, mesh)``."""
        spec = partition_spec(logical_axes, x.shape, self.rules, self.mesh)
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))


def parallelize(model: nnx.Module, mesh: Mesh, mesh_config: MeshConfig) -> nnx.Module:
    """``model`` (a `K3Model`, or any module holding MoE layers) set up to run on ``mesh`` as
    ``mesh_config`` says; changed in place and returned. Calling it again replaces the setup."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"parallelize needs a concrete jax.sharding.Mesh, got {type(mesh).__name__}")
    layout = MeshLayout(mesh, mesh_config.rules)
    dispatch = expert_dispatch(mesh, mesh_config)
    context = (ContextParallel(mesh, attention_method=mesh_config.context_attention)
               if mesh.shape.get("context", 1) > 1 else None)
    for _, module in nnx.iter_modules(model):
        if isinstance(module, (K3Model, DecoderLayer)):
            module.activation_layout = layout
        if isinstance(module, MoE):
            module.expert_dispatch = dispatch
        if isinstance(module, (KDALayer, MLALayer)):
            module.context_parallel = context
        if isinstance(module, MLALayer):
            module.head_parallel = None if context is not None else mla_head_parallel(mesh, mesh_config.rules)
        if isinstance(module, KDALayer):
            heads = module.config
            module.head_parallel = None if context is not None else head_parallel_for(
                mesh, mesh_config.rules, heads.num_heads, heads.num_value_heads, heads.conv_width)
    return model
