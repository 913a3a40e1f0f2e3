"""`SessionStore`: many conversations over one model, each a value that can be kept, copied,
rolled back and moved between device, host and disk.

    store = SessionStore(model, device_bytes=None, host_bytes=None, disk_dir=None)
    sid = store.open(prompt)            # prefill (resuming from the longest cached prefix)
    store.append(sid, tokens)           # -> logits [T, vocab]; store.logits(sid) -> [vocab]
    store.generate([sid, ...], 32)      # one batched jitted step per token over all the sessions
    store.step({sid: Sampling(...), ...})  # one token for each (a server's continuous batching)
    store.feed({sid: token, ...})       # the same step, feeding given tokens (teacher forcing)
    store.reserve(slots, pages)         # grow the pools up front: one pool shape, one set of programs
    store.generate(sids, 32, speculator=Speculator(store, PromptLookup()))   # speculative rounds
    h = store.snapshot(sid); store.rollback(sid, h); sid2 = store.fork(sid); store.close(sid)
    store.save(dir); SessionStore.load(model, dir)

This module is the public API; each job lives in its own module:

    paged      the device pools and the jitted programs over them (prefill piece, decode step, copies)
    pools      who holds which slot and page: reference counts, growth, copy-on-write
    prefix     the prefix cache: boundary states keyed by sha256(model fingerprint, token ids)
    tiers      where a value lives (device, host, disk) and the moves that keep the byte budgets
    batching   which sessions step together in `generate`, and the padded inputs of their step
    speculate  speculative rounds: draft, verify in one batched call, roll back and replay
    persist    `save` / `load`: the directory format
    recency    least-recently-used order

The batched decode runs the KDA kernels the model's config names (``model.kda.implementation``);
``_gathered_decode`` switches it to the gather / decode / scatter baseline `bench.sessions` compares.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.sampling import check_sampling
from k3jax.sessions import batching, paged, persist
from k3jax.sessions.batching import Sampling
from k3jax.sessions.pools import DevicePools
from k3jax.sessions.prefix import PrefixCache
from k3jax.sessions.recency import Clock
from k3jax.sessions.tiers import HostTier, HostValue, NoRoom, Tiers, Value

_INITIAL_SLOTS, _INITIAL_PAGES = 8, 32


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A handle to a saved point of one session (plain, picklable; valid after `SessionStore.load`)."""

    session: int
    serial: int


def model_fingerprint(model) -> str:
    """sha256 of the model's config and every parameter and buffer value."""
    digest = hashlib.sha256(json.dumps(dataclasses.asdict(model.config), sort_keys=True, default=str).encode())
    for path, leaf in sorted(jax.tree_util.tree_leaves_with_path(nnx.state(model)), key=lambda item: str(item[0])):
        array = np.asarray(leaf)
        digest.update(f"{jax.tree_util.keystr(path)}:{array.dtype}:{array.shape}".encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


class SessionStore:
    """Sessions over ``model``; ``device_bytes`` / ``host_bytes`` None = unlimited, ``disk_dir``
    None = no disk tier. ``fingerprint`` names the model's weights in prefix-cache keys and saved
    stores; None: `model_fingerprint` (a hash of every weight; pass a name of your own where hashing
    costs too much, e.g. an RL policy's step). ``prefix_cache`` False: every `open` prefills its
    whole prompt and no state is kept for later ones (no host copies at chunk boundaries; for work
    that never repeats a prefix, such as one rollout's distinct prompts). See the module docstring."""

    def __init__(self, model, device_bytes: int | None = None, host_bytes: int | None = None,
                 disk_dir: str | os.PathLike | None = None, fingerprint: str | None = None,
                 prefix_cache: bool = True):
        config = model.config
        self._gathered_decode = False   # bench.sessions's baseline: paged.decode_step(gathered=True)
        self.model, self.config = model, config
        graphdef, self._params = nnx.split(model)
        self._graph = paged.StaticGraph(graphdef)
        self.page_size = config.kda.chunk_size
        self.fingerprint = fingerprint or model_fingerprint(model)
        self.prefix_cache = prefix_cache
        self._device = DevicePools(paged.empty_pools(config, _INITIAL_SLOTS, _INITIAL_PAGES, self.page_size))
        self.slot_bytes, self.page_bytes = self._device.slot_bytes, self._device.page_bytes
        self.device_budget, self.host_budget = device_bytes, host_bytes
        self.disk_dir = None if disk_dir is None else pathlib.Path(disk_dir)
        self._sessions: dict[int, Value] = {}
        self._snapshots: dict[tuple[int, int], Value] = {}
        self._clock = Clock()
        self._prefix = PrefixCache(self.fingerprint, self._device.pages, self._clock)
        host = HostTier(next(iter(self._device.arrays.state.devices())))
        self._tiers = Tiers(self._device, self._prefix, host, self._clock, self._values, self.device_budget,
                            self.host_budget, self.disk_dir)
        self._released_handles: list[tuple[int, int]] = []
        self._next_session = self._next_serial = 0
        self._counters = dict.fromkeys(("prefill_tokens", "decode_steps", "decode_tokens"), 0)

    # ------------------------------------------------------------------ public API
    def open(self, prompt_tokens) -> int:
        """Prefill a new session with ``prompt_tokens`` ``[T]`` (T >= 1) -> its id."""
        self._collect()
        tokens = self._check_tokens(prompt_tokens)
        self._tiers.check_fits(len(tokens))
        entry = self._prefix.longest_prefix(tokens) if self.prefix_cache else None
        start = 0 if entry is None else entry.length
        value = Value(list(tokens[:start]), None if entry is None else entry.logits)
        if entry is None:
            state, conv = self._device.zero_state()
        else:
            state, conv = entry.state, entry.conv
            value.pages = list(entry.pages)
            self._device.pages.share(value.pages)      # before the reservation, which may drop the entry
        self._tiers.reserve(slots=1, pages=0, pinned=(value,))
        value.slot = self._device.start_slot(state, conv)
        sid = self._next_session
        self._next_session += 1
        self._sessions[sid] = value
        self._clock.touch(value)
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
        self._tiers.check_fits(value.length + len(tokens))
        return self._extend(value, tokens)

    def generate(self, sids, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int = 0, eos_id: int | None = None,
                 speculator=None) -> list[np.ndarray]:
        """Continue each session by up to ``max_new_tokens`` sampled tokens (stopping after
        ``eos_id``); they are appended to its history. Returns one int32 array per session.

        All sessions step together in one jitted decode step (`step`; batch and page counts in
        power-of-two buckets); when the device budget cannot hold them all, those earlier in
        ``sids`` run first and the others join as sessions finish. A session's samples depend
        only on (seed, its id, its position), not on the batch it runs in.

        ``speculator`` (a `k3jax.sessions.speculate.Speculator` of this store): speculative rounds
        instead of single steps; greedy output is the same, sampled output follows the same
        distribution (with its own random numbers)."""
        check_sampling(max_new_tokens, temperature, top_k, top_p, seed)
        self._collect()
        sids = list(sids)
        values = [self._session(sid) for sid in sids]
        if len(set(sids)) != len(sids):
            raise ValueError(f"each session may appear once in sids, got {sids}")
        if eos_id is not None and not (isinstance(eos_id, (int, np.integer)) and 0 <= eos_id < self.config.vocab_size):
            raise ValueError(f"eos_id must be an integer in [0, {self.config.vocab_size}), got {eos_id!r}")
        for value in values:
            self._tiers.check_fits(value.length + max_new_tokens)
        if speculator is not None and speculator.store is not self:
            raise ValueError("the speculator belongs to another session store")
        sampling = Sampling(temperature, top_k, top_p, seed)
        width = 1 if speculator is None else 1 + speculator.k
        new = {sid: [] for sid in sids}
        pending, running = list(sids), []
        while pending or running:
            running = batching.admit(running, pending,
                                     lambda sid, admitted: self._make_room_to_decode(sid, admitted, width))
            if speculator is None:
                emitted = {sid: [token] for sid, token in self._decode({sid: sampling for sid in running}).items()}
            else:
                rounds = speculator.round({sid: sampling for sid in running},
                                          limits={sid: max_new_tokens - len(new[sid]) for sid in running},
                                          stop_ids=() if eos_id is None else (eos_id,))
                emitted = {sid: result.tokens for sid, result in rounds.items()}
            for sid, tokens in emitted.items():
                new[sid].extend(tokens)
            finished = [sid for sid in running if len(new[sid]) == max_new_tokens
                        or (eos_id is not None and new[sid][-1] == eos_id)]
            for sid in finished:
                running.remove(sid)
                self._remember_prefix(self._sessions[sid])
                if speculator is not None:
                    speculator.leave(sid)
        return [np.asarray(new[sid], np.int32) for sid in sids]

    def step(self, sampling: dict) -> dict[int, int]:
        """One token for each session of ``sampling`` ({session id: `Sampling`}), sampled from
        its logits and fed, all in one batched decode step -> {session id: token} for the sessions
        that stepped. Where the device budget cannot hold them all, those earlier in the dict step
        and the others are left out (ValueError when not even one fits): the loop of a server
        whose requests join and leave between steps."""
        for sid, rule in sampling.items():
            if not isinstance(rule, Sampling):
                raise ValueError(f"session {sid}: sampling must be a k3jax.sessions.Sampling, got {rule!r}")
        return self._step(sampling)

    def feed(self, tokens: dict) -> dict[int, int]:
        """Teacher forcing: one batched decode step in which each session of ``tokens`` ({session
        id: token id}) feeds its given token instead of sampling one -> {session id: token} for the
        sessions that stepped (left out as in `step`). It runs `step`'s own program, the token
        chosen greedily from a one-hot row, so feeding the tokens a `step` sampled, to sessions in
        the same state and batch, gives its logits bit for bit (a rollout's replay,
        `k3jax.training.rollout.replay`)."""
        if tokens:
            self._check_tokens(list(tokens.values()))
        return self._step(dict.fromkeys(tokens, Sampling()), forced=tokens)

    def reserve(self, slots: int, pages: int) -> None:
        """Grow the device pools now (doubling, as they grow on demand) to at least ``slots`` free
        KDA slots and ``pages`` free MLA pages. Every program is compiled for the pools' shape, so a
        store that repeats another's work (a rollout's `replay`) reserves the other's capacity
        (`stats`' ``slot_capacity``, ``page_capacity``) and reuses its programs instead of
        compiling its own for each size it would pass through."""
        for name, count in (("slots", slots), ("pages", pages)):
            if not (isinstance(count, (int, np.integer)) and not isinstance(count, bool) and count >= 0):
                raise ValueError(f"{name} must be a non-negative integer, got {count!r}")
        self._device.grow(int(slots), int(pages))

    def cache_prefix(self, sid) -> None:
        """Keep the session's current state in the prefix cache: a later `open` of a prompt that
        extends its tokens resumes here (`generate` does this when a session finishes)."""
        self._collect()
        value = self._session(sid)
        self._tiers.writable(value, 0)
        self._remember_prefix(value)

    def snapshot(self, sid) -> Snapshot:
        """A handle to the session's current point; released when the handle is garbage or the
        session closes."""
        self._collect()
        copy = self._tiers.copy(self._session(sid))
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
        copy = self._tiers.copy(self._snapshots[(handle.session, handle.serial)], pinned=(value,))
        self._tiers.release(value)
        self._sessions[sid] = copy

    def fork(self, sid) -> int:
        """A new session with this one's history: KDA state copied, MLA pages shared."""
        self._collect()
        copy = self._tiers.copy(self._session(sid))
        new = self._next_session
        self._next_session += 1
        self._sessions[new] = copy
        return new

    def close(self, sid) -> None:
        """Forget the session and its snapshots."""
        self._collect()
        self._tiers.release(self._session(sid))
        del self._sessions[sid]
        for key in [key for key in self._snapshots if key[0] == sid]:
            self._tiers.release(self._snapshots.pop(key))

    def sessions(self) -> list[int]:
        return sorted(self._sessions)

    def save(self, directory) -> None:
        """Write every session and snapshot into the new directory ``directory`` (atomically:
        a temporary directory renamed at the end; `k3jax.sessions.persist`). The store is unchanged."""
        self._collect()
        persist.save(directory, fingerprint=self.fingerprint, sessions=self._sessions, snapshots=self._snapshots,
                     next_session=self._next_session, next_serial=self._next_serial, saved=self._saved)

    @classmethod
    def load(cls, model, directory, device_bytes: int | None = None, host_bytes: int | None = None,
             disk_dir=None) -> "SessionStore":
        """A store holding the sessions and snapshots `save` wrote to ``directory``, for the same
        model (same config and weights); they start on host and move to the device on use."""
        directory = pathlib.Path(directory)
        manifest = persist.read_manifest(directory)
        store = cls(model, device_bytes, host_bytes, disk_dir)
        saved = persist.read_values(directory, manifest, store.fingerprint)
        for registry, values in ((store._sessions, saved.sessions), (store._snapshots, saved.snapshots)):
            for key, (tokens, logits, memory) in values.items():
                value = Value([int(t) for t in tokens], logits)
                store._tiers.put_on_host(value, memory)
                registry[key] = value
                store._clock.touch(value)
        store._next_session, store._next_serial = manifest["next_session"], manifest["next_serial"]
        store._tiers.fit_host()
        return store

    def stats(self) -> dict:
        """Counters and bytes per tier (device bytes in use = slots and pages held)."""
        values = self._values()
        tiers = {tier: sum(v.tier == tier for v in self._sessions.values()) for tier in ("device", "host", "disk")}
        return {
            **self._prefix.counts, "prefill_tokens": self._counters["prefill_tokens"], **self._tiers.counts,
            "pages_copied": self._device.pages_copied,
            "decode_steps": self._counters["decode_steps"], "decode_tokens": self._counters["decode_tokens"],
            "sessions": len(self._sessions), "snapshots": len(self._snapshots), "prefix_entries": len(self._prefix),
            **{f"sessions_on_{tier}": count for tier, count in tiers.items()},
            "values_on_device": sum(v.slot is not None for v in values),
            "slots_in_use": self._device.slots.in_use, "pages_in_use": self._device.pages.in_use,
            "slot_capacity": self._device.slots.capacity, "page_capacity": self._device.pages.capacity,
            "pages_shared": self._device.pages.shared,
            "device_bytes": self._device.used_bytes, "host_bytes": self._tiers.host_bytes,
            "disk_bytes": self._tiers.disk_bytes, "device_pool_bytes": self._device.pool_bytes,
            "slot_bytes": self.slot_bytes, "page_bytes": self.page_bytes, "page_size": self.page_size,
            "host_memory": self._host_tier.kind,
        }

    # ------------------------------------------------------------------ checks
    def _session(self, sid) -> Value:
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

    # ------------------------------------------------------------------ prefill and decode
    def _extend(self, value: Value, tokens: list[int]) -> np.ndarray:
        """Prefill ``tokens`` after ``value``'s history in chunk-aligned pieces -> logits [T, vocab]."""
        chunk, outputs, done = self.config.kda.chunk_size, [], 0
        for size in paged.piece_lengths(value.length, value.length + len(tokens), chunk):
            self._tiers.writable(value, size)
            bucket = paged.next_power_of_two(self._device.pages_for(value.length + size))
            logits, self._device.arrays = paged.prefill_piece(
                self._graph, self._params, self._device.arrays, np.int32(value.slot),
                self._device.table(value.pages, bucket), np.int32(value.length),
                np.asarray(tokens[done : done + size], np.int32))
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

    def _make_room_to_decode(self, sid: int, admitted: list[int], tokens: int = 1) -> bool:
        """Room on device for ``tokens`` more tokens of session ``sid`` beside the ``admitted``
        ones -> whether there is."""
        try:
            self._tiers.writable(self._sessions[sid], tokens, pinned=[self._sessions[s] for s in admitted])
        except NoRoom:
            return False
        return True

    def _step(self, sampling: dict, forced: dict | None = None) -> dict[int, int]:
        """`step` (``forced``: `feed`) of the sessions that fit on device, those earlier in ``sampling`` first."""
        self._collect()
        if not sampling:
            return {}
        for sid in sampling:
            self._tiers.check_fits(self._session(sid).length + 1)
        admitted = batching.admit([], list(sampling), self._make_room_to_decode)
        return self._decode({sid: sampling[sid] for sid in admitted}, forced)

    def _decode(self, sampling: dict, forced: dict | None = None) -> dict[int, int]:
        """One batched decode step of the sessions of ``sampling`` (each on device with room for
        a token): each samples from its logits (or, in ``forced`` {sid: token}, from a one-hot row
        of its token, greedily) and feeds the token -> {session id: token}."""
        sids = list(sampling)
        values = [self._sessions[sid] for sid in sids]
        batch = batching.decode_batch(sids, values, [sampling[sid] for sid in sids], self._device)
        if forced is not None:
            one_hot = np.zeros_like(batch.logits)
            one_hot[np.arange(len(sids)), [forced[sid] for sid in sids]] = 1.0
            batch = batch._replace(logits=one_hot)
        tokens, logits, self._device.arrays = paged.decode_step(
            self._graph, self._params, self._device.arrays, batch.slots, batch.tables,
            batch.lengths, batch.logits, batch.sampling,
            gathered=self._gathered_decode)
        tokens, logits = np.asarray(tokens), np.asarray(logits)
        for index, value in enumerate(values):
            value.tokens.append(int(tokens[index]))
            value.logits = logits[index]
        self._counters["decode_steps"] += 1
        self._counters["decode_tokens"] += len(values)
        return {sid: int(tokens[index]) for index, sid in enumerate(sids)}

    def _remember_prefix(self, value: Value) -> None:
        """Cache ``value``'s state (it is on device) and pages at its current length (with the prefix cache on)."""
        if not self.prefix_cache:
            return
        key = self._prefix.key(value.tokens)
        if self._prefix.touch(key):
            return
        state, conv = self._device.read_slot(value.slot)
        self._prefix.add(key, value.length, state, conv, value.pages[: self._device.pages_for(value.length)],
                         np.asarray(value.logits))
        self._tiers.fit_host()

    # ------------------------------------------------------------------ values
    def _values(self) -> tuple[Value, ...]:
        """Every session and snapshot."""
        return (*self._sessions.values(), *self._snapshots.values())

    def _collect(self) -> None:
        """Release the snapshots whose handles were garbage-collected since the last call."""
        while self._released_handles:
            value = self._snapshots.pop(self._released_handles.pop(), None)
            if value is not None:
                self._tiers.release(value)

    def _arrays(self, value: Value) -> HostValue:
        """The value's memory, wherever it is (`Tiers.arrays`)."""
        return self._tiers.arrays(value)

    def _saved(self, value: Value) -> persist.SavedValue:
        return persist.SavedValue(np.asarray(value.tokens, np.int32), np.asarray(value.logits), self._arrays(value))

    @property
    def _host_tier(self) -> HostTier:
        """Where values off the device are held (a test swaps in another)."""
        return self._tiers.host

    @_host_tier.setter
    def _host_tier(self, host: HostTier) -> None:
        self._tiers.host = host
