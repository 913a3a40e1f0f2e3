"""`SessionStore`: many conversations over one model, each a value that can be kept, copied,
rolled back and moved between device, host and disk.

    store = SessionStore(model, device_bytes=None, host_bytes=None, disk_dir=None)
    sid = store.open(prompt)            # prefill (resuming from the longest cached prefix)
    store.append(sid, tokens)           # -> logits [T, vocab]; store.logits(sid) -> [vocab]
    store.generate([sid, ...], 32)      # one batched jitted step per token over all the sessions
    h = store.snapshot(sid); store.rollback(sid, h); sid2 = store.fork(sid); store.close(sid)
    store.save(dir); SessionStore.load(model, dir)

A session's memory is its KDA states and conv tails (a slot of the device pools) and its MLA
latent rows (pages of the paged cache, `k3jax.sessions.paged`). Forks, snapshots and prefix-cache
entries share pages; a page is copied before a write when someone else holds it (copy-on-write:
only a session's last, partial page is ever written). Under a device byte budget the
least-recently-used values (prefix entries holding the last reference to a page first, then
sessions and snapshots) leave the device
for host numpy arrays; under a host budget they go on to atomic files in ``disk_dir``. Each
comes back on use. Prefill runs in pieces that end at every multiple of ``kda.chunk_size``;
the KDA state and conv tails at each such boundary and at the end of each turn are kept with
the pages before them, keyed by sha256(model fingerprint, token ids). A new session resumes
from the longest cached prefix of its prompt.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import pathlib
import shutil
import uuid
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.sessions import paged
from k3jax.sessions.tiers import HostTier, HostValue, RefCounts, read_npz, write_npz_atomically

FORMAT_VERSION = 1
MAX_PREFIX_ENTRIES = 4096
_INITIAL_SLOTS, _INITIAL_PAGES = 8, 32


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A handle to a saved point of one session (plain, picklable; valid after `SessionStore.load`)."""

    session: int
    serial: int


class _Value:
    """One sequence's memory and history: on device (slot + pages), on host, or in a file."""

    def __init__(self, tokens: list[int], logits):
        self.tokens = tokens
        self.logits = logits            # [vocab] of the last position
        self.slot: int | None = None
        self.pages: list[int] = []
        self.host: HostValue | None = None
        self.disk: pathlib.Path | None = None
        self.used = 0

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def tier(self) -> str:
        return "device" if self.slot is not None else "host" if self.host is not None else "disk"


class _PrefixEntry:
    """A cached boundary: the KDA state and conv tails (host) after ``length`` tokens, the pages
    holding their latent rows, and the logits of the last of them."""

    def __init__(self, key: str, length: int, state, conv, pages: list[int], logits):
        self.key, self.length, self.state, self.conv, self.pages, self.logits = key, length, state, conv, pages, logits
        self.used = 0

    @property
    def nbytes(self) -> int:
        return self.state.nbytes + self.conv.nbytes


class _NoRoom(Exception):
    pass


def model_fingerprint(model) -> str:
    """sha256 of the model's config and every parameter and buffer value."""
    digest = hashlib.sha256(json.dumps(dataclasses.asdict(model.config), sort_keys=True, default=str).encode())
    for path, leaf in sorted(jax.tree_util.tree_leaves_with_path(nnx.state(model)), key=lambda item: str(item[0])):
        array = np.asarray(leaf)
        digest.update(f"{jax.tree_util.keystr(path)}:{array.dtype}:{array.shape}".encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def _nbytes(shape_tree) -> int:
    return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(shape_tree))


class SessionStore:
    """Sessions over ``model``; ``device_bytes`` / ``host_bytes`` None = unlimited, ``disk_dir``
    None = no disk tier. See the module docstring."""

    def __init__(self, model, device_bytes: int | None = None, host_bytes: int | None = None,
                 disk_dir: str | os.PathLike | None = None):
        config = model.config
        self._gathered_decode = False   # bench.sessions's baseline: paged.decode_step(gathered=True)
        self.model, self.config = model, config
        self._graphdef, self._params = nnx.split(model)
        self.page_size = config.kda.chunk_size
        self.fingerprint = model_fingerprint(model)
        one = jax.eval_shape(lambda: paged.empty_pools(config, 1, 1, self.page_size))
        self.slot_bytes, self.page_bytes = _nbytes((one.state, one.conv)), _nbytes(one.latent)
        smallest = self.slot_bytes + self.page_bytes
        for name, budget in (("device_bytes", device_bytes), ("host_bytes", host_bytes)):
            if budget is not None and budget < smallest:
                raise ValueError(f"{name}={budget} is too small for one session "
                                 f"(one KDA slot + one MLA page = {smallest} bytes)")
        self.device_budget, self.host_budget = device_bytes, host_bytes
        self.disk_dir = None if disk_dir is None else pathlib.Path(disk_dir)
        if self.disk_dir is not None:
            self.disk_dir.mkdir(parents=True, exist_ok=True)
        self._pools = paged.empty_pools(config, _INITIAL_SLOTS, _INITIAL_PAGES, self.page_size)
        self._host_tier = HostTier(next(iter(self._pools.state.devices())))
        self._slots, self._pages = RefCounts(_INITIAL_SLOTS), RefCounts(_INITIAL_PAGES)
        self._sessions: dict[int, _Value] = {}
        self._snapshots: dict[tuple[int, int], _Value] = {}
        self._prefix: dict[str, _PrefixEntry] = {}
        self._prefix_lengths: dict[int, int] = {}      # cached length -> entries of that length
        self._released_handles: list[tuple[int, int]] = []
        self._next_session = self._next_serial = 0
        self._tick = 0
        self._host_used = self._disk_used = 0
        self._counters = dict.fromkeys(
            ("prefix_hits", "prefix_misses", "prefix_tokens_reused", "prefill_tokens", "spills_to_host",
             "spills_to_disk", "loads_from_host", "loads_from_disk", "pages_copied", "decode_steps",
             "decode_tokens"), 0)

    # ------------------------------------------------------------------ public API
    def open(self, prompt_tokens) -> int:
        """Prefill a new session with ``prompt_tokens`` ``[T]`` (T >= 1) -> its id."""
        self._collect()
        tokens = self._check_tokens(prompt_tokens)
        self._check_fits(len(tokens))
        entry = self._longest_prefix(tokens)
        start = 0 if entry is None else entry.length
        value = _Value(list(tokens[:start]), None if entry is None else entry.logits)
        if entry is None:
            self._counters["prefix_misses"] += 1
            state, conv = (np.zeros(a.shape[1:], a.dtype) for a in (self._pools.state, self._pools.conv))
        else:
            self._counters["prefix_hits"] += 1
            self._counters["prefix_tokens_reused"] += start
            state, conv = entry.state, entry.conv
            value.pages = list(entry.pages)
            self._pages.share(value.pages)      # before the reservation, which may drop the entry
        self._reserve(slots=1, pages=0, pinned=(value,))
        value.slot = self._slots.allocate()
        self._pools = paged.write_value(self._pools, value.slot, state, conv, jnp.zeros((0,), jnp.int32),
                                        jnp.zeros((self._pools.latent.shape[0], 0, self._pools.latent.shape[-1]),
                                                  self._pools.latent.dtype))
        sid = self._next_session
        self._next_session += 1
        self._sessions[sid] = value
        self._touch(value)
        if start < len(tokens):
            self._extend(value, tokens[start:])
        return sid

    def logits(self, sid) -> np.ndarray:
        """The logits ``[vocab]`` at the session's current last position."""
        self._collect()
        return np.array(self._session(sid).logits)

    def tokens(self, sid) -> np.ndarray:
        """Every token of the session so far ``[length]``."""
        return np.asarray(self._session(sid).tokens, np.int32)

    def append(self, sid, tokens) -> np.ndarray:
        """Another turn: feed ``tokens`` ``[T]`` -> their logits ``[T, vocab]``."""
        self._collect()
        value = self._session(sid)
        tokens = self._check_tokens(tokens)
        self._check_fits(value.length + len(tokens))
        return self._extend(value, tokens)

    def generate(self, sids, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int = 0, eos_id: int | None = None) -> list[np.ndarray]:
        """Continue each session by up to ``max_new_tokens`` sampled tokens (stopping after
        ``eos_id``); they are appended to its history. Returns one int32 array per session.

        All sessions step together in one jitted decode step (batch and page counts in
        power-of-two buckets); when the device budget cannot hold them all, those earlier in
        ``sids`` run first and the others join as sessions finish. A session's samples depend
        only on (seed, its id, its position), not on the batch it runs in."""
        self._collect()
        sids = list(sids)
        values = [self._session(sid) for sid in sids]
        if len(set(sids)) != len(sids):
            raise ValueError(f"each session may appear once in sids, got {sids}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if temperature < 0 or (top_k is not None and top_k < 1) or (top_p is not None and not 0 < top_p <= 1):
            raise ValueError(f"need temperature >= 0, top_k >= 1, 0 < top_p <= 1; got {temperature}, {top_k}, {top_p}")
        for value in values:
            self._check_fits(value.length + max_new_tokens)
        sampling = (jnp.float32(temperature), jnp.int32(top_k or 0), jnp.float32(1.0 if top_p is None else top_p))
        new = {sid: [] for sid in sids}
        pending, running = list(sids), []
        while pending or running:
            running = self._admit(running, pending)
            self._decode(running, new, sampling, seed)
            finished = [sid for sid in running if len(new[sid]) == max_new_tokens
                        or (eos_id is not None and new[sid][-1] == eos_id)]
            for sid in finished:
                running.remove(sid)
                self._remember_prefix(self._sessions[sid])
        return [np.asarray(new[sid], np.int32) for sid in sids]

    def snapshot(self, sid) -> Snapshot:
        """A handle to the session's current point; released when the handle is garbage or the
        session closes."""
        self._collect()
        copy = self._copy(self._session(sid))
        handle = Snapshot(sid, self._next_serial)
        self._next_serial += 1
        self._snapshots[(handle.session, handle.serial)] = copy
        weakref.finalize(handle, self._released_handles.append, (handle.session, handle.serial))
        return handle

    def rollback(self, sid, handle: Snapshot) -> None:
        """Return the session to the point of ``handle`` (a snapshot of this session)."""
        self._collect()
        value = self._session(sid)
        if not isinstance(handle, Snapshot) or handle.session != sid:
            raise ValueError(f"{handle!r} is not a snapshot of session {sid}")
        if (handle.session, handle.serial) not in self._snapshots:
            raise ValueError(f"{handle!r} was released")
        copy = self._copy(self._snapshots[(handle.session, handle.serial)], pinned=(value,))
        self._release(value)
        self._sessions[sid] = copy

    def fork(self, sid) -> int:
        """A new session with this one's history: KDA state copied, MLA pages shared."""
        self._collect()
        copy = self._copy(self._session(sid))
        new = self._next_session
        self._next_session += 1
        self._sessions[new] = copy
        return new

    def close(self, sid) -> None:
        """Forget the session and its snapshots."""
        self._collect()
        self._release(self._session(sid))
        del self._sessions[sid]
        for key in [key for key in self._snapshots if key[0] == sid]:
            self._release(self._snapshots.pop(key))

    def sessions(self) -> list[int]:
        return sorted(self._sessions)

    def save(self, directory) -> None:
        """Write every session and snapshot into the new directory ``directory`` (atomically:
        a temporary directory renamed at the end). The store is unchanged."""
        self._collect()
        target = pathlib.Path(directory)
        if target.exists():
            raise ValueError(f"{target} already exists; save writes a new directory")
        if not target.parent.is_dir():
            raise ValueError(f"{target.parent} is not a directory")
        temporary = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
        temporary.mkdir()
        try:
            files = {}
            for name, value in [(f"session-{sid}", v) for sid, v in self._sessions.items()] + \
                               [(f"snapshot-{s}-{n}", v) for (s, n), v in self._snapshots.items()]:
                write_npz_atomically(temporary / f"{name}.npz", **self._arrays(value)._asdict(),
                                     tokens=np.asarray(value.tokens, np.int32), logits=np.asarray(value.logits))
                files[name] = f"{name}.npz"
            manifest = {"format": FORMAT_VERSION, "fingerprint": self.fingerprint, "sessions": sorted(self._sessions),
                        "snapshots": sorted(map(list, self._snapshots)), "next_session": self._next_session,
                        "next_serial": self._next_serial}
            (temporary / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
            os.rename(temporary, target)
        except BaseException:
            shutil.rmtree(temporary, ignore_errors=True)
            raise

    @classmethod
    def load(cls, model, directory, device_bytes: int | None = None, host_bytes: int | None = None,
             disk_dir=None) -> "SessionStore":
        """A store holding the sessions and snapshots `save` wrote to ``directory``, for the same
        model (same config and weights); they start on host and move to the device on use."""
        directory = pathlib.Path(directory)
        try:
            manifest = json.loads((directory / "manifest.json").read_text(encoding="utf-8"))
            sessions, snapshots = manifest["sessions"], manifest["snapshots"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{directory} is not a saved session store ({type(error).__name__}: {error})") from None
        if manifest.get("format") != FORMAT_VERSION:
            raise ValueError(f"{directory} has format {manifest.get('format')!r}, this version reads {FORMAT_VERSION}")
        store = cls(model, device_bytes, host_bytes, disk_dir)
        if manifest.get("fingerprint") != store.fingerprint:
            raise ValueError(f"{directory} was saved by a different model (config or weights differ)")
        try:
            values = {("session", sid): read_npz(directory / f"session-{sid}.npz") for sid in sessions}
            values.update({("snapshot", s, n): read_npz(directory / f"snapshot-{s}-{n}.npz") for s, n in snapshots})
        except (OSError, ValueError) as error:
            raise ValueError(f"{directory}: unreadable session file ({error})") from None
        for key, arrays in values.items():
            value = _Value([int(t) for t in arrays["tokens"]], arrays["logits"])
            store._set_host(value, store._host_tier.put(HostValue(arrays["state"], arrays["conv"], arrays["rows"])))
            if key[0] == "session":
                store._sessions[key[1]] = value
            else:
                store._snapshots[key[1:]] = value
            store._touch(value)
        store._next_session, store._next_serial = manifest["next_session"], manifest["next_serial"]
        store._fit_host(pinned=set())
        return store

    def stats(self) -> dict:
        """Counters and bytes per tier (device bytes in use = slots and pages held)."""
        values = list(self._sessions.values()) + list(self._snapshots.values())
        tiers = {tier: sum(v.tier == tier for v in self._sessions.values()) for tier in ("device", "host", "disk")}
        return {
            **self._counters,
            "sessions": len(self._sessions), "snapshots": len(self._snapshots), "prefix_entries": len(self._prefix),
            **{f"sessions_on_{tier}": count for tier, count in tiers.items()},
            "values_on_device": sum(v.slot is not None for v in values),
            "slots_in_use": self._slots.in_use, "pages_in_use": self._pages.in_use, "pages_shared": self._pages.shared,
            "device_bytes": self._device_used(), "host_bytes": self._host_used, "disk_bytes": self._disk_used,
            "device_pool_bytes": sum(a.nbytes for a in self._pools),
            "slot_bytes": self.slot_bytes, "page_bytes": self.page_bytes, "page_size": self.page_size,
            "host_memory": self._host_tier.kind,
        }

    # ------------------------------------------------------------------ checks
    def _session(self, sid) -> _Value:
        if isinstance(sid, bool) or not isinstance(sid, (int, np.integer)) or int(sid) not in self._sessions:
            raise ValueError(f"unknown or closed session id {sid!r}")
        return self._sessions[int(sid)]

    def _check_tokens(self, tokens) -> list[int]:
        array = np.asarray(tokens)
        if array.ndim != 1 or array.size == 0 or not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"tokens must be a non-empty 1-D array of integers, got shape {array.shape} {array.dtype}")
        if array.min() < 0 or array.max() >= self.config.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size}), got [{array.min()}, {array.max()}]")
        return [int(t) for t in array]

    def _check_fits(self, length: int) -> None:
        """A session of ``length`` tokens must fit the device budget on its own."""
        need = self.slot_bytes + (math.ceil(length / self.page_size) + 1) * self.page_bytes
        if self.device_budget is not None and need > self.device_budget:
            raise ValueError(f"a session of {length} tokens needs {need} device bytes, the budget is {self.device_budget}")

    # ------------------------------------------------------------------ prefill and decode
    def _table(self, pages: list[int], bucket: int) -> np.ndarray:
        """A page table padded to ``bucket`` entries with the out-of-range page id."""
        table = np.full((bucket,), self._pages.capacity, np.int32)
        table[: len(pages)] = pages
        return table

    def _extend(self, value: _Value, tokens: list[int]) -> np.ndarray:
        """Prefill ``tokens`` after ``value``'s history in chunk-aligned pieces -> logits [T, vocab]."""
        chunk, outputs, done = self.config.kda.chunk_size, [], 0
        for size in paged.piece_lengths(value.length, value.length + len(tokens), chunk):
            self._writable(value, size)
            bucket = paged.next_power_of_two(math.ceil((value.length + size) / self.page_size))
            logits, self._pools = paged.prefill_piece(
                self._graphdef, self._params, self._pools, jnp.int32(value.slot),
                jnp.asarray(self._table(value.pages, bucket)), jnp.int32(value.length),
                jnp.asarray(tokens[done : done + size], jnp.int32))
            value.tokens.extend(tokens[done : done + size])
            done += size
            outputs.append(logits)
            if value.length % chunk == 0:
                value.logits = logits[-1]
                self._remember_prefix(value)
        self._counters["prefill_tokens"] += len(tokens)
        logits = np.asarray(jnp.concatenate(outputs))
        value.logits = logits[-1]
        self._remember_prefix(value)
        return logits

    def _admit(self, running: list[int], pending: list[int]) -> list[int]:
        """Make room for one more token of every running session, then admit pending sessions in
        order while the device has room; returns the sessions of this step."""
        admitted = []
        for sid in running + list(pending):
            value = self._sessions[sid]
            try:
                self._writable(value, 1, pinned=[self._sessions[s] for s in admitted])
            except _NoRoom:
                if not admitted:
                    raise ValueError("the device budget cannot hold one decoding session") from None
                break
            admitted.append(sid)
            if sid in pending:
                pending.remove(sid)
        pending[:0] = [sid for sid in running if sid not in admitted]
        return admitted

    def _decode(self, sids: list[int], new: dict, sampling, seed: int) -> None:
        """One batched decode step: each session samples from its logits and feeds the token."""
        values = [self._sessions[sid] for sid in sids]
        batch = paged.next_power_of_two(len(values))
        pages = paged.next_power_of_two(max(math.ceil((v.length + 1) / self.page_size) for v in values))
        pad = batch - len(values)
        slots = np.asarray([v.slot for v in values] + self._scratch_slots(pad), np.int32)
        tables = np.stack([self._table(v.pages, pages) for v in values] + [self._table([], pages)] * pad)
        lengths = np.asarray([v.length for v in values] + [0] * pad, np.int32)
        logits = np.stack([np.asarray(v.logits, np.float32) for v in values]
                          + [np.zeros(self.config.vocab_size, np.float32)] * pad)
        tokens, logits, self._pools = paged.decode_step(
            self._graphdef, self._params, self._pools, jnp.asarray(slots), jnp.asarray(tables),
            jnp.asarray(lengths), jnp.asarray(logits), jnp.uint32(seed),
            jnp.asarray(list(sids) + [0] * pad, jnp.uint32), sampling, gathered=self._gathered_decode)
        tokens, logits = np.asarray(tokens), np.asarray(logits)
        for index, (sid, value) in enumerate(zip(sids, values)):
            value.tokens.append(int(tokens[index]))
            value.logits = logits[index]
            new[sid].append(int(tokens[index]))
        self._counters["decode_steps"] += 1
        self._counters["decode_tokens"] += len(values)

    # ------------------------------------------------------------------ prefix cache
    def _prefix_key(self, tokens) -> str:
        digest = hashlib.sha256(self.fingerprint.encode())
        digest.update(np.asarray(tokens, np.int32).tobytes())
        return digest.hexdigest()

    def _longest_prefix(self, tokens: list[int]) -> _PrefixEntry | None:
        for length in sorted(self._prefix_lengths, reverse=True):
            if length <= len(tokens):
                entry = self._prefix.get(self._prefix_key(tokens[:length]))
                if entry is not None:
                    self._touch(entry)
                    return entry
        return None

    def _remember_prefix(self, value: _Value) -> None:
        """Cache ``value``'s state (it is on device) and pages at its current length."""
        key = self._prefix_key(value.tokens)
        if key in self._prefix:
            self._touch(self._prefix[key])
            return
        state, conv = (np.asarray(a) for a in paged.read_slot(self._pools, jnp.int32(value.slot)))
        pages = value.pages[: math.ceil(value.length / self.page_size)]
        self._pages.share(pages)
        entry = _PrefixEntry(key, value.length, state, conv, pages, np.asarray(value.logits))
        self._prefix[key] = entry
        self._prefix_lengths[entry.length] = self._prefix_lengths.get(entry.length, 0) + 1
        self._host_used += entry.nbytes
        self._touch(entry)
        if len(self._prefix) > MAX_PREFIX_ENTRIES:
            self._drop_prefix(min(self._prefix.values(), key=lambda e: e.used))
        self._fit_host(pinned=set())

    def _drop_prefix(self, entry: _PrefixEntry) -> None:
        del self._prefix[entry.key]
        self._prefix_lengths[entry.length] -= 1
        if not self._prefix_lengths[entry.length]:
            del self._prefix_lengths[entry.length]
        self._pages.release(entry.pages)
        self._host_used -= entry.nbytes

    # ------------------------------------------------------------------ values and tiers
    def _touch(self, item) -> None:
        self._tick += 1
        item.used = self._tick

    def _collect(self) -> None:
        """Release the snapshots whose handles were garbage-collected since the last call."""
        while self._released_handles:
            value = self._snapshots.pop(self._released_handles.pop(), None)
            if value is not None:
                self._release(value)

    def _device_used(self) -> int:
        return self._slots.in_use * self.slot_bytes + self._pages.in_use * self.page_bytes

    def _reserve(self, slots: int, pages: int, pinned) -> None:
        """Free device room for ``slots`` slots and ``pages`` pages (evicting the least recently
        used values not in ``pinned``) and grow the pools so they can be allocated."""
        need = slots * self.slot_bytes + pages * self.page_bytes
        pinned = {id(v) for v in pinned}
        while self.device_budget is not None and self._device_used() + need > self.device_budget:
            freeing = [e for e in self._prefix.values() if any(self._pages.refs[p] == 1 for p in e.pages)]
            if freeing:           # prefix entries that are the last holder of a page go first
                self._drop_prefix(min(freeing, key=lambda e: e.used))
                continue
            candidates = [v for v in (*self._sessions.values(), *self._snapshots.values())
                          if v.slot is not None and id(v) not in pinned]
            if not candidates:
                raise _NoRoom()
            self._to_host(min(candidates, key=lambda v: v.used), pinned)
        self._grow(slots, pages)

    def _scratch_slots(self, count: int) -> list[int]:
        """``count`` distinct free slots (not allocated) for a batch's padding rows to write into;
        the pools grow when fewer are free (scratch does not count against the device budget)."""
        self._grow(count, 0)
        return self._slots.free[len(self._slots.free) - count:]

    def _grow(self, slots: int, pages: int) -> None:
        """Grow the pools (doubling) until ``slots`` slots and ``pages`` pages are free."""
        slot_capacity, page_capacity = self._slots.capacity, self._pages.capacity
        while len(self._slots.free) + (slot_capacity - self._slots.capacity) < slots:
            slot_capacity *= 2
        while len(self._pages.free) + (page_capacity - self._pages.capacity) < pages:
            page_capacity *= 2
        if (slot_capacity, page_capacity) != (self._slots.capacity, self._pages.capacity):
            self._pools = paged.grown(self._pools, slot_capacity, page_capacity)
            self._slots.grow(slot_capacity)
            self._pages.grow(page_capacity)

    def _writable(self, value: _Value, new_tokens: int, pinned=()) -> None:
        """Put ``value`` on device with pages for ``new_tokens`` more tokens, the page written
        first copied if shared."""
        self._touch(value)
        pinned = (*pinned, value)
        if value.slot is None:
            self._to_device(value, pinned)
        first = value.length // self.page_size
        copy = new_tokens > 0 and value.length % self.page_size != 0 and self._pages.refs[value.pages[first]] > 1
        grow = math.ceil((value.length + new_tokens) / self.page_size) - len(value.pages)
        self._reserve(0, grow + copy, pinned)
        if copy and self._pages.refs[value.pages[first]] > 1:
            page = self._pages.allocate()
            self._pools = paged.copy_page(self._pools, jnp.int32(value.pages[first]), jnp.int32(page))
            self._pages.release([value.pages[first]])
            value.pages[first] = page
            self._counters["pages_copied"] += 1
        value.pages += [self._pages.allocate() for _ in range(grow)]

    def _to_device(self, value: _Value, pinned) -> None:
        """Upload a host or disk value into a fresh slot and pages."""
        host = value.host if value.host is not None else self._read_disk(value)
        count = math.ceil(value.length / self.page_size)
        self._reserve(1, count, pinned)
        bucket = paged.next_power_of_two(count) if count else 0
        rows = np.zeros((host.rows.shape[0], bucket * self.page_size, host.rows.shape[-1]), host.rows.dtype)
        rows[:, : value.length] = np.asarray(host.rows)
        slot, pages = self._slots.allocate(), [self._pages.allocate() for _ in range(count)]
        state, conv = (self._host_tier.to_device(a) for a in (host.state, host.conv))
        self._pools = paged.write_value(self._pools, jnp.int32(slot), state, conv,
                                        jnp.asarray(self._table(pages, bucket)), rows)
        self._counters["loads_from_host" if value.host is not None else "loads_from_disk"] += 1
        self._clear_off_device(value)
        value.slot, value.pages = slot, pages

    def _arrays(self, value: _Value) -> HostValue:
        """The value's memory (rows cut to its length, on the host), wherever it is: state and conv
        tails as device arrays when it is on the device, else its host-tier arrays or its file's."""
        if value.slot is None:
            return value.host if value.host is not None else self._read_disk(value)
        bucket = paged.next_power_of_two(len(value.pages)) if value.pages else 0
        state, conv, rows = paged.read_value(self._pools, jnp.int32(value.slot),
                                             jnp.asarray(self._table(value.pages, bucket)))
        return HostValue(state, conv, np.asarray(rows)[:, : value.length])

    def _to_host(self, value: _Value, pinned: set[int]) -> None:
        host = self._host_tier.put(self._arrays(value))
        self._slots.release([value.slot])
        self._pages.release(value.pages)
        value.slot, value.pages = None, []
        self._set_host(value, host)
        self._counters["spills_to_host"] += 1
        self._fit_host(pinned)

    def _set_host(self, value: _Value, host: HostValue) -> None:
        value.host = host
        self._host_used += host.nbytes

    def _fit_host(self, pinned: set[int]) -> None:
        """Within the host budget: drop prefix entries, then move host values (whose ids are not
        in ``pinned``) to disk, least recently used first."""
        while self.host_budget is not None and self._host_used > self.host_budget:
            if self._prefix:
                self._drop_prefix(min(self._prefix.values(), key=lambda e: e.used))
                continue
            candidates = [v for v in (*self._sessions.values(), *self._snapshots.values())
                          if v.host is not None and id(v) not in pinned]
            if not candidates:
                return
            if self.disk_dir is None:
                raise ValueError(f"the host budget of {self.host_budget} bytes is full and there is no disk tier "
                                 f"(give disk_dir)")
            self._to_disk(min(candidates, key=lambda v: v.used))

    def _to_disk(self, value: _Value) -> None:
        path = self.disk_dir / f"value-{uuid.uuid4().hex}.npz"
        write_npz_atomically(path, **value.host._asdict())
        self._disk_used += path.stat().st_size
        self._host_used -= value.host.nbytes
        value.host, value.disk = None, path
        self._counters["spills_to_disk"] += 1

    def _read_disk(self, value: _Value) -> HostValue:
        arrays = read_npz(value.disk)
        return HostValue(arrays["state"], arrays["conv"], arrays["rows"])

    def _clear_off_device(self, value: _Value) -> None:
        """Forget the value's host arrays and file (it is now elsewhere or gone)."""
        if value.host is not None:
            self._host_used -= value.host.nbytes
            value.host = None
        if value.disk is not None:
            self._disk_used -= value.disk.stat().st_size
            value.disk.unlink()
            value.disk = None

    def _release(self, value: _Value) -> None:
        if value.slot is not None:
            self._slots.release([value.slot])
            self._pages.release(value.pages)
            value.slot, value.pages = None, []
        self._clear_off_device(value)

    def _copy(self, source: _Value, pinned=()) -> _Value:
        """A new device value equal to ``source``: its slot copied, its pages shared."""
        self._writable(source, 0, pinned)
        self._reserve(1, 0, (*pinned, source))
        copy = _Value(list(source.tokens), np.array(source.logits))
        copy.slot = self._slots.allocate()
        self._pools = paged.copy_slot(self._pools, jnp.int32(source.slot), jnp.int32(copy.slot))
        copy.pages = list(source.pages)
        self._pages.share(copy.pages)
        self._touch(copy)
        return copy
