"""The sampling rules (`k3jax.sampling`): the host distribution against a float64 NumPy reference
written here from the rules, and the compiled sampler's draws against that distribution's support
and masses (greedy = first argmax; top-k / top-p supports with tied logits)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.sampling import filtered_ranking, sample_logits, sampling_probs


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
