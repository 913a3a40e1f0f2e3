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
  2. verify: one `paged.feed_rows` call (`Feeder.feed`) feeds [t_0, d_1..d_k] to every session
     (rows padded to the round's longest drafts rounded up to a power of two, at most 1 + k, so a
     few widths compile; batch to a power of two); it returns the logits of every position;
  3. each session accepts a prefix of its drafts and keeps [t_0, d_1..d_j]; its next logits are
     the verify's at d_j. A session that kept fewer tokens than were fed is rolled back, by
     ``rollback``:
       "states" (default): the verify fed the tokens one at a time and saved the KDA state and
          conv tail after every position (`k3jax.memory.KDAPositions`); one small call
          (`Feeder.keep_positions`) sets every such slot to its position j. Memory: 1 + k states
          per session during the round.
       "replay": the verify saved the states from before it; a `feed_rows` call per kept length
          writes them back into the slots and feeds [t_0, d_1..d_j] again (the logits are the
          replay's). No per-position memory; a model call per distinct kept length.
     MLA rows past a session's length are masked, so only the KDA states and conv tails need
     restoring.
After the round every session's KDA state, conv tails, MLA rows and logits are those of feeding
exactly its emitted tokens, and its history holds them. Pages a verify took beyond that are given
back (a fork must never share a page it may write).

A session's logits options (`Sampling`: penalties, biases, min-p, a grammar) are part of p: each
position's distribution is `sampling_probs` with the `row_adjustment` of the history up to it, and a
grammar (``constraint``) is advanced through t_0 and the drafts it allows, so a draft it forbids has
p(d) = 0 and is rejected; it is then taken back to the kept tokens. Greedy constrained rounds thus
emit what constrained plain steps would. The store is used through its public
``feeder`` only (`k3jax.sessions.feeding`).
"""
from __future__ import annotations

import time
from typing import Mapping, NamedTuple, Sequence

import jax.numpy as jnp
import numpy as np

from k3jax.config import SpeculationConfig
from k3jax.sampling import log_softmax, sampling_probs
from k3jax.sessions import paged
from k3jax.sessions.batching import Sampling, row_adjustment
from k3jax.sessions.store import SessionStore
from k3jax.sessions.tiers import Value
from k3jax.speculative import (DRAW, UNIFORM, AdaptiveK, SpeculationStats, accepted_drafts, draw, position_rng,
                               prompt_lookup, residual)


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
        history: new ones prefilled, the others fed what they lack (`Feeder.append`)."""
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
            self.store.feeder.append(missing)
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
        feeder = self.store.feeder
        sids = list(sampling)
        values = feeder.values(sids)
        limits = {sid: (1 + self.k) if limits is None else int(limits[sid]) for sid in sids}
        if any(limit < 1 for limit in limits.values()):
            raise ValueError(f"every session must be allowed at least one token, got limits {limits}")
        stops = {sid: frozenset(int(t) for t in (stop_ids.get(sid, ()) if isinstance(stop_ids, Mapping) else stop_ids))
                 for sid in sids}
        room = 1 + min(self.k, max(limits.values()) - 1)
        feeder.make_room(values, [room] * len(values))                          # before any change
        first = {sid: self._first_token(sid, value, sampling[sid]) for sid, value in zip(sids, values)}
        drafts = self._drafts(sids, values, [token for token, _ in first.values()], limits, stops)

        started = time.perf_counter()
        width = min(paged.next_power_of_two(1 + max(len(d) for d in drafts.values())), room)
        fed = {sid: [first[sid][0], *drafts[sid]] for sid in sids}
        logits, saved = feeder.feed(values, [fed[sid] for sid in sids], width, every_position=self.rollback == "states")
        results = {sid: self._verified(sid, value, sampling[sid], logits[row], fed[sid], first[sid][1], stops[sid])
                   for row, (sid, value) in enumerate(zip(sids, values))}
        last = self._rolled_back(sids, values, [results[sid].tokens for sid in sids], logits, saved, width)
        for sid, value in zip(sids, values):
            feeder.extend(value, results[sid].tokens, last[sid])
            self.drafter.keep(sid, value.tokens)
        self.stats.verify_seconds += time.perf_counter() - started
        self.stats.batched_rounds += 1
        feeder.count_round(sum(len(r.tokens) for r in results.values()))
        return results

    # ------------------------------------------------------------------ a round's steps
    def _first_token(self, sid: int, value: Value, rule: Sampling) -> tuple[int, float]:
        """t_0 from the session's logits (from the residual after a rejected sampled draft) -> (t_0, its
        log-prob); the session's grammar, if any, advanced by it."""
        probs = self._probs(value.logits, rule, value.tokens)
        if sid in self._rejected and rule.temperature > 0:
            probs = residual(probs, self._rejected[sid])
        stream = sid if rule.stream is None else rule.stream
        token = int(np.argmax(probs)) if rule.temperature == 0 else \
            draw(probs, position_rng(rule.seed, stream, value.length, DRAW))
        self._rejected.pop(sid, None)
        if rule.constraint is not None:
            rule.constraint.advance([token])
        return token, float(log_softmax(value.logits)[token])

    def _probs(self, logits: np.ndarray, rule: Sampling, history) -> np.ndarray:
        """p at a position after ``history``: `sampling_probs` with the session's logits options there."""
        adjustment = row_adjustment(rule, history, logits.shape[-1]) if rule.adjusts else None
        return sampling_probs(logits, rule.temperature, rule.top_k, rule.top_p, adjustment)

    def _drafts(self, sids, values, first: list[int], limits, stops) -> dict[int, list[int]]:
        """Each session's drafts after its t_0 (none after a stop id; at most its limit - 1)."""
        started = time.perf_counter()
        lengths = {sid: 0 if token in stops[sid] else min(self._adaptive(sid).next(), limits[sid] - 1)
                   for sid, token in zip(sids, first)}
        drafts = self.drafter.propose({sid: value.tokens + [token] for sid, value, token in zip(sids, values, first)},
                                      lengths)
        self.stats.draft_seconds += time.perf_counter() - started
        return {sid: drafts.get(sid, [])[: lengths[sid]] for sid in sids}

    def _verified(self, sid: int, value: Value, rule: Sampling, logits: np.ndarray, fed: list[int],
                  first_logprob: float, stops: frozenset) -> RoundResult:
        """The acceptance test of the drafts ``fed[1:]`` against the verify's ``logits`` [width, vocab]
        -> the tokens the session keeps, [t_0, d_1..d_j], and their log-probs."""
        drafts, stream = fed[1:], sid if rule.stream is None else rule.stream
        probs, advanced = [], 0       # with a grammar: up to the first draft it forbids (p = 0 there)
        for i, token in enumerate(drafts):
            probs.append(self._probs(logits[i], rule, value.tokens + fed[: i + 1]))
            if rule.constraint is not None:
                if not (probs[-1][token] > 0 and rule.constraint.advance([token]) == 1):
                    break
                advanced += 1
        uniforms = [position_rng(rule.seed, stream, value.length + 1 + i, UNIFORM).random() for i in range(len(probs))]
        accepted = accepted_drafts(probs, drafts[: len(probs)], uniforms, stops)
        if rule.constraint is not None:           # it took t_0 and drafts[:advanced]; keep t_0 and drafts[:accepted]
            rule.constraint.rollback(advanced - accepted)
        stopped = accepted > 0 and drafts[accepted - 1] in stops
        if accepted < len(drafts) and not stopped:
            self._rejected[sid] = drafts[accepted]
        accepted_logprobs = log_softmax(logits[:accepted])[np.arange(accepted), drafts[:accepted]]
        self._adaptive(sid).update(len(drafts), accepted)
        self.stats.rounds += 1
        self.stats.drafted += len(drafts)
        self.stats.accepted += accepted
        self.stats.emitted += 1 + accepted
        return RoundResult(fed[: 1 + accepted], [first_logprob, *map(float, accepted_logprobs)])

    def _rolled_back(self, sids, values, kept: list[list[int]], logits, saved, width: int) -> dict[int, np.ndarray]:
        """Every session that kept fewer than the ``width`` tokens fed set back to feeding only its
        ``kept[i]`` (by ``rollback``) -> each session's logits after its last kept token."""
        feeder = self.store.feeder
        last = {sid: logits[row, len(kept[row]) - 1] for row, sid in enumerate(sids)}
        rolled = [row for row in range(len(sids)) if len(kept[row]) < width]
        if rolled and self.rollback == "states":
            feeder.keep_positions(values, saved, [len(tokens) - 1 for tokens in kept])
        elif rolled:
            restore = tuple(array[jnp.asarray(rolled)] for array in saved)
            replays = feeder.feed_by_length([values[row] for row in rolled], [kept[row] for row in rolled], restore)
            last.update({sids[row]: row_logits for row, row_logits in zip(rolled, replays)})
        return last

    # ------------------------------------------------------------------ internals
    def _adaptive(self, sid: int) -> AdaptiveK:
        if sid not in self._k:
            self._k[sid] = AdaptiveK(self.k, floor=0.1 if self.adaptive else 0.0)
        return self._k[sid]
