"""Batched decode: which sessions step together, and the padded inputs of their step.

All sessions of a `SessionStore.generate` call step together in one jitted decode step
(`k3jax.sessions.paged.decode_step`; batch and page counts in power-of-two buckets); when the
device budget cannot hold them all, those earlier in ``sids`` run first and the others join as
sessions finish (`admit`). A padding row of a batch reads no pages and writes into a free slot of
its own (`decode_batch`).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Sequence

import numpy as np

from k3jax.sampling import Adjustment, check_sampling, pack_bits, penalty_bias
from k3jax.sessions.paged import RowSampling, next_power_of_two
from k3jax.sessions.pools import DevicePools


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How a session samples its next tokens in `SessionStore.step`: ``temperature`` 0 is greedy;
    ``top_k`` / ``top_p`` None switch those filters off. The token at position p draws from the key
    fold_in(fold_in(key(seed mod 2**32), stream), p), ``stream`` None meaning the session's id: samples depend
    on these and the position only, not on the batch a session steps in.

    The logits options (`k3jax.sampling.adjusted_logits`, `row_adjustment`): ``min_p`` (0: off),
    ``logit_bias`` ((token id, bias) pairs), ``presence_penalty`` / ``frequency_penalty`` over the
    tokens generated since history position ``generated_from``, ``repetition_penalty`` (1: off) over
    the whole history, and ``constraint``: a grammar's state (`k3jax.grammar.Constraint`: which
    tokens it allows next, advanced by the store with each token the session keeps)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    stream: int | None = None
    min_p: float = 0.0
    logit_bias: tuple = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    generated_from: int = 0
    constraint: object = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        check_sampling(1, self.temperature, self.top_k, self.top_p, self.seed)
        if self.stream is not None and not (isinstance(self.stream, (int, np.integer)) and 0 <= self.stream < 2**32):
            raise ValueError(f"stream must be an integer in [0, 2**32), got {self.stream!r}")
        if not (0 <= self.min_p <= 1 and self.repetition_penalty > 0):
            raise ValueError(f"need 0 <= min_p <= 1 and repetition_penalty > 0, got {self.min_p!r}, "
                             f"{self.repetition_penalty!r}")

    @property
    def adjusts(self) -> bool:
        """Whether any logits option is on (else the decode step needs no `Adjustment`)."""
        return bool(self.min_p or self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1 or self.constraint is not None)


def row_adjustment(sampling: Sampling, tokens, vocab: int) -> Adjustment:
    """One row's `Adjustment` (NumPy, float64) for a session of history ``tokens`` sampling with
    ``sampling``: its grammar's allowed tokens now (all without a constraint), the tokens seen
    (the repetition penalty's), `penalty_bias` over the tokens since ``generated_from``."""
    words = -(-vocab // 32)
    allowed = np.full(words, -1, np.int32) if sampling.constraint is None else sampling.constraint.allowed(words)
    tokens = np.asarray(tokens, np.int64)
    if sampling.repetition_penalty != 1:
        seen = pack_bits(np.bincount(tokens, minlength=vocab)[:vocab] > 0)
    else:
        seen = np.zeros(words, np.int32)
    if sampling.logit_bias or sampling.presence_penalty or sampling.frequency_penalty:
        bias = penalty_bias(vocab, tokens[sampling.generated_from:], sampling.logit_bias, sampling.presence_penalty,
                            sampling.frequency_penalty)
    else:
        bias = np.zeros(vocab)
    return Adjustment(allowed, seen, np.float64(sampling.repetition_penalty), bias, np.float64(sampling.min_p))


def row_adjustments(samplings: Sequence[Sampling], histories: Sequence, vocab: int, batch: int) -> Adjustment | None:
    """The `Adjustment` arrays ``[batch, ...]`` of a step (float32; padding rows: no adjustment), or
    None when no row adjusts its logits."""
    if not any(s.adjusts for s in samplings):
        return None
    neutral = Sampling()
    rows = [row_adjustment(s, h, vocab) for s, h in zip(samplings, histories)]
    rows += [row_adjustment(neutral, [], vocab)] * (batch - len(rows))
    allowed, seen, repetition, bias, min_p = zip(*rows)
    return Adjustment(np.stack(allowed), np.stack(seen), np.asarray(repetition, np.float32),
                      np.stack(bias).astype(np.float32), np.asarray(min_p, np.float32))


def row_sampling(sids: Sequence[int], samplings: Sequence[Sampling], batch: int) -> RowSampling:
    """The `RowSampling` arrays of a step of ``sids`` padded to ``batch`` rows (padding: greedy)."""
    pad = batch - len(sids)
    rows = [(s.seed % 2**32, sid if s.stream is None else s.stream, s.temperature, s.top_k or 0,
             1.0 if s.top_p is None else s.top_p) for sid, s in zip(sids, samplings)] + [(0, 0, 0.0, 0, 1.0)] * pad
    seed, stream, temperature, top_k, top_p = zip(*rows)
    return RowSampling(np.asarray(seed, np.uint32), np.asarray(stream, np.uint32),
                       np.asarray(temperature, np.float32), np.asarray(top_k, np.int32),
                       np.asarray(top_p, np.float32))


def admit(running: list[int], pending: list[int], make_room: Callable[[int, list[int]], bool]) -> list[int]:
    """The sessions of the next step: every running one, then pending ones in order, while
    ``make_room(sid, admitted)`` (room on device for one more token of ``sid`` beside the
    ``admitted``) succeeds. Admitted ones leave ``pending``; running ones that found no room go
    back to its front."""
    admitted = []
    for sid in running + list(pending):
        if not make_room(sid, admitted):
            if not admitted:
                raise ValueError("the device budget cannot hold one decoding session")
            break
        admitted.append(sid)
        if sid in pending:
            pending.remove(sid)
    pending[:0] = [sid for sid in running if sid not in admitted]
    return admitted


class DecodeBatch(NamedTuple):
    """One decode step's inputs, padded to a power-of-two batch of power-of-two page tables."""

    slots: np.ndarray      # [B] int32
    tables: np.ndarray     # [B, P] int32
    lengths: np.ndarray    # [B] int32
    logits: np.ndarray     # [B, vocab] float32
    sampling: RowSampling  # [B] each
    adjustment: Adjustment | None   # [B, ...] each (`row_adjustments`)


def decode_batch(sids: list[int], values, samplings: Sequence[Sampling], device: DevicePools) -> DecodeBatch:
    """The step of sessions ``sids`` (their values on device, each with a page for one more
    token) sampling with ``samplings``; padding rows get free slots of ``device`` (grown if
    needed), empty page tables and greedy sampling."""
    batch = next_power_of_two(len(values))
    pages = next_power_of_two(max(device.pages_for(v.length + 1) for v in values))
    pad = batch - len(values)
    logits = [np.asarray(v.logits, np.float32) for v in values]
    return DecodeBatch(
        slots=np.asarray([v.slot for v in values] + device.scratch_slots(pad), np.int32),
        tables=np.stack([device.table(v.pages, pages) for v in values] + [device.table([], pages)] * pad),
        lengths=np.asarray([v.length for v in values] + [0] * pad, np.int32),
        logits=np.stack(logits + [np.zeros_like(logits[0])] * pad),
        sampling=row_sampling(sids, samplings, batch),
        adjustment=row_adjustments(samplings, [v.tokens for v in values], logits[0].shape[-1], batch),
    )
