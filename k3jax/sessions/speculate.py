"""Speculative rounds over the sessions of a `SessionStore`: draft, verify in one batched call,
roll back the rejected drafts, exactly (the rules: `k3jax.speculative`).

    speculator = Speculator(store, PromptLookup(max_ngram=3), SpeculationConfig(k=4))   # or DraftModel(draft_model)
    speculator = Speculator.of(store, SpeculationConfig(prompt_lookup=3, k=4))          # the same
    out = speculator.round({sid: Sampling(...), ...}, limits={sid: 16}, stop_ids={2})
    out[sid].tokens, out[sid].logprobs                                   # this round's, >= 1 token each
    speculator.stats.as_dict()                                           # acceptance, draft / verify s

One round of B sessions:
  1. each session's first token t_0 is drawn from its logits (`k3jax.speculative`) and the drafts
     d_1..d_k proposed after it;
  2. verify: one `paged.feed_rows` call feeds [t_0, d_1..d_k] to every session (rows padded to the
     round's longest drafts rounded up to a power of two, at most 1 + k, so a few widths compile;
     batch to a power of two); it returns the logits of every position;
  3. each session accepts a prefix of its drafts and keeps [t_0, d_1..d_j]; its next logits are
     the verify's at d_j. A session that kept fewer tokens than were fed is rolled back, by
     ``rollback``:
       "states" (default): the verify fed the tokens one at a time and saved the KDA state and
          conv tail after every position (`k3jax.memory.KDAPositions`); one small call
          (`paged.keep_positions`) sets every such slot to its position j. Memory: 1 + k states
          per session during the round.
       "replay": the verify saved the states from before it; a `feed_rows` call per kept length
          writes them back into the slots and feeds [t_0, d_1..d_j] again (the logits are the
          replay's). No per-position memory; a model call per distinct kept length.
     MLA rows past a session's length are masked, so only the KDA states and conv tails need
     restoring.
After the round every session's KDA state, conv tails, MLA rows and logits are those of feeding
exactly its emitted tokens, and its history holds them. Pages a verify took beyond that are given
back (a fork must never share a page it may write).
"""
from __future__ import annotations

import time
from typing import Mapping, NamedTuple, Sequence

import jax.numpy as jnp
import numpy as np

from k3jax.sampling import log_softmax
from k3jax.sessions import paged
from k3jax.sessions.batching import Sampling
from k3jax.sessions.store import SessionStore
from k3jax.sessions.tiers import NoRoom, Value
from k3jax.config import SpeculationConfig
from k3jax.speculative import (DRAW, UNIFORM, AdaptiveK, SpeculationStats, accepted_drafts, draw, position_rng,
                               prompt_lookup, residual, sampling_probs)


class RoundResult(NamedTuple):
    """One session's round: the ``tokens`` it emitted (>= 1) and each one's ``logprobs`` (the
    target's log-softmax, no temperature or filter)."""

    tokens: list[int]
    logprobs: list[float]


class PromptLookup:
    """Drafts copied from the session's own history (`k3jax.speculative.prompt_lookup`)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not (isinstance(max_ngram, int) and isinstance(min_ngram, int) and 1 <= min_ngram <= max_ngram):
            raise ValueError(f"prompt lookup needs integers 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, histories: Mapping[int, list[int]], lengths: Mapping[int, int]) -> dict[int, list[int]]:
        return {sid: prompt_lookup(history, lengths[sid], self.max_ngram, self.min_ngram)
                for sid, history in histories.items() if lengths[sid] > 0}

    def keep(self, sid: int, history: list[int]) -> None:
        """The session's history is now ``history`` (prompt lookup keeps nothing)."""

    def leave(self, sid: int) -> None:
        """The session no longer speculates."""


class DraftModel:
    """Greedy drafts from a smaller model with the same tokenizer, in a session store of its own:
    each target session has a draft session holding the same tokens, all drafting in one
    batched `SessionStore.generate` per round. A draft session is snapshotted before it drafts
    and rolled back to that point when the target rejected some of its drafts."""

    def __init__(self, model, device_bytes: int | None = None):
        self.store = SessionStore(model, device_bytes=device_bytes, fingerprint="draft", prefix_cache=False)
        self._sessions: dict[int, int] = {}        # target session -> draft session
        self._before: dict[int, object] = {}       # target session -> its draft session's snapshot before drafting

    def _synced(self, histories: Mapping[int, list[int]]) -> list[int]:
        """The draft sessions of the target sessions of ``histories``, each holding exactly its
        history: new ones prefilled, the others fed what they lack (`append_together`)."""
        missing = {}
        for sid, history in histories.items():
            draft = self._sessions.get(sid)
            held = [] if draft is None else list(self.store.tokens(draft))
            if draft is not None and (len(held) > len(history) or held != history[: len(held)]):
                self.store.close(draft)
                draft = None
            if draft is None:
                self._sessions[sid] = self.store.open(np.asarray(history, np.int32))
            elif len(held) < len(history):
                missing[draft] = history[len(held):]
        if missing:
            append_together(self.store, missing)
        return [self._sessions[sid] for sid in histories]

    def propose(self, histories: Mapping[int, list[int]], lengths: Mapping[int, int]) -> dict[int, list[int]]:
        sids = [sid for sid in histories if lengths[sid] > 0]
        if not sids:
            return {}
        drafts = self._synced({sid: histories[sid] for sid in sids})
        self._before.update((sid, self.store.snapshot(draft)) for sid, draft in zip(sids, drafts))
        tokens = self.store.generate(drafts, max(lengths[sid] for sid in sids))
        return {sid: [int(t) for t in out[: lengths[sid]]] for sid, out in zip(sids, tokens)}

    def keep(self, sid: int, history: list[int]) -> None:
        """The target now holds ``history``: when the draft session drafted past it, roll it back to
        before its drafts (a prefix of ``history``; the next proposal feeds the rest)."""
        draft, before = self._sessions.get(sid), self._before.pop(sid, None)
        if draft is not None and before is not None and \
                list(self.store.tokens(draft)) != history[: self.store.tokens(draft).size]:
            self.store.rollback(draft, before)

    def leave(self, sid: int) -> None:
        self._before.pop(sid, None)
        draft = self._sessions.pop(sid, None)
        if draft is not None:
            self.store.close(draft)


class Speculator:
    """Speculative rounds for sessions of ``store`` with ``drafter`` (`PromptLookup` or
    `DraftModel`) proposing up to ``settings.k`` tokens a round (`AdaptiveK` per session when
    ``settings.adaptive``), rejected drafts undone as ``settings.rollback`` says (the settings'
    draft source is `of`'s). See the module docstring."""

    def __init__(self, store, drafter, settings: SpeculationConfig = SpeculationConfig()):
        self.store, self.drafter = store, drafter
        self.k, self.adaptive, self.rollback = settings.k, settings.adaptive, settings.rollback
        self.stats = SpeculationStats()
        self._k: dict[int, AdaptiveK] = {}
        self._rejected: dict[int, int] = {}       # session -> the draft its last round rejected (sampled)

    @classmethod
    def of(cls, store, settings: SpeculationConfig, draft_model=None) -> "Speculator":
        """The speculator ``settings`` describe, over ``store``: prompt lookup, or ``draft_model``
        (the model of ``settings.draft``, loaded and checked by `k3jax.inference.load_draft`)."""
        if not settings.enabled:
            raise ValueError("speculation needs a draft source: prompt_lookup or a draft model")
        if settings.prompt_lookup is not None:
            return cls(store, PromptLookup(settings.prompt_lookup), settings)
        if draft_model is None:
            raise ValueError(f"speculation drafting with {settings.draft} needs its model (k3jax.inference.load_draft)")
        if draft_model.config.vocab_size != store.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft_model.config.vocab_size} tokens) is not "
                             f"the target's ({store.config.vocab_size})")
        return cls(store, DraftModel(draft_model), settings)

    def leave(self, sid: int) -> None:
        """Forget ``sid``'s speculation state (its draft session, draft length)."""
        self.drafter.leave(sid)
        self._k.pop(sid, None)
        self._rejected.pop(sid, None)

    def round(self, sampling: Mapping[int, Sampling], limits: Mapping[int, int] | None = None,
              stop_ids: Sequence[int] | Mapping[int, Sequence[int]] = ()) -> dict[int, RoundResult]:
        """One round of every session of ``sampling`` ({session id: `Sampling`}): each emits at
        least one and at most ``limits[sid]`` tokens (default 1 + k), none after one of its
        ``stop_ids`` (the same for all, or {session id: its ids}) -> {session id: `RoundResult`}.
        ValueError, with every session as it was, when the device budget cannot hold the round."""
        store = self.store
        store._collect()
        sids = list(sampling)
        values = [store._session(sid) for sid in sids]
        limits = {sid: (1 + self.k) if limits is None else int(limits[sid]) for sid in sids}
        if any(limit < 1 for limit in limits.values()):
            raise ValueError(f"every session must be allowed at least one token, got limits {limits}")
        stops = {sid: frozenset(int(t) for t in (stop_ids.get(sid, ()) if isinstance(stop_ids, Mapping) else stop_ids))
                 for sid in sids}
        room = 1 + min(self.k, max(limits.values()) - 1)
        make_room(store, values, [room] * len(values))                          # before any change
        first, first_logprob = {}, {}
        for sid, value in zip(sids, values):
            rule = sampling[sid]
            probs = sampling_probs(value.logits, rule.temperature, rule.top_k, rule.top_p)
            if sid in self._rejected and rule.temperature > 0:
                probs = residual(probs, self._rejected[sid])
            stream = sid if rule.stream is None else rule.stream
            token = int(np.argmax(probs)) if rule.temperature == 0 else \
                draw(probs, position_rng(rule.seed, stream, value.length, DRAW))
            first[sid], first_logprob[sid] = token, float(log_softmax(value.logits)[token])
            self._rejected.pop(sid, None)

        started = time.perf_counter()
        lengths = {sid: 0 if first[sid] in stops[sid] else min(self._adaptive(sid).next(), limits[sid] - 1)
                   for sid in sids}
        drafts = self.drafter.propose({sid: value.tokens + [first[sid]] for sid, value in zip(sids, values)}, lengths)
        drafts = {sid: drafts.get(sid, [])[: lengths[sid]] for sid in sids}
        self.stats.draft_seconds += time.perf_counter() - started

        started = time.perf_counter()
        width = min(paged.next_power_of_two(1 + max(len(d) for d in drafts.values())), room)
        fed = {sid: [first[sid], *drafts[sid]] for sid in sids}
        logits, saved = feed(store, values, [fed[sid] for sid in sids], width,
                             every_position=self.rollback == "states")
        kept, results = {}, {}
        for row, (sid, value) in enumerate(zip(sids, values)):
            rule, stream = sampling[sid], sid if sampling[sid].stream is None else sampling[sid].stream
            probs = [sampling_probs(logits[row, i], rule.temperature, rule.top_k, rule.top_p)
                     for i in range(len(drafts[sid]))]
            uniforms = [position_rng(rule.seed, stream, value.length + 1 + i, UNIFORM).random()
                        for i in range(len(drafts[sid]))]
            accepted = accepted_drafts(probs, drafts[sid], uniforms, stops[sid])
            stopped = accepted > 0 and drafts[sid][accepted - 1] in stops[sid]
            if accepted < len(drafts[sid]) and not stopped:
                self._rejected[sid] = drafts[sid][accepted]
            kept[sid] = fed[sid][: 1 + accepted]
            accepted_logprobs = log_softmax(logits[row, :accepted])[np.arange(accepted), drafts[sid][:accepted]]
            logprobs = [first_logprob[sid], *map(float, accepted_logprobs)]
            results[sid] = RoundResult(kept[sid], logprobs)
            self._adaptive(sid).update(len(drafts[sid]), accepted)
            self.stats.rounds += 1
            self.stats.drafted += len(drafts[sid])
            self.stats.accepted += accepted
            self.stats.emitted += 1 + accepted
        last = {sid: logits[row, len(kept[sid]) - 1] for row, sid in enumerate(sids)}
        rolled = [row for row, sid in enumerate(sids) if len(kept[sid]) < width]
        if rolled and self.rollback == "states":
            keep_positions(store, values, saved, [len(kept[sid]) - 1 for sid in sids])
        elif rolled:
            restore = tuple(array[jnp.asarray(rolled)] for array in saved)
            replays = feed_by_length(store, [values[row] for row in rolled], [kept[sids[row]] for row in rolled],
                                     restore)
            last.update({sids[row]: logits for row, logits in zip(rolled, replays)})
        for sid, value in zip(sids, values):
            value.tokens.extend(kept[sid])
            value.logits = last[sid]
            give_back_pages(store, value)
            self.drafter.keep(sid, value.tokens)
        self.stats.verify_seconds += time.perf_counter() - started
        self.stats.batched_rounds += 1
        store._counters["decode_steps"] += 1
        store._counters["decode_tokens"] += sum(len(r.tokens) for r in results.values())
        return results

    # ------------------------------------------------------------------ internals
    def _adaptive(self, sid: int) -> AdaptiveK:
        if sid not in self._k:
            self._k[sid] = AdaptiveK(self.k, floor=0.1 if self.adaptive else 0.0)
        return self._k[sid]


# ---------------------------------------------------------------------- sessions fed together
def make_room(store, values: list[Value], widths: list[int]) -> None:
    """Every value on device with pages for ``widths[i]`` more tokens (shared pages copied);
    where there is no room, the pages taken are given back before the ValueError."""
    for index, (value, width) in enumerate(zip(values, widths)):
        try:
            store._tiers.writable(value, width, pinned=values[:index])
        except NoRoom:
            for taken in values[:index]:
                give_back_pages(store, taken)
            raise ValueError(f"the device budget cannot hold a speculative round of {len(values)} "
                             f"session(s) of up to {max(widths)} tokens each") from None


def feed(store, values: list[Value], tokens: list[list[int]], width: int, restore=None, every_position=False):
    """`paged.feed_rows` over ``values`` (on device with room; each fed its ``tokens`` after its
    history, padded to ``width``) -> (logits [B, width, vocab] on host, the saved KDA states and
    conv tails on device: from before the call, or after every token with ``every_position``).
    Histories and logits are the caller's to update."""
    device = store._device
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
        store._graph, store._params, device.arrays, slots, tables, lengths, rows, restore,
        every_position=every_position)
    return np.asarray(logits)[: len(values)], saved


def keep_positions(store, values: list[Value], saved, positions: list[int]) -> None:
    """Each value's slot := its KDA state and conv tail after token ``positions[i]`` of the
    `feed` (``every_position``) that returned ``saved`` for ``values`` in this order."""
    device = store._device
    batch = saved[0].shape[0]
    outside = device.arrays.state.shape[0]                    # padding rows write nowhere
    slots = np.asarray([v.slot for v in values] + [outside] * (batch - len(values)), np.int32)
    positions = np.asarray(list(positions) + [0] * (batch - len(values)), np.int32)
    device.arrays = paged.keep_positions(device.arrays, slots, saved, positions)


def feed_by_length(store, values: list[Value], tokens: list[list[int]], restore=None) -> list[np.ndarray]:
    """Feed each value its ``tokens`` (lengths >= 1), one `feed` per distinct length; with
    ``restore`` (state and conv tails, row i for value i) each slot is first set back to its row
    -> the logits after each value's last token."""
    last = [None] * len(values)
    for length in sorted({len(row) for row in tokens}):
        group = [index for index, row in enumerate(tokens) if len(row) == length]
        rows = None if restore is None else tuple(array[jnp.asarray(group)] for array in restore)
        logits, _ = feed(store, [values[i] for i in group], [tokens[i] for i in group], length, rows)
        for position, index in enumerate(group):
            last[index] = logits[position, -1]
    return last


def append_together(store, tokens: Mapping[int, list[int]]) -> None:
    """`SessionStore.append` of many sessions at once ({session id: tokens}), batched by length."""
    sids = list(tokens)
    values = [store._session(sid) for sid in sids]
    make_room(store, values, [len(tokens[sid]) for sid in sids])
    for sid, value, logits in zip(sids, values, feed_by_length(store, values, [tokens[sid] for sid in sids])):
        value.tokens.extend(tokens[sid])
        value.logits = logits
        give_back_pages(store, value)
    store._counters["prefill_tokens"] += sum(len(row) for row in tokens.values())


def give_back_pages(store, value: Value) -> None:
    """Release the pages past the ones ``value``'s tokens fill."""
    device = store._device
    spare = value.pages[device.pages_for(value.length):]
    if spare:
        del value.pages[device.pages_for(value.length):]
        device.pages.release(spare)
