"""What every k3jax dataset shares: the batch format, the splits, and which rows a process owns.

A batch is a dict of host NumPy arrays, each ``[rows, seq_len]``:

    tokens       int32    model inputs
    targets      int32    the next token at each position (``tokens`` shifted left by one)
    loss_mask    float32  1.0 where the position counts in the loss, else 0.0
    segment_ids  int32    document number per position, from 1 within each row; the model resets its
                          memory and blocks attention where it changes; 0 marks padding

Batch ``step`` holds the global rows ``step * batch_size ... step * batch_size + batch_size - 1`` of
a split's row stream; process ``p`` of ``P`` gets the ``p``-th contiguous block of
``batch_size // P`` of them. A row is a pure function of the dataset definition, its seed, the split
and the row's global index, so a run resumes from ``(seed, step)`` alone, on any number of processes.
"""
from __future__ import annotations

import hashlib
import json
from typing import Protocol

import numpy as np

from k3jax.data.errors import DataError, require_int

Batch = dict[str, np.ndarray]
SPLITS = ("train", "heldout")


class Dataset(Protocol):
    """The interface the trainer and the evaluators use; `MQARDataset` and `TextDataset` implement it."""

    seq_len: int

    @property
    def vocab_size(self) -> int:
        """Token ids in a batch are in ``[0, vocab_size)``."""

    def batch(self, step: int, batch_size: int, split: str = "train",
              process_index: int = 0, process_count: int = 1) -> Batch:
        """This process's rows of global batch ``step`` (``batch_size`` rows over all processes)."""

    def describe(self) -> dict:
        """A JSON-serialisable summary of the definition, for logs and checkpoints."""

    def content_hash(self) -> str:
        """A hex digest that changes whenever any row of any split would change."""


def split_index(split: str) -> int:
    """The split's position in `SPLITS` (it seeds that split's random stream)."""
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; expected one of {', '.join(map(repr, SPLITS))}")
    return SPLITS.index(split)


def shard_row_indices(step: int, batch_size: int, process_index: int = 0, process_count: int = 1) -> np.ndarray:
    """Global row indices (int64) that process ``process_index`` of ``process_count`` reads at ``step``."""
    step = require_int("step", step, 0)
    batch_size = require_int("batch_size", batch_size, 1)
    process_count = require_int("process_count", process_count, 1)
    process_index = require_int("process_index", process_index, 0)
    if process_index >= process_count:
        raise DataError(f"process_index must be in [0, process_count); got {process_index} of {process_count}")
    if batch_size % process_count:
        raise DataError(f"batch_size {batch_size} must be a multiple of process_count {process_count}")
    rows_per_process = batch_size // process_count
    first = step * batch_size + process_index * rows_per_process
    return np.arange(first, first + rows_per_process, dtype=np.int64)


def inputs_and_targets(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[R, T+1]`` token rows → contiguous ``(tokens, targets)``: ``rows[:, :-1]`` and ``rows[:, 1:]``."""
    return np.ascontiguousarray(rows[:, :-1]), np.ascontiguousarray(rows[:, 1:])


def definition_hash(definition: dict, *arrays: np.ndarray) -> str:
    """SHA-256 of a JSON definition (keys sorted) followed by the raw bytes of ``arrays``."""
    digest = hashlib.sha256(json.dumps(definition, sort_keys=True).encode())
    for array in arrays:
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()
