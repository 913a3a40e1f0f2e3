"""A trained model back from its checkpoints, to run it: evaluation, generation, serving, RL's
policy, reference and draft, export.

    run = load_run("runs/chat")                 # a run, its checkpoints/ or one step directory
    run = load_run("runs/chat", mesh="expert=4,tensor=2", dtype="bfloat16")   # sharded, cast
    run.model, run.config, run.step, run.run_dir, run.placement
    restored = restore_model("runs/chat", step=None, placement=None)   # the library call under it
    draft = load_draft("runs/small", run.config)       # a draft model for speculative decoding

The model is rebuilt from the config saved in the checkpoint: on this process's first device
(whatever devices wrote it), or on a mesh (`k3jax.inference.layout`), each array restored by Orbax
straight into the shards the inference layout gives it (the abstract arrays carry their
shardings, so nothing lands in the saved layout first). Parameters and router biases only (no
optimizer state), each array verified against its saved checksum, then cast shard by shard if a
dtype is asked for; MXFP4 experts stay packed. Every failure of `load_run` and `load_draft` is one
`InputError` line.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import pathlib
import sys
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.checkpoint import (CheckpointError, RunCheckpoints, checkpoint_directory,
                              restore_newest_good, restore_subtree)
from k3jax.config import Config, ConfigError, config_from_dict
from k3jax.data import DataError
from k3jax.data.tokenizers import same_tokenizer
from k3jax.inference.layout import MeshError, Placement, inference_placement
from k3jax.layers.lora import LoRA
from k3jax.sharding import abstract, parallelize
from k3jax.training.finetune import restore_lora_model
from k3jax.training.state import abstract_model, split_model


class RestoredModel(NamedTuple):
    model: nnx.Module
    config: Any               # the run's `k3jax.config.Config`
    meta: dict                # the checkpoint's metadata
    step: int


def _restore_model_at(directory, step: int, placement: Placement | None,
                      dtype: str | None) -> tuple[nnx.Module, Any, dict]:
    """``(model, config, meta)`` of checkpoint ``step``, its arrays verified, placed by ``placement``
    and cast to ``dtype``."""
    meta, config = saved_meta(directory, step)
    if dtype is not None:
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, compute_dtype=dtype))
    mesh, mesh_config = (None, None) if placement is None else (placement.mesh, placement.mesh_config)
    if config.finetune.lora:
        model = restore_lora_model(directory, step, config, meta, placement)
        return cast_weights(model, dtype), config, meta
    parts, params, buffers = abstract_model(config.model, mesh, mesh_config)
    if placement is not None:
        params = abstract(params, placement.shardings(parts.params.axes(), params))
        buffers = abstract(buffers, placement.shardings(parts.buffers.axes(), buffers))
    params, _ = restore_subtree(directory, "params", params, step)
    buffers, _ = restore_subtree(directory, "buffers", buffers, step)
    return cast_weights(parts.merge(params, buffers), dtype), config, meta


def place_model(model: nnx.Module, placement: Placement) -> nnx.Module:
    """A built model (its arrays wherever they are) moved onto ``placement``'s mesh, each array
    into its shards, and `parallelize`d for it: what `restore_model` gives for a checkpoint, for a
    model made in this process (benchmarks, tests)."""
    parts, params, buffers = split_model(model)
    params = jax.device_put(params, placement.shardings(parts.params.axes(), params))
    buffers = jax.device_put(buffers, placement.shardings(parts.buffers.axes(), buffers))
    return parallelize(parts.merge(params, buffers), placement.mesh, placement.mesh_config)


@functools.partial(jax.jit, static_argnames="dtype")
def _converted(array: jax.Array, dtype) -> jax.Array:
    """``array`` in ``dtype``, computed where its shards lie (the result keeps its sharding); one
    program per shape, sharding and dtype, shared by every layer."""
    return array.astype(dtype)


def cast_weights(model: nnx.Module, dtype: str | None) -> nnx.Module:
    """``model`` with its floating-point parameters (`nnx.Param`, LoRA adapters) in ``dtype`` (None:
    as stored), one array at a time where it lies: each device converts its own shards, and each
    stored array is freed once converted. Router biases and MXFP4 codes and scales are kept."""
    if dtype is None:
        return model
    target = jnp.dtype(dtype)
    for _, variable in nnx.iter_graph(model):
        if isinstance(variable, (nnx.Param, LoRA)) and jnp.issubdtype(variable.dtype, jnp.floating) \
                and variable.dtype != target:
            stored = variable.get_value()
            variable.set_value(_converted(stored, target))
            stored.delete()
    return model


def restore_model(directory, step: int | None = None, report=None, placement: Placement | None = None,
                  dtype: str | None = None) -> RestoredModel:
    """The model of a trainer checkpoint (a run directory or its ``checkpoints/``), built from the
    config saved with it. ``placement`` (`k3jax.inference.layout.inference_placement`) puts it on a
    mesh: every array is restored straight into its shards there (no host or device holds the
    whole model) and the model is `parallelize`d for the mesh; None: on this process's first
    device (whatever devices wrote it). ``dtype`` ("bfloat16", "float32"; None: as stored) converts
    the floating-point weights shard by shard after they are verified, and sets the model's
    ``compute_dtype``. ``step`` None picks the newest checkpoint that restores: each newer one that
    is corrupted or unreadable is reported through ``report`` (default: a logging warning) and
    skipped. Only parameters and router biases are read (not the optimizer state), each verified
    against its saved checksum; a LoRA run's model is its base (from the run it names) with the
    adapters it trained. Raises `k3jax.checkpoint.CheckpointError` when there is none."""
    checkpoints = RunCheckpoints(checkpoint_directory(directory), read_only=True)
    try:
        steps = [checkpoints.require_step(step)] if step is not None else checkpoints.steps()
        checkpoints.require_step(None)
    finally:
        checkpoints.close()
    report = report or logging.getLogger(__name__).warning
    restore = functools.partial(_restore_model_at, directory, placement=placement, dtype=dtype)
    step, (model, config, meta) = restore_newest_good(steps, restore, report)
    return RestoredModel(model, config, meta, step)


class InputError(ValueError):
    """Bad input to running a model (a missing or unreadable checkpoint, a draft that reads other
    token ids, a bad argument): one line, for the programs to print."""


class LoadedRun(NamedTuple):
    model: nnx.Module
    config: Config
    meta: dict
    step: int
    checkpoints: pathlib.Path     # the directory holding the step directories
    run_dir: pathlib.Path         # where the run's metrics.jsonl and summary.json are
    placement: Placement | None = None   # the mesh it runs on (None: this process's first device)


def locate_checkpoint(path: str, step: int | None) -> tuple[pathlib.Path, int | None]:
    """``(checkpoints directory, step)`` for a run, checkpoints or step directory (``step`` None: latest)."""
    given = pathlib.Path(path).expanduser().resolve()
    if not given.is_dir():
        raise InputError(f"{path}: no such directory")
    if given.name.isdigit() and not (given / "checkpoints").is_dir():
        if step is not None and step != int(given.name):
            raise InputError(f"{path} is the checkpoint of step {given.name}, but --step {step} was given")
        return given.parent, int(given.name)
    return checkpoint_directory(given), step


def _warn(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def load_run(path: str, step: int | None = None, mesh: str | dict | None = None,
             dtype: str | None = None) -> LoadedRun:
    """Restore the model of the checkpoint at ``path`` (a run directory, its ``checkpoints/`` or one
    step directory ``<run>/checkpoints/<step>``): ``step``, or else the newest one that restores
    (each newer, corrupted one reported on stderr); on ``mesh`` (``"expert=4,tensor=2"``, ``"auto"``
    or ``{axis: size}``; None: one device) over every device of every process, its floating-point
    weights in ``dtype`` (None: as stored). A mesh that cannot hold the model is refused before
    any weight is read."""
    checkpoints, step = locate_checkpoint(path, step)
    placement = None
    try:
        if mesh is not None:
            placement = inference_placement(saved_meta(checkpoints, step)[1].model, mesh)
        with warnings.catch_warnings():   # the trainer's checkpoints hold single-device arrays
            warnings.filterwarnings("ignore", message="Sharding info not provided when restoring")
            restored = restore_model(checkpoints, step, report=_warn, placement=placement, dtype=dtype)
    except MeshError as error:
        raise InputError(str(error)) from None
    except (CheckpointError, ConfigError) as error:
        raise InputError(f"cannot load the checkpoint in {checkpoints}: {error}") from None
    except (KeyError, TypeError, ValueError) as error:   # metadata without a usable config
        raise InputError(f"checkpoint in {checkpoints} has unusable metadata: {type(error).__name__}: {error}") from None
    run_dir = checkpoints.parent if checkpoints.name == "checkpoints" else checkpoints
    return LoadedRun(restored.model, restored.config, restored.meta, restored.step, checkpoints, run_dir, placement)


def saved_meta(directory, step: int | None) -> tuple[dict, Config]:
    """``(metadata, config)`` saved with checkpoint ``step`` (None: the newest) of a run, without
    its arrays; `CheckpointError` when there is no such checkpoint or it has no config."""
    checkpoints = RunCheckpoints(checkpoint_directory(directory), read_only=True)
    try:
        step = checkpoints.require_step(step)
        meta = checkpoints.meta(step)
    finally:
        checkpoints.close()
    if not isinstance(meta.get("config"), dict):
        raise CheckpointError(f"checkpoint {step} in {checkpoints.directory} has no saved config")
    return meta, config_from_dict(meta["config"])


def draft_mismatch(target: Config, draft: Config) -> str | None:
    """Why a model trained with ``draft`` cannot draft for one trained with ``target`` (None: it
    can): a draft must read the same token ids -- the same ``model.vocab_size`` and tokenizer
    (`k3jax.data.tokenizers.same_tokenizer`: bytes, or BPE files of the same content and special
    tokens). The one rule every speculative path applies (generate, chat, serve, RL rollouts)."""
    if draft.model.vocab_size != target.model.vocab_size:
        return (f"its vocabulary has {draft.model.vocab_size} tokens, the target's {target.model.vocab_size}: "
                f"a draft must share the target's vocabulary")
    try:
        same = same_tokenizer(draft.data.tokenizer, target.data.tokenizer)
    except DataError as error:
        return f"its tokenizer does not load: {error}"
    if not same:
        return (f"it was trained with tokenizer {draft.data.tokenizer or 'bytes'}, the target with "
                f"{target.data.tokenizer or 'bytes'}: a draft must share the target's tokenizer")
    return None


def draft_mesh(target_on_a_mesh: bool) -> str | None:
    """Where a draft model runs beside its target: on one device beside one device (None), beside a
    mesh on a mesh of every device of its own (``"auto"``: a small draft's few heads and experts
    split as far as they go), so that every process of a multi-process mesh runs it too."""
    return "auto" if target_on_a_mesh else None


def load_draft(path: str, target: Config, mesh: str | dict | None = None, dtype: str | None = None,
               step: int | None = None) -> nnx.Module:
    """The model of run ``path`` (``step``, else its newest good checkpoint) as a draft for a model
    trained with ``target``, on ``mesh`` in ``dtype`` (`load_run`): `InputError` when it does not
    load or reads other token ids (`draft_mismatch`)."""
    run = load_run(path, step, mesh=mesh, dtype=dtype)
    problem = draft_mismatch(target, run.config)
    if problem is not None:
        raise InputError(f"draft {path}: {problem}")
    return run.model
