"""KDA Pallas kernels in interpret mode against the float64 NumPy oracle and the reference's
gradients, plus lowering for TPU (Mosaic) and CUDA (Triton) from this CPU-only jaxlib.

On CPU, ``implementation="pallas"`` runs the GPU (Triton) kernels in interpret mode; the TPU
(Mosaic) kernels run under ``forced_kernels("tpu")`` (interpreted with ``pltpu.InterpretParams()``). Interpret mode compiles slowly, so cases share shapes where they
can (a jitted function is reused across parameters with equal shapes).
"""
import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import kda as kda_ops
from k3jax.ops.kda import segment_starts
from k3jax.ops.kda.blocks import chunk_length
from k3jax.ops.kda.pallas import forced_kernels, pallas_kda
from tests.helpers import rel_err
from tests.ops.numpy_kda import kda_numpy
from tests.ops.test_kda import as_f32, check_bf16_inputs_keep_fp32_state, make_inputs

FIXTURE = pathlib.Path(__file__).with_name("kda_fla_reference.npz")
ARGS = ("q", "k", "v", "g", "beta", "initial_state")
kda = jax.jit(kda_ops.kda, static_argnames=("scale", "chunk_size", "implementation"))


@functools.partial(jax.jit, static_argnames=("backend", "chunk_size", "scale"))
def run_pallas(args, segment_ids, *, backend, chunk_size=64, scale=None):
    """Forward through the given kernel family in interpret mode."""
    q, k, v, g, beta, initial_state = args
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    with forced_kernels(backend):
        return pallas_kda(q, k, v, g, beta, initial_state, segment_starts(segment_ids), scale=scale,
                          chunk_size=chunk_size)


def _loss(outputs, cotangent):
    o, state = outputs
    return jnp.sum(o * cotangent) + jnp.sum(state**2)


@functools.partial(jax.jit, static_argnames=("backend", "chunk_size"))
def pallas_outputs_and_grads(args, segment_ids, cotangent, *, backend, chunk_size):
    outputs, pullback = jax.vjp(lambda a: run_pallas(a, segment_ids, backend=backend, chunk_size=chunk_size), args)
    return outputs, pullback((cotangent, 2.0 * outputs[1]))[0]


@jax.jit
def reference_grads(args, segment_ids, cotangent):
    def loss(a):
        return _loss(kda_ops.kda(*a[:5], initial_state=a[5], segment_ids=segment_ids, implementation="reference"),
                     cotangent)
    return jax.grad(loss)(args)


def test_chunk_size_is_a_power_of_two_shrunk_for_short_sequences():
    assert [chunk_length(t, 64) for t in (1, 16, 17, 33, 63, 64, 65, 1000)] == [16, 16, 32, 64, 64, 64, 64, 64]
    assert [chunk_length(1000, c) for c in (16, 32, 64, 128)] == [16, 32, 64, 128]
    for bad in (8, 48, 0, 100):
        with pytest.raises(ValueError, match="chunk_size must be a power of two >= 16"):
            chunk_length(1000, bad)


@pytest.mark.parametrize("length", [1, 63, 64, 65, 200])
def test_values_match_numpy_for_lengths(length):
    x = make_inputs(0, length=length)
    o, state = kda(**as_f32(x), implementation="pallas")
    o_ref, state_ref = kda_numpy(**x)
    assert o.dtype == jnp.float32 and state.dtype == jnp.float32
    assert rel_err(o, o_ref) <= 1e-5
    assert rel_err(state, state_ref) <= 1e-5


@pytest.mark.parametrize("regime", ["mild", "bounded", "unbounded"])
def test_gate_regimes_match_numpy(regime):
    x = make_inputs(1, length=200, regime=regime)
    o, state = kda(**as_f32(x), implementation="pallas")
    o_ref, state_ref = kda_numpy(**x)
    assert rel_err(o, o_ref) <= 1e-5
    assert rel_err(state, state_ref) <= 1e-5


def test_without_initial_state_starts_from_zero():
    x = make_inputs(3, length=1)
    x.pop("initial_state")
    o, _ = kda(**as_f32(x), implementation="pallas")
    assert rel_err(o, kda_numpy(**x)[0]) <= 1e-5


def test_tpu_kernels_with_grouped_values_custom_scale_and_segments():
    x = make_inputs(2, length=100, heads=2, value_heads=6, key_dim=16, value_dim=12, regime="unbounded")
    segment_ids = np.repeat([[0, 0, 3, 3, 3, 5, 5, 5, 5, 5]], 10, axis=0).T.reshape(1, 100).repeat(2, 0)
    args = [jnp.asarray(x[n], jnp.float32) for n in ARGS]
    o, state = run_pallas(args, jnp.asarray(segment_ids), backend="tpu", scale=0.3)
    o_ref, state_ref = kda_numpy(**x, scale=0.3, segment_ids=segment_ids)
    assert rel_err(o, o_ref) <= 1e-5
    assert rel_err(state, state_ref) <= 1e-5


def test_segments_equal_each_segment_run_alone_with_grouped_values_and_custom_scale():
    x = make_inputs(4, batch=2, length=150, heads=2, value_heads=6, value_dim=12, regime="bounded")
    bounds = [[0, 20, 64, 65, 150], [0, 100, 150]]  # boundaries on and off chunk edges
    segment_ids = np.zeros((2, 150), np.int32)
    for b, edges in enumerate(bounds):
        for seg, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
            segment_ids[b, lo:hi] = 10 * seg + 7
    o, state = kda(**as_f32(x), segment_ids=jnp.asarray(segment_ids), scale=0.3, implementation="pallas")
    for b, edges in enumerate(bounds):
        for seg, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
            alone = {n: a[b : b + 1, lo:hi] for n, a in x.items() if n != "initial_state"}
            init = x["initial_state"][b : b + 1] if seg == 0 else None
            o_ref, state_ref = kda_numpy(**alone, initial_state=init, scale=0.3)
            assert rel_err(o[b : b + 1, lo:hi], o_ref) <= 1e-5
        assert rel_err(state[b], state_ref[0]) <= 1e-5


@pytest.mark.parametrize("case", ["basic", "gva_odd_len", "strong_decay"])
def test_parity_with_fla_reference(case):
    data = np.load(FIXTURE)
    inputs = {n: jnp.asarray(data[f"{case}/{n}"], jnp.float32) for n in ARGS}
    o, state = kda(**inputs, scale=float(data[f"{case}/scale"]), implementation="pallas")
    assert rel_err(o, data[f"{case}/o"]) <= 1e-5
    assert rel_err(state, data[f"{case}/final_state"]) <= 1e-5


def _gradient_case(seed, regime):
    x = make_inputs(seed, length=90, heads=2, value_heads=4, regime=regime)
    cotangent = jnp.asarray(np.random.default_rng(seed + 1).standard_normal((2, 90, 4, 8)), jnp.float32)
    segment_ids = np.repeat([[0, 1, 1]], 30, axis=1).reshape(1, 90).repeat(2, 0)
    segment_ids[1] = 0
    return x, jnp.asarray(segment_ids), cotangent


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_gradients_equal_reference_gradients(backend):
    x, segment_ids, cotangent = _gradient_case(7, "unbounded")
    args = [jnp.asarray(x[n], jnp.float32) for n in ARGS]
    _, grads = pallas_outputs_and_grads(args, segment_ids, cotangent, backend=backend, chunk_size=32)
    for name, got, want in zip(ARGS, grads, reference_grads(args, segment_ids, cotangent)):
        assert np.isfinite(got).all(), name
        assert rel_err(got, want) <= 1e-4, name


def test_extreme_gates_and_zero_keys_stay_finite():
    x, segment_ids, cotangent = _gradient_case(10, "unbounded")
    x["g"][:, 10:50] = -1000.0
    x["g"][:, 60:70, :, :3] = -1000.0
    x["k"][:, 80:90] = 0.0
    args = [jnp.asarray(x[n], jnp.float32) for n in ARGS]
    (o, state), grads = pallas_outputs_and_grads(args, segment_ids, cotangent, backend="gpu", chunk_size=32)
    o_ref, state_ref = kda_numpy(**x, segment_ids=np.asarray(segment_ids))
    assert rel_err(o, o_ref) <= 1e-5 and rel_err(state, state_ref) <= 1e-5
    for name, got, want in zip(ARGS, grads, reference_grads(args, segment_ids, cotangent)):
        assert np.isfinite(got).all(), name
        assert rel_err(got, want) <= 1e-4, name


def test_bf16_inputs_keep_fp32_state():
    check_bf16_inputs_keep_fp32_state("pallas", length=30)


@pytest.mark.parametrize("platform, kernel_call", [("tpu", "tpu_custom_call"), ("cuda", "__gpu$xla.gpu.triton")])
def test_forward_and_gradient_lower_for_accelerators(platform, kernel_call):
    """Lowering for TPU (Mosaic) and CUDA (Triton) from this CPU-only jaxlib catches Pallas
    lowering errors early. It stops before the device compilers (Mosaic layout passes in libtpu,
    Triton to PTX in XLA:GPU), which only run on the device."""
    batch, length, heads, value_heads, dim = 1, 192, 2, 4, 128
    spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    args = (spec(batch, length, heads, dim), spec(batch, length, heads, dim), spec(batch, length, value_heads, dim),
            spec(batch, length, value_heads, dim, dtype=jnp.float32),
            spec(batch, length, value_heads, dtype=jnp.float32),
            spec(batch, value_heads, dim, dim, dtype=jnp.float32), spec(batch, length, dtype=jnp.int32))

    def forward(q, k, v, g, beta, initial_state, segment_ids):
        return kda_ops.kda(q, k, v, g, beta, initial_state=initial_state, segment_ids=segment_ids,
                           implementation="pallas")

    def loss(*a):
        o, state = forward(*a)
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(state)

    for fn, kernels in ((forward, 1), (jax.grad(loss, argnums=range(6)), 2)):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
        assert text.count(kernel_call) >= kernels
