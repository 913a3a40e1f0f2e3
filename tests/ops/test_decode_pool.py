"""One-token decode: the pool steps against `kda_step` and a NumPy conv, other slots untouched,
for the XLA form and both Pallas kernel families in interpret mode (`forced_kernels`); every
implementation's token steps (`kda_step`, `kda_pool_step`) against the float64 forward over the
whole history; the one rule of "auto" (Pallas only where lowered for a GPU); the error
for a word outside the vocabulary; accelerator lowering."""
import contextlib
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import kda as kda_ops
from k3jax.ops.kda import kda_step
from k3jax.ops.kda.decode_pool import conv_pool_step, kda_pool_step
from k3jax.ops.kda.pallas import forced_kernels
from tests.ops.numpy_kda import kda_numpy
from tests.ops.test_kda import make_gate, make_inputs, rel_err

# (implementation, Pallas family forced in interpret mode or None)
VARIANTS = {"reference": ("reference", None), "pallas-gpu": ("pallas", "gpu"), "pallas-tpu": ("pallas", "tpu")}
SLOTS = np.array([5, 0, 3])


def kernels(backend):
    """The context running ``backend``'s Pallas kernels interpreted, or none (the platform's choice)."""
    return contextlib.nullcontext() if backend is None else forced_kernels(backend)


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


@functools.partial(jax.jit, static_argnames=("implementation",), donate_argnums=0)
def kda_pool_step_donated(pool, slots, token, implementation):
    return kda_pool_step(pool, slots, **token, scale=0.2, implementation=implementation)


@pytest.mark.parametrize("variant", VARIANTS)
def test_kda_pool_step_equals_kda_step_and_leaves_other_slots_bit_identical(variant):
    implementation, backend = VARIANTS[variant]
    token = kda_token(0)
    pool = np.random.default_rng(1).standard_normal((7, 4, 16, 32)).astype(np.float32)
    with kernels(backend):
        o, new_pool = kda_pool_step_donated(jnp.asarray(pool), jnp.asarray(SLOTS), token, implementation)
    o_ref, states_ref = kda_step(**token, state=jnp.asarray(pool[SLOTS]), scale=0.2)
    assert o.dtype == jnp.bfloat16 and new_pool.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_ref, np.float32), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(new_pool[SLOTS], states_ref, rtol=1e-6, atol=1e-6)
    untouched = np.setdiff1d(np.arange(7), SLOTS)
    np.testing.assert_array_equal(new_pool[untouched], pool[untouched])


@pytest.mark.parametrize("variant", VARIANTS)
def test_repeated_pool_steps_equal_a_step_loop(variant):
    """Two sessions stepped alternately through one pool follow their own kda_step loops."""
    implementation, backend = VARIANTS[variant]
    pool = jnp.zeros((4, 4, 16, 32), jnp.float32)
    states = {2: jnp.zeros((1, 4, 16, 32)), 1: jnp.zeros((1, 4, 16, 32))}
    for step in range(3):
        slot = 2 if step % 2 == 0 else 1
        token = kda_token(10 + step, batch=1)
        with kernels(backend):
            o, pool = kda_pool_step_donated(pool, jnp.asarray([slot]), token, implementation)
        o_ref, states[slot] = kda_step(**token, state=states[slot], scale=0.2)
        np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_ref, np.float32), rtol=1e-2, atol=1e-2)
    for slot, state in states.items():
        np.testing.assert_allclose(pool[slot], state[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(pool[jnp.asarray([0, 3])], 0.0)


@functools.partial(jax.jit, static_argnames=("implementation",), donate_argnums=0)
def conv_pool_step_donated(pool, slots, x, weight, implementation):
    return conv_pool_step(pool, slots, x, weight, implementation=implementation)


@pytest.mark.parametrize("variant", VARIANTS)
def test_conv_pool_step_equals_numpy_conv(variant):
    implementation, backend = VARIANTS[variant]
    rng = np.random.default_rng(2)
    taps, channels = 4, 24
    pool = rng.standard_normal((7, taps - 1, channels)).astype(np.float32)
    x = rng.standard_normal((3, channels)).astype(np.float32)
    weight = rng.standard_normal((channels, taps)).astype(np.float32)
    with kernels(backend):
        y, new_pool = conv_pool_step_donated(jnp.asarray(pool), jnp.asarray(SLOTS), jnp.asarray(x),
                                             jnp.asarray(weight), implementation)
    window = np.concatenate([pool[SLOTS], x[:, None, :]], axis=1).astype(np.float64)   # oldest first
    np.testing.assert_allclose(y, np.einsum("bwc,cw->bc", window, weight), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(new_pool[SLOTS], window[:, 1:].astype(np.float32))
    untouched = np.setdiff1d(np.arange(7), SLOTS)
    np.testing.assert_array_equal(new_pool[untouched], pool[untouched])


STEP_VARIANTS = {**VARIANTS, "chunk": ("chunk", None), "auto": ("auto", None)}
kda_step_jit = jax.jit(kda_step, static_argnames=("scale", "implementation"))
kda_pool_step_jit = jax.jit(kda_pool_step, static_argnames=("scale", "implementation"))


@pytest.mark.parametrize("variant", STEP_VARIANTS)
def test_token_steps_of_every_implementation_equal_the_forward_over_the_history(variant):
    """`kda_step` on a contiguous state and `kda_pool_step` on rows 3, 1 of a pool, token by token,
    give the float64 forward's outputs and final state. V = 96 is split into 32-column programs by
    the GPU kernel (a 64-column block would leave columns 64-95 unwritten)."""
    implementation, backend = STEP_VARIANTS[variant]
    x = make_inputs(30, batch=2, length=5, heads=2, value_heads=4, key_dim=16, value_dim=96, regime="unbounded")
    o_ref, state_ref = kda_numpy(**x)
    inputs = {name: jnp.asarray(a, jnp.float32) for name, a in x.items()}
    rows = jnp.asarray([3, 1])
    pool = np.random.default_rng(31).standard_normal((5, 4, 16, 96)).astype(np.float32)
    pool[np.asarray(rows)] = x["initial_state"]
    state, pooled = inputs["initial_state"], jnp.asarray(pool)
    outputs, pooled_outputs = [], []
    with kernels(backend):
        for t in range(5):
            token = {name: inputs[name][:, t] for name in ("q", "k", "v", "g", "beta")}
            o, state = kda_step_jit(**token, state=state, implementation=implementation)
            o_pooled, pooled = kda_pool_step_jit(pooled, rows, **token, implementation=implementation)
            outputs.append(o)
            pooled_outputs.append(o_pooled)
    assert rel_err(jnp.stack(outputs, axis=1), o_ref) <= 1e-5
    assert rel_err(state, state_ref) <= 1e-5
    assert rel_err(jnp.stack(pooled_outputs, axis=1), o_ref) <= 1e-5
    assert rel_err(pooled[rows], state_ref) <= 1e-5
    np.testing.assert_array_equal(np.asarray(pooled)[[0, 2, 4]], pool[[0, 2, 4]])


@pytest.mark.parametrize("default_backend", ["cpu", "tpu", "gpu"])
def test_auto_runs_pallas_only_where_lowered_for_a_gpu(monkeypatch, default_backend):
    """The one rule of "auto" on all three paths: lowered for CUDA it is the Pallas kernels (a
    pallas_call in the program) and for a CPU or TPU the XLA forms, decided at lowering
    (`jax.lax.platform_dependent`); where JAX's default backend is a CPU (this machine) or a TPU
    it is the XLA forms without tracing Pallas at all."""
    monkeypatch.setattr(jax, "default_backend", lambda: default_backend)
    spec = jax.ShapeDtypeStruct
    token = (spec((2, 2, 16), jnp.float32),) * 2 + (spec((2, 4, 16), jnp.float32), spec((2, 4, 16), jnp.float32),
                                                   spec((2, 4), jnp.float32))
    paths = {
        "forward": (lambda *a: kda_ops.kda(*a), tuple(spec((2, 16, *x.shape[1:]), x.dtype) for x in token)),
        "one-token decode": (lambda *a: kda_step(*a), (*token, spec((2, 4, 16, 16), jnp.float32))),
        "pooled decode": (lambda *a: kda_pool_step(*a), (spec((5, 4, 16, 16), jnp.float32), spec((2,), jnp.int32),
                                                          *token)),
        "pooled conv": (lambda *a: conv_pool_step(*a), (spec((5, 3, 8), jnp.float32), spec((2,), jnp.int32),
                                                        spec((2, 8), jnp.float32), spec((8, 4), jnp.float32))),
    }
    for path, (fn, args) in paths.items():
        for platform in ("cpu", "cuda", "tpu"):
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text(debug_info=True)
            expected = default_backend == "gpu" and platform == "cuda"
            assert ("pallas_call" in text) == expected, (path, platform)


def test_a_word_outside_the_vocabulary_is_one_error_naming_the_path():
    token = kda_token(3)
    state = jnp.zeros((3, 4, 16, 32))
    sequence = {name: a[:, None] for name, a in token.items()}
    calls = {
        "forward": lambda: kda_ops.kda(**sequence, implementation="xla"),
        "one-token decode": lambda: kda_step(**token, state=state, implementation="xla"),
        "pooled decode": lambda: kda_pool_step(jnp.zeros((7, 4, 16, 32)), jnp.asarray(SLOTS), **token,
                                               implementation="xla"),
    }
    for path, call in calls.items():
        message = (f"KDA {path}: implementation must be one of ('auto', 'reference', 'chunk', 'pallas') "
                   f"or None, got 'xla'")
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            call()
    with pytest.raises(ValueError, match="^KDA pooled decode: implementation must be one of .* got 'xla'$"):
        conv_pool_step(jnp.zeros((7, 3, 24)), jnp.asarray(SLOTS), jnp.zeros((3, 24)), jnp.zeros((24, 4)),
                       implementation="xla")


def test_bad_shapes_and_implementation_raise_value_error():
    token = kda_token(3)
    with pytest.raises(ValueError, match="must agree with pool"):
        kda_pool_step(jnp.zeros((7, 3, 16, 32)), jnp.asarray(SLOTS), **token)
    with pytest.raises(ValueError, match="implementation must be one of"):
        kda_pool_step(jnp.zeros((7, 4, 16, 32)), jnp.asarray(SLOTS), **token, implementation="cuda")
    with pytest.raises(ValueError, match="pool must be"):
        conv_pool_step(jnp.zeros((7, 2, 24)), jnp.asarray(SLOTS), jnp.zeros((3, 24)), jnp.zeros((24, 4)))
    with pytest.raises(ValueError, match="backend must be one of"):
        forced_kernels("cuda")


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
