"""Passkey retrieval: a number hidden at a chosen depth in filler text, asked for at the end.

Each prompt of exactly ``context_length`` input tokens (the run's tokenizer: bytes, or its BPE) is

    INTRO · filler[:j] · NEEDLE(key) · filler[j:] · QUESTION · " key"

with filler the repeated FILLER sentence cut to the length left over and j = round(depth · its
length). A prompt counts as retrieved when the argmax at every answer position is the answer
token, i.e. exactly when greedy decoding would write the key. Keys have ``digits`` digits, drawn
from a stream seeded by (seed, context length, depth index, trial); chance is about 10^-digits.
An MQAR model, which never saw text, scores ~0: the task still runs, so the number is measured.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from k3jax.data import DataError, load_tokenizer
from ..stats import t_interval
from .common import TaskOutput, TaskSkipped, canonical_json, require_vocabulary, sha256_text

INTRO = "A pass key is hidden in the text below. Find it and remember it; you will be asked for it.\n"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key? The pass key is"


def passkey_row(tokenizer, key: str, depth: float, context_length: int) -> tuple[np.ndarray, int]:
    """``(row of context_length + 1 tokens, number of answer tokens at its end)``."""
    intro, needle = tokenizer.encode(INTRO), tokenizer.encode(NEEDLE.format(key=key))
    question, answer = tokenizer.encode(QUESTION), tokenizer.encode(f" {key}")
    budget = context_length + 1 - len(intro) - len(needle) - len(question) - len(answer)
    if budget < 0:
        raise TaskSkipped(f"a passkey prompt needs at least {context_length - budget} tokens, "
                          f"context length {context_length} is too short")
    filler = tokenizer.encode(FILLER)
    filler = (filler * (budget // len(filler) + 1))[:budget]
    split = round(depth * budget)
    row = intro + filler[:split] + needle + filler[split:] + question + answer
    return np.asarray(row, np.int32), len(answer)


def passkey_batch(rows: list[np.ndarray], answer_lengths: list[int]) -> dict:
    """Rows of equal length as an evaluation batch that scores only each row's answer tokens."""
    stacked = np.stack(rows)
    tokens, targets = stacked[:, :-1], stacked[:, 1:]
    loss_mask = np.zeros(tokens.shape, np.float32)
    for index, answer in enumerate(answer_lengths):
        loss_mask[index, -answer:] = 1.0
    return {"tokens": tokens, "targets": targets, "loss_mask": loss_mask, "segment_ids": np.ones_like(tokens)}


def retrieved(predictions: np.ndarray, batch: dict) -> np.ndarray:
    """Per row: every answer position predicted right."""
    answers = batch["loss_mask"] > 0
    return np.all((predictions == batch["targets"]) | ~answers, axis=1)


@dataclasses.dataclass(frozen=True)
class PasskeyTask:
    """Retrieval accuracy per context length and depth, ``trials`` keys per depth and seed."""

    name: ClassVar[str] = "passkey"
    context_lengths: tuple[int, ...] = (256, 512, 1024, 2048)
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    trials: int = 2
    digits: int = 5

    def key(self, seed: int, context_length: int, depth_index: int, trial: int) -> str:
        rng = np.random.default_rng([seed, context_length, depth_index, trial])
        return str(rng.integers(10 ** (self.digits - 1), 10**self.digits))

    def data_hash(self, tokenizer) -> str:
        """The prompt text and the tokenizer: with the definition they fix every prompt."""
        return sha256_text(canonical_json({"intro": INTRO, "filler": FILLER, "needle": NEEDLE, "question": QUESTION,
                                           "tokenizer": tokenizer.describe()}))

    def _accuracy(self, context, cost, tokenizer, seed: int, context_length: int) -> np.ndarray:
        """Retrieval of seed ``seed`` at one length, ``[depths, trials]`` bool."""
        prompts = [passkey_row(tokenizer, self.key(seed, context_length, d, t), depth, context_length)
                   for d, depth in enumerate(self.depths) for t in range(self.trials)]
        batch = passkey_batch(*zip(*prompts))
        return retrieved(context.forward(batch, cost).predictions, batch).reshape(len(self.depths), self.trials)

    def run(self, context, cost, progress) -> TaskOutput:
        try:
            tokenizer = load_tokenizer(context.config.data.tokenizer if context.config.data.kind == "text" else None)
        except DataError as error:
            raise TaskSkipped(f"the run's tokenizer cannot be read ({error})") from None
        require_vocabulary(context.config.model.vocab_size, tokenizer.vocab_size, "the passkey tokenizer")
        progress.reset(total=len(self.context_lengths) * len(context.seeds))
        rows = []
        for length in self.context_lengths:
            per_seed = []
            for seed in context.seeds:
                per_seed.append(self._accuracy(context, cost, tokenizer, seed, length).mean(axis=1))
                progress.update()
            per_seed = np.stack(per_seed)                       # [seeds, depths]
            rows += [{"context_length": length, "depth": depth, "accuracy": t_interval(per_seed[:, d])}
                     for d, depth in enumerate(self.depths)]
            rows.append({"context_length": length, "depth": "all", "accuracy": t_interval(per_seed.mean(axis=1))})
        return TaskOutput(rows, self.data_hash(tokenizer))
