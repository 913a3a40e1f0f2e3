"""Feeding tokens to sessions on the device: the model programs of a `SessionStore`
(`k3jax.sessions.paged`) over its sessions' values, and the counters `SessionStore.stats` reports.

The store prefills one session at a time (`Feeder.prefill`, chunk-aligned pieces that leave
prefix-cache entries at chunk boundaries) and steps many in one batched decode step
(`Feeder.decode`). Its collaborators feed several sessions together through ``store.feeder``:

    feeder = store.feeder
    values = feeder.values(sids)                    # the sessions' values (ValueError for unknown ids)
    feeder.make_room(values, widths)                # on device, pages for widths[i] more tokens each
    logits, saved = feeder.feed(values, rows, width, every_position=True)   # one model call
    feeder.keep_positions(values, saved, positions) # each slot := its state after rows[i][positions[i]]
    last = feeder.feed_by_length(values, rows, restore)   # one `feed` per row length (a replay)
    feeder.extend(value, tokens, logits)            # history += tokens, logits, spare pages back
    feeder.append({sid: tokens, ...})               # `SessionStore.append` of many sessions at once
    feeder.count_round(tokens)                      # a decode step emitting ``tokens`` in `stats`

A `Value` (`k3jax.sessions.tiers`) is read there for its ``tokens``, ``length`` and ``logits``;
`feed` leaves histories and logits to its caller, who keeps them with `extend`
(`k3jax.sessions.speculate` runs its verify, rollback and replay this way).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.layers.lora import AdapterBank
from k3jax.sessions import batching, paged
from k3jax.sessions.pools import DevicePools
from k3jax.sessions.prefix import PrefixCache
from k3jax.sessions.registry import Registry
from k3jax.sessions.tiers import NoRoom, Tiers, Value


class Feeder:
    """The model programs over the values of ``registry``'s sessions: ``device`` holds the pools,
    ``tiers`` brings values on device with room, ``prefix`` caches states at chunk boundaries
    (when ``prefix_cache``). ``counts``: prefill tokens, decode steps and decode tokens so far.
    ``gathered_decode``: the decode step's gather / decode / scatter baseline (`bench.sessions`)."""

    def __init__(self, model, device: DevicePools, tiers: Tiers, prefix: PrefixCache, registry: Registry,
                 prefix_cache: bool):
        graphdef, self.params = nnx.split(model)
        self.graph = paged.StaticGraph(graphdef)
        self.device, self.tiers, self.prefix, self.registry = device, tiers, prefix, registry
        self.prefix_cache = prefix_cache
        self.chunk_size = model.config.kda.chunk_size
        self.counts = dict.fromkeys(("prefill_tokens", "decode_steps", "decode_tokens"), 0)
        self.gathered_decode = False
        # {adapter tag: bank slot}, the base on 0 (`serve_adapters`); None: the model has no adapter bank
        self.adapter_slots = {"": 0} if any(isinstance(m, AdapterBank) for _, m in nnx.iter_modules(model)) else None

    def serve_adapters(self, model, slots: Mapping[str, int]) -> None:
        """Serve sessions tagged with an adapter from its slot of ``model``'s adapter banks
        (``{tag: slot}``, the base "" on 0), with ``model``'s current weights (a slot just filled)."""
        self.params = nnx.state(model)
        self.adapter_slots = {"": 0, **slots}

    def adapters(self, values: Sequence[Value], pad: int = 0) -> np.ndarray | None:
        """The bank slot of each value, then ``pad`` base rows (None without banks); ValueError for
        a value whose adapter is no longer served."""
        if self.adapter_slots is None:
            return None
        for value in values:
            if value.adapter not in self.adapter_slots:
                raise ValueError(f"adapter {value.adapter.split('@')[0]!r} is not loaded")
        return np.asarray([self.adapter_slots[v.adapter] for v in values] + [0] * pad, np.int32)

    # ------------------------------------------------------------------ one session, one step
    def prefill(self, value: Value, tokens: list[int], every_position: bool = True) -> np.ndarray | None:
        """Prefill ``tokens`` after ``value``'s history in chunk-aligned pieces -> logits [T, vocab]
        (``every_position`` False: None, only the last position's are read back, into ``value``)."""
        outputs, done = [], 0
        for size in paged.piece_lengths(value.length, value.length + len(tokens), self.chunk_size):
            self.tiers.writable(value, size)
            bucket = paged.next_power_of_two(self.device.pages_for(value.length + size))
            logits, self.device.arrays = paged.prefill_piece(
                self.graph, self.params, self.device.arrays, np.int32(value.slot),
                self.device.table(value.pages, bucket), np.int32(value.length),
                np.asarray(tokens[done : done + size], np.int32), self._adapter(value))
            value.tokens.extend(tokens[done : done + size])
            done += size
            outputs.append(logits)
            if value.length % self.chunk_size == 0:
                value.logits = logits[-1]
                self.remember_prefix(value)
        self.counts["prefill_tokens"] += len(tokens)
        value.logits = np.asarray(outputs[-1][-1])
        self.remember_prefix(value)
        return np.asarray(jnp.concatenate(outputs)) if every_position else None

    def _adapter(self, value: Value) -> np.ndarray | None:
        slots = self.adapters([value])
        return None if slots is None else slots[0]

    def remember_prefix(self, value: Value) -> None:
        """Cache ``value``'s state (it is on device) and pages at its current length (with the prefix cache on)."""
        if not self.prefix_cache:
            return
        key = self.prefix.key(value.tokens, value.adapter)
        if self.prefix.touch(key):
            return
        state, conv = self.device.read_slot(value.slot)
        self.prefix.add(key, value.length, state, conv, value.pages[: self.device.pages_for(value.length)],
                        np.asarray(value.logits))
        self.tiers.fit_host()

    def room_to_decode(self, sid: int, admitted: Sequence[int], tokens: int = 1) -> bool:
        """Room on device for ``tokens`` more tokens of session ``sid`` beside the ``admitted``
        ones -> whether there is (`batching.admit` asks)."""
        sessions = self.registry.sessions
        try:
            self.tiers.writable(sessions[sid], tokens, pinned=[sessions[s] for s in admitted])
        except NoRoom:
            return False
        return True

    def decode(self, sids: list[int], samplings: Sequence[batching.Sampling],
               forced: Mapping | None = None) -> dict[int, int]:
        """One batched decode step of sessions ``sids`` (each on device with room for a token): each
        samples from its logits with its `Sampling` (or, in ``forced`` {sid: token}, from a one-hot
        row of its token, greedily) and feeds the token -> {session id: token}. A sampling's
        grammar (``constraint``) allowed the token and is advanced by it."""
        values = [self.registry.sessions[sid] for sid in sids]
        batch = batching.decode_batch(sids, values, samplings, self.device)
        if forced is not None:
            one_hot = np.zeros_like(batch.logits)
            one_hot[np.arange(len(sids)), [forced[sid] for sid in sids]] = 1.0
            batch = batch._replace(logits=one_hot)
        tokens, logits, self.device.arrays = paged.decode_step(
            self.graph, self.params, self.device.arrays, batch.slots, batch.tables,
            batch.lengths, batch.logits, batch.sampling, gathered=self.gathered_decode, adjustment=batch.adjustment,
            adapters=self.adapters(values, len(batch.slots) - len(values)))
        tokens, logits = np.asarray(tokens), np.asarray(logits)
        for index, (value, sampling) in enumerate(zip(values, samplings)):
            value.tokens.append(int(tokens[index]))
            value.logits = logits[index]
            if sampling.constraint is not None:
                sampling.constraint.advance([int(tokens[index])])
        self.count_round(len(values))
        return {sid: int(tokens[index]) for index, sid in enumerate(sids)}

    def count_round(self, tokens: int) -> None:
        """One more decode step (a batched step or speculative round) that emitted ``tokens`` tokens."""
        self.counts["decode_steps"] += 1
        self.counts["decode_tokens"] += tokens

    # ------------------------------------------------------------------ sessions fed together
    def values(self, sids: Sequence[int]) -> list[Value]:
        """The values of sessions ``sids`` (snapshots whose handles are gone released first)."""
        self.registry.collect()
        return [self.registry.session(sid) for sid in sids]

    def make_room(self, values: list[Value], widths: list[int]) -> None:
        """Every value on device with pages for ``widths[i]`` more tokens (shared pages copied);
        where there is no room, the pages taken are given back before the ValueError."""
        for index, (value, width) in enumerate(zip(values, widths)):
            try:
                self.tiers.writable(value, width, pinned=values[:index])
            except NoRoom:
                for taken in values[:index]:
                    self.give_back_pages(taken)
                raise ValueError(f"the device budget cannot hold a speculative round of {len(values)} "
                                 f"session(s) of up to {max(widths)} tokens each") from None

    def feed(self, values: list[Value], tokens: list[list[int]], width: int, restore=None, every_position=False):
        """`paged.feed_rows` over ``values`` (on device with room; each fed its ``tokens`` after its
        history, padded to ``width``) -> (logits [B, width, vocab] on host, the saved KDA states and
        conv tails on device: from before the call, or after every token with ``every_position``).
        Histories and logits are the caller's to update (`extend`)."""
        device = self.device
        batch = paged.next_power_of_two(len(values))
        pad = batch - len(values)
        pages = paged.next_power_of_two(max(len(v.pages) for v in values))
        slots = np.asarray([v.slot for v in values] + device.scratch_slots(pad), np.int32)
        tables = np.stack([device.table(v.pages, pages) for v in values] + [device.table([], pages)] * pad)
        lengths = np.asarray([v.length for v in values] + [0] * pad, np.int32)
        rows = np.zeros((batch, width), np.int32)
        for index, row in enumerate(tokens):
            rows[index, : len(row)] = row
        if restore is not None:
            restore = tuple(jnp.concatenate([a, jnp.zeros((pad, *a.shape[1:]), a.dtype)]) for a in restore)
        logits, device.arrays, saved = paged.feed_rows(
            self.graph, self.params, device.arrays, slots, tables, lengths, rows, restore,
            every_position=every_position, adapters=self.adapters(values, pad))
        return np.asarray(logits)[: len(values)], saved

    def keep_positions(self, values: list[Value], saved, positions: list[int]) -> None:
        """Each value's slot := its KDA state and conv tail after token ``positions[i]`` of the
        `feed` (``every_position``) that returned ``saved`` for ``values`` in this order."""
        device = self.device
        batch = saved[0].shape[0]
        outside = device.arrays.state.shape[0]                    # padding rows write nowhere
        slots = np.asarray([v.slot for v in values] + [outside] * (batch - len(values)), np.int32)
        positions = np.asarray(list(positions) + [0] * (batch - len(values)), np.int32)
        device.arrays = paged.keep_positions(device.arrays, slots, saved, positions)

    def feed_by_length(self, values: list[Value], tokens: list[list[int]], restore=None) -> list[np.ndarray]:
        """Feed each value its ``tokens`` (lengths >= 1), one `feed` per distinct length; with
        ``restore`` (state and conv tails, row i for value i) each slot is first set back to its row
        -> the logits after each value's last token."""
        last = [None] * len(values)
        for length in sorted({len(row) for row in tokens}):
            group = [index for index, row in enumerate(tokens) if len(row) == length]
            rows = None if restore is None else tuple(array[jnp.asarray(group)] for array in restore)
            logits, _ = self.feed([values[i] for i in group], [tokens[i] for i in group], length, rows)
            for position, index in enumerate(group):
                last[index] = logits[position, -1]
        return last

    def extend(self, value: Value, tokens: list[int], logits) -> None:
        """After a `feed`: ``value``'s history gains ``tokens`` (fed, kept), its logits are
        ``logits`` (after its last token) and the pages past its tokens are given back."""
        value.tokens.extend(tokens)
        value.logits = logits
        self.give_back_pages(value)

    def append(self, tokens: Mapping[int, list[int]]) -> None:
        """`SessionStore.append` of many sessions at once ({session id: tokens}), batched by length."""
        sids = list(tokens)
        values = self.values(sids)
        self.make_room(values, [len(tokens[sid]) for sid in sids])
        for sid, value, logits in zip(sids, values, self.feed_by_length(values, [tokens[sid] for sid in sids])):
            self.extend(value, tokens[sid], logits)
        self.counts["prefill_tokens"] += sum(len(row) for row in tokens.values())

    def give_back_pages(self, value: Value) -> None:
        """Release the pages past the ones ``value``'s tokens fill."""
        spare = value.pages[self.device.pages_for(value.length):]
        if spare:
            del value.pages[self.device.pages_for(value.length):]
            self.device.pages.release(spare)
