"""User text as a dataset: files → documents → tokens → packed rows, shuffled by seed, with a held-out tail.

Reading rules are in `k3jax.data.sources`, tokenizers in `k3jax.data.tokenizers`, packing, shuffling
and the held-out cut in `k3jax.data.packing`. Everything is read and tokenized once, when the dataset
is built (so bad input fails at once), and kept in memory; nothing is written to disk.
"""
from __future__ import annotations

import os
from typing import Iterator, Sequence

from k3jax.data.batching import SPLITS, Batch, definition_hash, shard_row_indices, split_index
from k3jax.data.errors import DataError, require_int
from k3jax.data.packing import TokenStream, heldout_start, pack_rows, shuffled_rows, tokenize_documents
from k3jax.data.sources import find_data_files, read_documents
from k3jax.data.tokenizers import load_tokenizer

PathLike = str | os.PathLike


def _documents(files: Sequence[os.PathLike], field: str) -> Iterator[str]:
    """Every document of ``files``, in order, read one file at a time."""
    for file in files:
        yield from read_documents(file, field)


class TextDataset:
    """Packed rows of ``seq_len`` positions from local UTF-8 text, JSON Lines or JSON files.

    Args:
      path: a file, a directory (searched recursively), or a list of them, read in that order.
      seq_len: positions per row (each row holds ``seq_len + 1`` tokens: inputs and shifted targets).
      seed: seeds the row shuffle of each epoch.
      heldout_fraction: share of documents at the end that form the "heldout" split (see
        `k3jax.data.packing.heldout_start`); 0 for none.
      jsonl_field: the field of each JSON record that holds its text.
      tokenizer_path: a tiktoken-format BPE file (or a directory holding ``tiktoken.model``); None for bytes.
    """

    def __init__(self, path: PathLike | Sequence[PathLike], seq_len: int, *, seed: int = 0,
                 heldout_fraction: float = 0.05, jsonl_field: str = "text", tokenizer_path: PathLike | None = None):
        seq_len, seed = require_int("seq_len", seq_len, 1), require_int("seed", seed, 0)
        if isinstance(heldout_fraction, bool) or not isinstance(heldout_fraction, (int, float)) \
                or not 0 <= heldout_fraction < 1:
            raise DataError(f"heldout_fraction must be in [0, 1), got {heldout_fraction!r}")
        if not isinstance(jsonl_field, str) or not jsonl_field:
            raise DataError(f"jsonl_field must be a non-empty string, got {jsonl_field!r}")
        self.paths = [str(p) for p in ([path] if isinstance(path, (str, os.PathLike)) else path)]
        self.seq_len, self.seed, self.heldout_fraction, self.jsonl_field = seq_len, seed, heldout_fraction, jsonl_field
        self.tokenizer = load_tokenizer(tokenizer_path)
        self.files = [file for p in self.paths for file in find_data_files(p)]
        self.stream = tokenize_documents(_documents(self.files, jsonl_field), self.tokenizer)
        if len(self.stream) <= seq_len:
            raise DataError(f"{', '.join(self.paths)}: {len(self.stream)} tokens in {self.stream.doc_starts.size} "
                            f"documents, fewer than one row of seq_len + 1 = {seq_len + 1}")
        cut = heldout_start(self.stream, heldout_fraction, seq_len + 1)
        self.splits = {"train": self.stream.slice(0, cut), "heldout": self.stream.slice(cut, len(self.stream))}

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def num_rows(self, split: str = "train") -> int:
        """Distinct rows in ``split`` (one epoch)."""
        split_index(split)
        return self.splits[split].num_rows(self.seq_len)

    def _split_stream(self, split: str) -> TokenStream:
        if self.num_rows(split) == 0:
            raise DataError(f"{', '.join(self.paths)}: the {split} split has {len(self.splits[split])} tokens, "
                            f"fewer than one row of {self.seq_len + 1}; "
                            "raise heldout_fraction, add data or lower seq_len")
        return self.splits[split]

    def batch(self, step: int, batch_size: int, split: str = "train",
              process_index: int = 0, process_count: int = 1) -> Batch:
        """This process's rows of global batch ``step``, in the format of `k3jax.data.batching`."""
        stream = self._split_stream(split)
        indices = shard_row_indices(step, batch_size, process_index, process_count)
        rows = shuffled_rows(indices, self.num_rows(split), self.seed, split_index(split))
        return pack_rows(stream, rows, self.seq_len)

    def _definition(self) -> dict:
        """Everything besides the token stream that decides the rows."""
        return {"kind": "text", "seq_len": self.seq_len, "seed": self.seed, "heldout_fraction": self.heldout_fraction,
                "vocab_size": self.vocab_size, "eos_id": self.tokenizer.eos_id}

    def describe(self) -> dict:
        return {**self._definition(), "paths": self.paths, "num_files": len(self.files),
                "jsonl_field": self.jsonl_field, "tokenizer": self.tokenizer.describe(),
                "num_documents": int(self.stream.doc_starts.size), "num_tokens": len(self.stream),
                "rows": {split: self.num_rows(split) for split in SPLITS}}

    def content_hash(self) -> str:
        """Hash of the tokens and the packing settings; the files' names and locations do not enter it."""
        return definition_hash(self._definition(), self.stream.tokens, self.stream.doc_starts)
