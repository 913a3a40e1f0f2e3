"""Bits per byte: a model's loss on text measured against the text's size, whatever the tokenizer.

    bits per byte = Σ token NLL (nats) / ln 2 / Σ UTF-8 bytes of the scored target tokens

A token's bytes are those it decodes to (1 per byte token, ``len(token)`` for a BPE token, 0 for
special tokens such as BOS/EOS), so the figure compares a byte-level and a BPE model on equal terms.
"""
from __future__ import annotations

import math

import numpy as np

from k3jax.data.sources import read_file_bytes
from k3jax.data.tokenizers import ByteTokenizer, parse_bpe_ranks


def token_byte_lengths(tokenizer) -> np.ndarray:
    """UTF-8 bytes each token id stands for (0 for special tokens), ``[vocab_size]`` int64."""
    lengths = np.zeros(tokenizer.vocab_size, np.int64)
    if isinstance(tokenizer, ByteTokenizer):
        lengths[:256] = 1
        return lengths
    for token, rank in parse_bpe_ranks(read_file_bytes(tokenizer.path), tokenizer.path).items():
        lengths[rank] = len(token)
    return lengths


def scored_bytes(byte_lengths: np.ndarray, targets: np.ndarray, loss_mask: np.ndarray) -> float:
    """Σ over scored positions (``loss_mask`` 1) of the UTF-8 bytes of the target token."""
    return float(np.sum(byte_lengths[targets] * loss_mask))


def bits_per_byte(nll_nats: float, num_bytes: float) -> float:
    """``nll_nats / ln 2 / num_bytes`` (nan when no byte was scored)."""
    return nll_nats / math.log(2) / num_bytes if num_bytes else math.nan
