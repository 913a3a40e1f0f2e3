"""Memory-bank decode: the pool steps against `kda_step` and a NumPy conv, other slots untouched,
for the XLA path and both Pallas kernel families in interpret mode, plus accelerator lowering."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.kda import kda_step
from k3jax.ops.kda.decode_pool import conv_pool_step, kda_pool_step
from tests.ops.test_kda import make_gate

VARIANTS = [dict(implementation="xla"),
            dict(implementation="pallas", backend="gpu", interpret=True),
            dict(implementation="pallas", backend="tpu", interpret=True)]
VARIANT_IDS = ["xla", "pallas-gpu", "pallas-tpu"]
SLOTS = np.array([5, 0, 3])


def kda_token(seed, batch=3, heads=2, value_heads=4, key_dim=16, value_dim=32):
    rng = np.random.default_rng(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    return dict(
        q=jnp.asarray(unit(rng.standard_normal((batch, heads, key_dim))), jnp.float32),
        k=jnp.asarray(unit(rng.standard_normal((batch, heads, key_dim))), jnp.float32),
        v=jnp.asarray(rng.standard_normal((batch, value_heads, value_dim)), jnp.bfloat16),
        g=jnp.asarray(make_gate(rng, (batch, value_heads, key_dim), "unbounded"), jnp.float32),
        beta=jnp.asarray(rng.uniform(0.05, 0.95, (batch, value_heads)), jnp.float32),
    )


@functools.partial(jax.jit, static_argnames=("implementation", "backend", "interpret"), donate_argnums=0)
def kda_pool_step_donated(pool, slots, token, **variant):
    return kda_pool_step(pool, slots, **token, scale=0.2, **variant)


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_kda_pool_step_equals_kda_step_and_leaves_other_slots_bit_identical(variant):
    token = kda_token(0)
    pool = np.random.default_rng(1).standard_normal((7, 4, 16, 32)).astype(np.float32)
    o, new_pool = kda_pool_step_donated(jnp.asarray(pool), jnp.asarray(SLOTS), token, **variant)
    o_ref, states_ref = kda_step(**token, state=jnp.asarray(pool[SLOTS]), scale=0.2)
    assert o.dtype == jnp.bfloat16 and new_pool.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_ref, np.float32), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(new_pool[SLOTS], states_ref, rtol=1e-6, atol=1e-6)
    untouched = np.setdiff1d(np.arange(7), SLOTS)
    np.testing.assert_array_equal(new_pool[untouched], pool[untouched])


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_repeated_pool_steps_equal_a_step_loop(variant):
    """Two sessions stepped alternately through one pool follow their own kda_step loops."""
    pool = jnp.zeros((4, 4, 16, 32), jnp.float32)
    states = {2: jnp.zeros((1, 4, 16, 32)), 1: jnp.zeros((1, 4, 16, 32))}
    for step in range(3):
        slot = 2 if step % 2 == 0 else 1
        token = kda_token(10 + step, batch=1)
        o, pool = kda_pool_step_donated(pool, jnp.asarray([slot]), token, **variant)
        o_ref, states[slot] = kda_step(**token, state=states[slot], scale=0.2)
        np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_ref, np.float32), rtol=1e-2, atol=1e-2)
    for slot, state in states.items():
        np.testing.assert_allclose(pool[slot], state[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(pool[jnp.asarray([0, 3])], 0.0)


@functools.partial(jax.jit, static_argnames=("implementation", "backend", "interpret"), donate_argnums=0)
def conv_pool_step_donated(pool, slots, x, weight, **variant):
    return conv_pool_step(pool, slots, x, weight, **variant)


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_conv_pool_step_equals_numpy_conv(variant):
    rng = np.random.default_rng(2)
    taps, channels = 4, 24
    pool = rng.standard_normal((7, taps - 1, channels)).astype(np.float32)
    x = rng.standard_normal((3, channels)).astype(np.float32)
    weight = rng.standard_normal((channels, taps)).astype(np.float32)
    y, new_pool = conv_pool_step_donated(jnp.asarray(pool), jnp.asarray(SLOTS), jnp.asarray(x),
                                         jnp.asarray(weight), **variant)
    window = np.concatenate([pool[SLOTS], x[:, None, :]], axis=1).astype(np.float64)   # oldest first
    np.testing.assert_allclose(y, np.einsum("bwc,cw->bc", window, weight), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(new_pool[SLOTS], window[:, 1:].astype(np.float32))
    untouched = np.setdiff1d(np.arange(7), SLOTS)
    np.testing.assert_array_equal(new_pool[untouched], pool[untouched])


def test_bad_shapes_and_implementation_raise_value_error():
    token = kda_token(3)
    with pytest.raises(ValueError, match="must agree with pool"):
        kda_pool_step(jnp.zeros((7, 3, 16, 32)), jnp.asarray(SLOTS), **token)
    with pytest.raises(ValueError, match="implementation must be one of"):
        kda_pool_step(jnp.zeros((7, 4, 16, 32)), jnp.asarray(SLOTS), **token, implementation="cuda")
    with pytest.raises(ValueError, match="pool must be"):
        conv_pool_step(jnp.zeros((7, 2, 24)), jnp.asarray(SLOTS), jnp.zeros((3, 24)), jnp.zeros((24, 4)))


@pytest.mark.parametrize("platform, kernel_call", [("tpu", "tpu_custom_call"), ("cuda", "__gpu$xla.gpu.triton")])
def test_pool_steps_lower_for_accelerators(platform, kernel_call):
    spec = jax.ShapeDtypeStruct
    kda_args = (spec((64, 8, 128, 128), jnp.float32), spec((16,), jnp.int32), spec((16, 4, 128), jnp.bfloat16),
                spec((16, 4, 128), jnp.bfloat16), spec((16, 8, 128), jnp.bfloat16), spec((16, 8, 128), jnp.float32),
                spec((16, 8), jnp.float32))
    conv_args = (spec((64, 3, 3072), jnp.bfloat16), spec((16,), jnp.int32), spec((16, 3072), jnp.bfloat16),
                 spec((3072, 4), jnp.float32))
    for fn, args in ((functools.partial(kda_pool_step, implementation="pallas"), kda_args),
                     (functools.partial(conv_pool_step, implementation="pallas"), conv_args)):
        text = jax.jit(fn, donate_argnums=0).trace(*args).lower(lowering_platforms=(platform,)).as_text()
        assert kernel_call in text
