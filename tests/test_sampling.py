"""The sampling rules (`k3jax.sampling`): the host distribution against a float64 NumPy reference
written here from the rules, and the compiled sampler's draws against that distribution's support
and masses (greedy = first argmax; top-k / top-p supports with tied logits)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.sampling import (Adjustment, adjusted_logits, filtered_ranking, pack_bits, sample_logits, sampling_probs,
                            unpack_bits)


def reference_probs(logits, temperature, top_k, top_p):
    """p(z) in float64 from the rules: rank by -logit (ties to the lower id, a stable sort), scale
    by 1 / temperature, keep the top k, softmax (shifted by the top logit), keep the ranks whose
    preceding mass is below top_p (the top one always), renormalise over those."""
    logits = np.asarray(logits, np.float64)
    if temperature == 0:
        return np.eye(logits.size)[int(np.argmax(logits))]
    order = np.argsort(-logits, kind="stable")
    scaled = logits[order] / temperature
    kept = np.arange(logits.size) < (top_k or logits.size)
    weights = np.exp(np.where(kept, scaled - scaled[0], -np.inf))
    mass = weights / weights.sum()
    if top_p is not None and top_p < 1:
        kept &= np.cumsum(mass) - mass < top_p
        mass = np.where(kept, mass, 0.0)
        mass = mass / mass.sum()
    probs = np.zeros(logits.size)
    probs[order] = mass
    return probs


SETTINGS = [(1.0, None, None), (0.7, 3, None), (1.3, None, 0.8), (0.5, 5, 0.6), (2.0, 1, None), (0.9, None, 1.0),
            (1.0, 40, 0.95), (0.3, None, 0.1), (0.0, None, None), (0.0, 2, 0.5)]


def tied_logits(seed: int, size: int) -> np.ndarray:
    logits = np.round(np.random.default_rng(seed).normal(size=size) * 2, 1).astype(np.float32)
    logits[[3, 7, size - 1]] = logits[0]                       # ties in the ranking
    return logits


@pytest.mark.parametrize("temperature, top_k, top_p", SETTINGS)
def test_host_probs_equal_the_reference_bit_for_bit(temperature, top_k, top_p):
    for seed in range(20):
        logits = tied_logits(seed, 10 + 7 * seed)
        np.testing.assert_array_equal(sampling_probs(logits, temperature, top_k, top_p),
                                      reference_probs(logits, temperature, top_k, top_p))


def test_the_rules_run_in_either_namespace():
    """`filtered_ranking` in jax.numpy and NumPy ranks alike and keeps the same ranks."""
    logits = tied_logits(1, 33)
    host = filtered_ranking(logits.astype(np.float64), 0.8, 6, 0.9, xp=np)
    device = filtered_ranking(jnp.asarray(logits), jnp.float32(0.8), jnp.int32(6), jnp.float32(0.9), xp=jnp)
    np.testing.assert_array_equal(host.order, device.order)
    np.testing.assert_array_equal(host.keep, device.keep)
    assert host.keep[0] and host.keep.sum() <= 6


def compiled_draws(logits, temperature, top_k, top_p, count: int, seed: int = 0) -> np.ndarray:
    rows = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (count, logits.size))
    return np.asarray(jax.jit(sample_logits)(rows, jax.random.key(seed), jnp.float32(temperature),
                                             jnp.int32(top_k or 0), jnp.float32(1.0 if top_p is None else top_p)))


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.0, None, None), (0.0, 3, 0.2), (1.0, 3, None),
                                                        (0.8, 5, 0.7), (1.2, None, 0.5), (1.0, 1, None)])
def test_compiled_draws_follow_the_host_probs(temperature, top_k, top_p):
    """Greedy draws are the first argmax; sampled ones land exactly on the host support (ties at the
    top-k edge go to the lower id in both) with each token's share within 5 standard errors."""
    count = 4096
    for seed in range(3):
        logits = tied_logits(seed, 24)
        probs = sampling_probs(logits, temperature, top_k, top_p)
        draws = compiled_draws(logits, temperature, top_k, top_p, count, seed)
        if temperature == 0:
            assert set(draws) == {int(np.argmax(logits))} == set(np.flatnonzero(probs))
            continue
        assert set(draws) == set(np.flatnonzero(probs))
        shares = np.bincount(draws, minlength=logits.size) / count
        assert np.all(np.abs(shares - probs) <= 5 * np.sqrt(probs * (1 - probs) / count) + 1e-12), (shares, probs)


# -------------------------------------------------------------------- logits options (`adjusted_logits`)
def reference_adjusted(logits, history, generated_from, logit_bias, presence, frequency, repetition, allowed):
    """The options written out token by token in float64: the repetition penalty over the history
    (HF / vLLM: divide a positive logit by r, multiply a negative one), then OpenAI's
    ``- frequency * count - presence * [count > 0]`` over the generated tokens and ``+ logit_bias``,
    then -inf for the tokens the grammar forbids."""
    logits = np.asarray(logits, np.float64).copy()
    generated = list(history[generated_from:])
    for token in range(logits.size):
        if token in history:
            logits[token] = logits[token] / repetition if logits[token] > 0 else logits[token] * repetition
        count = generated.count(token)
        logits[token] -= frequency * count + presence * (count > 0)
        logits[token] += dict(logit_bias).get(token, 0.0)
        if not allowed[token]:
            logits[token] = -np.inf
    return logits


def reference_min_p(probs, min_p):
    """min-p over a distribution: keep p_v >= min_p * max p, renormalise."""
    kept = np.where(probs >= min_p * probs.max(), probs, 0.0)
    return kept / kept.sum()


OPTIONS = [dict(logit_bias=((3, 2.5), (7, -100.0)), presence=0.5, frequency=0.3, repetition=1.3),
           dict(logit_bias=(), presence=-1.0, frequency=-0.5, repetition=0.8),
           dict(logit_bias=((0, 1.0),), presence=0.0, frequency=0.0, repetition=1.0)]


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("min_p", [0.0, 0.2])
def test_adjusted_probs_equal_the_reference(options, min_p):
    """`row_adjustment` + `sampling_probs` (the host path, float64) against the formulas written out,
    and the compiled sampler's greedy draw against the reference's argmax."""
    from k3jax.sessions.batching import Sampling, row_adjustment

    rng = np.random.default_rng(0)
    for seed in range(5):
        vocab = 40 + seed
        logits = rng.normal(size=vocab).astype(np.float32) * 2
        history = list(rng.integers(0, vocab, size=12))
        allowed = rng.random(vocab) < 0.7
        allowed[int(np.argmax(logits))] = seed % 2 == 0
        constraint = type("Mask", (), {"allowed": lambda self, words: pack_bits(allowed)})()
        rule = Sampling(1.0, min_p=min_p, logit_bias=options["logit_bias"], presence_penalty=options["presence"],
                        frequency_penalty=options["frequency"], repetition_penalty=options["repetition"],
                        generated_from=5, constraint=constraint)
        adjustment = row_adjustment(rule, history, vocab)
        expected_logits = reference_adjusted(logits, history, 5, options["logit_bias"], options["presence"],
                                             options["frequency"], options["repetition"], allowed)
        np.testing.assert_allclose(adjusted_logits(logits.astype(np.float64), adjustment), expected_logits, rtol=1e-12)
        weights = np.exp(expected_logits - expected_logits.max())
        expected = reference_min_p(weights / weights.sum(), min_p)
        np.testing.assert_allclose(sampling_probs(logits, 1.0, None, None, adjustment), expected, rtol=1e-9, atol=1e-15)
        greedy = sampling_probs(logits, 0.0, None, None, adjustment)
        assert greedy[int(np.argmax(expected_logits))] == 1.0
        device = Adjustment(*(jnp.asarray(np.asarray(a), jnp.float32 if np.asarray(a).dtype == np.float64 else None)[None]
                              for a in adjustment))
        token = jax.jit(lambda z, a: sample_logits(adjusted_logits(z, a, xp=jnp), jax.random.key(0), 0.0, 0, 1.0,
                                                   a.min_p[:, None]))(jnp.asarray(logits)[None], device)
        assert int(token[0]) == int(np.argmax(expected_logits))


def test_bits_pack_and_unpack_alike_in_either_namespace():
    flags = np.random.default_rng(1).random((3, 70)) < 0.5
    packed = pack_bits(flags)
    assert packed.shape == (3, 3) and packed.dtype == np.int32
    np.testing.assert_array_equal(unpack_bits(packed, 70), flags)
    np.testing.assert_array_equal(np.asarray(unpack_bits(jnp.asarray(packed), 70, xp=jnp)), flags)
