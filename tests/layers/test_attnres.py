"""The AttnRes pair and residual stream (SPEC §3): zero pseudo-queries, unit key gains, block closing."""
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.layers.attnres import AttnRes, ResidualStream
from tests import numpy_reference as ref


def test_fresh_pair_mixes_a_plain_mean_and_closing_a_block_appends_the_partial():
    pair = AttnRes(8, rngs=nnx.Rngs(0))
    assert not pair.query[...].any() and np.all(pair.key_norm[...] == 1.0)
    rng = np.random.default_rng(0)
    embedding, block_sum = (jnp.asarray(rng.standard_normal((2, 3, 8)), jnp.float32) for _ in range(2))
    stream = ResidualStream.start(embedding, num_sources=3)
    assert int(stream.count) == 0 and stream.sources.shape == (3, 2, 3, 8)
    stream = stream.close_block()._replace(partial=block_sum)
    assert int(stream.count) == 1
    np.testing.assert_allclose(pair(stream), (embedding + block_sum) / 2, rtol=1e-6, atol=1e-6)

    pair.query[...] = jnp.asarray(rng.standard_normal(8), jnp.float32)
    pair.key_norm[...] = jnp.asarray(rng.uniform(0.5, 2.0, 8), jnp.float32)
    expected = ref.attnres_mix(block_sum, [embedding], pair.query[...], pair.key_norm[...], 1e-5)
    np.testing.assert_allclose(pair(stream), expected, rtol=1e-5, atol=1e-6)


def test_prenorm_stream_has_no_sources():
    stream = ResidualStream.start(jnp.ones((1, 2, 4), jnp.bfloat16), num_sources=None)
    assert stream.sources is None and stream.partial.dtype == jnp.float32
