"""Conversations as a dataset: ``messages`` records → K3's chat format → whole conversations packed into rows.

Each line of a ``.jsonl`` / ``.json`` file (or each element of a JSON array) is a record
``{"messages": [{"role": ..., "content": ...}, ...], "tools": [...]?}``; each row of a ``.parquet``
file is one too: its ``messages`` column (and optional ``tools`` column) holds either a list of
structs (pyarrow's type for a list of JSON objects; a null struct field counts as absent, since a
struct column gives every row every field) or a JSON string of the list (which keeps explicit nulls
and key order as written). Paths are files, directories or globs as for text
(`k3jax.data.sources.find_data_files`), keeping those files. Records are rendered by
`k3jax.data.chat_format` with the tokenizer's special tokens. The last
``floor(heldout_fraction * conversations)`` conversations (at least one when there are two or more)
form the "heldout" split, the rest "train". A conversation longer than a row (``seq_len + 1`` tokens)
is cut to its first ``seq_len + 1`` tokens (``overflow="truncate"``) or left out (``"drop"``); both are
counted in ``describe()``.

Packing: each split's conversations, in file order, fill rows of ``seq_len + 1`` tokens one after
another; a conversation that does not fit in what is left of a row starts the next one, and the rest
of the row is padding (segment 0). In a row, conversations are numbered from 1; position t (input
``row[t]``, target ``row[t+1]``) counts in the loss when ``row[t+1]`` is assistant output of the same
conversation as ``row[t]``. Rows are shuffled per epoch by ``(seed, split, epoch)`` as in
`k3jax.data.packing`, so a batch is a pure function of ``(seed, step)``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from k3jax.data.batching import SPLITS, Batch, definition_hash, shard_row_indices, split_index
from k3jax.data.chat_format import LOSS_MODES, ChatEncoder, render_conversation
from k3jax.data.errors import DataError, require_int
from k3jax.data.pipeline import rows_at, shuffled_row_order
from k3jax.data.sources import (JSON_SUFFIXES, PARQUET_SUFFIXES, decode_utf8, find_data_files, is_arrow_string,
                                json_records, parquet_column, read_file_bytes)
from k3jax.data.tokenizers import load_tokenizer

PathLike = str | os.PathLike
OVERFLOW_MODES = ("truncate", "drop")


def read_conversations(path: PathLike) -> Iterator[tuple[str, dict]]:
    """``(location, record)`` for each conversation of a file: the records of a JSON Lines file (or
    JSON array), each an object with a ``messages`` field, or the rows of a Parquet file."""
    path = Path(path)
    if path.suffix.lower() in PARQUET_SUFFIXES:
        yield from parquet_conversations(path)
        return
    for where, record in json_records(decode_utf8(read_file_bytes(path), path), path):
        if not isinstance(record, dict) or "messages" not in record:
            raise DataError(f"{where}: expected a JSON object with a 'messages' field")
        yield where, record


def _is_records_type(kind) -> bool:
    """A JSON string column, or a list of structs."""
    import pyarrow
    return is_arrow_string(kind) or ((pyarrow.types.is_list(kind) or pyarrow.types.is_large_list(kind))
                                     and pyarrow.types.is_struct(kind.value_type))


def _without_nulls(value):
    """``value`` with the null fields of its objects left out (a struct column has every field in every row)."""
    if isinstance(value, dict):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value


def _parquet_value(value, where: str, column: str):
    """A Parquet cell of `_is_records_type`: a JSON string parsed, a list of structs without its nulls."""
    if not isinstance(value, str):
        return _without_nulls(value)
    try:
        return json.loads(value)
    except json.JSONDecodeError as error:
        raise DataError(f"{where}: column {column!r} is malformed JSON ({error.msg} at column {error.colno})") from None
    except RecursionError:
        raise DataError(f"{where}: column {column!r} is JSON nested too deeply") from None


def parquet_conversations(path: Path) -> Iterator[tuple[str, dict]]:
    """``(location, record)`` per row of a Parquet file whose ``messages`` column (and optional ``tools``
    column) holds a list of structs or a JSON string per row."""
    holds = "a list of structs or JSON strings"
    messages = parquet_column(path, "messages", _is_records_type, holds)
    tools = parquet_column(path, "tools", _is_records_type, holds, optional=True) or [None] * len(messages)
    for row, (row_messages, row_tools) in enumerate(zip(messages, tools)):
        where = f"{path}: row {row}"
        if row_messages is None:
            raise DataError(f"{where}: column 'messages' is null")
        record = {"messages": _parquet_value(row_messages, where, "messages")}
        if row_tools is not None:
            record["tools"] = _parquet_value(row_tools, where, "tools")
        yield where, record


def _chat_files(path: PathLike) -> list:
    suffixes = JSON_SUFFIXES + PARQUET_SUFFIXES
    files = [file for file in find_data_files(path) if file.suffix.lower() in suffixes]
    if not files:
        raise DataError(f"{path}: no {', '.join(suffixes)} files of conversations")
    return files


def pack_units(units: Sequence[Sequence[tuple[np.ndarray, np.ndarray]]], row_len: int) -> dict[str, np.ndarray]:
    """Units of sequences ``(ids, loss flags)``, each unit at most ``row_len`` tokens in all, filled into
    rows in order, a unit's sequences side by side in one row: ``tokens`` int32, ``assistant`` bool and
    ``conversation`` int32 (each sequence's number in the row, 1, 2, ...; 0 padding), each ``[rows, row_len]``."""
    starts, row, used, number = [], 0, 0, 0
    for unit in units:
        size = sum(ids.size for ids, _ in unit)
        if used + size > row_len:
            row, used, number = row + 1, 0, 0
        for ids, _ in unit:
            number += 1
            starts.append((row, used, number))
            used += ids.size
    num_rows = row + 1 if units else 0
    tokens = np.zeros((num_rows, row_len), np.int32)
    assistant = np.zeros((num_rows, row_len), bool)
    conversation = np.zeros((num_rows, row_len), np.int32)
    for (ids, flags), (row, start, number) in zip((piece for unit in units for piece in unit), starts):
        tokens[row, start:start + ids.size], assistant[row, start:start + ids.size] = ids, flags
        conversation[row, start:start + ids.size] = number
    return {"tokens": tokens, "assistant": assistant, "conversation": conversation}


def pack_conversations(conversations: Sequence[tuple[np.ndarray, np.ndarray]], row_len: int) -> dict[str, np.ndarray]:
    """Whole conversations ``(ids, loss flags)``, each at most ``row_len`` tokens, filled into rows in
    order (`pack_units` of one conversation each)."""
    return pack_units([[conversation] for conversation in conversations], row_len)


def rows_batch(packed: dict[str, np.ndarray], rows: np.ndarray) -> Batch:
    """The batch (format of `k3jax.data.batching`) of packed ``rows``."""
    tokens, assistant, conversation = (packed[key][rows] for key in ("tokens", "assistant", "conversation"))
    same = (conversation[:, 1:] == conversation[:, :-1]) & (conversation[:, 1:] > 0)
    return {"tokens": np.ascontiguousarray(tokens[:, :-1]), "targets": np.ascontiguousarray(tokens[:, 1:]),
            "loss_mask": (same & assistant[:, 1:]).astype(np.float32),
            "segment_ids": np.ascontiguousarray(conversation[:, :-1])}


class PackedRows:
    """What a dataset packed into rows per split serves (``self.splits``: {split: arrays},
    ``self.tokenizer``, ``self.seed``, ``self.paths``): its vocabulary, rows per split and batches.
    ``unit`` names what a row packs, ``source`` what to add when a split has none."""

    unit, source = "rows", "records"

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def num_rows(self, split: str = "train") -> int:
        """Distinct rows in ``split`` (one epoch)."""
        return self.splits[SPLITS[split_index(split)]]["tokens"].shape[0]

    def batch(self, step: int, batch_size: int, split: str = "train",
              process_index: int = 0, process_count: int = 1) -> Batch:
        """This process's rows of global batch ``step``, in the format of `k3jax.data.batching`."""
        num_rows = self.num_rows(split)
        if num_rows == 0:
            raise DataError(f"{', '.join(self.paths)}: the {split} split has no {self.unit}; "
                            f"raise data.heldout_fraction or add {self.source}")
        indices = shard_row_indices(step, batch_size, process_index, process_count)
        return rows_batch(self.splits[split], rows_at(shuffled_row_order(num_rows, self.seed, split), indices))


class ChatDataset(PackedRows):
    """Packed rows of ``seq_len`` positions from JSONL or Parquet conversations in K3's chat format.

    Args:
      path: a ``.jsonl`` / ``.json`` / ``.parquet`` file, a directory (searched recursively), a glob,
        or a list of them.
      seq_len: positions per row (a row holds ``seq_len + 1`` tokens).
      seed: seeds the row shuffle of each epoch.
      heldout_fraction: share of conversations at the end that form the "heldout" split; 0 for none.
      tokenizer_path: a tiktoken BPE file (or directory) whose ``tokenizer_config.json`` names
        ``<|open|>``, ``<|close|>``, ``<|sep|>`` and ``<|end_of_msg|>`` (K3's does).
      loss: "assistant" (the assistant's output tokens) or "all".
      overflow: "truncate" or "drop" a conversation longer than a row.
      thinking, thinking_effort: as K3's renderer (`k3jax.data.chat_format.render_conversation`).
    """

    unit = source = "conversations"

    def __init__(self, path: PathLike | Sequence[PathLike], seq_len: int, *, seed: int = 0,
                 heldout_fraction: float = 0.05, tokenizer_path: PathLike | None = None, loss: str = "assistant",
                 overflow: str = "truncate", thinking: bool = True, thinking_effort: str | None = "max"):
        seq_len, seed = require_int("seq_len", seq_len, 1), require_int("seed", seed, 0)
        if isinstance(heldout_fraction, bool) or not isinstance(heldout_fraction, (int, float)) \
                or not 0 <= heldout_fraction < 1:
            raise DataError(f"heldout_fraction must be in [0, 1), got {heldout_fraction!r}")
        if loss not in LOSS_MODES or overflow not in OVERFLOW_MODES:
            raise DataError(f"chat loss must be one of {LOSS_MODES} and overflow one of {OVERFLOW_MODES}; "
                            f"got {loss!r}, {overflow!r}")
        self.paths = [str(p) for p in ([path] if isinstance(path, (str, os.PathLike)) else path)]
        self.seq_len, self.seed, self.heldout_fraction = seq_len, seed, heldout_fraction
        self.loss, self.overflow, self.thinking, self.thinking_effort = loss, overflow, thinking, thinking_effort
        self.tokenizer = load_tokenizer(tokenizer_path)
        self.encoder = ChatEncoder(self.tokenizer)
        self.files = [file for p in self.paths for file in _chat_files(p)]
        self.conversations, self.truncated, self.dropped = self._encode_all()
        if not self.conversations:
            raise DataError(f"{', '.join(self.paths)}: no conversation fits in a row of seq_len + 1 = {seq_len + 1} "
                            f"tokens ({self.dropped} dropped); raise seq_len or set data.chat_overflow=truncate")
        count = len(self.conversations)
        heldout = min(max(int(heldout_fraction * count), 1), count - 1) if heldout_fraction and count > 1 else 0
        if not any(flags[1:].any() for _, flags in self.conversations[:count - heldout]):
            raise DataError(f"{', '.join(self.paths)}: no training conversation has a token the loss counts "
                            f"(loss={loss!r}; {self.truncated} cut to seq_len + 1 = {seq_len + 1} tokens, "
                            f"before the reply); raise seq_len, or set data.chat_loss=all")
        self.num_heldout_conversations = heldout
        self.splits = {"train": pack_conversations(self.conversations[:count - heldout], seq_len + 1),
                       "heldout": pack_conversations(self.conversations[count - heldout:], seq_len + 1)}

    def _encode_all(self) -> tuple[list[tuple[np.ndarray, np.ndarray]], int, int]:
        """Every conversation's ``(ids, loss flags)`` cut to a row, and the numbers truncated and dropped."""
        kept, truncated, dropped, row_len = [], 0, 0, self.seq_len + 1
        for file in self.files:
            for where, record in read_conversations(file):
                segments = render_conversation(record["messages"], record.get("tools"), thinking=self.thinking,
                                               thinking_effort=self.thinking_effort, where=where)
                ids, flags = self.encoder.encode(segments, self.loss)
                if ids.size > row_len and self.overflow == "drop":
                    dropped += 1
                    continue
                truncated += ids.size > row_len
                kept.append((ids[:row_len], flags[:row_len]))
        return kept, truncated, dropped

    def _definition(self) -> dict:
        return {"kind": "chat", "seq_len": self.seq_len, "seed": self.seed, "heldout_fraction": self.heldout_fraction,
                "vocab_size": self.vocab_size, "loss": self.loss, "overflow": self.overflow,
                "thinking": self.thinking, "thinking_effort": self.thinking_effort}

    def describe(self) -> dict:
        return {**self._definition(), "paths": self.paths, "num_files": len(self.files),
                "tokenizer": self.tokenizer.describe(), "num_conversations": len(self.conversations),
                "heldout_conversations": self.num_heldout_conversations,
                "truncated_conversations": self.truncated, "dropped_conversations": self.dropped,
                "num_tokens": int(sum(ids.size for ids, _ in self.conversations)),
                "rows": {split: self.num_rows(split) for split in SPLITS}}

    def content_hash(self) -> str:
        """Hash of the conversations' tokens, loss flags and the packing settings."""
        ids = [ids for ids, _ in self.conversations]
        flags = [flags for _, flags in self.conversations]
        lengths = np.array([piece.size for piece in ids], np.int64)
        return definition_hash(self._definition(), lengths, np.concatenate(ids), np.concatenate(flags))
