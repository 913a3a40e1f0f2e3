"""Where a run's numbers go: a JSONL file, optional TensorBoard events, a progress bar or log lines.

``<run_dir>/metrics.jsonl`` holds one JSON object per logged step and, with ``train.eval_every``,
one ``{"kind": "eval", "step": N, "heldout_loss": ..., ...}`` per periodic held-out evaluation
(readers that look for ``loss`` skip them). On resume the lines of steps
after the restored checkpoint are dropped first (they are about to be recomputed), so the file
always reads as one uninterrupted run. A line that does not parse (a crash can leave the last one
torn) is dropped there, and skipped by `read_metrics`.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import sys
import time
from typing import Any

from tqdm import tqdm

from k3jax.disk import disk_full, free_space
from k3jax.training.run_dir import RunError


def parsed_lines(path: pathlib.Path) -> list[dict]:
    """The JSON objects of the lines of ``path`` that parse as one (torn or foreign lines skipped)."""
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """The records of a run's metrics file (empty when there is none)."""
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    return parsed_lines(path) if path.exists() else []


def jsonable(value: Any) -> Any:
    """Plain JSON values from numpy / jax scalars and arrays, in lists and dicts (non-finite floats
    become the strings "nan", "inf", "-inf": strict JSON has no literal for them)."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {key: jsonable(v) for key, v in value.items()}
    return value


class MetricsLog:
    """Append-only JSONL of ``{"step": ..., ...}`` records."""

    def __init__(self, path: pathlib.Path, resume_step: int):
        self.path = path
        self._drop_after(resume_step)
        self._file = open(path, "a", encoding="utf-8")

    def _drop_after(self, step: int) -> None:
        if not self.path.exists():
            return
        kept = [record for record in parsed_lines(self.path) if record.get("step", 0) <= step]
        temporary = self.path.with_suffix(".jsonl.tmp")
        temporary.write_text("".join(json.dumps(record) + "\n" for record in kept), encoding="utf-8")
        os.replace(temporary, self.path)

    def write(self, record: dict) -> None:
        """Append ``record`` as one line, flushed; a failed write (a full disk) is a one-line `RunError`."""
        try:
            self._file.write(json.dumps({k: jsonable(v) for k, v in record.items()}) + "\n")
            self._file.flush()
        except OSError as error:
            reason = f"no space left on device ({free_space(self.path)} free)" if disk_full(error) else error.strerror or error
            raise RunError(f"writing {self.path} failed: {reason}; the checkpoints saved so far are kept: make room "
                           "and run again to resume") from None

    def close(self) -> None:
        try:
            self._file.close()
        except OSError:          # its last flush failed: `write` already reported why
            pass


class TensorBoard:
    """Scalar summaries through tensorboardX (an optional dependency: ``pip install k3jax[tensorboard]``)."""

    def __init__(self, directory: pathlib.Path):
        try:
            from tensorboardX import SummaryWriter
        except ImportError as error:
            raise RuntimeError("logging.tensorboard=true needs tensorboardX: pip install 'k3jax[tensorboard]'") from error
        self._writer = SummaryWriter(str(directory))

    def write(self, record: dict) -> None:
        step = record["step"]
        for name, value in record.items():
            if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(name, value, step)
            elif isinstance(value, list):
                for index, item in enumerate(value):
                    self._writer.add_scalar(f"{name}/{index}", item, step)

    def close(self) -> None:
        self._writer.close()


class Progress:
    """Where the run shows its progress, on stderr: a bar (step, loss, tokens/s, ETA) when
    ``enabled`` and stderr is a terminal, else a plain line every ``every`` steps. The first step
    of a run (which compiles) is left out of the rate, so the ETA starts after it."""

    def __init__(self, enabled: bool, start: int, total: int, every: int):
        self._use_bar = enabled and sys.stderr.isatty()
        self._step, self._total, self._every = start, total, every
        self._bar = None
        self._timed_from: tuple[float, int] | None = None   # (time, step) after the first step

    def update(self, steps: int, loss: float, tokens_per_second: float) -> None:
        self._step += steps
        now = time.perf_counter()
        if self._timed_from is None:
            self._timed_from = (now, self._step)
            if self._use_bar:
                self._bar = tqdm(total=self._total, initial=self._step, unit="step", dynamic_ncols=True,
                                 file=sys.stderr, smoothing=0.1)
        elif self._bar is not None:
            self._bar.set_postfix_str(f"loss {loss:.4f}, {tokens_per_second:,.0f} tok/s", refresh=False)
            self._bar.update(steps)
            return
        if self._bar is None and (self._step % self._every == 0 or self._step == self._total):
            self.write(f"step {self._step}/{self._total}  loss {loss:.4f}  {tokens_per_second:,.0f} tok/s  "
                       f"ETA {self.eta(now)}")

    def eta(self, now: float) -> str:
        """The time left at the rate since the first step ("?" until a second step has run)."""
        started, first = self._timed_from
        if self._step <= first:
            return "?"
        seconds = (self._total - self._step) * (now - started) / (self._step - first)
        minutes, seconds = divmod(int(seconds), 60)
        hours, minutes = divmod(minutes, 60)
        return f"{hours}:{minutes:02d}:{seconds:02d}"

    def write(self, message: str) -> None:
        if self._bar is not None:
            self._bar.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
