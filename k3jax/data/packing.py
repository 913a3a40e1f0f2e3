"""Packing documents into fixed-length rows and cutting off the held-out split.

The token stream is each document's tokens followed by EOS, concatenated (empty documents are
skipped). Row r of a stream of N tokens is the window ``stream[r*T : r*T + T + 1]`` (T = seq_len): its
first T tokens are the inputs and its last T the targets, so neighbouring rows share one token and
every next-token pair of the stream is trained once; the ``(N - 1) // T`` full windows are the rows
and the shorter tail is left out. In a row, documents are numbered from 1 (a document continuing from
the previous row is 1 again), and the loss skips a position whose target starts the next document:
nothing before it in the row predicts it, and the model resets there.

Rows are shuffled and read in epochs by `k3jax.data.pipeline`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable

import numpy as np

from k3jax.data.batching import Batch, inputs_and_targets
from k3jax.data.tokenizers import Tokenizer


@dataclasses.dataclass(frozen=True)
class TokenStream:
    """Documents' tokens end to end (int32 ``tokens``) and the offset where each begins (``doc_starts``,
    increasing, from 0)."""

    tokens: np.ndarray
    doc_starts: np.ndarray

    def __len__(self) -> int:
        return self.tokens.size

    def num_rows(self, seq_len: int) -> int:
        """Full rows of ``seq_len + 1`` tokens (overlapping by one) in this stream."""
        return max(len(self) - 1, 0) // seq_len

    def slice(self, start: int, stop: int) -> TokenStream:
        """Tokens ``[start, stop)`` as a stream; a document cut at ``start`` begins the slice."""
        inside = self.doc_starts[(self.doc_starts > start) & (self.doc_starts < stop)] - start
        return TokenStream(self.tokens[start:stop], np.concatenate([[0], inside]).astype(np.int64))


def document_tokens(text: str, tokenizer: Tokenizer) -> np.ndarray | None:
    """A document's tokens followed by EOS (int32), or None for an empty document (it is skipped)."""
    ids = tokenizer.encode(text)
    return np.asarray(ids + [tokenizer.eos_id], dtype=np.int32) if ids else None


def concatenate_documents(pieces: list[np.ndarray]) -> TokenStream:
    """Documents' EOS-terminated tokens end to end, as a stream."""
    lengths = np.array([piece.size for piece in pieces], dtype=np.int64)
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
    return TokenStream(tokens, np.cumsum(lengths) - lengths)


def tokenize_documents(documents: Iterable[str], tokenizer: Tokenizer) -> TokenStream:
    """The EOS-terminated tokens of every non-empty document, in order."""
    pieces = (document_tokens(text, tokenizer) for text in documents)
    return concatenate_documents([piece for piece in pieces if piece is not None])


def heldout_start(stream: TokenStream, fraction: float, row_len: int) -> int:
    """Offset where the held-out split (the stream's tail) begins.

    It is the last ``floor(fraction * documents)`` documents, or when that is none (too few documents
    to split by), the last ``ceil(fraction * tokens)`` tokens, cut inside a document. It then grows
    to at least one row and shrinks to leave training at least one, when the stream holds two rows.
    ``fraction == 0`` means no held-out split.
    """
    total, num_docs = len(stream), stream.doc_starts.size
    if fraction == 0:
        return total
    heldout_docs = math.floor(fraction * num_docs)
    start = int(stream.doc_starts[num_docs - heldout_docs]) if heldout_docs else total - math.ceil(fraction * total)
    return max(min(start, total - row_len), min(row_len, total))


def pack_rows(stream: TokenStream, rows: np.ndarray, seq_len: int) -> Batch:
    """The batch made of ``rows`` of ``stream`` (format in `k3jax.data.batching`)."""
    offsets = rows[:, None] * seq_len + np.arange(seq_len + 1)
    tokens, targets = inputs_and_targets(stream.tokens[offsets])
    document = np.searchsorted(stream.doc_starts, offsets, side="right") - 1
    return {
        "tokens": tokens,
        "targets": targets,
        "loss_mask": (document[:, 1:] == document[:, :-1]).astype(np.float32),
        "segment_ids": (document[:, :-1] - document[:, :1] + 1).astype(np.int32),
    }
