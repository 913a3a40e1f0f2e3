"""LoRA fine-tuning on a frozen base: the model split, the adapters' first values, the base's fingerprint.

With ``finetune.lora_rank > 0`` the model carries `k3jax.layers.lora` adapters and splits four ways
(`split_lora_model`):

    params    the adapters' factors (`LoRA`): the only arrays the optimizer sees and keeps state for
    buffers   the routers' selection biases: updated by the balancer only with
              ``finetune.update_router_bias`` (else frozen at the base's values)
    frozen    everything else (the base's parameters, whatever their variable types, and with MXFP4
              routed experts their packed codes and scales, `ExpertCodes`: QLoRA): never updated
    dropout   the adapters' dropout key slots, filled anew by every training forward

The base comes from a checkpoint of the base run (`restore_base`): its parameters from ``params``, its
MXFP4 codes and router biases from ``buffers``, where a run keeps them; the codes stay packed (the
layers decode them a tile at a time) and, like every frozen array, never reach the optimizer.

A LoRA run's checkpoints hold the adapters, the router biases and the adapters' optimizer state
only, with ``meta["lora_base"]``: where the base came from (``init_from``, step) and its
fingerprint (`base_fingerprint`), which a resume and `k3jax.inference.restore_model` check
against the base they load (the streaming exporter checks only that the base's model config is
the run's: fingerprinting would read the whole base first).
"""
from __future__ import annotations

import hashlib
import json
from typing import NamedTuple

import jax
from flax import nnx

from k3jax.checkpoint import CHECKSUMS, CheckpointError, restore_subtree, tree_checksums
from k3jax.sharding import abstract
from k3jax.config import ConfigError, FinetuneConfig, ModelConfig
from k3jax.layers.lora import (LoRA, LoRADropoutSeed, adaptable_weights, attach_adapters, select_weights,
                              set_adapter_dropout)
from k3jax.layers.moe import ExpertCodes, RouterBias
from k3jax.model import K3Model
from k3jax.training.state import ModelParts, StateCodec

BASE_META = "lora_base"


class LoRAModel(NamedTuple):
    """`split_lora_model`'s result: the parts and the flat ``{path: array}`` dicts of each group."""

    parts: ModelParts
    adapters: dict
    buffers: dict
    frozen: dict


def with_adapters(model: nnx.Module, finetune: FinetuneConfig, seed: int) -> nnx.Module:
    """``model`` with the adapters ``finetune`` asks for attached (in place; returned)."""
    try:
        attach_adapters(model, rank=finetune.lora_rank, alpha=finetune.lora_alpha, dropout_rate=finetune.lora_dropout,
                        targets=finetune.lora_targets, routed_experts=finetune.lora_routed_experts, seed=seed)
    except ValueError as error:
        raise ConfigError("", str(error)) from None
    return model


def split_lora_model(model: nnx.Module, finetune: FinetuneConfig) -> LoRAModel:
    """Split a model carrying adapters into adapters, buffers, frozen base and dropout slots."""
    groups = [LoRA, RouterBias, LoRADropoutSeed, ...]
    graphdef, adapters, buffers, dropout, frozen = nnx.split(model, *groups)
    codecs = [StateCodec(state) for state in (adapters, buffers, frozen, dropout)]
    parts = ModelParts(graphdef, codecs[0], codecs[1], frozen=codecs[2],
                       dropout=codecs[3] if finetune.lora_dropout else None, balance=finetune.update_router_bias)
    return LoRAModel(parts, *(codec.flatten(state) for codec, state in zip(codecs, (adapters, buffers, frozen))))


def abstract_lora_model(config: ModelConfig, finetune: FinetuneConfig, seed: int, mesh=None,
                        mesh_config=None) -> LoRAModel:
    """`split_lora_model` of the adapted model as ``jax.ShapeDtypeStruct``s (nothing allocated);
    with a ``mesh``, `parallelize`d for it."""
    from k3jax.sharding import parallelize

    def build():
        model = with_adapters(K3Model(config, rngs=nnx.Rngs(0)), finetune, seed)
        return model if mesh is None else parallelize(model, mesh, mesh_config)

    model = nnx.eval_shape(build)
    return split_lora_model(model, finetune)


def initial_adapters(config: ModelConfig, finetune: FinetuneConfig, seed: int, shardings=None) -> dict:
    """The adapters' first values (A random from ``seed`` and each weight's path, B zero), created
    where ``shardings`` place them. They depend on the shapes only, never on the base's values."""

    def create():
        return split_lora_model(with_adapters(nnx.eval_shape(lambda: K3Model(config, rngs=nnx.Rngs(0))), finetune,
                                              seed), finetune).adapters

    return jax.jit(create, out_shardings=shardings)()


def base_fingerprint(frozen: dict) -> str:
    """SHA-256 of the per-array checksums (`k3jax.checkpoint.tree_checksums`) of a base's frozen
    parameters: the same for any sharding or device count, different for any changed bit."""
    return hashlib.sha256(json.dumps(tree_checksums(frozen), sort_keys=True).encode()).hexdigest()


def saved_base_fingerprint(meta: dict, config: ModelConfig) -> str:
    """`base_fingerprint` of the base a model of ``config`` saved in a (full) checkpoint, from the
    checksums saved in its ``meta`` (no array is read): its parameters' (``params``) and MXFP4
    codes' (``buffers``); `CheckpointError` when the checkpoint lacks one."""
    model = nnx.eval_shape(lambda: K3Model(config, rngs=nnx.Rngs(0)))
    _, _, _, frozen = nnx.split(model, RouterBias, LoRADropoutSeed, ...)
    codec = StateCodec(frozen)
    codes, saved = set(codec.keys_of(ExpertCodes)), meta.get(CHECKSUMS) or {}
    sums = {}
    for key in codec.shapes():
        name = f"['{'buffers' if key in codes else 'params'}']['{key}']"
        if name not in saved:
            raise CheckpointError(f"the checkpoint has no saved checksum of {key} (a checkpoint of another model?)")
        sums[f"['{key}']"] = saved[name]
    return hashlib.sha256(json.dumps(sums, sort_keys=True).encode()).hexdigest()


def adapted_weights(config: ModelConfig, finetune: FinetuneConfig | None) -> list[tuple[str, bool]]:
    """``(weight path, routed)`` of every weight ``finetune`` adapts in a model of ``config`` (None:
    every weight an adapter can join, `k3jax.layers.lora.adaptable_weights`)."""
    model = nnx.eval_shape(lambda: K3Model(config, rngs=nnx.Rngs(0)))
    if finetune is None:
        return [(item.path, item.routed) for item in adaptable_weights(model)]
    try:
        chosen = select_weights(model, finetune.lora_targets, finetune.lora_routed_experts)
    except ValueError as error:
        raise ConfigError("", str(error)) from None
    return [(item.path, item.routed) for item in chosen]


def restore_base(source, step: int, parts: ModelParts, abstract_frozen: dict,
                 abstract_buffers: dict | None = None) -> tuple[dict, dict]:
    """``(frozen, buffers)`` of checkpoint ``step`` of the base run ``source``, placed like the
    abstract arrays: the frozen parameters from its ``params``; the frozen MXFP4 codes
    (``parts.frozen``'s `ExpertCodes`) and the ``abstract_buffers`` (router biases) from its
    ``buffers``. Raises `CheckpointError`."""
    codes = set(parts.frozen.keys_of(ExpertCodes))
    params, _ = restore_subtree(source, "params", {k: v for k, v in abstract_frozen.items() if k not in codes}, step)
    wanted = {**{key: abstract_frozen[key] for key in codes}, **(abstract_buffers or {})}
    buffers = restore_subtree(source, "buffers", wanted, step)[0] if wanted else {}
    frozen = {**params, **{key: buffers[key] for key in codes}}
    return frozen, {key: buffers[key] for key in abstract_buffers or {}}


def restored_base(meta: dict, parts: ModelParts, abstract_frozen: dict, where: str) -> dict:
    """The frozen base a LoRA checkpoint's ``meta`` names, restored like ``abstract_frozen`` and
    checked against the fingerprint it recorded (`CheckpointError` when it is gone or changed)."""
    base = meta.get(BASE_META)
    if not isinstance(base, dict):
        raise CheckpointError(f"{where}: a LoRA checkpoint without its base's record ({BASE_META})")
    try:
        frozen, _ = restore_base(base["init_from"], base["step"], parts, abstract_frozen)
    except CheckpointError as error:
        raise CheckpointError(f"{where}: its base {base['init_from']} step {base['step']}: {error}") from None
    found = base_fingerprint(frozen)
    if found != base["fingerprint"]:
        raise CheckpointError(f"{where}: its base {base['init_from']} step {base['step']} has changed "
                              f"(fingerprint {found[:12]}, the adapters were trained on {base['fingerprint'][:12]})")
    return frozen


def restore_lora_model(directory, step: int, config, meta: dict, placement=None) -> nnx.Module:
    """The fine-tuned model of LoRA checkpoint ``step``: its base (verified) with the adapters and
    router biases of the checkpoint, dropout off; on this process's first device, or restored
    straight into its shards on ``placement``'s mesh (`k3jax.inference.layout.Placement`), the
    adapters beside the weights they adapt."""
    mesh = None if placement is None else placement.mesh
    lora = abstract_lora_model(config.model, config.finetune, config.train.seed, mesh,
                               None if placement is None else placement.mesh_config)
    frozen, adapters, buffers = lora.frozen, lora.adapters, lora.buffers
    if placement is not None:
        frozen = abstract(frozen, placement.shardings(lora.parts.frozen.axes(), frozen))
        adapters = abstract(adapters, placement.shardings(lora.parts.params.axes(), adapters))
        buffers = abstract(buffers, placement.shardings(lora.parts.buffers.axes(), buffers))
    frozen = restored_base(meta, lora.parts, frozen, f"checkpoint {step} in {directory}")
    adapters, _ = restore_subtree(directory, "params", adapters, step)
    buffers, _ = restore_subtree(directory, "buffers", buffers, step)
    model = lora.parts.merge(adapters, buffers, frozen)
    set_adapter_dropout(model, 0.0)
    return model
