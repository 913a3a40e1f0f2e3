"""Reading a run directory's ``metrics.jsonl`` (written by the trainer, ``train.metrics.MetricsLog``).

One JSON object per line: training records ``{"step", "loss", ...}`` and, with ``train.eval_every``,
held-out evaluation records ``{"kind": "eval", "step", "heldout_loss", ...}``. Lines that do not
parse as an object (a crash can leave the last one torn) are skipped.
"""
from __future__ import annotations

import json
import os
import pathlib


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
