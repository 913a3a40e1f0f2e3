"""A trained model back from a run's checkpoints, for evaluation, generation and export."""
from __future__ import annotations

import functools
import logging
from typing import Any, NamedTuple

from flax import nnx

from k3jax.checkpoint import (CheckpointError, RunCheckpoints, checkpoint_directory, restore_newest_good,
                              restore_subtree)
from k3jax.config import config_from_dict
from k3jax.training.finetune import restore_lora_model
from k3jax.training.state import abstract_model


class RestoredModel(NamedTuple):
    model: nnx.Module
    config: Any               # the run's `k3jax.config.Config`
    meta: dict                # the checkpoint's metadata
    step: int


def _restore_model_at(directory, step: int) -> tuple[nnx.Module, Any, dict]:
    """``(model, config, meta)`` of checkpoint ``step``, its arrays verified."""
    checkpoints = RunCheckpoints(checkpoint_directory(directory), read_only=True)
    try:
        meta = checkpoints.meta(step)
    finally:
        checkpoints.close()
    if not isinstance(meta.get("config"), dict):
        raise CheckpointError(f"checkpoint {step} in {checkpoints.directory} has no saved config")
    config = config_from_dict(meta["config"])
    if config.finetune.lora:
        return restore_lora_model(directory, step, config, meta), config, meta
    parts, params, buffers = abstract_model(config.model)
    params, _ = restore_subtree(directory, "params", params, step)
    buffers, _ = restore_subtree(directory, "buffers", buffers, step)
    return parts.merge(params, buffers), config, meta


def restore_model(directory, step: int | None = None, report=None) -> RestoredModel:
    """The model of a trainer checkpoint (a run directory or its ``checkpoints/``), built from the
    config saved with it, on this process's first device (whatever devices wrote it). ``step`` None
    picks the newest checkpoint that restores: each newer one that is corrupted or unreadable is
    reported through ``report`` (default: a logging warning) and skipped. Only parameters and router
    biases are read (not the optimizer state), each verified against its saved checksum; a LoRA
    run's model is its base (from the run it names) with the adapters it trained. Raises
    `k3jax.checkpoint.CheckpointError` when there is none."""
    checkpoints = RunCheckpoints(checkpoint_directory(directory), read_only=True)
    try:
        steps = [checkpoints.require_step(step)] if step is not None else checkpoints.steps()
        checkpoints.require_step(None)
    finally:
        checkpoints.close()
    report = report or logging.getLogger(__name__).warning
    step, (model, config, meta) = restore_newest_good(steps, functools.partial(_restore_model_at, directory), report)
    return RestoredModel(model, config, meta, step)
