"""Where a run starts: its train state resumed from its own checkpoints, or initialised afresh,
from ``init_from``'s parameters, or (LoRA) as first adapters on ``init_from``'s frozen base.

    start_run(config, layout, checkpoints, data_hash, run_dir, primary) -> RunStart

A resume restores ``train.resume_step`` or else the newest checkpoint that restores, after checking
that it was written by the same model (`check_same_model`: kernel choices may differ), on the same
data (`check_same_data`) and, for LoRA, on the same base (`check_same_base`).
"""
from __future__ import annotations

import pathlib
from typing import Any, NamedTuple

from k3jax.checkpoint import CheckpointError, RunCheckpoints, latest_meta, restore_newest_good, restore_subtree
from k3jax.config import Config, to_dict
from k3jax.sharding import wait_for_all_processes
from k3jax.training.finetune import BASE_META, base_fingerprint, initial_adapters, restore_base
from k3jax.training.layout import RunLayout
from k3jax.training.run_dir import RunError, say, set_aside
from k3jax.training.state import TrainState, sharded_state_from_params, sharded_train_state


def _flat_items(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        out.update(_flat_items(value, name) if isinstance(value, dict) else {name: value})
    return out


def setting_differences(section: str, saved: dict, current: dict, ignore: tuple[str, ...] = ()) -> list[str]:
    """``section.key: checkpoint X, config Y`` for every setting of ``section`` that differs, but
    the dotted keys in ``ignore``."""
    old, new = _flat_items(saved, section), _flat_items(current, section)
    return [f"{key}: checkpoint {old.get(key)!r}, config {new.get(key)!r}"
            for key in sorted(old.keys() | new.keys()) if key not in ignore and old.get(key) != new.get(key)]


def _first_of(differences: list[str]) -> str:
    return differences[0] + (f" (and {len(differences) - 1} more)" if len(differences) > 1 else "")


# Model settings that choose kernels, not parameters or mathematics (the same numbers up to fp32
# rounding): a checkpoint written with one loads with another.
KERNEL_SETTINGS = ("model.kda.implementation", "model.mla.attention_implementation",
                   "model.mla.attention_block_size", "model.moe.expert_matmul", "model.moe.mxfp4_implementation")


def check_same_model(meta: dict, config: Config, source: str) -> None:
    differences = setting_differences("model", meta.get("config", {}).get("model", {}), to_dict(config.model),
                                      ignore=KERNEL_SETTINGS)
    if differences:
        raise RunError(f"{source} was written by a different model: {_first_of(differences)}")


# Data settings that change how batches are read, not which: they may differ on resume.
READING_SETTINGS = ("data.prefetch",)


def check_same_data(meta: dict, config: Config, content_hash: str, source: str) -> None:
    """Refuse to resume a checkpoint trained on other data settings, or on data whose content has
    changed since (``train.allow_data_change`` allows both)."""
    if config.train.allow_data_change:
        return
    differences = setting_differences("data", meta.get("config", {}).get("data", {}), to_dict(config.data),
                                      ignore=READING_SETTINGS)
    if meta.get("data_hash", content_hash) != content_hash:
        differences.append(f"the data's content: checkpoint {meta['data_hash'][:12]}, now {content_hash[:12]}")
    if differences:
        raise RunError(f"{source} was trained on other data: {_first_of(differences)}; resume with the same data "
                       f"or set train.allow_data_change=true")


def check_same_base(meta: dict, base: dict, source: str) -> None:
    """Refuse a LoRA checkpoint whose adapters were trained on another base than ``base``."""
    saved = meta.get(BASE_META) or {}
    if saved.get("fingerprint") != base["fingerprint"]:
        raise RunError(f"{source} holds adapters for a different base (fingerprint "
                       f"{str(saved.get('fingerprint'))[:12]}, from {saved.get('init_from')} step {saved.get('step')}); "
                       f"init_from={base['init_from']} step {base['step']} has {base['fingerprint'][:12]}")


class RunStart(NamedTuple):
    """A run's first state: the train state, the batches consumed, the checkpoint it resumed from
    (None for a fresh run) and, for a LoRA run, its frozen base: the arrays (``frozen``) and
    where they came from (``base``: ``init_from``, step, fingerprint; saved with each checkpoint)."""

    state: TrainState
    position: int
    resumed_from: int | None
    frozen: Any = None
    base: dict | None = None


def start_run(config: Config, layout: RunLayout, checkpoints: RunCheckpoints, data_hash: str,
              run_dir: pathlib.Path, primary: bool) -> RunStart:
    """Resume from the newest usable checkpoint in ``checkpoints`` (or ``train.resume_step``), else
    initialise; a LoRA run loads its base first. ``primary``: the process that sets aside the
    checkpoints a resume cannot use."""
    frozen = base_buffers = base = None
    if config.finetune.lora:
        frozen, base_buffers, base = load_base(config, layout)
    steps = checkpoints.steps()
    if steps:
        state, position, step = resume(config, layout, checkpoints, steps, data_hash, base, run_dir, primary)
        return RunStart(state, position, step, frozen, base)
    if config.train.resume_step is not None:
        raise RunError(f"train.resume_step={config.train.resume_step}, but {run_dir} has no checkpoint")
    return RunStart(initial_state(config, layout, base_buffers), 0, None, frozen, base)


def load_base(config: Config, layout: RunLayout) -> tuple[Any, Any, dict]:
    """A LoRA run's frozen base: ``init_from``'s latest parameters, MXFP4 expert codes (QLoRA)
    and router biases -> (frozen arrays, router-bias buffers, where they came from)."""
    if not config.init_from:
        raise RunError("finetune.lora_rank > 0 trains adapters on a frozen base: set init_from=RUN_DIR (the base run)")
    source = pathlib.Path(config.init_from).expanduser().resolve()
    try:
        step, meta = latest_meta(source)
        check_same_model(meta, config, f"init_from {source}")
        frozen, buffers = restore_base(source, step, layout.parts, layout.frozen, layout.state.buffers)
    except CheckpointError as error:
        raise CheckpointError(f"init_from={source}: {error}") from None
    return frozen, buffers, {"init_from": str(source), "step": step, "fingerprint": base_fingerprint(frozen)}


def resume(config: Config, layout: RunLayout, checkpoints: RunCheckpoints, steps: list[int], data_hash: str,
           base: dict | None, run_dir: pathlib.Path, primary: bool) -> tuple[TrainState, int, int]:
    """Restore ``train.resume_step`` or else the newest of ``steps`` that restores; set aside the
    newer ones (unusable, or superseded by the choice) so that the run can save those steps again.
    Returns (state, data position, the step restored)."""
    def restore_checkpoint(step: int) -> tuple[TrainState, dict]:
        meta = checkpoints.meta(step)
        check_same_model(meta, config, f"checkpoint {step} in {run_dir}")
        check_same_data(meta, config, data_hash, f"checkpoint {step} in {run_dir}")
        if base is not None:
            check_same_base(meta, base, f"checkpoint {step} in {run_dir}")
        return checkpoints.restore(step, layout.state)

    wanted = config.train.resume_step
    candidates = [checkpoints.require_step(wanted)] if wanted is not None else steps
    try:
        step, (state, meta) = restore_newest_good(candidates, restore_checkpoint, say)
    except CheckpointError as error:
        raise CheckpointError(f"no usable checkpoint: {error}; pick one with train.resume_step=N "
                              f"or start afresh in another run_dir") from None
    if primary:
        set_aside(run_dir, [s for s in steps if s > step],
                  "newer than train.resume_step" if wanted is not None else "unusable")
    wait_for_all_processes("checkpoints set aside")
    checkpoints.reload()
    return state, int(meta["data_position"]), step


def initial_state(config: Config, layout: RunLayout, base_buffers: Any = None) -> TrainState:
    """A fresh run's state: first adapters on a LoRA run's base (whose router biases are
    ``base_buffers``), else ``init_from``'s parameters and buffers, else initialised from
    ``train.seed``; each with a new optimizer state."""
    optimizer, shardings = layout.optimizer, layout.shardings.state
    if config.finetune.lora:
        adapters = initial_adapters(config.model, config.finetune, config.train.seed, shardings.params)
        return sharded_state_from_params(adapters, base_buffers, optimizer, shardings)
    if config.init_from:
        source = pathlib.Path(config.init_from).expanduser()
        try:
            params, meta = restore_subtree(source, "params", layout.state.params)
            check_same_model(meta, config, f"init_from {source}")
            buffers, _ = restore_subtree(source, "buffers", layout.state.buffers)
        except CheckpointError as error:
            raise CheckpointError(f"init_from={source}: {error}") from None
        return sharded_state_from_params(params, buffers, optimizer, shardings)
    return sharded_train_state(config.model, config.train.seed, optimizer, shardings)
