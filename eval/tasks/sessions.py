"""Multi-turn memory through `k3jax.sessions.SessionStore`: facts written in turn 1, the store saved
to disk and restored, the facts queried in later turns, and two forked branches compared.

The facts are the run's MQAR bindings (`eval.tasks.mqar.base_mqar_dataset`, held-out rows): per
session, one row's written pairs ``k1 v1 … kP vP`` (and filler) then the separator. Turns:

    write     open(writes · separator)                            (prefill; no answers)
    restore   store.save(dir), SessionStore.load(model, dir)       (a fresh store from the files)
    query 1   append(first half of the row's queries  k v k v …)   accuracy: argmax at each k == its v
    query 2   append(second half of the queries)                  (memory carried across turns)
    branches  fork the post-restore session twice; each branch asks one half; accuracy, and
              agreement: the fraction of answers equal to those of the linear session

``sessions_per_seed`` rows per seed (seed s reads rows s·n … s·n + n - 1). Each turn reports
accuracy (mean ± 95% t-interval over seeds), tokens and wall seconds; chance is 1 / num_values.
The restore reads the saved files into a new store in this process; a restore in another process
gives the same logits bit for bit (tests/sessions/test_scale.py).
"""
from __future__ import annotations

import dataclasses
import tempfile
import time
from typing import ClassVar

import numpy as np

from k3jax.data import DataError
from k3jax.flops import forward_flops
from k3jax.sessions import SessionStore

from ..stats import t_interval
from .common import TaskOutput, TaskSkipped, require_vocabulary
from .mqar import base_mqar_dataset

TURNS = ("write", "restore", "query 1", "query 2", "branches")


def split_row(dataset, row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(writes · separator, queries k v k v …)`` of one MQAR row."""
    written = 2 * dataset.num_pairs + dataset.num_filler + 1
    return row[:written], row[written : written + 2 * dataset.queries_per_row]


def answered(logits: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """Per query pair of ``queries`` (``k v k v …`` fed as one turn): is the argmax after k its v."""
    return np.argmax(logits[0::2], axis=-1) == queries[1::2]


@dataclasses.dataclass(frozen=True)
class SessionsTask:
    """Accuracy and cost per turn of multi-turn MQAR sessions with a save/restore and a fork."""

    name: ClassVar[str] = "sessions"
    sessions_per_seed: int = 8

    def __post_init__(self):
        if self.sessions_per_seed < 1:
            raise ValueError(f"sessions_per_seed must be at least 1, got {self.sessions_per_seed}")

    def _one_seed(self, context, cost, dataset, seed: int) -> dict[str, dict]:
        """Per turn: correct answers, answers, tokens and seconds of one seed's sessions."""
        flops = forward_flops(context.config.model, dataset.seq_len).total
        turns = {turn: {"correct": 0, "answers": 0, "tokens": 0, "seconds": 0.0, "agree": 0} for turn in TURNS}

        def timed(turn, run, tokens=0):
            started = time.perf_counter()
            result = run()
            turns[turn]["seconds"] += time.perf_counter() - started
            turns[turn]["tokens"] += tokens
            cost.add(tokens, flops)
            return result

        rows = [split_row(dataset, dataset.row(seed * self.sessions_per_seed + i, "heldout"))
                for i in range(self.sessions_per_seed)]
        store = SessionStore(context.model)
        sids = [timed("write", lambda w=writes: store.open(w), len(writes)) for writes, _ in rows]
        with tempfile.TemporaryDirectory() as directory:
            timed("restore", lambda: store.save(f"{directory}/store"))
            store = timed("restore", lambda: SessionStore.load(context.model, f"{directory}/store"))
        for sid, (_, queries) in zip(sids, rows):
            half = len(queries) // 4 * 2
            branch_left, branch_right = store.fork(sid), store.fork(sid)
            linear = []
            for turn, part in (("query 1", queries[:half]), ("query 2", queries[half:])):
                if len(part):
                    hits = answered(timed(turn, lambda p=part: store.append(sid, p), len(part)), part)
                    turns[turn]["correct"] += int(hits.sum())
                    turns[turn]["answers"] += hits.size
                    linear.append(hits)
            for branch, part, reference in ((branch_left, queries[:half], linear[0] if half else None),
                                            (branch_right, queries[half:], linear[-1])):
                if len(part):
                    hits = answered(timed("branches", lambda b=branch, p=part: store.append(b, p), len(part)), part)
                    turns["branches"]["correct"] += int(hits.sum())
                    turns["branches"]["answers"] += hits.size
                    # the right branch asks query 2 right after the write, the linear session after query 1
                    turns["branches"]["agree"] += int((hits == reference).sum())
        return turns

    def run(self, context, cost, progress) -> TaskOutput:
        try:
            dataset = base_mqar_dataset(context.config)
        except DataError as error:
            raise TaskSkipped(str(error)) from None
        require_vocabulary(context.config.model.vocab_size, dataset.vocab_size, "MQAR")
        progress.reset(total=len(context.seeds))
        per_seed = []
        for seed in context.seeds:
            per_seed.append(self._one_seed(context, cost, dataset, seed))
            progress.update()
        rows = []
        for turn in TURNS:
            seeds = [result[turn] for result in per_seed]
            row = {"turn": turn, "tokens_per_seed": seeds[0]["tokens"],
                   "seconds": t_interval([s["seconds"] for s in seeds]),
                   "answers_per_seed": seeds[0]["answers"]}
            if seeds[0]["answers"]:
                row["accuracy"] = t_interval([s["correct"] / s["answers"] for s in seeds])
                row["chance"] = 1.0 / dataset.num_values
            if turn == "branches":
                row["agreement_with_linear"] = t_interval([s["agree"] / s["answers"] for s in seeds])
            rows.append(row)
        return TaskOutput(rows, dataset.content_hash())
