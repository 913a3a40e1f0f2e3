"""Preference pairs for DPO-family tuning (``data.kind=preferences``; `k3jax.training.preference`).

Each record of a ``.jsonl`` / ``.json`` file (a line, or an element of a JSON array) or row of a
``.parquet`` file is an object with

    prompt | messages   the prompt: text tokenized as it is (no BOS), or a conversation (``tools``
                        optional) rendered in K3's chat format with the assistant's generation prompt,
                        exactly as `k3jax.data.PromptDataset` renders it
    chosen, rejected    two replies to it: text, or an assistant message object (``content``,
                        ``reasoning_content``, ``tool_calls``); after a text prompt a reply is its text's
                        tokens and EOS, after a chat prompt what the assistant writes after the
                        generation prompt through ``<|end_of_msg|>`` (`k3jax.data.chat_format.reply_segments`)

A pair is two sequences, prompt + chosen and prompt + rejected, packed side by side into one row of
``seq_len + 1`` tokens (pairs in file order fill rows as conversations do, `k3jax.data.chat.pack_units`),
so a pair is never split across rows or batches. In a row the sequences are numbered from 1: pair k
of the row (from 0) is segments ``2k + 1`` (chosen) and ``2k + 2`` (rejected). The loss mask marks
the reply's tokens only. A pair longer than a row is cut (``overflow="truncate"``: the longer reply
loses tokens first, each keeping at least one; a pair whose two prompts leave less than two tokens is
dropped) or dropped (``"drop"``); both are counted in ``describe()``. The last
``floor(heldout_fraction * pairs)`` pairs (at least one when there are two or more) form the "heldout"
split. Rows are shuffled per epoch by ``(seed, split, epoch)`` as in `k3jax.data.pipeline`.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from k3jax.data.batching import SPLITS, definition_hash
from k3jax.data.chat import OVERFLOW_MODES, PackedRows, pack_units
from k3jax.data.chat_format import ChatEncoder, generation_prompt, render_conversation, reply_segments
from k3jax.data.errors import DataError, require_int
from k3jax.data.prompts import read_prompt_records
from k3jax.data.sources import JSON_SUFFIXES, PARQUET_SUFFIXES, find_data_files
from k3jax.data.tokenizers import load_tokenizer

PathLike = str | os.PathLike
REPLIES = ("chosen", "rejected")


def fit_pair(prompt: int, chosen: int, rejected: int, row_len: int) -> tuple[int, int] | None:
    """The reply lengths ``(chosen', rejected')`` that fit a pair with a ``prompt``-token prompt in a
    row of ``row_len`` tokens (twice the prompt plus both replies), cutting the longer reply first,
    each keeping at least one token; None when not even that fits."""
    budget = row_len - 2 * prompt
    if budget < 2:
        return None
    if chosen + rejected <= budget:
        return chosen, rejected
    short = min(chosen, rejected, budget // 2)
    long_ = budget - short
    return (long_, short) if chosen >= rejected else (short, long_)


class PreferenceDataset(PackedRows):
    """Packed preference pairs; see the module docstring. In a batch's rows (`PackedRows.batch`),
    segment ``2k + 1`` / ``2k + 2`` is pair k's chosen / rejected sequence.

    Args:
      path: a file, directory or glob of ``.jsonl`` / ``.json`` / ``.parquet`` files, or a list of them.
      seq_len: positions per row (a row holds ``seq_len + 1`` tokens).
      seed: seeds the row shuffle of each epoch.
      heldout_fraction: share of the pairs at the end that form the "heldout" split.
      tokenizer_path: None for UTF-8 bytes, or a tiktoken BPE file (chat records need K3's markers).
      overflow: "truncate" or "drop" a pair longer than a row.
      thinking, thinking_effort: the chat rendering (`k3jax.data.chat_format.render_conversation`).
    """

    unit, source = "pairs", "records"

    def __init__(self, path: PathLike | Sequence[PathLike], seq_len: int, *, seed: int = 0,
                 heldout_fraction: float = 0.05, tokenizer_path: PathLike | None = None, overflow: str = "truncate",
                 thinking: bool = True, thinking_effort: str | None = "max"):
        self.seq_len, self.seed = require_int("seq_len", seq_len, 1), require_int("seed", seed, 0)
        if isinstance(heldout_fraction, bool) or not isinstance(heldout_fraction, (int, float)) \
                or not 0 <= heldout_fraction < 1:
            raise DataError(f"heldout_fraction must be in [0, 1), got {heldout_fraction!r}")
        if overflow not in OVERFLOW_MODES:
            raise DataError(f"overflow must be one of {OVERFLOW_MODES}, got {overflow!r}")
        self.paths = [str(p) for p in ([path] if isinstance(path, (str, os.PathLike)) else path)]
        self.heldout_fraction, self.overflow = heldout_fraction, overflow
        self.thinking, self.thinking_effort = thinking, thinking_effort
        self.tokenizer = load_tokenizer(tokenizer_path)
        self._encoder = None
        suffixes = JSON_SUFFIXES + PARQUET_SUFFIXES
        self.files = [file for p in self.paths for file in find_data_files(p) if file.suffix.lower() in suffixes]
        if not self.files:
            raise DataError(f"{', '.join(self.paths)}: no {', '.join(suffixes)} files of preference pairs")
        self.pairs, self.truncated, self.dropped = [], 0, 0
        for file in self.files:
            for where, record in read_prompt_records(file):
                self._add(where, record)
        if not self.pairs:
            raise DataError(f"{', '.join(self.paths)}: no preference pair fits in a row of seq_len + 1 = "
                            f"{seq_len + 1} tokens ({self.dropped} dropped); raise data.seq_len")
        count = len(self.pairs)
        heldout = min(max(int(heldout_fraction * count), 1), count - 1) if heldout_fraction and count > 1 else 0
        self.num_heldout_pairs = heldout
        self.splits = {"train": pack_units(self.pairs[:count - heldout], seq_len + 1),
                       "heldout": pack_units(self.pairs[count - heldout:], seq_len + 1)}

    @property
    def encoder(self) -> ChatEncoder:
        if self._encoder is None:
            self._encoder = ChatEncoder(self.tokenizer)
        return self._encoder

    def _reply(self, where: str, name: str, reply: Any, chat: bool) -> np.ndarray:
        """A reply's tokens (module docstring)."""
        if isinstance(reply, dict):
            if not chat:
                raise DataError(f"{where}: {name!r} is a message object, which needs a 'messages' prompt")
            if reply.get("role", "assistant") != "assistant":
                raise DataError(f"{where}: {name!r} must be an assistant message, got role {reply.get('role')!r}")
            return self.encoder.encode(reply_segments({**reply, "role": "assistant"}, self.thinking))[0]
        if not isinstance(reply, str) or not reply:
            raise DataError(f"{where}: {name!r} must be non-empty text or an assistant message object")
        if chat:
            return self.encoder.encode(reply_segments({"role": "assistant", "content": reply}, self.thinking))[0]
        return np.asarray(self.tokenizer.encode(reply) + [self.tokenizer.eos_id], np.int32)

    def _add(self, where: str, record: Any) -> None:
        """Encode one record's pair into ``self.pairs`` (or count it dropped)."""
        if not isinstance(record, dict) or ("prompt" in record) == ("messages" in record) \
                or any(name not in record for name in REPLIES):
            raise DataError(f"{where}: expected a JSON object with a 'prompt' (text) or 'messages' (chat) field, "
                            f"and 'chosen' and 'rejected'")
        chat = "messages" in record
        if chat:
            segments = render_conversation(record["messages"], record.get("tools"), thinking=self.thinking,
                                           thinking_effort=self.thinking_effort, where=where)
            prompt = self.encoder.encode(segments + generation_prompt(self.thinking))[0]
        else:
            if not isinstance(record["prompt"], str) or not record["prompt"]:
                raise DataError(f"{where}: 'prompt' must be non-empty text")
            prompt = np.asarray(self.tokenizer.encode(record["prompt"]), np.int32)
        chosen, rejected = (self._reply(where, name, record[name], chat) for name in REPLIES)
        row_len = self.seq_len + 1
        fitted = fit_pair(prompt.size, chosen.size, rejected.size, row_len)
        if fitted is None or (fitted != (chosen.size, rejected.size) and self.overflow == "drop"):
            self.dropped += 1
            return
        self.truncated += fitted != (chosen.size, rejected.size)
        self.pairs.append([(np.concatenate([prompt, reply[:length]]),
                            np.concatenate([np.zeros(prompt.size, bool), np.ones(length, bool)]))
                           for reply, length in zip((chosen, rejected), fitted)])

    def _definition(self) -> dict:
        return {"kind": "preferences", "seq_len": self.seq_len, "seed": self.seed,
                "heldout_fraction": self.heldout_fraction, "vocab_size": self.vocab_size, "overflow": self.overflow,
                "thinking": self.thinking, "thinking_effort": self.thinking_effort}

    def describe(self) -> dict:
        return {**self._definition(), "paths": self.paths, "num_files": len(self.files),
                "tokenizer": self.tokenizer.describe(), "num_pairs": len(self.pairs),
                "heldout_pairs": self.num_heldout_pairs, "truncated_pairs": self.truncated,
                "dropped_pairs": self.dropped, "rows": {split: self.num_rows(split) for split in SPLITS}}

    def content_hash(self) -> str:
        """Hash of every pair's tokens, loss flags and the packing settings."""
        pieces = [piece for pair in self.pairs for piece in pair]
        lengths = np.array([ids.size for ids, _ in pieces], np.int64)
        return definition_hash(self._definition(), lengths, np.concatenate([ids for ids, _ in pieces]),
                               np.concatenate([flags for _, flags in pieces]))
