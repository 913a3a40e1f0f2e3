"""MQAR recall vs sequence length: length extrapolation without positional encoding.

The base definition is the run's own MQAR data (for a run trained on text: `MQARDataset` defaults
at the run's sequence length). At multiplier m the row is m times longer and every part of it
scales with it, so the row keeps the training density of bindings:

    seq_len m·T,  num_pairs min(m·P, num_keys, num_values),  num_filler m·F,  num_queries m·Q (or all)

The vocabulary does not change, so the same model reads every length. Recall is the fraction of
query positions whose argmax is the bound value (`k3jax.data.mqar_recall`), on the held-out
split. A row at multiplier m asks m times as many queries, so a seed reads R / m rows there
(R = rows_per_seed): every length scores the same number of answers at about the same cost.
Seed s reads rows ``s·R/m … (s+1)·R/m - 1``; seed 0 at m = 1 with R = train.eval_batches x
train.batch_size (8 x 32 by default) reads exactly the rows the trainer's final evaluation read.
Chance is 1 / num_values.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from k3jax.data import DataError, MQARDataset, make_dataset, mqar_recall
from ..stats import t_interval
from .common import TaskOutput, TaskSkipped, require_vocabulary


def base_mqar_dataset(config) -> MQARDataset:
    """The run's MQAR definition, or the default one at the run's sequence length for text runs."""
    if config.data.kind == "mqar":
        return make_dataset(config.data)
    return MQARDataset(config.data.seq_len)


def scaled_mqar_dataset(base: MQARDataset, multiplier: int) -> MQARDataset:
    """``base`` at ``multiplier`` times its length with pairs, filler and queries scaled alike."""
    pairs = min(base.num_pairs * multiplier, base.num_keys, base.num_values)
    queries = None if base.num_queries is None else min(base.num_queries * multiplier, pairs)
    return dataclasses.replace(base, seq_len=base.seq_len * multiplier, num_pairs=pairs, num_queries=queries,
                               num_filler=base.num_filler * multiplier)


@dataclasses.dataclass(frozen=True)
class MQARLengthTask:
    """Held-out MQAR recall at each length multiplier m, ``rows_per_seed / m`` rows per seed."""

    name: ClassVar[str] = "mqar"
    length_multipliers: tuple[int, ...] = (1, 2, 4, 8)
    rows_per_seed: int = 256
    batch_size: int = 32

    def __post_init__(self):
        for multiplier in self.length_multipliers:
            if self.rows_per_seed % (multiplier * self.batch_size):
                raise ValueError(f"rows_per_seed {self.rows_per_seed} must be a multiple of batch_size "
                                 f"{self.batch_size} x each length multiplier, not of {multiplier * self.batch_size}")

    def batches_per_seed(self, multiplier: int) -> int:
        return self.rows_per_seed // (multiplier * self.batch_size)

    def run(self, context, cost, progress) -> TaskOutput:
        try:
            base = base_mqar_dataset(context.config)
        except DataError as error:
            raise TaskSkipped(str(error)) from None
        require_vocabulary(context.config.model.vocab_size, base.vocab_size, "MQAR")
        progress.reset(total=len(context.seeds) * sum(map(self.batches_per_seed, self.length_multipliers)))
        rows = []
        for multiplier in self.length_multipliers:
            dataset = scaled_mqar_dataset(base, multiplier)
            batches = self.batches_per_seed(multiplier)
            per_seed = []
            for seed in context.seeds:
                recalls = []
                for index in range(batches):
                    batch = dataset.batch(seed * batches + index, self.batch_size, "heldout")
                    recalls.append(mqar_recall(context.forward(batch, cost).predictions, batch))
                    progress.update()
                per_seed.append(float(np.mean(recalls)))   # every batch has the same number of answers
            rows.append({"length_multiplier": multiplier, "seq_len": dataset.seq_len, "num_pairs": dataset.num_pairs,
                         "answers_per_seed": batches * self.batch_size * dataset.queries_per_row,
                         "recall": t_interval(per_seed),
                         "chance": 1.0 / dataset.num_values})
        return TaskOutput(rows, base.content_hash())
