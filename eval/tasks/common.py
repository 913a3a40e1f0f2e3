"""What every evaluation task shares: the context it runs in, its result, its content hash, and a
jitted held-out forward that counts its cost.

A task is a frozen dataclass whose fields are its whole definition (sizes, lengths, prompts).
``run(context, cost, progress) -> TaskOutput`` evaluates it once per seed in ``context.seeds``;
`run_task` times it and hashes it:

    content hash = sha256(canonical JSON of {"task": name, "definition": fields, "data": data hash})

where the data hash identifies what the task read (a dataset's ``content_hash()``, or a hash of
the generated prompts), so two reports with the same hash measured the same thing.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import time
from typing import Any, NamedTuple

import numpy as np
from tqdm import tqdm

from k3jax.config import Config
from k3jax.flops import forward_flops
from k3jax.model import K3Model
from k3jax.training import make_eval_step, split_model

from ..cost import Cost


class TaskSkipped(Exception):
    """The task does not apply to this model (the message says why, in one line)."""


class TaskOutput(NamedTuple):
    """What a task's ``run`` returns: table rows (scalars and `Estimate`s), the hash of the data it
    read, and free-form examples (generated samples)."""

    rows: list[dict]
    data_hash: str
    examples: list[dict] = []


class TaskResult(NamedTuple):
    name: str
    definition: dict
    content_hash: str | None
    output: TaskOutput | None
    cost: Cost
    skipped: str | None = None


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and no whitespace: the same value always gives the same text."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def content_hash(name: str, definition: dict, data_hash: str) -> str:
    """The task's identity: its name, its frozen definition and the data it reads."""
    return sha256_text(canonical_json({"task": name, "definition": definition, "data": data_hash}))


class BatchOutput(NamedTuple):
    loss_sum: float          # nats, summed over positions with loss_mask > 0
    count: float             # positions with loss_mask > 0
    predictions: np.ndarray  # argmax of the logits, [B, T]


class HeldoutForward:
    """The model's jitted evaluation forward (`k3jax.training.make_eval_step`) on host batches."""

    def __init__(self, model: K3Model):
        parts, self._params, self._buffers = split_model(model)
        self._step = make_eval_step(parts)
        self.config = model.config

    def __call__(self, batch: dict, cost: Cost) -> BatchOutput:
        """Loss and argmax predictions of one batch (tokens, targets, loss_mask, segment_ids);
        its tokens and estimated FLOPs are added to ``cost``."""
        loss_sum, count, predictions = self._step(self._params, self._buffers, batch)
        rows, length = batch["tokens"].shape
        cost.add(rows * length, forward_flops(self.config, length).total)
        return BatchOutput(float(loss_sum), float(count), np.asarray(predictions))


@dataclasses.dataclass
class EvalContext:
    """A restored model and what the tasks need around it."""

    model: K3Model
    config: Config                       # the run's config (its data section describes the training data)
    seeds: tuple[int, ...]
    text: Any = None                     # a `k3jax.data.TextDataset` from --text, or None

    @functools.cached_property
    def forward(self) -> HeldoutForward:
        """The model's evaluation forward (compiled once per input shape, shared by the tasks)."""
        return HeldoutForward(self.model)


def run_task(task, context: EvalContext, progress: tqdm) -> TaskResult:
    """Run ``task`` in ``context``, timing it; a `TaskSkipped` becomes a skipped result."""
    definition = dataclasses.asdict(task)
    cost = Cost()
    started = time.perf_counter()
    try:
        output = task.run(context, cost, progress)
    except TaskSkipped as reason:
        return TaskResult(task.name, definition, None, None, cost, skipped=str(reason))
    cost.wall_seconds = time.perf_counter() - started
    return TaskResult(task.name, definition, content_hash(task.name, definition, output.data_hash), output, cost)


def require_vocabulary(model_vocab: int, data_vocab: int, what: str) -> None:
    """Skip the task when ``what`` uses token ids the model's embedding does not have."""
    if data_vocab > model_vocab:
        raise TaskSkipped(f"{what} uses {data_vocab} token ids, the model has {model_vocab}")
