"""Orbax checkpoints of a training run.

A run directory holds ``checkpoints/<step>/`` with two items: ``state`` (a pytree of arrays:
parameters, optimizer state, router biases, step) and ``meta`` (JSON: the resolved config, the
data position, the model config, what wrote it). Orbax writes each step into a temporary
directory and renames it when complete, so a killed save never becomes the latest checkpoint;
leftover temporaries are removed on the next start.

    checkpoints = RunCheckpoints(run_dir / "checkpoints", keep=3, every=100)
    checkpoints.save(step, state, meta)            # asynchronous unless async_save=False
    state, meta = checkpoints.restore(step, abstract_state)   # onto abstract_state's shardings
    params = restore_subtree(other_run / "checkpoints", "params", abstract_params)

Every failure (missing or corrupted checkpoint, full disk, unwritable directory) surfaces as a
`CheckpointError` with a one-line message.
"""
from __future__ import annotations

import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp

STATE, META = "state", "meta"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, found or read."""


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) < 300 else text[:297] + "..."


def checkpoint_directory(path: str | pathlib.Path) -> pathlib.Path:
    """The checkpoint directory of a run directory (``<run>/checkpoints``), or ``path`` itself when it
    already is one."""
    path = pathlib.Path(path).expanduser().resolve()
    return path / "checkpoints" if (path / "checkpoints").is_dir() else path


class RunCheckpoints:
    """The checkpoints of one run: saves every ``every`` steps (or when forced), keeps the last ``keep``."""

    def __init__(self, directory: str | pathlib.Path, *, keep: int = 3, every: int = 1,
                 async_save: bool = True, read_only: bool = False):
        self.directory = pathlib.Path(directory).expanduser().resolve()
        writing = {} if read_only else {"max_to_keep": keep, "save_interval_steps": every}
        options = ocp.CheckpointManagerOptions(
            **writing,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=not read_only,
            read_only=read_only,
            create=not read_only,
        )
        try:
            self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=(STATE, META))
        except Exception as error:  # noqa: BLE001 - any failure to open is reported the same way
            raise CheckpointError(f"cannot open checkpoints at {self.directory}: {_one_line(error)}") from error

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: Any, meta: dict, *, force: bool = False) -> bool:
        """Start saving ``state`` and ``meta`` at ``step`` (when due, or ``force``); True if started.

        A failure of an earlier asynchronous save is raised here or by `wait`."""
        try:
            return self._manager.save(
                step, args=ocp.args.Composite(**{STATE: ocp.args.StandardSave(state), META: ocp.args.JsonSave(meta)}),
                force=force,
            )
        except Exception as error:  # noqa: BLE001
            raise CheckpointError(f"saving checkpoint {step} in {self.directory} failed: {_one_line(error)}") from error

    def wait(self) -> None:
        """Block until pending saves are on disk."""
        try:
            self._manager.wait_until_finished()
        except Exception as error:  # noqa: BLE001
            raise CheckpointError(f"saving a checkpoint in {self.directory} failed: {_one_line(error)}") from error

    def meta(self, step: int | None = None) -> dict:
        """The JSON metadata of ``step`` (default: the latest)."""
        step = self.require_step(step)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))
        except Exception as error:  # noqa: BLE001
            raise CheckpointError(f"checkpoint {step} in {self.directory} is unreadable: {_one_line(error)}") from error
        return dict(restored[META])

    def restore(self, step: int | None, abstract_state: Any) -> tuple[Any, dict]:
        """The state and metadata of ``step`` (default: the latest), placed like ``abstract_state``
        (a pytree of `jax.ShapeDtypeStruct`, with shardings)."""
        step = self.require_step(step)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(
                **{STATE: ocp.args.StandardRestore(abstract_state), META: ocp.args.JsonRestore()}))
        except Exception as error:  # noqa: BLE001
            raise CheckpointError(f"checkpoint {step} in {self.directory} does not match this model or is "
                                  f"corrupted: {_one_line(error)}") from error
        return restored[STATE], dict(restored[META])

    def read_state(self, step: int | None = None) -> Any:
        """The state of ``step`` (default: the latest) as saved, without a target structure (host arrays)."""
        step = self.require_step(step)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**{STATE: ocp.args.StandardRestore()}))
        except Exception as error:  # noqa: BLE001
            raise CheckpointError(f"checkpoint {step} in {self.directory} is unreadable: {_one_line(error)}") from error
        return restored[STATE]

    def close(self) -> None:
        self._manager.close()

    def require_step(self, step: int | None) -> int:
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointError(f"no checkpoint in {self.directory}")
        elif step not in self._manager.all_steps():
            raise CheckpointError(f"no checkpoint for step {step} in {self.directory} (have {self.steps()})")
        return step


def latest_meta(directory: str | pathlib.Path, step: int | None = None) -> tuple[int, dict]:
    """``(step, metadata)`` of a run's checkpoint ``step`` (None: the latest), read only."""
    checkpoints = RunCheckpoints(checkpoint_directory(directory), read_only=True)
    try:
        step = checkpoints.require_step(step)
        return step, checkpoints.meta(step)
    finally:
        checkpoints.close()


def restore_subtree(directory: str | pathlib.Path, key: str, abstract: Any, step: int | None = None) -> tuple[Any, dict]:
    """Restore only ``state[key]`` (e.g. the parameters, for fine-tuning) of a run's checkpoint,
    placed like ``abstract``; returns ``(subtree, meta)``."""
    checkpoints = RunCheckpoints(checkpoint_directory(directory), read_only=True)
    step = checkpoints.require_step(step)
    restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=getattr(a, "sharding", None)), abstract)
    try:
        restored = checkpoints._manager.restore(step, args=ocp.args.Composite(**{
            STATE: ocp.args.PyTreeRestore(item={key: abstract}, restore_args={key: restore_args}, partial_restore=True),
            META: ocp.args.JsonRestore(),
        }))
    except Exception as error:  # noqa: BLE001
        raise CheckpointError(f"cannot restore '{key}' from checkpoint {step} in {checkpoints.directory}: "
                              f"{_one_line(error)}") from error
    finally:
        checkpoints.close()
    return restored[STATE][key], dict(restored[META])
