"""Finding and restoring the checkpoint to evaluate, with every failure as one `EvalInputError` line.

Accepted paths: a run directory (``<run>/checkpoints/<step>/``), its ``checkpoints/`` directory, or
one step directory ``<run>/checkpoints/<step>``. The model is rebuilt from the config saved in the
checkpoint (`k3jax.training.restore_model`), on the devices of this process.
"""
from __future__ import annotations

import pathlib
import sys
import warnings
from typing import NamedTuple

from flax import nnx

from k3jax.checkpoint import CheckpointError, checkpoint_directory
from k3jax.config import Config, ConfigError
from k3jax.training import restore_model


class EvalInputError(Exception):
    """Bad input to the evaluator (a missing or unreadable checkpoint, a bad argument): one line."""


class LoadedRun(NamedTuple):
    model: nnx.Module
    config: Config
    meta: dict
    step: int
    checkpoints: pathlib.Path     # the directory holding the step directories
    run_dir: pathlib.Path         # where the run's metrics.jsonl and summary.json are


def locate_checkpoint(path: str, step: int | None) -> tuple[pathlib.Path, int | None]:
    """``(checkpoints directory, step)`` for a run, checkpoints or step directory (``step`` None: latest)."""
    given = pathlib.Path(path).expanduser().resolve()
    if not given.is_dir():
        raise EvalInputError(f"{path}: no such directory")
    if given.name.isdigit() and not (given / "checkpoints").is_dir():
        if step is not None and step != int(given.name):
            raise EvalInputError(f"{path} is the checkpoint of step {given.name}, but --step {step} was given")
        return given.parent, int(given.name)
    return checkpoint_directory(given), step


def _warn(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def load_run(path: str, step: int | None = None) -> LoadedRun:
    """Restore the model of the checkpoint at ``path``: ``step``, or else the newest one that
    restores (each newer, corrupted one reported on stderr)."""
    checkpoints, step = locate_checkpoint(path, step)
    try:
        with warnings.catch_warnings():   # the trainer's checkpoints hold single-device arrays
            warnings.filterwarnings("ignore", message="Sharding info not provided when restoring")
            restored = restore_model(checkpoints, step, report=_warn)
    except (CheckpointError, ConfigError) as error:
        raise EvalInputError(f"cannot load the checkpoint in {checkpoints}: {error}") from None
    except (KeyError, TypeError, ValueError) as error:   # metadata without a usable config
        raise EvalInputError(f"checkpoint in {checkpoints} has unusable metadata: {type(error).__name__}: {error}") from None
    run_dir = checkpoints.parent if checkpoints.name == "checkpoints" else checkpoints
    return LoadedRun(restored.model, restored.config, restored.meta, restored.step, checkpoints, run_dir)
