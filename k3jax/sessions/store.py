"""`SessionStore`: many conversations over one model, each a value that can be kept, copied,
rolled back and moved between device, host and disk.

    store = SessionStore(model, device_bytes=None, host_bytes=None, disk_dir=None)
    sid = store.open(prompt)            # prefill (resuming from the longest cached prefix)
    store.append(sid, tokens)           # -> logits [T, vocab]; store.logits(sid) -> [vocab]
    store.extend(sid, tokens)           # the same without reading back every position's logits
    for _ in prefill_in_turns(store, prompt, 512): ...   # a long prompt in turns (a server's chunked prefill)
    store.generate([sid, ...], 32)      # one batched jitted step per token over all the sessions
    store.step({sid: Sampling(...), ...})  # one token for each (a server's continuous batching)
    store.serve_adapters({tag: slot}); store.open(prompt, adapter=tag)   # LoRA adapters of the model's banks
    store.feed({sid: token, ...})       # the same step, feeding given tokens (teacher forcing)
    store.reserve(slots, pages)         # grow the pools up front: one pool shape, one set of programs
    store.generate(sids, 32, speculator=Speculator(store, PromptLookup()))   # speculative rounds
    h = store.snapshot(sid); store.rollback(sid, h); sid2 = store.fork(sid); store.close(sid)
    store.park(sid)                     # off the device until its next use (a waiting conversation)
    store.save(dir); SessionStore.load(model, dir)

This module is the public API; each job lives in its own module:

    paged      the device pools and the jitted programs over them (prefill piece, decode step, copies)
    feeding    the store's runs of those programs over its sessions (prefill, decode step, rows fed
               together): `SessionStore.feeder`, the public surface of speculative rounds
    registry   which sessions and snapshots the store holds: ids, handles, copies
    pools      who holds which slot and page: reference counts, growth, copy-on-write
    prefix     the prefix cache: boundary states keyed by sha256(model fingerprint, token ids)
    tiers      where a value lives (device, host, disk) and the moves that keep the byte budgets
    batching   which sessions step together in `generate`, and the padded inputs of their step
    speculate  speculative rounds: draft, verify in one batched call, roll back and replay
    persist    `save` / `load`: the directory format
    recency    least-recently-used order

The batched decode runs the KDA kernels the model's config names (``model.kda.implementation``);
``store.feeder.gathered_decode`` switches it to the gather / decode / scatter baseline that
`bench.sessions` compares.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib

import jax
import numpy as np
from flax import nnx

from k3jax.checkpoint import tree_checksums
from k3jax.layers.lora import AdapterBank
from k3jax.sampling import check_sampling
from k3jax.sessions import batching, paged, persist
from k3jax.sessions.batching import Sampling
from k3jax.sessions.feeding import Feeder
from k3jax.sessions.pools import DevicePools
from k3jax.sessions.prefix import PrefixCache
from k3jax.sessions.recency import Clock
from k3jax.sessions.registry import Registry, Snapshot
from k3jax.sessions.tiers import HostTier, HostValue, Tiers, Value

_INITIAL_SLOTS, _INITIAL_PAGES = 8, 32
__all__ = ["SessionStore", "Snapshot", "model_fingerprint", "prefill_in_turns"]


def prefill_in_turns(store: "SessionStore", tokens, turn_tokens: int, sid: int | None = None,
                     logits: list | None = None, adapter: str = ""):
    """A generator that opens a session on ``tokens`` (``sid`` None) or feeds them after session
    ``sid``'s history, about ``turn_tokens`` per turn (`paged.turn_stop`), yielding between turns
    -> the session's id (its return value). A server runs other requests' steps at each yield, and
    stops one whose deadline passed; the pieces, state and logits are those of one `open` /
    `extend`. ``logits`` (with ``sid``): a list that receives each turn's `append` logits [t, vocab].
    ``adapter``: the LoRA adapter serving a session it opens (`SessionStore.open`)."""
    tokens = [int(t) for t in np.asarray(tokens).reshape(-1)]
    if sid is None:
        if logits is not None:
            raise ValueError("logits are collected when feeding an open session (give sid)")
        sid, offset = store.open(tokens, limit=turn_tokens, adapter=adapter), 0
    else:
        offset = len(store.tokens(sid))
    while (length := len(store.tokens(sid))) < offset + len(tokens):
        yield
        piece = tokens[length - offset : paged.turn_stop(length, offset + len(tokens), turn_tokens, store.page_size) - offset]
        if logits is None:
            store.extend(sid, piece)
        else:
            logits.append(store.append(sid, piece))
    return sid


def model_fingerprint(model) -> str:
    """sha256 of the model's config and every parameter and buffer value (not its adapter banks,
    whose slots `serve_adapters` tags one by one); of a model spread over
    several processes, of each array's checksum (`k3jax.checkpoint.tree_checksums`, computed where
    the shards lie) instead, as no host holds its bytes."""
    digest = hashlib.sha256(json.dumps(dataclasses.asdict(model.config), sort_keys=True, default=str).encode())
    banks = [path for path, module in nnx.iter_modules(model) if isinstance(module, AdapterBank)]
    weights = nnx.state(model, lambda path, _: not any(path[:len(bank)] == bank for bank in banks))
    leaves = sorted(jax.tree_util.tree_leaves_with_path(weights), key=lambda item: str(item[0]))
    if not all(leaf.is_fully_addressable for _, leaf in leaves):
        sums = tree_checksums({"state": {jax.tree_util.keystr(path): leaf for path, leaf in leaves}})
        return hashlib.sha256(digest.digest() + json.dumps(sums, sort_keys=True).encode()).hexdigest()
    for path, leaf in leaves:
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
    that never repeats a prefix, such as one rollout's distinct prompts). ``feeder``: the store's
    model programs over its sessions, several fed together (`k3jax.sessions.feeding`; speculative
    rounds use it). See the module docstring."""

    def __init__(self, model, device_bytes: int | None = None, host_bytes: int | None = None,
                 disk_dir: str | os.PathLike | None = None, fingerprint: str | None = None,
                 prefix_cache: bool = True):
        config = model.config
        self.model, self.config = model, config
        self.page_size = config.kda.chunk_size
        self.fingerprint = fingerprint or model_fingerprint(model)
        shapes = paged.empty_pools(config, _INITIAL_SLOTS, _INITIAL_PAGES, self.page_size)
        shardings = paged.pool_shardings(model, shapes)
        self._device = DevicePools(paged.placed(shapes, shardings), self.page_size, shardings)
        self.slot_bytes, self.page_bytes = self._device.slot_bytes, self._device.page_bytes
        self.device_budget, self.host_budget = device_bytes, host_bytes
        self.disk_dir = None if disk_dir is None else pathlib.Path(disk_dir)
        self._clock = Clock()
        self._prefix = PrefixCache(self.fingerprint, self._device.pages, self._clock)
        host = HostTier(self._device.arrays.state.devices())
        self._tiers = Tiers(self._device, self._prefix, host, self._clock, self._values, self.device_budget,
                            self.host_budget, self.disk_dir)
        self._registry = Registry(self._tiers)
        self.feeder = Feeder(model, self._device, self._tiers, self._prefix, self._registry, prefix_cache)

    # ------------------------------------------------------------------ public API
    def open(self, prompt_tokens, limit: int | None = None, adapter: str = "") -> int:
        """Prefill a new session with ``prompt_tokens`` ``[T]`` (T >= 1) -> its id. ``limit``: feed
        about that many tokens past the cached prefix now (`paged.turn_stop`: whole chunks, at least
        one); the session then holds a prefix of the prompt (`tokens`), and `extend` feeds the rest
        (`prefill_in_turns`). ``adapter``: the tag of the LoRA adapter that serves the session, its
        forks and snapshots (`serve_adapters`; "" the base model)."""
        self._collect()
        if limit is not None and not (isinstance(limit, (int, np.integer)) and not isinstance(limit, bool) and limit >= 1):
            raise ValueError(f"limit must be a positive integer or None, got {limit!r}")
        tokens = self._check_tokens(prompt_tokens)
        if adapter and adapter not in (self.feeder.adapter_slots or {}):
            raise ValueError(f"adapter {adapter.split('@')[0]!r} is not loaded")
        self._tiers.check_fits(len(tokens))
        entry = self._prefix.longest_prefix(tokens, adapter) if self.feeder.prefix_cache else None
        start = 0 if entry is None else entry.length
        value = Value(list(tokens[:start]), None if entry is None else entry.logits, adapter)
        if entry is None:
            state, conv = self._device.zero_state()
        else:
            state, conv = entry.state, entry.conv
            value.pages = list(entry.pages)
            self._device.pages.share(value.pages)      # before the reservation, which may drop the entry
        self._tiers.reserve(slots=1, pages=0, pinned=(value,))
        value.slot = self._device.start_slot(state, conv)
        sid = self._registry.add(value)
        self._clock.touch(value)
        stop = len(tokens) if limit is None else paged.turn_stop(start, len(tokens), int(limit), self.page_size)
        if start < stop:
            self.feeder.prefill(value, tokens[start:stop], every_position=False)
        return sid

    def logits(self, sid) -> np.ndarray:
        """The logits ``[vocab]`` at the session's current last position."""
        self._collect()
        return np.array(self._registry.session(sid).logits)

    def tokens(self, sid) -> np.ndarray:
        """Every token of the session so far ``[length]``."""
        return np.asarray(self._registry.session(sid).tokens, np.int32)

    def append(self, sid, tokens) -> np.ndarray:
        """Another turn: feed ``tokens`` ``[T]`` -> their logits ``[T, vocab]``."""
        self._collect()
        value = self._registry.session(sid)
        tokens = self._check_tokens(tokens)
        self._tiers.check_fits(value.length + len(tokens))
        return self.feeder.prefill(value, tokens)

    def extend(self, sid, tokens) -> None:
        """`append` without reading back the logits of every position (`logits` gives the last
        one's): a long prompt fed in turns (`prefill_in_turns`)."""
        self._collect()
        value = self._registry.session(sid)
        tokens = self._check_tokens(tokens)
        self._tiers.check_fits(value.length + len(tokens))
        self.feeder.prefill(value, tokens, every_position=False)

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
        values = [self._registry.session(sid) for sid in sids]
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
                                     lambda sid, admitted: self.feeder.room_to_decode(sid, admitted, width))
            remaining = {sid: max_new_tokens - len(new[sid]) for sid in running}
            for sid, tokens in self._next_tokens(running, sampling, remaining, eos_id, speculator).items():
                new[sid].extend(tokens)
            finished = [sid for sid in running if len(new[sid]) == max_new_tokens
                        or (eos_id is not None and new[sid][-1] == eos_id)]
            for sid in finished:
                running.remove(sid)
                self.feeder.remember_prefix(self._sessions[sid])
                if speculator is not None:
                    speculator.leave(sid)
        return [np.asarray(new[sid], np.int32) for sid in sids]

    def _next_tokens(self, running: list[int], sampling: Sampling, remaining: dict, eos_id: int | None,
                     speculator) -> dict[int, list[int]]:
        """One decode step of the ``running`` sessions, or one speculative round (each emitting at
        most ``remaining[sid]`` tokens, none past ``eos_id``) -> {session id: its new tokens}."""
        if speculator is None:
            return {sid: [token] for sid, token in self.feeder.decode(running, [sampling] * len(running)).items()}
        rounds = speculator.round({sid: sampling for sid in running}, limits=remaining,
                                  stop_ids=() if eos_id is None else (eos_id,))
        return {sid: result.tokens for sid, result in rounds.items()}

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

    def serve_adapters(self, slots: dict[str, int]) -> None:
        """Serve the adapters of the model's banks (`k3jax.layers.lora.AdapterBank`) now loaded:
        ``{tag: bank slot}`` (a tag names one adapter's weights, e.g. ``name@checksum``). Sessions
        opened with a tag run on its slot; a session whose tag is gone refuses to be fed (its
        cached prefixes are keyed by the tag, so a slot refilled with other weights reuses none)."""
        self.feeder.serve_adapters(self.model, slots)

    def adapter(self, sid) -> str:
        """The tag of the adapter serving session ``sid`` ("" the base model)."""
        return self._registry.session(sid).adapter

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
        value = self._registry.session(sid)
        self._tiers.writable(value, 0)
        self.feeder.remember_prefix(value)

    def snapshot(self, sid) -> Snapshot:
        """A handle to the session's current point; released when the handle is garbage or the
        session closes."""
        self._collect()
        return self._registry.snapshot(sid)

    def rollback(self, sid, handle: Snapshot) -> None:
        """Return the session to the point of ``handle`` (a snapshot of this session)."""
        self._collect()
        self._registry.rollback(sid, handle)

    def fork(self, sid) -> int:
        """A new session with this one's history: KDA state copied, MLA pages shared."""
        self._collect()
        return self._registry.fork(sid)

    def close(self, sid) -> None:
        """Forget the session and its snapshots."""
        self._collect()
        self._registry.close(sid)

    def park(self, sid) -> None:
        """Move the session off the device now, to the host tier (and on to disk past the host
        budget), as the budgets would move it once it is the least recently used: a session that
        waits (a server's stored response) then holds no slot or page, so the device pools stay
        sized to the sessions that run -- their capacity, not their batch, sets the cost of a decode
        step where the backend copies the donated pools (XLA on CPU: `bench.sessions --parts
        capacity`). Its next use brings it back to the device, bit for bit; a session
        already off the device stays where it is."""
        self._collect()
        value = self._registry.session(sid)
        if value.slot is not None:
            self._tiers.to_host(value)

    def sessions(self) -> list[int]:
        return sorted(self._sessions)

    def save(self, directory) -> None:
        """Write every session and snapshot into the new directory ``directory`` (atomically:
        a temporary directory renamed at the end; `k3jax.sessions.persist`). The store is unchanged.
        A store spread over several processes (each making the same calls, `k3jax.inference.mirror`)
        is written by process 0; the others read its values with it and write nothing."""
        self._collect()
        registry = self._registry
        writes = jax.process_index() == 0 or self._device.arrays.state.is_fully_addressable
        persist.save(directory, fingerprint=self.fingerprint, sessions=registry.sessions, snapshots=registry.snapshots,
                     next_session=registry.next_session, next_serial=registry.next_serial, saved=self._saved,
                     write=writes)

    @classmethod
    def load(cls, model, directory, device_bytes: int | None = None, host_bytes: int | None = None,
             disk_dir=None, damaged: list | None = None) -> "SessionStore":
        """A store holding the sessions and snapshots `save` wrote to ``directory``, for the same
        model (same config and weights); they start on host and move to the device on use. A
        damaged file is a ValueError, or, given a ``damaged`` list, that session is left out and its
        id appended there."""
        directory = pathlib.Path(directory)
        manifest = persist.read_manifest(directory)
        store = cls(model, device_bytes, host_bytes, disk_dir)
        saved = persist.read_values(directory, manifest, store.fingerprint, damaged)
        store._registry.restore(saved, manifest["next_session"], manifest["next_serial"], store._clock)
        store._tiers.fit_host()
        return store

    def check_length(self, length: int) -> None:
        """ValueError when one session of ``length`` tokens could not fit the device budget (without
        one: the device's memory) -- what a program checks for its longest session before any work."""
        self._tiers.check_fits(length)

    @property
    def disk_failure(self) -> str | None:
        """Why the latest spill to the disk tier failed, until one succeeds (None: no failure)."""
        return self._tiers.disk_failure

    @property
    def prefix_cache(self) -> bool:
        """Whether states are kept for later prompts (the constructor's ``prefix_cache``)."""
        return self.feeder.prefix_cache

    def stats(self) -> dict:
        """Counters and bytes per tier (device bytes in use = slots and pages held)."""
        values = self._values()
        tiers = {tier: sum(v.tier == tier for v in self._sessions.values()) for tier in ("device", "host", "disk")}
        return {
            **self._prefix.counts, "prefill_tokens": self.feeder.counts["prefill_tokens"], **self._tiers.counts,
            "pages_copied": self._device.pages_copied,
            "decode_steps": self.feeder.counts["decode_steps"], "decode_tokens": self.feeder.counts["decode_tokens"],
            "sessions": len(self._sessions), "snapshots": len(self._registry.snapshots),
            "prefix_entries": len(self._prefix),
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
    def _check_tokens(self, tokens) -> list[int]:
        array = np.asarray(tokens)
        if array.ndim != 1 or array.size == 0 or not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"tokens must be a non-empty 1-D array of integers, got shape {array.shape} {array.dtype}")
        if array.min() < 0 or array.max() >= self.config.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size}), got [{array.min()}, {array.max()}]")
        return [int(t) for t in array]

    # ------------------------------------------------------------------ decode
    def _step(self, sampling: dict, forced: dict | None = None) -> dict[int, int]:
        """`step` (``forced``: `feed`) of the sessions that fit on device, those earlier in ``sampling`` first."""
        self._collect()
        if not sampling:
            return {}
        for sid in sampling:
            self._tiers.check_fits(self._registry.session(sid).length + 1)
        admitted = batching.admit([], list(sampling), self.feeder.room_to_decode)
        return self.feeder.decode(admitted, [sampling[sid] for sid in admitted], forced)

    # ------------------------------------------------------------------ values
    @property
    def _sessions(self) -> dict[int, Value]:
        return self._registry.sessions

    def _values(self) -> tuple[Value, ...]:
        """Every session and snapshot."""
        return self._registry.values()

    def _collect(self) -> None:
        """Release the snapshots whose handles were garbage-collected since the last call."""
        self._registry.collect()

    def _arrays(self, value: Value) -> HostValue:
        """The value's memory, wherever it is (`Tiers.arrays`)."""
        return self._tiers.arrays(value)

    def _saved(self, value: Value) -> persist.SavedValue:
        return persist.SavedValue(np.asarray(value.tokens, np.int32), np.asarray(value.logits), self._arrays(value),
                                  value.adapter)

    @property
    def _host_tier(self) -> HostTier:
        """Where values off the device are held (a test swaps in another)."""
        return self._tiers.host

    @_host_tier.setter
    def _host_tier(self, host: HostTier) -> None:
        self._tiers.host = host
