"""Pre-tokenised shards (written once by ``python -m k3jax.data.prepare``) read as a dataset from disk.

A prepared directory holds the token stream of a corpus (every non-empty document's tokens and
EOS, end to end, exactly as `k3jax.data.TextDataset` builds it) cut at document boundaries into shards:

    shard-00000.tokens.npy   int32 [n]   the shard's tokens (memory-mapped when read)
    shard-00000.docs.npy     int64 [d]   where each of its documents begins, from 0
    shard-00000.json         its token, document and source-document counts and the SHA-256 of both
                             arrays; written last, so its presence marks the shard complete
    prepare.json             the settings (sources, text field, tokenizer, shard size)
    index.json               the shards in order and the totals; written last, when all are done

`TokensDataset` packs, cuts and shuffles that stream like `TextDataset` (rows cross shard
boundaries as they cross documents), so the two give the same rows for the same corpus and
settings. Tokens are never loaded whole: each row reads its ``seq_len + 1`` tokens from the
memory-mapped shards; the document offsets (8 bytes per document) are read into memory.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from k3jax.data.batching import definition_hash
from k3jax.data.errors import DataError, require_int
from k3jax.data.packing import TokenStream
from k3jax.data.sources import read_file_bytes
from k3jax.data.text import PackedDataset, check_heldout_fraction
from k3jax.data.tokenizers import load_tokenizer

FORMAT = "k3jax-tokens"
FORMAT_VERSION = 1
INDEX_NAME = "index.json"
SETTINGS_NAME = "prepare.json"


def shard_name(number: int) -> str:
    return f"shard-{number:05d}"


def read_json(path: Path):
    """A JSON file written by prepare; a missing or damaged one is a `DataError`."""
    try:
        return json.loads(read_file_bytes(path))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DataError(f"{path}: not valid JSON ({error})") from None


def tokenizer_label(described: dict) -> str:
    """``bytes``, or a BPE tokenizer's path and the start of its SHA-256."""
    return "bytes" if described["kind"] == "bytes" else f"{described['path']} (SHA-256 {described['sha256'][:12]}…)"


def array_sha256(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


class ShardDigests:
    """The SHA-256 each shard's tokens must have, checked once per shard per process, on its first read
    (a shard is read whole once to hash it; later reads touch only the rows they need)."""

    def __init__(self, names: list[str], digests: list[str]):
        self.names, self.digests, self.checked = names, digests, set()

    def check(self, number: int, tokens: np.ndarray) -> None:
        if number in self.checked:
            return
        if array_sha256(tokens) != self.digests[number]:
            raise DataError(f"{self.names[number]}: the tokens do not match the SHA-256 the index recorded "
                            f"(changed or damaged on disk); prepare it again")
        self.checked.add(number)


class ShardedTokens:
    """Memory-mapped token shards read as one int32 array, or a window ``[lo, hi)`` of it.

    Supports what packing needs: ``size``, ``len``, a contiguous slice (another window, nothing read)
    and indexing by an integer array of any shape (a gather from the shards holding those positions).
    With ``digests`` every shard is verified on its first read (`ShardDigests`).
    """

    def __init__(self, shards: list[np.ndarray], lo: int = 0, hi: int | None = None,
                 digests: ShardDigests | None = None):
        self.shards, self.digests = shards, digests
        self.starts = np.cumsum([0] + [shard.size for shard in shards], dtype=np.int64)
        self.lo, self.hi = lo, int(self.starts[-1]) if hi is None else hi

    @property
    def size(self) -> int:
        return self.hi - self.lo

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, stride = key.indices(self.size)
            if stride != 1:
                raise DataError("sharded tokens take contiguous slices only")
            return ShardedTokens(self.shards, self.lo + start, self.lo + max(start, stop), self.digests)
        positions = np.asarray(key, dtype=np.int64).ravel() + self.lo
        which = np.searchsorted(self.starts, positions, side="right") - 1
        out = np.empty(positions.size, dtype=np.int32)
        for shard in np.unique(which):
            if self.digests is not None:
                self.digests.check(int(shard), self.shards[shard])
            here = which == shard
            out[here] = self.shards[shard][positions[here] - self.starts[shard]]
        return out.reshape(np.shape(key))


def open_shard(directory: Path, entry: dict) -> tuple[np.ndarray, np.ndarray]:
    """``(memory-mapped tokens, document starts)`` of one shard of an index, checked against its entry."""
    name = entry["name"]
    try:
        tokens = np.load(directory / f"{name}.tokens.npy", mmap_mode="r")
        docs = np.load(directory / f"{name}.docs.npy")
    except (OSError, ValueError) as error:
        raise DataError(f"{directory / name}: cannot read the shard ({error}); prepare it again") from None
    if tokens.dtype != np.int32 or tokens.size != entry["num_tokens"] or docs.size != entry["num_documents"]:
        raise DataError(f"{directory / name}: {tokens.size} {tokens.dtype} tokens and {docs.size} documents, "
                        f"the index says {entry['num_tokens']} int32 and {entry['num_documents']}; prepare it again")
    if array_sha256(docs) != entry["docs_sha256"]:
        raise DataError(f"{directory / name}: the document offsets do not match the SHA-256 the index recorded "
                        f"(changed or damaged on disk); prepare it again")
    return tokens, docs


def read_index(directory: Path) -> dict:
    """A prepared directory's index, with a clear error when the directory is not (fully) prepared."""
    if not directory.is_dir():
        raise DataError(f"{directory}: no such directory (write one with python -m k3jax.data.prepare)")
    if not (directory / INDEX_NAME).is_file():
        hint = "an unfinished prepare: run it again to continue" if (directory / SETTINGS_NAME).is_file() \
            else "not written by python -m k3jax.data.prepare"
        raise DataError(f"{directory}: no {INDEX_NAME} ({hint})")
    index = read_json(directory / INDEX_NAME)
    if index.get("format") != FORMAT or index.get("version") != FORMAT_VERSION:
        raise DataError(f"{directory / INDEX_NAME}: format {index.get('format')!r} version {index.get('version')!r}, "
                        f"expected {FORMAT!r} version {FORMAT_VERSION}")
    return index


class TokensDataset(PackedDataset):
    """Packed rows of ``seq_len`` positions read from a prepared directory (see the module docstring).

    Args:
      path: the output directory of ``python -m k3jax.data.prepare``.
      seq_len, seed, heldout_fraction: as for `k3jax.data.TextDataset`.
      tokenizer_path: the tokenizer the shards were made with (checked by SHA-256); None: the one the
        index names (byte tokens, or the BPE file at its recorded path).
    """

    def __init__(self, path: str | os.PathLike, seq_len: int, *, seed: int = 0, heldout_fraction: float = 0.05,
                 tokenizer_path: str | os.PathLike | None = None):
        self.seq_len, self.seed = require_int("seq_len", seq_len, 1), require_int("seed", seed, 0)
        self.heldout_fraction = check_heldout_fraction(heldout_fraction)
        directory = Path(path)
        self.paths = [str(directory)]
        self.index = read_index(directory)
        self.tokenizer = self._tokenizer(tokenizer_path)
        shards = [open_shard(directory, entry) for entry in self.index["shards"]]
        firsts = np.cumsum([0] + [tokens.size for tokens, _ in shards[:-1]], dtype=np.int64)
        doc_starts = np.concatenate([docs + first for (_, docs), first in zip(shards, firsts)] or [np.zeros(0, np.int64)])
        digests = ShardDigests([str(directory / entry["name"]) for entry in self.index["shards"]],
                               [entry["tokens_sha256"] for entry in self.index["shards"]])
        self._set_stream(TokenStream(ShardedTokens([tokens for tokens, _ in shards], digests=digests), doc_starts))

    def _tokenizer(self, tokenizer_path):
        made_with = self.index["tokenizer"]
        if tokenizer_path is None and made_with["kind"] != "bytes":
            tokenizer_path = made_with["path"]
            if not Path(tokenizer_path).exists():
                raise DataError(f"{self.paths[0]}: prepared with the tokenizer {tokenizer_path}, which is not there; "
                                "name it with data.tokenizer=PATH")
        tokenizer = load_tokenizer(tokenizer_path)
        if tokenizer.describe().get("sha256") != made_with.get("sha256"):
            raise DataError(f"{self.paths[0]}: prepared with the tokenizer {tokenizer_label(made_with)}, "
                            f"not {tokenizer_label(tokenizer.describe())}")
        return tokenizer

    def _definition(self) -> dict:
        return {**super()._definition(), "kind": "tokens"}

    def describe(self) -> dict:
        return {**super().describe(), "num_shards": len(self.index["shards"])}

    def content_hash(self) -> str:
        """Hash of the shards' recorded digests, the document offsets and the packing settings (no token is read)."""
        digests = [entry["tokens_sha256"] for entry in self.index["shards"]]
        return definition_hash({**self._definition(), "shards": digests}, self.stream.doc_starts)
