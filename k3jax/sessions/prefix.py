"""The prefix cache: where a new session's prefill can start.

Prefill runs in pieces that end at every multiple of ``kda.chunk_size``; the KDA state and conv
tails at each such boundary and at the end of each turn are kept (on the host) with the pages
before them (shared: the cache holds a reference to each), keyed by sha256(model fingerprint,
the serving adapter's tag, token ids). A new session resumes from the longest cached prefix of its prompt. Entries leave
least recently used first: past ``MAX_PREFIX_ENTRIES``, when the store needs device or host
room, and when a session needs pages the pools do not have free -- the cache holds spare pages
only and never makes the pools grow (growing recompiles the programs over them;
`k3jax.sessions.tiers`).
"""
from __future__ import annotations

import hashlib

import numpy as np

from k3jax.sessions.pools import RefCounts
from k3jax.sessions.recency import Clock, least_recent

MAX_PREFIX_ENTRIES = 4096


class PrefixEntry:
    """A cached boundary: the KDA state and conv tails (host) after ``length`` tokens, the pages
    holding their latent rows, and the logits of the last of them."""

    def __init__(self, key: str, length: int, state, conv, pages: list[int], logits):
        self.key, self.length, self.state, self.conv, self.pages, self.logits = key, length, state, conv, pages, logits
        self.used = 0

    @property
    def nbytes(self) -> int:
        return self.state.nbytes + self.conv.nbytes


class PrefixCache:
    """Entries for the model of ``fingerprint``, holding references to their pages in ``pages``;
    ``nbytes`` is the host memory they take, ``counts`` the hits and misses of `longest_prefix`."""

    def __init__(self, fingerprint: str, pages: RefCounts, clock: Clock, max_entries: int = MAX_PREFIX_ENTRIES):
        self.fingerprint, self.pages, self.clock, self.max_entries = fingerprint, pages, clock, max_entries
        self.entries: dict[str, PrefixEntry] = {}
        self.lengths: dict[int, int] = {}          # cached length -> entries of that length
        self.nbytes = 0
        self.counts = dict.fromkeys(("prefix_hits", "prefix_misses", "prefix_tokens_reused"), 0)

    def __len__(self) -> int:
        return len(self.entries)

    def key(self, tokens, adapter: str = "") -> str:
        """sha256(fingerprint, ``adapter``'s tag when it is not the base, token ids)."""
        digest = hashlib.sha256(self.fingerprint.encode())
        if adapter:
            digest.update(b"adapter:" + adapter.encode() + b"\0")
        digest.update(np.asarray(tokens, np.int32).tobytes())
        return digest.hexdigest()

    def longest_prefix(self, tokens: list[int], adapter: str = "") -> PrefixEntry | None:
        """The entry of the longest cached prefix of ``tokens`` served by ``adapter`` (counted as a
        hit), or None (a miss)."""
        for length in sorted(self.lengths, reverse=True):
            if length <= len(tokens):
                entry = self.entries.get(self.key(tokens[:length], adapter))
                if entry is not None:
                    self.clock.touch(entry)
                    self.counts["prefix_hits"] += 1
                    self.counts["prefix_tokens_reused"] += length
                    return entry
        self.counts["prefix_misses"] += 1
        return None

    def touch(self, key: str) -> bool:
        """Mark the entry of ``key`` used -> whether there is one."""
        entry = self.entries.get(key)
        if entry is not None:
            self.clock.touch(entry)
        return entry is not None

    def add(self, key: str, length: int, state, conv, pages: list[int], logits) -> None:
        """Cache the boundary after ``length`` tokens (of ``key``, not cached yet) and share its
        ``pages``; past ``max_entries`` the least recently used entry goes."""
        self.pages.share(pages)
        entry = PrefixEntry(key, length, state, conv, pages, logits)
        self.entries[key] = entry
        self.lengths[length] = self.lengths.get(length, 0) + 1
        self.nbytes += entry.nbytes
        self.clock.touch(entry)
        if len(self.entries) > self.max_entries:
            self.drop(least_recent(self.entries.values()))

    def drop(self, entry: PrefixEntry) -> None:
        del self.entries[entry.key]
        self.lengths[entry.length] -= 1
        if not self.lengths[entry.length]:
            del self.lengths[entry.length]
        self.pages.release(entry.pages)
        self.nbytes -= entry.nbytes

    def evict(self, *, freeing_pages: bool = False) -> bool:
        """Drop the least recently used entry -- with ``freeing_pages``, of those that hold the
        last reference to one of their pages -> whether there was one."""
        entries = self.entries.values()
        if freeing_pages:
            entries = [e for e in entries if any(self.pages.refs[page] == 1 for page in e.pages)]
        entry = least_recent(entries)
        if entry is not None:
            self.drop(entry)
        return entry is not None
