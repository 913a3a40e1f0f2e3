"""Multi-query associative recall (MQAR, the task of the Zoology benchmark), generated in the package.

A row writes ``num_pairs`` key→value bindings, then optional noise, a separator and ``num_queries``
queries: a key written earlier followed by its value. Loss counts only where the input is a query
key, whose target is the value bound to it.

    row (seq_len + 1 tokens):  k1 v1 … kP vP | n1 … nF | SEP | q1 a1 … qQ aQ | PAD …
    tokens = row[:-1]    targets = row[1:]    loss_mask = 1 where tokens[t] is a query key
    segment_ids = 1 on the sequence, 0 on padding;    needs seq_len >= 2P + F + 2Q

Vocabulary (K keys, V values, N noise tokens; it does not depend on seq_len, so one model is
evaluated at 2×, 4×, 8× its training length with ``dataclasses.replace(ds, seq_len=..., ...)``):

    0 PAD    1 SEP    [2, 2+K) keys    [2+K, 2+K+V) values    [2+K+V, 2+K+V+N) noise
    vocab_size = 2 + K + V + N

Keys within a row are distinct, and so are values; queries ask distinct keys in random order (by
default every key once). Row i of split s draws from a stream seeded by (seed, s, i), so it is a pure
function of the definition, the seed, s and i. The splits never share a binding set: a row belongs
to "heldout" exactly when a hash of its written pairs is odd, and each stream redraws until its row
falls in its own split.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import ClassVar

import numpy as np

from k3jax.data.batching import Batch, definition_hash, inputs_and_targets, shard_row_indices, split_index
from k3jax.data.errors import DataError, require_int

GENERATOR_VERSION = 1  # bump when the rows a definition produces change
MAX_DRAWS_PER_ROW = 64  # a split misses 64 fair coin flips in a row with probability 2^-64


@dataclasses.dataclass(frozen=True)
class MQARDataset:
    """MQAR rows of ``seq_len`` positions; see the module docstring for the layout and vocabulary.

    ``num_queries=None`` queries every written key once; ``num_filler`` noise tokens sit between the
    writes and the separator.
    """

    seq_len: int
    num_pairs: int = 16
    num_keys: int = 256
    num_values: int = 256
    num_queries: int | None = None
    num_filler: int = 0
    noise_vocab_size: int = 64
    seed: int = 0

    pad_id: ClassVar[int] = 0
    separator_id: ClassVar[int] = 1
    first_key_id: ClassVar[int] = 2

    def __post_init__(self):
        minimums = {"seq_len": 1, "num_pairs": 1, "num_keys": 1, "num_values": 1, "num_filler": 0,
                    "noise_vocab_size": 0, "seed": 0, **({} if self.num_queries is None else {"num_queries": 1})}
        for name, minimum in minimums.items():  # fields become plain ints, so describe() is JSON
            object.__setattr__(self, name, require_int(f"MQAR {name}", getattr(self, name), minimum))
        if self.num_pairs > min(self.num_keys, self.num_values):
            raise DataError(f"MQAR num_pairs {self.num_pairs} exceeds num_keys {self.num_keys} or "
                            f"num_values {self.num_values} (keys and values are distinct within a row)")
        if self.queries_per_row > self.num_pairs:
            raise DataError(f"MQAR num_queries {self.queries_per_row} exceeds num_pairs {self.num_pairs}")
        if self.num_filler and not self.noise_vocab_size:
            raise DataError("MQAR num_filler > 0 needs noise_vocab_size >= 1")
        if self.seq_len < self.min_seq_len:
            raise DataError(f"MQAR seq_len {self.seq_len} is too short for {self.num_pairs} pairs, "
                            f"{self.num_filler} filler tokens and {self.queries_per_row} queries: "
                            f"needs at least {self.min_seq_len}")

    @property
    def queries_per_row(self) -> int:
        """Queries in each row: ``num_queries``, or every written key."""
        return self.num_pairs if self.num_queries is None else self.num_queries

    @property
    def min_seq_len(self) -> int:
        """The shortest ``seq_len`` that holds the writes, filler, separator and queries."""
        return 2 * self.num_pairs + self.num_filler + 2 * self.queries_per_row

    @property
    def first_value_id(self) -> int:
        return self.first_key_id + self.num_keys

    @property
    def first_noise_id(self) -> int:
        return self.first_value_id + self.num_values

    @property
    def vocab_size(self) -> int:
        return self.first_noise_id + self.noise_vocab_size

    @property
    def answer_positions(self) -> np.ndarray:
        """Input positions holding a query key (their targets are the answers), the same in every row."""
        first_query = 2 * self.num_pairs + self.num_filler + 1
        return first_query + 2 * np.arange(self.queries_per_row)

    def _draw_writes(self, rng: np.random.Generator) -> np.ndarray:
        """The written pairs ``k1 v1 … kP vP`` (int32): distinct keys, distinct values."""
        keys = self.first_key_id + rng.choice(self.num_keys, self.num_pairs, replace=False)
        values = self.first_value_id + rng.choice(self.num_values, self.num_pairs, replace=False)
        return np.stack([keys, values], axis=1).ravel().astype(np.int32)

    @staticmethod
    def _split_of(writes: np.ndarray) -> int:
        """The split a row with these writes belongs to: 1 ("heldout") when their hash is odd."""
        return hashlib.blake2b(writes.tobytes(), digest_size=8).digest()[0] & 1

    def row(self, index: int, split: str = "train") -> np.ndarray:
        """Row ``index`` of ``split``: ``seq_len + 1`` int32 tokens (inputs are ``[:-1]``, targets ``[1:]``)."""
        wanted = split_index(split)
        rng = np.random.default_rng([self.seed, wanted, int(index)])
        for _ in range(MAX_DRAWS_PER_ROW):
            writes = self._draw_writes(rng)
            if self._split_of(writes) == wanted:
                break
        else:
            raise DataError(f"MQAR could not draw a {split!r} row in {MAX_DRAWS_PER_ROW} tries: "
                            f"{self.num_keys} keys and {self.num_values} values are too few to keep the splits apart")
        asked = rng.permutation(self.num_pairs)[: self.queries_per_row]
        noise = rng.integers(self.first_noise_id, self.vocab_size, self.num_filler)
        queries = writes.reshape(self.num_pairs, 2)[asked].ravel()
        row = np.full(self.seq_len + 1, self.pad_id, dtype=np.int32)
        sequence = np.concatenate([writes, noise, [self.separator_id], queries])
        row[: sequence.size] = sequence
        return row

    def batch(self, step: int, batch_size: int, split: str = "train",
              process_index: int = 0, process_count: int = 1) -> Batch:
        """This process's rows of global batch ``step``, in the format of `k3jax.data.batching`."""
        indices = shard_row_indices(step, batch_size, process_index, process_count)
        rows = np.stack([self.row(index, split) for index in indices])
        tokens, targets = inputs_and_targets(rows)
        loss_mask = np.zeros(tokens.shape, dtype=np.float32)
        loss_mask[:, self.answer_positions] = 1.0
        return {
            "tokens": tokens,
            "targets": targets,
            "loss_mask": loss_mask,
            "segment_ids": (tokens != self.pad_id).astype(np.int32),
        }

    def describe(self) -> dict:
        return {"kind": "mqar", "generator_version": GENERATOR_VERSION, **dataclasses.asdict(self),
                "queries_per_row": self.queries_per_row, "vocab_size": self.vocab_size}

    def content_hash(self) -> str:
        return definition_hash(self.describe())


def mqar_recall(predicted_tokens, batch: Batch) -> float:
    """Fraction of answer positions (``loss_mask > 0``) where ``predicted_tokens`` (e.g. the argmax of
    the logits, ``[B, T]``) equals the target."""
    predicted = np.asarray(predicted_tokens)
    targets, answers = batch["targets"], np.asarray(batch["loss_mask"]) > 0
    if predicted.shape != targets.shape:
        raise DataError(f"predicted tokens have shape {predicted.shape}, the batch's targets {targets.shape}")
    if not answers.any():
        raise DataError("the batch has no answer positions (loss_mask is all zero)")
    return float(np.mean(predicted[answers] == targets[answers]))
