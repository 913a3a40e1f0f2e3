"""Custom-VJP ops inside a differentiated `lax.scan` (the model's scanned depth; k3jax.ops.residuals):
gradients against independent references, and the compiled backward keeps no per-block
intermediates (for attention: no score matrix)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.attention import attention
from k3jax.ops.kda import kda
from tests.helpers import rel_err
from tests.ops.test_attention import inputs, numpy_attention
from tests.ops.test_kda import as_f32, make_inputs


def scanned(loss):
    """``loss`` evaluated as the body of a two-step scan whose carry scales the first argument (step 2
    sees it times 1 + step 1's loss * 0, i.e. unchanged): the structure of the model's depth scan."""
    def wrapped(first, *rest):
        def body(carry, _):
            value = loss(first * carry, *rest)
            return carry + 0.0 * value, value
        return jax.lax.scan(body, jnp.ones((), first.dtype), None, length=2)[1].sum() / 2
    return wrapped


def temp_bytes(fn, *args) -> int:
    return jax.jit(jax.grad(fn, argnums=tuple(range(len(args))))).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_attention_inside_a_scan_matches_numpy_and_stores_no_score_matrix():
    q, k, v, d_o = inputs(2, 19, 19, 4, 2, 6, 5, seed=3)
    segments = np.array([[0] * 8 + [1] * 11, [3] * 19], np.int32)
    positions = np.broadcast_to(np.arange(19), (2, 19))

    def loss(q, k, v, d_o, segments, block):
        o = attention(q, k, v, scale=0.4, query_segments=segments, key_segments=segments, implementation="xla",
                      block_size=block)
        return jnp.sum(o * d_o)

    grads = jax.jit(jax.grad(scanned(lambda q, k, v: loss(q, k, v, d_o, segments, 4)), argnums=(0, 1, 2)))(q, k, v)
    for got, want in zip(grads, numpy_attention(q, k, v, 0.4, positions, positions, segments, segments, d_o)[1:]):
        assert rel_err(got, want) <= 1e-5

    length, heads = 1024, 2                       # 8 x 8 blocks of 128; the score matrix is 8 MiB
    q, k, v, d_o = (jnp.asarray(x) for x in inputs(1, length, length, heads, heads, 8, 8, seed=4))
    one_doc = jnp.zeros((1, length), jnp.int32)
    score_matrix = heads * length * length * 4
    assert temp_bytes(scanned(lambda q, k, v: loss(q, k, v, d_o, one_doc, 128)), q, k, v) < score_matrix / 4


@pytest.mark.slow
@pytest.mark.parametrize("implementation, length", [("chunk", 2048), ("pallas", 512)])
def test_kda_inside_a_scan_matches_the_reference_and_keeps_its_standalone_memory(implementation, length):
    """"chunk" needs `k3jax.ops.residuals` (without it, 8x its standalone temporaries); the Pallas
    kernels (interpreted here) are one primitive each, whose insides linearisation never sees."""
    x = as_f32(make_inputs(5, batch=1, length=96, heads=2, value_heads=2))
    names = ("q", "k", "v", "g", "beta")
    cotangent = jnp.asarray(np.random.default_rng(6).standard_normal((1, 96, 2, 8)), jnp.float32)
    segments = jnp.asarray(np.repeat([[1, 2]], 48, axis=1))

    def loss(implementation, q, k, v, g, beta):
        o, _ = kda(q, k, v, g, beta, segment_ids=segments, chunk_size=32, implementation=implementation)
        return jnp.sum(o * cotangent)

    got = jax.grad(scanned(lambda *a: loss(implementation, *a)), argnums=tuple(range(5)))(*(x[n] for n in names))
    want = jax.grad(lambda *a: loss("reference", *a), argnums=tuple(range(5)))(*(x[n] for n in names))
    for a, b in zip(got, want):
        assert rel_err(a, b) <= 1e-4

    y = as_f32(make_inputs(7, batch=1, length=length, heads=2, value_heads=2, key_dim=32, value_dim=32))
    cotangent = jnp.ones((1, length, 2, 32))
    segments = jnp.ones((1, length), jnp.int32)
    args = [y[n] for n in names]
    alone = temp_bytes(lambda *a: loss(implementation, *a), *args)
    assert temp_bytes(scanned(lambda *a: loss(implementation, *a)), *args) < 4 * alone
