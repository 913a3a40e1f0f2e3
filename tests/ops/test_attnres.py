"""Attention Residuals' Mix against float64 NumPy (SPEC §3)."""
import jax
import jax.numpy as jnp
import numpy as np

from k3jax.ops.attnres import append_source, attnres_mix
from tests import numpy_reference as ref

mix = jax.jit(attnres_mix, static_argnames="eps")


def test_mix_matches_numpy_and_ignores_unfilled_sources():
    rng = np.random.default_rng(0)
    sources = rng.standard_normal((4, 2, 3, 16)) * rng.uniform(0.1, 5.0, (4, 1, 1, 1))
    partial, query, gain = rng.standard_normal((2, 3, 16)), rng.standard_normal(16), rng.uniform(0.5, 1.5, 16)
    buffer = sources.copy()
    buffer[3] = 1e3  # slot 3 is not filled (count = 3) and must not matter
    out = mix(*(jnp.asarray(a, jnp.float32) for a in (partial, buffer)), jnp.int32(3),
              jnp.asarray(query, jnp.float32), jnp.asarray(gain, jnp.float32), eps=1e-5)
    assert out.dtype == jnp.float32
    expected = ref.attnres_mix(partial, list(sources[:3]), query, gain, 1e-5)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_zero_query_is_the_mean_and_append_fills_the_next_slot():
    rng = np.random.default_rng(1)
    sources, count = jnp.zeros((3, 1, 2, 4)), jnp.int32(0)
    values = [jnp.asarray(rng.standard_normal((1, 2, 4)), jnp.float32) for _ in range(2)]
    for value in values:
        sources, count = append_source(sources, count, value)
    assert int(count) == 2
    partial = jnp.asarray(rng.standard_normal((1, 2, 4)), jnp.float32)
    out = attnres_mix(partial, sources, count, jnp.zeros(4), jnp.ones(4))
    np.testing.assert_allclose(out, (values[0] + values[1] + partial) / 3, rtol=1e-6, atol=1e-6)
