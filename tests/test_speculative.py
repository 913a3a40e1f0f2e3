"""Speculative decoding's host-side rules against independent computations: the sampling
distribution against a plain-Python ranking, the acceptance rule's output distribution against
the target's p (every emitted token distributed as p, by Monte Carlo at 5 sigma), prompt lookup and
the adaptive draft length on hand-made cases."""
import numpy as np
import pytest

from k3jax.config import ConfigError, SpeculationConfig
from k3jax.sampling import sampling_probs
from k3jax.speculative import DRAW, UNIFORM, AdaptiveK, accepted_drafts, draw, position_rng, prompt_lookup, residual


def ranked_reference(logits, temperature, top_k, top_p):
    """p(z) by hand: rank (ties to the lower id), keep top-k, softmax at ``temperature``, keep the
    most likely tokens until their mass reaches top-p (the top one always)."""
    order = sorted(range(len(logits)), key=lambda i: (-logits[i], i))
    kept = order[: top_k or len(order)]
    weights = {i: np.exp((logits[i] - logits[order[0]]) / temperature) for i in kept}
    total = sum(weights.values())
    chosen, mass = [], 0.0
    for i in kept:
        if top_p is not None and chosen and mass >= top_p:
            break
        chosen.append(i)
        mass += weights[i] / total
    probs = np.zeros(len(logits))
    for i in chosen:
        probs[i] = weights[i]
    return probs / probs.sum()


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, None, None), (0.7, 3, None), (1.3, None, 0.8),
                                                        (0.5, 5, 0.6), (2.0, 1, None)])
def test_sampling_probs_equal_a_plain_ranking(temperature, top_k, top_p):
    logits = np.random.default_rng(0).normal(size=12).astype(np.float32) * 2
    logits[7] = logits[3]                       # a tie in the ranking
    np.testing.assert_allclose(sampling_probs(logits, temperature, top_k, top_p),
                               ranked_reference(logits.astype(np.float64), temperature, top_k, top_p), atol=1e-12)


def test_greedy_puts_all_mass_on_the_first_argmax():
    probs = sampling_probs(np.asarray([0.0, 3.0, 3.0, 1.0]), 0.0, None, None)
    np.testing.assert_array_equal(probs, [0, 1, 0, 0])


@pytest.mark.parametrize("draft", [0, 2, 4])
def test_every_emitted_token_is_distributed_as_the_target(draft):
    """One position: accept draft d with probability p(d), else draw from the residual. The
    empirical distribution of the emitted token equals p within 5 standard errors."""
    p = np.asarray([0.05, 0.4, 0.25, 0.2, 0.1])
    trials, counts = 40_000, np.zeros(p.size)
    for trial in range(trials):
        uniform = position_rng(trial, 0, 0, UNIFORM).random()
        if accepted_drafts([p], [draft], [uniform]) == 1:
            counts[draft] += 1
        else:
            counts[draw(residual(p, draft), position_rng(trial, 0, 0, DRAW))] += 1
    error = np.sqrt(p * (1 - p) / trials)
    assert np.all(np.abs(counts / trials - p) < 5 * error), (counts / trials, p)


def test_acceptance_stops_at_the_first_rejection_and_after_a_stop_id():
    probs = [np.eye(4)[1], np.eye(4)[2], np.eye(4)[3]]      # greedy: the target wants 1, 2, 3
    assert accepted_drafts(probs, [1, 2, 3], [0.5] * 3) == 3
    assert accepted_drafts(probs, [1, 0, 3], [0.5] * 3) == 1
    assert accepted_drafts(probs, [0, 2, 3], [0.5] * 3) == 0
    assert accepted_drafts(probs, [1, 2, 3], [0.5] * 3, stop_ids=frozenset({2})) == 2


def test_residual_removes_the_rejected_token():
    np.testing.assert_allclose(residual(np.asarray([0.5, 0.25, 0.25]), 0), [0, 0.5, 0.5])
    np.testing.assert_array_equal(residual(np.asarray([1.0, 0.0]), 0), [1.0, 0.0])   # nothing left: p itself


def test_draw_follows_the_cumulative_mass():
    probs = np.asarray([0.0, 0.3, 0.0, 0.7])
    tokens = [draw(probs, position_rng(seed, 1, 2, DRAW)) for seed in range(2000)]
    assert set(tokens) == {1, 3}
    assert abs(np.mean(np.asarray(tokens) == 3) - 0.7) < 0.05


def test_prompt_lookup_copies_after_the_latest_longest_match():
    assert prompt_lookup([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3], k=2) == [5, 1]     # latest 3-gram match
    assert prompt_lookup([7, 8, 9, 7, 8], k=4) == [9, 7, 8]                    # 2-gram; runs into the end
    assert prompt_lookup([4, 5, 6, 9, 6], k=3, max_ngram=3) == [9, 6]          # only the last token recurs
    assert prompt_lookup([1, 2, 3, 4], k=3) == []                              # nothing recurs
    assert prompt_lookup([4, 5, 6, 9, 6], k=3, min_ngram=2) == []
    assert prompt_lookup([5], k=3) == []


def test_adaptive_k_grows_on_full_acceptance_and_pauses_below_the_floor():
    adaptive = AdaptiveK(4)
    assert adaptive.next() == 4
    adaptive.update(4, 1)
    assert adaptive.next() == 2                       # accepted + 1
    adaptive.update(2, 2)
    assert adaptive.next() == 3                       # all accepted: one more
    for _ in range(8):
        adaptive.update(adaptive.next() or 1, 0)
    assert adaptive.rate < adaptive.floor
    probes = np.asarray([adaptive.next() for _ in range(16)])          # paused, one probe every 8 rounds
    assert set(probes) == {0, 1} and probes.sum() == 2 and np.diff(np.flatnonzero(probes)).tolist() == [8]


@pytest.mark.parametrize("arguments, key, message", [
    (dict(prompt_lookup=2, draft="runs/small"), "draft", "not both"), (dict(prompt_lookup=0), "prompt_lookup", "must be positive"),
    (dict(prompt_lookup=2, k=0), "k", "must be positive"), (dict(draft=" "), "draft", "must name a run directory")])
def test_bad_speculation_is_a_one_line_error(arguments, key, message):
    with pytest.raises(ConfigError, match=message) as error:
        SpeculationConfig(**arguments)
    assert error.value.key == key and "\n" not in str(error.value)


def test_speculation_is_enabled_by_a_draft_source_only():
    assert not SpeculationConfig().enabled and not SpeculationConfig(k=2, rollback="replay").enabled
    assert SpeculationConfig(prompt_lookup=1).enabled and SpeculationConfig(draft="runs/small").enabled
