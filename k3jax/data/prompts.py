"""Prompts with answers for reinforcement learning (``data.kind=prompts``, ``train.objective=grpo``).

Each record of a ``.jsonl`` / ``.json`` file (a line, or an element of a JSON array) or row of a
``.parquet`` file is an object with

    prompt     text, tokenized as it is (no BOS), as ``python -m eval.generate`` does; or
    messages   a conversation (``tools`` optional) rendered in K3's chat format with the assistant's
               generation prompt, as ``eval.generate`` / the server render a chat request
    answer     any JSON value the reward reads (`k3jax.training.rewards`: the built-in rewards need
               it in every record; an environment or a reward function may read other fields)

and any other fields, which the reward function receives with the record. Parquet columns hold
strings, or JSON strings / lists of structs for ``messages`` and ``tools``. The last
``floor(heldout_fraction * records)`` records (at least one when there are two or more) are the
"heldout" split. A prompt of more than ``seq_len`` tokens is an error naming the record (an update
row holds the prompt and its completion within ``seq_len + 1`` tokens).

Prompts of step ``s`` are ``prompts_per_step`` consecutive entries of the split's record order,
shuffled per epoch by ``(seed, split, epoch)``: a pure function of ``(seed, step)``.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from k3jax.data.batching import SPLITS, definition_hash, split_index
from k3jax.data.chat import _is_records_type, _parquet_value
from k3jax.data.chat_format import ChatEncoder, generation_prompt, render_conversation
from k3jax.data.errors import DataError, require_int
from k3jax.data.pipeline import rows_at, shuffled_row_order
from k3jax.data.sources import (JSON_SUFFIXES, PARQUET_SUFFIXES, decode_utf8, find_data_files, is_arrow_string,
                                json_records, read_file_bytes)
from k3jax.data.tokenizers import load_tokenizer

PathLike = str | os.PathLike


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One record: where it is, its fields, and its prompt's token ids."""

    where: str
    record: dict
    tokens: np.ndarray            # int32 [T]

    @property
    def text(self) -> str:
        """The prompt as text: ``prompt``, or the last message's content for a chat record."""
        if "prompt" in self.record:
            return self.record["prompt"]
        content = self.record["messages"][-1].get("content", "")
        return content if isinstance(content, str) else str(content)


def _parquet_records(path: Path):
    import pyarrow.parquet
    try:
        table = pyarrow.parquet.read_table(path)
    except Exception as error:  # noqa: BLE001 - pyarrow raises many types for a bad file
        raise DataError(f"{path}: not a readable Parquet file ({' '.join(str(error).split())[:200]})") from None
    structured = {name for name, kind in zip(table.column_names, table.schema.types)
                  if name in ("messages", "tools") and _is_records_type(kind) and not is_arrow_string(kind)}
    for row, record in enumerate(table.to_pylist()):
        where = f"{path}: row {row}"
        for column in ("messages", "tools"):
            if record.get(column) is not None and (column in structured or isinstance(record[column], str)):
                record[column] = _parquet_value(record[column], where, column)
        yield where, {key: value for key, value in record.items() if value is not None}


def read_prompt_records(path: PathLike):
    """``(location, record)`` for each record of one JSONL / JSON / Parquet file."""
    path = Path(path)
    if path.suffix.lower() in PARQUET_SUFFIXES:
        yield from _parquet_records(path)
        return
    for where, record in json_records(decode_utf8(read_file_bytes(path), path), path):
        yield where, record


class PromptDataset:
    """Prompts (text or chat) with answers; see the module docstring.

    Args:
      path: a file, directory or glob of ``.jsonl`` / ``.json`` / ``.parquet`` files, or a list of them.
      seq_len: the update's row length; a prompt may have at most this many tokens.
      seed: seeds the per-epoch order of the records.
      heldout_fraction: share of the records at the end that form the "heldout" split.
      tokenizer_path: None for UTF-8 bytes, or a tiktoken BPE file (chat records need K3's markers).
      thinking, thinking_effort: the chat rendering (`k3jax.data.chat_format.render_conversation`).
    """

    def __init__(self, path: PathLike | Sequence[PathLike], seq_len: int, *, seed: int = 0,
                 heldout_fraction: float = 0.05, tokenizer_path: PathLike | None = None, thinking: bool = True,
                 thinking_effort: str | None = "max"):
        self.seq_len, self.seed = require_int("seq_len", seq_len, 1), require_int("seed", seed, 0)
        if isinstance(heldout_fraction, bool) or not isinstance(heldout_fraction, (int, float)) \
                or not 0 <= heldout_fraction < 1:
            raise DataError(f"heldout_fraction must be in [0, 1), got {heldout_fraction!r}")
        self.paths = [str(p) for p in ([path] if isinstance(path, (str, os.PathLike)) else path)]
        self.heldout_fraction, self.thinking, self.thinking_effort = heldout_fraction, thinking, thinking_effort
        self.tokenizer = load_tokenizer(tokenizer_path)
        self._encoder = None
        suffixes = JSON_SUFFIXES + PARQUET_SUFFIXES
        self.files = [file for p in self.paths for file in find_data_files(p) if file.suffix.lower() in suffixes]
        if not self.files:
            raise DataError(f"{', '.join(self.paths)}: no {', '.join(suffixes)} files of prompts")
        prompts = [self._prompt(where, record) for file in self.files
                   for where, record in read_prompt_records(file)]
        if not prompts:
            raise DataError(f"{', '.join(self.paths)}: no prompt records")
        count = len(prompts)
        heldout = min(max(int(heldout_fraction * count), 1), count - 1) if heldout_fraction and count > 1 else 0
        self.splits = {"train": prompts[:count - heldout], "heldout": prompts[count - heldout:]}

    @property
    def chat(self) -> bool:
        """Whether any record is a conversation (the stop token is then ``<|end_of_msg|>``)."""
        return self._encoder is not None

    @property
    def encoder(self) -> ChatEncoder:
        if self._encoder is None:
            self._encoder = ChatEncoder(self.tokenizer)
        return self._encoder

    def _prompt(self, where: str, record: Any) -> Prompt:
        if not isinstance(record, dict) or ("prompt" in record) == ("messages" in record):
            raise DataError(f"{where}: expected a JSON object with a 'prompt' (text) or 'messages' (chat) field")
        if "prompt" in record:
            if not isinstance(record["prompt"], str) or not record["prompt"]:
                raise DataError(f"{where}: 'prompt' must be non-empty text")
            tokens = np.asarray(self.tokenizer.encode(record["prompt"]), np.int32)
        else:
            segments = render_conversation(record["messages"], record.get("tools"), thinking=self.thinking,
                                           thinking_effort=self.thinking_effort, where=where)
            tokens = self.encoder.encode(segments + generation_prompt(self.thinking))[0]
        if tokens.size > self.seq_len:
            raise DataError(f"{where}: the prompt is {tokens.size} tokens, more than data.seq_len = {self.seq_len} "
                            f"(a prompt and its completion share one row); raise data.seq_len or shorten it")
        return Prompt(where, record, tokens)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def stop_id(self) -> int:
        """Where a completion ends: ``<|end_of_msg|>`` for chat prompts, else the tokenizer's EOS."""
        return self.encoder.end_of_message_id if self.chat else self.tokenizer.eos_id

    def num_prompts(self, split: str = "train") -> int:
        return len(self.splits[SPLITS[split_index(split)]])

    def prompts(self, step: int, count: int, split: str = "train", resampling: int = 0) -> list[tuple[int, Prompt]]:
        """``(index, prompt)`` of step ``step``'s ``count`` prompts (index: global position in the
        split's stream, the `prompt_index` of rollouts). ``resampling`` r > 0: the prompts of the
        step's r-th resampling (``rl.resample_rounds``), the same positions in the split's r-th other
        stream (shuffled epochs of their own), so that a step's extra prompts never move another
        step's."""
        records = self.splits[SPLITS[split_index(split)]]
        if not records:
            raise DataError(f"{', '.join(self.paths)}: the {split} split has no prompts; "
                            "raise data.heldout_fraction or add records")
        indices = np.arange(step * count, (step + 1) * count)
        seed = self.seed if not resampling else int(
            np.random.SeedSequence([self.seed, resampling]).generate_state(1)[0])
        order = rows_at(shuffled_row_order(len(records), seed, split), indices)
        return [(int(index), records[int(row)]) for index, row in zip(indices, order)]

    def heldout(self, count: int) -> list[tuple[int, Prompt]]:
        """The first ``count`` held-out prompts in file order (all when fewer)."""
        return list(enumerate(self.splits["heldout"][:count]))

    def _definition(self) -> dict:
        return {"kind": "prompts", "seq_len": self.seq_len, "seed": self.seed,
                "heldout_fraction": self.heldout_fraction, "vocab_size": self.vocab_size,
                "thinking": self.thinking, "thinking_effort": self.thinking_effort}

    def describe(self) -> dict:
        return {**self._definition(), "paths": self.paths, "num_files": len(self.files),
                "tokenizer": self.tokenizer.describe(), "chat": self.chat,
                "prompts": {split: self.num_prompts(split) for split in SPLITS}}

    def content_hash(self) -> str:
        """Hash of every prompt's tokens and the records' answers."""
        prompts = self.splits["train"] + self.splits["heldout"]
        lengths = np.array([p.tokens.size for p in prompts], np.int64)
        answers = json.dumps([p.record.get("answer") for p in prompts], sort_keys=True, default=str).encode()
        return definition_hash(self._definition(), lengths, np.concatenate([p.tokens for p in prompts]),
                               np.frombuffer(answers, np.uint8))
