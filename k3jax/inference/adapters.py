"""Several LoRA fine-tunes served over one base model, each request choosing one (S-LoRA /
Punica-style batching: requests of different adapters decode in one batch).

    served = ServedAdapters.attach(run, capacity=4, rank=16, runs={"math": "runs/math-lora"})
    served.load("chat", "runs/chat-lora")      # into a free slot; the compiled programs are kept
    served.unload("math")                      # its slot is free again
    store.serve_adapters(served.tags())        # a `k3jax.sessions.SessionStore` over run.model
    sid = store.open(prompt, adapter=served.tag("chat"))

Every weight the adapters adapt gets an `k3jax.layers.lora.AdapterBank` of ``capacity + 1`` slots
(slot 0: the base) of rank ``rank``; an adapter of smaller rank is zero-padded (exact zeros), one
of larger rank is refused. The banks are sized once, so loading and unloading change values,
never the programs' shapes. The banks cover the weights the adapters given at start adapt (or
``targets``); an adapter loaded later that adapts another weight is refused by name. Routed
experts' adapters (``finetune.lora_routed_experts``) are not served per request: their
dispatch computes with merged weights (`k3jax.convert` exports such a fine-tune merged).

An adapter must have been trained on this base: its checkpoint records its base's fingerprint
(`k3jax.training.finetune.base_fingerprint`), compared with the fingerprint of the base's
checkpoint computed from the checksums saved with it (no weight is read again; the same whatever
``--dtype`` the base is served in). Each adapter's factors are restored from its own checkpoint,
verified against their checksums, onto the base's devices (replicated on a mesh: they are small).

A loaded adapter is known by its tag, ``name@`` and the digest of its checkpoint's metadata: a
session (`k3jax.sessions.tiers.Value.adapter`) and its cached prefixes keep the tag, so a name
reloaded with other weights never reuses them.
"""
from __future__ import annotations

import dataclasses
import functools
import pathlib
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp

from k3jax.checkpoint import META_DIGEST, CheckpointError, RunCheckpoints, restore_subtree
from k3jax.config import ConfigError
from k3jax.inference.load import InputError, LoadedRun, locate_checkpoint, saved_meta
from k3jax.layers.lora import (ADAPTER_SUFFIX, AdapterBank, adaptable_weights, attach_banks)
from k3jax.sharding import abstract
from k3jax.training.finetune import BASE_META, abstract_lora_model, adapted_weights, saved_base_fingerprint


class ServedAdapter(NamedTuple):
    name: str
    path: str            # the run or checkpoint directory it was loaded from
    step: int
    tag: str             # name@digest: what sessions and the prefix cache know it by
    slot: int            # its slot in every bank (1 ..)
    rank: int
    alpha: float
    weights: tuple       # the weight paths it adapts


class ServedAdapters:
    """The adapters a model serves (`attach`), by name; see the module docstring."""

    def __init__(self, run: LoadedRun, banks: dict[str, AdapterBank], rank: int, capacity: int):
        self.run, self.banks, self.rank, self.capacity = run, banks, rank, capacity
        # {name: record}, replaced (never changed in place) by load and unload: other threads (an
        # HTTP route listing the models) read it while the engine thread loads.
        self.adapters: dict[str, ServedAdapter] = {}
        self._base_fingerprint = None

    # ------------------------------------------------------------------ building
    @classmethod
    def attach(cls, run: LoadedRun, runs: Mapping[str, str], capacity: int | None = None,
               rank: int | None = None) -> "ServedAdapters":
        """Banks on ``run.model`` for ``runs`` ({name: LoRA run directory}), loaded into slots
        1.. in order; ``capacity`` slots for adapters in all (default: as many as ``runs``),
        ``rank`` the banks' rank (default: the largest of ``runs``'). The banks cover the weights
        ``runs`` adapt, or without any, every weight an adapter can join but the routed experts.
        `InputError` for any bad adapter, before the model changes."""
        if run.config.finetune.lora:
            raise InputError(f"{run.run_dir} is a LoRA run: serve its base, with each fine-tune as --lora NAME=RUN")
        capacity = len(runs) if capacity is None else capacity
        if capacity < max(len(runs), 1):
            raise InputError(f"--max-loras {capacity} cannot hold the {len(runs)} adapters given")
        described = {name: _describe(name, path) for name, path in runs.items()}
        rank = max((d.finetune.lora_rank for d in described.values()), default=0) if rank is None else rank
        if rank < 1:
            raise InputError("--max-lora-rank must be positive (or give --lora adapters to take it from)")
        weights: dict[str, None] = {}
        for d in described.values():
            weights.update(dict.fromkeys(d.weights))
        chosen = [w for w in adaptable_weights(run.model) if not w.routed and (w.path in weights or not runs)]
        served = cls(run, {}, rank, capacity)
        for name, path in runs.items():
            problem = served._mismatch(described[name], {w.path for w in chosen})
            if problem is not None:
                raise InputError(f"adapter {name} ({path}): {problem}")
        attach_banks(run.model, chosen, capacity + 1, rank)
        served.banks = {w.path: getattr(w.module, w.name + ADAPTER_SUFFIX) for w in chosen}
        if run.placement is not None:
            for bank in served.banks.values():
                for variable in (bank.a, bank.b, bank.scales):
                    sharding = run.placement.sharding(variable.get_metadata()["logical_axes"], variable.shape)
                    variable.set_value(jax.device_put(variable.get_value(), sharding))
        for name, path in runs.items():
            served._load(name, path, described[name])
        return served

    # ------------------------------------------------------------------ loading
    def load(self, name: str, path: str) -> ServedAdapter:
        """Load LoRA run ``path`` as ``name`` into a free slot -> its record. `InputError` when the
        name is taken, no slot is free, or the run cannot be served here (nothing changes then)."""
        return self._load(name, path, _describe(name, path))

    def unload(self, name: str) -> ServedAdapter:
        """Free adapter ``name``'s slot (its scale set to zero); `InputError` for an unknown name."""
        if name not in self.adapters:
            raise InputError(f"no adapter named {name!r} is loaded")
        adapter = self.adapters[name]
        self.adapters = {other: record for other, record in self.adapters.items() if other != name}
        for bank in self.banks.values():
            bank.scales.set_value(bank.scales.get_value().at[..., adapter.slot].set(0.0))
        return adapter

    def tag(self, name: str) -> str:
        return self.adapters[name].tag

    def tags(self) -> dict[str, int]:
        """``{tag: slot}`` of every loaded adapter (`k3jax.sessions.SessionStore.serve_adapters`)."""
        return {adapter.tag: adapter.slot for adapter in self.adapters.values()}

    def _load(self, name: str, path: str, described: "_Described") -> ServedAdapter:
        if name in self.adapters:
            raise InputError(f"an adapter named {name!r} is already loaded (unload it first)")
        problem = self._mismatch(described, self.banks.keys())
        if problem is not None:
            raise InputError(f"adapter {name} ({path}): {problem}")
        free = sorted(set(range(1, self.capacity + 1)) - {a.slot for a in self.adapters.values()})
        if not free:
            raise InputError(f"no free adapter slot: {self.capacity} adapters are loaded (--max-loras); unload one first")
        factors = _restore_factors(described, self.run.placement)
        slot = free[0]
        for weight, bank in self.banks.items():
            a, b = factors.get(weight, (None, None))
            scale = described.finetune.lora_scale if a is not None else 0.0
            bank.a.set_value(_filled(bank.a.get_value(), a, slot, slot_axis=bank.a.ndim - 2))
            bank.b.set_value(_filled(bank.b.get_value(), b, slot, slot_axis=bank.scales.ndim - 1))
            bank.scales.set_value(bank.scales.get_value().at[..., slot].set(scale))
        adapter = ServedAdapter(name, path, described.step, f"{name}@{described.digest[:16]}", slot,
                                described.finetune.lora_rank, described.finetune.lora_alpha, described.weights)
        self.adapters = {**self.adapters, name: adapter}
        return adapter

    def _mismatch(self, described: "_Described", covered) -> str | None:
        """Why ``described`` cannot be served over this base by banks on the weights ``covered``
        (None: it can)."""
        base = self.run.config.model
        if dataclasses.replace(described.config.model, compute_dtype=base.compute_dtype) != base:
            return "it fine-tunes a model of another configuration than the one served"
        if described.finetune.update_router_bias:
            return ("it trained the routers' biases (finetune.update_router_bias), which every request shares; "
                    "export it merged (python -m k3jax.convert export) and serve that")
        if described.finetune.lora_rank > self.rank:
            return f"its rank {described.finetune.lora_rank} is above the banks' {self.rank} (--max-lora-rank)"
        missing = [w for w in described.weights if w not in covered]
        if missing:
            return (f"it adapts {missing[0]}, which no adapter given at start adapts (the banks cover "
                    f"{len(covered)} weights; start the server with an adapter of each kind)")
        recorded = described.meta.get(BASE_META, {}).get("fingerprint")
        if recorded != self.base_fingerprint():
            base_record = described.meta.get(BASE_META, {})
            return (f"it was trained on {base_record.get('init_from')} step {base_record.get('step')}, whose "
                    f"weights are not the served base's ({self.run.checkpoints} step {self.run.step})")
        return None

    def base_fingerprint(self) -> str:
        """The served base's fingerprint, from the checksums saved with its checkpoint."""
        if self._base_fingerprint is None:
            try:
                meta, config = saved_meta(self.run.checkpoints, self.run.step)
                self._base_fingerprint = saved_base_fingerprint(meta, config.model)
            except CheckpointError as error:
                raise InputError(f"cannot check adapters against {self.run.checkpoints} step {self.run.step}: "
                                 f"{error}") from None
        return self._base_fingerprint


class _Described(NamedTuple):
    """A LoRA run's checkpoint as far as serving it needs, read from its metadata only."""

    checkpoints: pathlib.Path
    step: int
    meta: dict
    config: object
    digest: str
    weights: tuple

    @property
    def finetune(self):
        return self.config.finetune


def _describe(name: str, path: str) -> _Described:
    """The newest checkpoint of LoRA run ``path`` (or the one named), its metadata only; `InputError`
    for anything that cannot be an adapter."""
    if not name or any(c in name for c in "@/ \t"):
        raise InputError(f"adapter name {name!r}: give a non-empty name without '@', '/' or spaces")
    checkpoints, step = locate_checkpoint(path, None)
    try:
        step = _newest_step(checkpoints) if step is None else step
        meta, config = saved_meta(checkpoints, step)
    except (CheckpointError, ConfigError, KeyError, TypeError, ValueError) as error:
        raise InputError(f"adapter {name} ({path}): cannot read its checkpoint: {error}") from None
    if not config.finetune.lora:
        raise InputError(f"adapter {name} ({path}) is not a LoRA run (finetune.lora_rank is 0)")
    if config.finetune.lora_routed_experts:
        raise InputError(f"adapter {name} ({path}) adapts the routed experts, whose adapters cannot be chosen per "
                         f"request; export it merged (python -m k3jax.convert export) and serve that")
    weights = tuple(path for path, _ in adapted_weights(config.model, config.finetune))
    return _Described(checkpoints, step, meta, config, str(meta.get(META_DIGEST, "")), weights)


def _newest_step(checkpoints: pathlib.Path) -> int:
    """The newest step saved in ``checkpoints`` (`CheckpointError` when there is none)."""
    run = RunCheckpoints(checkpoints, read_only=True)
    try:
        return run.require_step(None)
    finally:
        run.close()


def _restore_factors(described: _Described, placement) -> dict[str, tuple[jax.Array, jax.Array]]:
    """``{weight path: (A, B)}`` of the adapter's checkpoint, verified (replicated on a mesh)."""
    config = described.config
    lora = abstract_lora_model(config.model, config.finetune, config.train.seed)
    adapters = lora.adapters
    if placement is not None:
        replicated = jax.sharding.NamedSharding(placement.mesh, jax.sharding.PartitionSpec())
        adapters = abstract(adapters, {key: replicated for key in adapters})
    try:
        restored, _ = restore_subtree(described.checkpoints, "params", adapters, described.step)
    except CheckpointError as error:
        raise InputError(f"adapter {described.checkpoints}: {error}") from None
    suffix = ADAPTER_SUFFIX + "/"
    return {weight: (restored[f"{weight}{suffix}a"], restored[f"{weight}{suffix}b"]) for weight in described.weights}


@functools.partial(jax.jit, static_argnames="slot_axis", donate_argnums=0)
def _filled(bank: jax.Array, factor: jax.Array | None, slot, slot_axis: int) -> jax.Array:
    """``bank`` with slot ``slot`` (axis ``slot_axis``, the rank right after it) := ``factor``
    zero-padded to the bank's rank (zeros for None); one program per bank shape, for every slot."""
    shape = bank.shape[:slot_axis] + bank.shape[slot_axis + 1:]
    if factor is None:
        value = jnp.zeros(shape, bank.dtype)
    else:
        pad = [(0, 0)] * factor.ndim
        pad[slot_axis] = (0, shape[slot_axis] - factor.shape[slot_axis])
        value = jnp.pad(factor.astype(bank.dtype), pad)
    return jax.lax.dynamic_update_index_in_dim(bank, value, slot, slot_axis)
