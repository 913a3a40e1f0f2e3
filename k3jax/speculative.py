"""Speculative decoding's host-side rules: drafts from prompt lookup, the acceptance rule, the
adaptive draft length and the counters. The device side (verify, rollback, replay over the
session pools) is `k3jax.sessions.speculate`.

A round of one sequence whose fed history is x_1..x_n and whose logits z_n predict the next token:

    t_0 ~ p(z_n)                           (from the residual r, see below, after a rejection)
    d_1..d_k = draft(x_1..x_n, t_0)        (deterministic proposals: q = one-hot)
    z'_0..z'_k = target(t_0, d_1..d_k)     (one verify call; z'_i predicts the token after d_i)
    accept d_{i+1} while u_i < p(z'_i)[d_{i+1}]      (greedy: while d_{i+1} = argmax z'_i)

p(z) is the target's sampling distribution: softmax(z / temperature) restricted to the top-k tokens
and then to the smallest most likely set whose mass reaches top-p (the top token always stays), as
`k3jax.sampling.sample_logits` (the rules' one definition: `k3jax.sampling.filtered_ranking`;
p is `k3jax.sampling.sampling_probs`); temperature 0 puts all mass on argmax z. With j drafts accepted
the round emits t_0, d_1..d_j and the sequence is left as if only those had been fed. After a
rejection of d at z'_j, the next round's t_0 is drawn from the residual r = p(z'_j) with d's mass
removed and renormalised. Every emitted token is then distributed exactly as p: P(d) =
p(d) (accepted), and P(x != d) = (1 - p(d)) p(x) / (1 - p(d)) = p(x) (rejected, then drawn from r).

Random numbers come from numpy generators seeded by (seed, stream, position, use), so a
sequence's samples depend on these only, not on the batch or the round it ran in.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

UNIFORM, DRAW = 0, 1        # the two uses of a position's random numbers


def residual(probs: np.ndarray, rejected: int) -> np.ndarray:
    """r: ``probs`` without the rejected draft's mass, renormalised (``probs`` itself when that
    leaves nothing, which a rejection of probability 1 - p(d) = 0 cannot produce)."""
    rest = probs.copy()
    rest[rejected] = 0.0
    total = rest.sum()
    return probs if total <= 0 else rest / total


def position_rng(seed: int, stream: int, position: int, use: int) -> np.random.Generator:
    """The random numbers of one sequence's token at ``position`` for one ``use``."""
    return np.random.default_rng([seed % 2**32, stream % 2**32, position, use])


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """A token from ``probs`` (float64, sums to 1): the first id whose cumulative mass exceeds u."""
    return int(min(np.searchsorted(np.cumsum(probs), rng.random(), side="right"), probs.size - 1))


def accepted_drafts(probs: Sequence[np.ndarray], drafts: Sequence[int], uniforms: Sequence[float],
                    stop_ids: frozenset = frozenset()) -> int:
    """How many of ``drafts`` are accepted: d_{i+1} while ``uniforms[i] < probs[i][d_{i+1}]``
    (``probs[i]`` = p(z'_i)); none after a stop id."""
    for index, token in enumerate(drafts):
        if not uniforms[index] < probs[index][token]:
            return index
        if token in stop_ids:
            return index + 1
    return len(drafts)


def prompt_lookup(tokens: Sequence[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to ``k`` drafts copied from the history ``tokens``: for n from ``max_ngram`` down to
    ``min_ngram``, the tokens after the latest earlier occurrence of the last n tokens (nothing
    when no such n-gram recurs)."""
    history = np.asarray(tokens, np.int64)
    length = history.size
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = history[length - n:]
        windows = np.lib.stride_tricks.sliding_window_view(history[: length - 1], n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if starts.size:
            start = int(starts[-1]) + n
            return [int(t) for t in history[start : start + k]]
    return []


@dataclasses.dataclass
class AdaptiveK:
    """A sequence's draft length: up by one after a round that accepted every draft, down to
    accepted + 1 after a rejection, in [1, ``maximum``]; 0 (no drafting: plain steps) while the
    acceptance rate of the last rounds (an exponential average, weight ``decay``) is below
    ``floor``, trying again with one draft every ``retry_every`` rounds."""

    maximum: int
    floor: float = 0.1
    decay: float = 0.7
    retry_every: int = 8
    k: int = 0
    rate: float = 1.0
    idle: int = 0

    def __post_init__(self):
        self.k = self.maximum

    def next(self) -> int:
        """The draft length of the next round."""
        if self.rate >= self.floor:
            return self.k
        self.idle += 1
        return 1 if self.idle % self.retry_every == 0 else 0

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.rate = self.decay * self.rate + (1 - self.decay) * accepted / drafted
        self.k = min(self.maximum, self.k + 1) if accepted == drafted else max(1, accepted + 1)


@dataclasses.dataclass
class SpeculationStats:
    """Counters over rounds: ``rounds`` session-rounds (a round of B sessions counts B),
    ``batched_rounds`` calls of the round, ``drafted`` / ``accepted`` draft tokens, ``emitted``
    tokens (accepted drafts plus each round's first token), seconds spent drafting and verifying
    (verify includes the rollbacks and replays)."""

    rounds: int = 0
    batched_rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Accepted drafts per session-round."""
        return self.accepted / self.rounds if self.rounds else 0.0

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "acceptance_rate": self.acceptance_rate,
                "mean_accepted_length": self.mean_accepted_length}
