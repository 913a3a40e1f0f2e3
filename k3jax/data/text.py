"""User text as a dataset: files → documents → tokens → packed rows, shuffled by seed, with a held-out tail.

Reading rules are in `k3jax.data.sources`, tokenizers in `k3jax.data.tokenizers`, packing and the
held-out cut in `k3jax.data.packing`, the shuffled row stream in `k3jax.data.pipeline`. Everything is
read and tokenized once, when the dataset is built (so bad input fails at once), and kept in memory;
for a corpus too large for that, `python -m k3jax.data.prepare` tokenizes it once into shards that
`k3jax.data.tokens.TokensDataset` reads from disk, row for row the same.
"""
from __future__ import annotations

import os
from typing import Iterator, Sequence

from k3jax.data.batching import SPLITS, Batch, definition_hash, shard_row_indices, split_index
from k3jax.data.errors import DataError, require_int
from k3jax.data.packing import TokenStream, heldout_start, pack_rows, tokenize_documents
from k3jax.data.pipeline import rows_at, shuffled_row_order
from k3jax.data.sources import find_data_files, read_documents
from k3jax.data.tokenizers import load_tokenizer

PathLike = str | os.PathLike


def _documents(files: Sequence[os.PathLike], field: str) -> Iterator[str]:
    """Every document of ``files``, in order, read one file at a time."""
    for file in files:
        yield from read_documents(file, field)


def check_heldout_fraction(heldout_fraction) -> float:
    if isinstance(heldout_fraction, bool) or not isinstance(heldout_fraction, (int, float)) \
            or not 0 <= heldout_fraction < 1:
        raise DataError(f"heldout_fraction must be in [0, 1), got {heldout_fraction!r}")
    return heldout_fraction


class PackedDataset:
    """A token stream packed into rows (`k3jax.data.packing`), cut into "train" and a held-out tail,
    read in the shuffled grain row order of each split (`k3jax.data.pipeline`).

    Subclasses set ``paths`` (for messages), ``seq_len``, ``seed``, ``heldout_fraction``, ``tokenizer``
    and call `_set_stream`.
    """

    paths: list[str]
    seq_len: int
    seed: int
    heldout_fraction: float

    def _set_stream(self, stream: TokenStream) -> None:
        """Hold ``stream`` and cut it into the splits (each a `TokenStream`, in ``self.splits``)."""
        self.stream = stream
        if len(stream) <= self.seq_len:
            raise DataError(f"{', '.join(self.paths)}: {len(stream)} tokens in {stream.doc_starts.size} "
                            f"documents, fewer than one row of seq_len + 1 = {self.seq_len + 1}")
        cut = heldout_start(stream, self.heldout_fraction, self.seq_len + 1)
        self.splits = {"train": stream.slice(0, cut), "heldout": stream.slice(cut, len(stream))}

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def num_rows(self, split: str = "train") -> int:
        """Distinct rows in ``split`` (one epoch)."""
        split_index(split)
        return self.splits[split].num_rows(self.seq_len)

    def _row_order(self, split: str):
        """The split's shuffled grain row order."""
        if self.num_rows(split) == 0:
            raise DataError(f"{', '.join(self.paths)}: the {split} split has {len(self.splits[split])} tokens, "
                            f"fewer than one row of {self.seq_len + 1}; "
                            "raise heldout_fraction, add data or lower seq_len")
        return shuffled_row_order(self.num_rows(split), self.seed, split)

    def batch(self, step: int, batch_size: int, split: str = "train",
              process_index: int = 0, process_count: int = 1) -> Batch:
        """This process's rows of global batch ``step``, in the format of `k3jax.data.batching`."""
        order = self._row_order(split)
        indices = shard_row_indices(step, batch_size, process_index, process_count)
        return pack_rows(self.splits[split], rows_at(order, indices), self.seq_len)

    def _definition(self) -> dict:
        """Everything besides the token stream that decides the rows."""
        return {"kind": "text", "seq_len": self.seq_len, "seed": self.seed, "heldout_fraction": self.heldout_fraction,
                "vocab_size": self.vocab_size, "eos_id": self.tokenizer.eos_id}

    def describe(self) -> dict:
        return {**self._definition(), "paths": self.paths, "tokenizer": self.tokenizer.describe(),
                "num_documents": int(self.stream.doc_starts.size), "num_tokens": len(self.stream),
                "rows": {split: self.num_rows(split) for split in SPLITS}}

    def content_hash(self) -> str:
        """Hash of the tokens and the packing settings; the files' names and locations do not enter it."""
        return definition_hash(self._definition(), self.stream.tokens, self.stream.doc_starts)


class TextDataset(PackedDataset):
    """Packed rows of ``seq_len`` positions from local UTF-8 text, JSON Lines, JSON or Parquet files.

    Args:
      path: a file, a directory (searched recursively), a glob, or a list of them, read in that order.
      seq_len: positions per row (each row holds ``seq_len + 1`` tokens: inputs and shifted targets).
      seed: seeds the row shuffle of each epoch.
      heldout_fraction: share of documents at the end that form the "heldout" split (see
        `k3jax.data.packing.heldout_start`); 0 for none.
      jsonl_field: the field of each JSON record (the column of a Parquet file) that holds its text.
      tokenizer_path: a tiktoken-format BPE file (or a directory holding ``tiktoken.model``); None for bytes.
    """

    def __init__(self, path: PathLike | Sequence[PathLike], seq_len: int, *, seed: int = 0,
                 heldout_fraction: float = 0.05, jsonl_field: str = "text", tokenizer_path: PathLike | None = None):
        self.seq_len, self.seed = require_int("seq_len", seq_len, 1), require_int("seed", seed, 0)
        self.heldout_fraction = check_heldout_fraction(heldout_fraction)
        if not isinstance(jsonl_field, str) or not jsonl_field:
            raise DataError(f"jsonl_field must be a non-empty string, got {jsonl_field!r}")
        self.paths = [str(p) for p in ([path] if isinstance(path, (str, os.PathLike)) else path)]
        self.jsonl_field = jsonl_field
        self.tokenizer = load_tokenizer(tokenizer_path)
        self.files = [file for p in self.paths for file in find_data_files(p)]
        self._set_stream(tokenize_documents(_documents(self.files, jsonl_field), self.tokenizer))

    def describe(self) -> dict:
        return {**super().describe(), "num_files": len(self.files), "jsonl_field": self.jsonl_field}
