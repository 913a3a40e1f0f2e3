"""A run directory: created writable, held by one trainer at a time, its files written atomically.

    <run_dir>/.lock                      `RunLock`: an exclusive advisory lock naming its holder
    <run_dir>/config.yaml, summary.json  written atomically (`write_atomically`)
    <run_dir>/checkpoints/               Orbax step directories (`k3jax.checkpoint`)
    <run_dir>/checkpoints-set-aside/     step directories a resume could not use (`set_aside`)
"""
from __future__ import annotations

import fcntl
import os
import pathlib
import shutil
import socket
import sys
import tempfile


class RunError(RuntimeError):
    """A run that cannot start or continue (the message is one line)."""


def say(message: str) -> None:
    """One line on stderr, at once."""
    print(message, file=sys.stderr, flush=True)


def prepare_run_dir(path: str) -> pathlib.Path:
    """Create the run directory and make sure it (and its checkpoints/, if present) is writable."""
    run_dir = pathlib.Path(path).expanduser().resolve()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        for directory in (run_dir, run_dir / "checkpoints"):
            if directory.is_dir():
                with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-test-"):
                    pass
    except OSError as error:
        raise RunError(f"cannot write run directory {run_dir}: {error.strerror or error}") from None
    return run_dir


def remove_if_empty(run_dir: pathlib.Path) -> None:
    """Remove ``run_dir`` when it holds nothing but empty directories and the lock file."""
    files = [path for path in run_dir.rglob("*") if not path.is_dir() and path.name != ".lock"]
    if not files:
        shutil.rmtree(run_dir, ignore_errors=True)


class RunLock:
    """An advisory, exclusive `fcntl` lock on ``<run_dir>/.lock``, which records who holds it. The
    kernel releases it when the process ends, however it ends."""

    def __init__(self, run_dir: pathlib.Path):
        self._file = open(run_dir / ".lock", "a+", encoding="utf-8")
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._file.seek(0)
            holder = self._file.read().strip() or "another process"
            self._file.close()
            raise RunError(f"run directory {run_dir} is in use by another trainer ({holder}); "
                           f"wait for it to end or choose another run_dir") from None
        self._file.seek(0)
        self._file.truncate()
        self._file.write(f"host {socket.gethostname()}, pid {os.getpid()}\n")
        self._file.flush()

    def release(self) -> None:
        if not self._file.closed:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()


def set_aside(run_dir: pathlib.Path, steps: list[int], reason: str) -> None:
    """Move the step directories ``steps`` of ``run_dir/checkpoints`` to ``run_dir/checkpoints-set-aside``."""
    if not steps:
        return
    target = run_dir / "checkpoints-set-aside"
    target.mkdir(exist_ok=True)
    for step in steps:
        destination = target / str(step)
        suffix = 1
        while destination.exists():
            destination, suffix = target / f"{step}.{suffix}", suffix + 1
        os.replace(run_dir / "checkpoints" / str(step), destination)
    say(f"moved checkpoints {', '.join(map(str, steps))} ({reason}) to {target}")
