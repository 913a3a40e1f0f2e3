"""The train state: a model split into flat parameter and buffer dicts, and its optimizer state.

The model's NNX state is kept as two flat dicts keyed by parameter path (``"body/layers/0/
mixer/q_proj"``): ``params`` (`nnx.Param`s, trained by the optimizer) and ``buffers`` (the
routers' selection biases, updated by the balancer, and the frozen MXFP4 routed experts). Flat
string-keyed dicts make the optimizer state, the checkpoints and the sharding rules simple;
`StateCodec` converts back to NNX.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from k3jax.config import MeshConfig, ModelConfig
from k3jax.layers.lora import LoRA, LoRADropoutSeed, dropout_keys
from k3jax.layers.moe import ExpertCodes, RouterBias
from k3jax.layers.params import logical_axes
from k3jax.model import K3Model
from k3jax.sharding import parallelize


# Variables kept beside the trained parameters: the routers' selection biases and MXFP4 experts.
BUFFER_TYPES = (RouterBias, ExpertCodes)


class StateCodec:
    """Converts an NNX state to a flat ``{path: array}`` dict and back (the Variable types and
    metadata come from the template the codec was built with)."""

    def __init__(self, template: nnx.State):
        self._entries = [("/".join(map(str, path)), path, variable) for path, variable in nnx.to_flat_state(template)]

    def flatten(self, state: nnx.State) -> dict[str, jax.Array]:
        return {"/".join(map(str, path)): variable.get_value() for path, variable in nnx.to_flat_state(state)}

    def unflatten(self, flat: dict[str, jax.Array]) -> nnx.State:
        return nnx.from_flat_state([(path, variable.replace(flat[key])) for key, path, variable in self._entries])

    def keys_of(self, variable_types) -> list[str]:
        """The keys of the entries that are instances of ``variable_types`` (a type or a tuple)."""
        return [key for key, _, variable in self._entries if isinstance(variable, variable_types)]

    def axes(self) -> dict[str, tuple[str, ...]]:
        """Logical axis names of every entry."""
        return {key: logical_axes(variable) for key, _, variable in self._entries}

    def shapes(self) -> dict[str, jax.ShapeDtypeStruct]:
        """Shape and dtype of every entry."""
        return {key: jax.ShapeDtypeStruct(variable.shape, variable.dtype) for key, _, variable in self._entries}


class ModelParts(NamedTuple):
    """A model split for functional use: its graph and the codecs of its params (what the optimizer
    trains) and buffers; for LoRA (`k3jax.training.finetune`) also of the frozen base and of the adapters'
    dropout key slots, and ``balance``: whether the train step updates the routers' biases."""

    graphdef: Any
    params: StateCodec
    buffers: StateCodec
    frozen: StateCodec | None = None
    dropout: StateCodec | None = None
    balance: bool = True

    def merge(self, params: dict, buffers: dict, frozen: dict | None = None, dropout_key: jax.Array | None = None):
        """The model with these parameter, buffer (and frozen) values; a LoRA model's dropout draws
        its masks from ``dropout_key`` (None: the slots hold zeros)."""
        states = [self.params.unflatten(params), self.buffers.unflatten(buffers)]
        if self.frozen is not None:
            states.append(self.frozen.unflatten(frozen))
        if self.dropout is not None:
            states.append(self.dropout.unflatten(dropout_keys(self.dropout.shapes(), dropout_key)))
        return nnx.merge(self.graphdef, *states)


def split_model(model: nnx.Module) -> tuple[ModelParts, dict, dict]:
    """``(parts, params, buffers)`` of a model (concrete or abstract from `nnx.eval_shape`); a
    fine-tuned model's LoRA adapters (and dropout slots) count as params here (LoRA training
    splits with `k3jax.training.finetune.split_lora_model` instead)."""
    graphdef, params, buffers = nnx.split(model, (nnx.Param, LoRA, LoRADropoutSeed), BUFFER_TYPES)
    parts = ModelParts(graphdef, StateCodec(params), StateCodec(buffers))
    return parts, parts.params.flatten(params), parts.buffers.flatten(buffers)


class TrainState(NamedTuple):
    step: jax.Array           # optimizer steps taken (int32)
    params: dict              # {path: fp32 array}
    buffers: dict             # {path: array}: router selection biases, MXFP4 expert codes and scales
    opt_state: Any
    skipped: jax.Array        # consecutive non-finite steps skipped so far (int32)


def init_train_state(params: dict, buffers: dict, optimizer: optax.GradientTransformation) -> TrainState:
    return TrainState(jnp.zeros((), jnp.int32), params, buffers, optimizer.init(params), jnp.zeros((), jnp.int32))


def abstract_model(config: ModelConfig, mesh: Mesh | None = None,
                   mesh_config: MeshConfig | None = None) -> tuple[ModelParts, dict, dict]:
    """`split_model` of the model ``config`` describes, as ``jax.ShapeDtypeStruct``s (nothing
    allocated); with a ``mesh``, the model is `parallelize`d for it as ``mesh_config`` says."""
    model = nnx.eval_shape(lambda: K3Model(config, rngs=nnx.Rngs(0)))
    return split_model(model if mesh is None else parallelize(model, mesh, mesh_config))


def abstract_train_state(params: dict, buffers: dict, optimizer: optax.GradientTransformation) -> TrainState:
    """The `TrainState` of abstract ``params`` and ``buffers`` (``jax.ShapeDtypeStruct``s)."""
    return jax.eval_shape(functools.partial(init_train_state, optimizer=optimizer), params, buffers)


def sharded_train_state(config: ModelConfig, seed: int, optimizer: optax.GradientTransformation,
                        shardings: TrainState) -> TrainState:
    """A freshly initialised `TrainState` created where ``shardings`` place it: one jitted program
    in which every device computes only its own shards (no full copy on any host, as a K3 needs).
    The values depend on ``seed`` only, not on the mesh (partitionable threefry)."""

    def initialise():
        _, params, buffers = split_model(K3Model(config, rngs=nnx.Rngs(seed)))
        return init_train_state(params, buffers, optimizer)

    return jax.jit(initialise, out_shardings=shardings)()


def sharded_state_from_params(params: dict, buffers: dict, optimizer: optax.GradientTransformation,
                            shardings: TrainState) -> TrainState:
    """A `TrainState` at step 0 around given (e.g. restored) parameters, laid out by ``shardings``."""
    return jax.jit(functools.partial(init_train_state, optimizer=optimizer), out_shardings=shardings)(params, buffers)
