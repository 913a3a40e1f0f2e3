"""KDA operator against an independent float64 NumPy reference (SPEC §1) and fla's own reference."""
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.test_util import check_grads

from k3jax.ops import kda as kda_ops
from k3jax.ops.kda import kda_gate, kda_step, kda_steps, l2_normalize
from tests.helpers import rel_err
from tests.ops.numpy_kda import kda_numpy

FIXTURE = pathlib.Path(__file__).with_name("kda_fla_reference.npz")
IMPLEMENTATIONS = ("reference", "chunk")
# Compiled once per shape and static options: eager op-by-op dispatch would dominate test time.
kda = jax.jit(kda_ops.kda, static_argnames=("scale", "chunk_size", "implementation"))


def make_gate(rng, shape, regime):
    """Log-space decays in the three regimes: mild, K3's bounded form, Kimi Linear's unbounded form."""
    heads, key_dim = shape[-2:]
    if regime == "mild":
        return -np.exp(rng.standard_normal(shape) - 2.0)
    a_log = np.log(rng.uniform(1, 16, size=heads))
    dt_bias = rng.standard_normal((heads, key_dim))
    raw = 3.0 * rng.standard_normal(shape)
    bound = -5.0 if regime == "bounded" else None
    return np.asarray(kda_gate(jnp.asarray(raw), jnp.asarray(a_log), jnp.asarray(dt_bias), lower_bound=bound), np.float64)


def make_inputs(seed, batch=2, length=65, heads=2, value_heads=2, key_dim=16, value_dim=8, regime="mild"):
    rng = np.random.default_rng(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    return dict(
        q=unit(rng.standard_normal((batch, length, heads, key_dim))),
        k=unit(rng.standard_normal((batch, length, heads, key_dim))),
        v=rng.standard_normal((batch, length, value_heads, value_dim)),
        g=make_gate(rng, (batch, length, value_heads, key_dim), regime),
        beta=rng.uniform(0.05, 0.95, size=(batch, length, value_heads)),
        initial_state=rng.standard_normal((batch, value_heads, key_dim, value_dim)),
    )


def as_f32(inputs):
    return {name: jnp.asarray(x, jnp.float32) for name, x in inputs.items()}


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("length", [1, 63, 64, 65, 200])
def test_values_match_numpy_for_lengths(implementation, length):
    x = make_inputs(0, length=length)
    o, state = kda(**as_f32(x), implementation=implementation)
    o_ref, state_ref = kda_numpy(**x)
    assert o.dtype == jnp.float32 and state.dtype == jnp.float32
    assert rel_err(o, o_ref) <= 1e-5
    assert rel_err(state, state_ref) <= 1e-5


def near_repeated_keys(seed, spread=0.01, length=65):
    """Keys within ``spread`` of one direction per head, beta 0.99, slow decay: A_kk has entries near
    1 and (I + A_kk)^-1 is ill-conditioned -- its Neumann series alternates terms up to C(15, 7)
    times the size of its sum (what the chunk form computed before it solved by substitution)."""
    x = make_inputs(seed, length=length)                 # the shapes of the other cases: shared compiles
    rng = np.random.default_rng(seed + 100)
    keys = x["k"][:, :1] + spread * rng.standard_normal(x["k"].shape)
    x["k"] = keys / np.linalg.norm(keys, axis=-1, keepdims=True)
    x["beta"] = np.full_like(x["beta"], 0.99)
    x["g"] = np.full_like(x["g"], -0.01)
    return x


@pytest.mark.parametrize("implementation", [*IMPLEMENTATIONS, "pallas"])
@pytest.mark.parametrize("spread", [0.01, 0.3])
def test_near_repeated_keys_with_strong_writes_are_as_accurate_as_the_recurrence(implementation, spread):
    x = near_repeated_keys(20, spread)
    o, state = kda(**as_f32(x), implementation=implementation)
    o_ref, state_ref = kda_numpy(**x)
    assert rel_err(o, o_ref) <= 2e-6 and rel_err(state, state_ref) <= 2e-6       # the doubling inverse: 7e-5


def test_near_repeated_keys_gradients_equal_the_float64_recurrence():
    x = near_repeated_keys(21)
    cotangent = np.random.default_rng(22).standard_normal(x["v"].shape)
    for got, want in zip(_chunk_grads(x, cotangent), _float64_reference_grads(x, cotangent)):
        assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
@pytest.mark.parametrize("regime", ["mild", "bounded", "unbounded"])
def test_chunk_matches_numpy_for_chunk_sizes_and_gate_regimes(chunk_size, regime):
    x = make_inputs(1, length=200, regime=regime)
    o, state = kda(**as_f32(x), chunk_size=chunk_size, implementation="chunk")
    o_ref, state_ref = kda_numpy(**x)
    assert rel_err(o, o_ref) <= 1e-5
    assert rel_err(state, state_ref) <= 1e-5


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_grouped_values_and_custom_scale(implementation):
    x = make_inputs(2, length=100, heads=2, value_heads=6, key_dim=16, value_dim=12, regime="unbounded")
    o, state = kda(**as_f32(x), scale=0.3, implementation=implementation)
    o_ref, state_ref = kda_numpy(**x, scale=0.3)
    assert rel_err(o, o_ref) <= 1e-5
    assert rel_err(state, state_ref) <= 1e-5


def test_without_initial_state_starts_from_zero():
    x = make_inputs(3, length=70)
    x.pop("initial_state")
    o, _ = kda(**as_f32(x), implementation="chunk")
    o_ref, _ = kda_numpy(**x)
    assert rel_err(o, o_ref) <= 1e-5


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_segments_equal_each_segment_run_alone(implementation):
    x = make_inputs(4, batch=2, length=150, regime="bounded")
    bounds = [[0, 20, 64, 65, 150], [0, 100, 150]]  # boundaries on and off chunk edges
    segment_ids = np.zeros((2, 150), np.int32)
    for b, edges in enumerate(bounds):
        for seg, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
            segment_ids[b, lo:hi] = 10 * seg + 7  # arbitrary ids: only changes matter
    o, state = kda(**as_f32(x), segment_ids=jnp.asarray(segment_ids), implementation=implementation)
    for b, edges in enumerate(bounds):
        for seg, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
            alone = {n: a[b : b + 1, lo:hi] for n, a in x.items() if n != "initial_state"}
            init = x["initial_state"][b : b + 1] if seg == 0 else None
            o_ref, state_ref = kda_numpy(**alone, initial_state=init)
            assert rel_err(o[b : b + 1, lo:hi], o_ref) <= 1e-5
        assert rel_err(state[b], state_ref[0]) <= 1e-5


@pytest.mark.parametrize("case", ["basic", "gva_odd_len", "strong_decay"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_parity_with_fla_reference(case, implementation):
    data = np.load(FIXTURE)
    get = lambda name: data[f"{case}/{name}"]  # noqa: E731
    inputs = {n: jnp.asarray(get(n), jnp.float32) for n in ("q", "k", "v", "g", "beta", "initial_state")}
    o, state = kda(**inputs, scale=float(get("scale")), implementation=implementation)
    assert rel_err(o, get("o")) <= 1e-5
    assert rel_err(state, get("final_state")) <= 1e-5


def test_state_threading_across_calls_off_chunk_boundary():
    x = as_f32(make_inputs(5, length=150, regime="unbounded"))
    o_full, s_full = kda(**x, implementation="chunk")
    first = {n: a[:, :37] for n, a in x.items() if n != "initial_state"}
    rest = {n: a[:, 37:] for n, a in x.items() if n != "initial_state"}
    o1, s1 = kda(**first, initial_state=x["initial_state"], implementation="chunk")
    o2, s2 = kda(**rest, initial_state=s1, implementation="chunk")
    assert rel_err(jnp.concatenate([o1, o2], axis=1), o_full) <= 1e-5
    assert rel_err(s2, s_full) <= 1e-5


def test_step_loop_equals_chunk():
    x = make_inputs(6, length=40, heads=2, value_heads=4, regime="bounded")
    f = as_f32(x)
    o_full, s_full = kda(**f, implementation="chunk")
    state = f["initial_state"]
    outs = []
    for t in range(40):
        o_t, state = kda_step(f["q"][:, t], f["k"][:, t], f["v"][:, t], f["g"][:, t], f["beta"][:, t], state)
        outs.append(o_t)
    assert rel_err(jnp.stack(outs, axis=1), o_full) <= 1e-5
    assert rel_err(state, s_full) <= 1e-5


@pytest.mark.parametrize("implementation", ["chunk", "pallas"])
def test_steps_keep_every_state_of_the_numpy_recurrence(implementation):
    x = make_inputs(7, length=5, heads=2, value_heads=4, regime="bounded")
    o, states = kda_steps(*(as_f32(x)[name] for name in ("q", "k", "v", "g", "beta", "initial_state")),
                          implementation=implementation)
    assert states.shape == (2, 5, 4, 16, 8) and states.dtype == jnp.float32
    o_ref, _ = kda_numpy(**x)
    assert rel_err(o, o_ref) <= 1e-5
    for t in range(5):                                 # the state after token t: a run of t + 1 tokens
        _, state_ref = kda_numpy(**{name: a if name == "initial_state" else a[:, : t + 1] for name, a in x.items()})
        assert rel_err(states[:, t], state_ref) <= 1e-5


@pytest.mark.parametrize("regime", ["mild", "unbounded"])
def test_chunk_gradients_equal_reference_gradients(regime):
    x = as_f32(make_inputs(7, length=90, heads=2, value_heads=4, regime=regime))
    cotangent = jnp.asarray(np.random.default_rng(8).standard_normal((2, 90, 4, 8)), jnp.float32)
    seg = jnp.asarray(np.repeat([[0, 1, 1]], 30, axis=1).reshape(1, 90).repeat(2, 0))
    seg = seg.at[1].set(0)

    def grads(implementation):
        def loss(q, k, v, g, beta, initial_state):
            o, state = kda(q, k, v, g, beta, initial_state=initial_state, segment_ids=seg,
                           chunk_size=32, implementation=implementation)
            return jnp.sum(o * cotangent) + jnp.sum(state**2)
        return jax.grad(loss, argnums=tuple(range(6)))(*(x[n] for n in ("q", "k", "v", "g", "beta", "initial_state")))

    for got, want in zip(grads("chunk"), grads("reference")):
        assert np.isfinite(got).all()
        assert rel_err(got, want) <= 1e-4


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_gradients_match_finite_differences_in_float64(implementation):
    x = make_inputs(9, batch=1, length=40, heads=1, value_heads=2, key_dim=8, value_dim=4, regime="bounded")
    with jax.enable_x64(True):
        args = [jnp.asarray(x[n], jnp.float64) for n in ("q", "k", "v", "g", "beta", "initial_state")]

        def f(*a):
            o, state = kda(*a[:5], initial_state=a[5], chunk_size=16, implementation=implementation)
            return jnp.sum(jnp.sin(o)) + jnp.sum(state * state)

        check_grads(f, args, order=1, modes=("rev",), eps=1e-6, atol=1e-6, rtol=1e-6)


def test_extreme_gates_and_zero_keys_stay_finite():
    x = make_inputs(10, length=130, regime="unbounded")
    x["g"][:, 10:50] = -1000.0
    x["g"][:, 60:70, :, :3] = -1000.0
    x["k"][:, 80:90] = 0.0
    f = as_f32(x)
    o, state = kda(**f, implementation="chunk")
    o_ref, state_ref = kda_numpy(**x)
    assert rel_err(o, o_ref) <= 1e-5 and rel_err(state, state_ref) <= 1e-5
    grads = jax.grad(lambda *a: jnp.sum(kda(*a, implementation="chunk")[0] ** 2), argnums=range(5))(
        f["q"], f["k"], f["v"], f["g"], f["beta"]
    )
    assert all(np.isfinite(gr).all() for gr in grads)


def test_long_sequence_forward_stays_finite():
    x = as_f32(make_inputs(11, batch=1, length=65536, heads=1, value_heads=1, key_dim=16, value_dim=16,
                           regime="unbounded"))
    o, state = jax.jit(lambda a: kda(**a, implementation="chunk"))(x)
    assert np.isfinite(o).all() and np.isfinite(state).all()


def check_bf16_inputs_keep_fp32_state(implementation: str, length: int) -> None:
    """bf16 inputs give a bf16 output and an fp32 state, which match the float64 oracle run on the
    same (rounded) inputs: only the output's rounding differs."""
    x = make_inputs(12, length=length, regime="bounded")
    bf16 = {n: jnp.asarray(a, jnp.bfloat16) for n, a in x.items()}
    o, state = kda(**bf16, implementation=implementation)
    assert o.dtype == jnp.bfloat16 and state.dtype == jnp.float32
    rounded = {n: np.asarray(a.astype(jnp.float32), np.float64) for n, a in bf16.items()}
    o_ref, state_ref = kda_numpy(**rounded)
    assert rel_err(state, state_ref) <= 1e-5
    assert rel_err(o, o_ref) <= 1e-2


def test_bf16_inputs_keep_fp32_state():
    check_bf16_inputs_keep_fp32_state("chunk", length=100)


def test_gate_forms_match_numpy():
    rng = np.random.default_rng(13)
    raw = rng.standard_normal((3, 5, 4, 8)) * 4
    a_log = np.log(rng.uniform(1, 16, 4))
    dt_bias = rng.standard_normal((4, 8))
    z = raw + dt_bias
    softplus = -np.exp(a_log)[:, None] * np.log1p(np.exp(z))
    bounded = -5.0 / (1.0 + np.exp(-np.exp(a_log)[:, None] * z))
    args = (jnp.asarray(raw, jnp.float32), jnp.asarray(a_log, jnp.float32), jnp.asarray(dt_bias, jnp.float32))
    got_softplus = kda_gate(*args)
    got_bounded = kda_gate(*args, lower_bound=-5.0)
    assert got_softplus.dtype == jnp.float32
    np.testing.assert_allclose(got_softplus, softplus, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_bounded, bounded, rtol=1e-5, atol=1e-6)
    assert (np.asarray(got_bounded) >= -5.0).all() and (np.asarray(got_bounded) <= 0).all()  # fp32 saturates


def test_l2_normalize_matches_numpy_and_maps_zero_to_zero():
    x = np.random.default_rng(14).standard_normal((4, 3, 16))
    x[0, 0] = 0.0
    want = x / np.sqrt((x**2).sum(-1, keepdims=True) + 1e-6)
    got = l2_normalize(jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert (np.asarray(got[0, 0]) == 0).all()


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(q=np.zeros((2, 10, 2))), "q must have shape"),
        (dict(k=np.zeros((2, 10, 2, 15))), "k must have shape"),
        (dict(v=np.zeros((2, 10, 3, 8))), "multiple of H"),
        (dict(v=np.zeros((2, 9, 2, 8))), "v must have shape"),
        (dict(g=np.zeros((2, 10, 2, 8))), "g must have shape"),
        (dict(beta=np.zeros((2, 10))), "beta must have shape"),
        (dict(initial_state=np.zeros((2, 2, 16, 9))), "initial_state must have shape"),
        (dict(segment_ids=np.zeros((2, 11), np.int32)), "segment_ids must have shape"),
    ],
)
def test_bad_shapes_raise_value_error_naming_the_argument(change, message):
    x = make_inputs(15, length=10)
    x.update(change)
    with pytest.raises(ValueError, match=message):
        kda(**{n: jnp.asarray(a) for n, a in x.items()})


def test_bad_step_shapes_raise_value_error():
    x = as_f32(make_inputs(16, length=1))
    with pytest.raises(ValueError, match="state must have shape"):
        kda_step(x["q"][:, 0], x["k"][:, 0], x["v"][:, 0], x["g"][:, 0], x["beta"][:, 0], x["initial_state"][:1])


def _float64_reference_grads(x, cotangent):
    """Gradients of sum(o * cotangent) + sum(state^2) through the token-serial recurrence in
    float64, called directly (no log-decay floor): exp(-inf) = 0 there on its own."""
    from k3jax.ops.kda.reference import recurrent_kda

    with jax.enable_x64(True):
        group = x["v"].shape[2] // x["q"].shape[2]
        scale = x["q"].shape[-1] ** -0.5

        def loss(q, k, v, g, beta, initial_state):
            q, k = jnp.repeat(q * scale, group, axis=2), jnp.repeat(k, group, axis=2)
            o, state = recurrent_kda(q, k, v, g, beta, initial_state, None)
            return jnp.sum(o * cotangent) + jnp.sum(state**2)

        args = [jnp.asarray(x[n], jnp.float64) for n in ("q", "k", "v", "g", "beta", "initial_state")]
        return [np.asarray(d) for d in jax.grad(loss, argnums=tuple(range(6)))(*args)]


def _chunk_grads(x, cotangent):
    def loss(q, k, v, g, beta, initial_state):
        o, state = kda(q, k, v, g, beta, initial_state=initial_state, chunk_size=32, implementation="chunk")
        return jnp.sum(o * jnp.asarray(cotangent, jnp.float32)) + jnp.sum(state**2)

    f = as_f32(x)
    return jax.grad(loss, argnums=tuple(range(6)))(*(f[n] for n in ("q", "k", "v", "g", "beta", "initial_state")))


def test_minus_infinity_gate_is_a_channel_reset_with_finite_gradients():
    """g = -inf (exp(g) = 0): values equal the float64 oracle, gradients are finite and equal the
    float64 recurrence's."""
    x = make_inputs(17, length=70, heads=1, value_heads=2, regime="bounded")
    x["g"][:, 5, :, :4] = -np.inf          # some channels reset at one token
    x["g"][:, 40:44] = -np.inf             # every channel, several tokens (across a block edge)
    o, state = kda(**as_f32(x), chunk_size=32, implementation="chunk")
    o_ref, state_ref = kda_numpy(**x)
    assert np.isfinite(o).all() and np.isfinite(state).all()
    assert rel_err(o, o_ref) <= 1e-5 and rel_err(state, state_ref) <= 1e-5
    cotangent = np.random.default_rng(18).standard_normal(o.shape)
    for name, got, want in zip("q k v g beta initial_state".split(), _chunk_grads(x, cotangent),
                               _float64_reference_grads(x, cotangent)):
        assert np.isfinite(got).all(), name
        assert rel_err(got, want) <= 1e-4, name
    assert (np.asarray(_chunk_grads(x, cotangent)[3])[:, 40:44] == 0).all()


@pytest.mark.slow   # 15-60 s of the default set's CPU: in .ci/run's slow set
def test_softplus_gate_overflow_gives_a_reset_with_finite_gradients():
    """raw = 1e38 makes a * softplus(z) overflow fp32 (-inf before the floor); through the gate and
    the chunk form, values and gradients are finite and equal to the float64 computation, where
    the same g is finite (-1.6e39) and its decay exp(g) = 0."""
    x = make_inputs(19, batch=1, length=40, heads=1, value_heads=2, regime="mild")
    rng = np.random.default_rng(20)
    raw = rng.standard_normal((1, 40, 2, 16))
    raw[0, 10:13, :, :5] = 1e38
    a_log, dt_bias = np.log(np.array([16.0, 2.0])), rng.standard_normal((2, 16))
    cotangent = rng.standard_normal((1, 40, 2, 8))

    def loss(raw, a_log, dt_bias, gate, implementation):
        g = gate(raw, a_log, dt_bias)
        q, k, v, beta, initial_state = (jnp.asarray(x[n], raw.dtype) for n in ("q", "k", "v", "beta", "initial_state"))
        o, state = kda_ops.kda(q, k, v, g, beta, initial_state=initial_state, chunk_size=16,
                               implementation=implementation)
        return jnp.sum(o * cotangent) + jnp.sum(state**2)

    def float64_gate(raw, a_log, dt_bias):  # -a softplus(z) written out, no floor
        return -jnp.exp(a_log)[:, None] * jnp.logaddexp(raw + dt_bias, 0.0)

    g32 = kda_gate(jnp.asarray(raw, jnp.float32), jnp.asarray(a_log, jnp.float32), jnp.asarray(dt_bias, jnp.float32))
    assert np.isfinite(g32).all()
    grad = jax.grad(loss, argnums=(0, 1, 2))
    got = grad(*(jnp.asarray(a, jnp.float32) for a in (raw, a_log, dt_bias)),
               lambda *a: kda_gate(*a), "chunk")
    with jax.enable_x64(True):
        want = grad(*(jnp.asarray(a, jnp.float64) for a in (raw, a_log, dt_bias)), float64_gate, "reference")
        assert np.isfinite(float64_gate(raw, a_log, dt_bias)).all()
    for name, d, w in zip(("raw", "A_log", "dt_bias"), got, want):
        assert np.isfinite(d).all(), name
        assert rel_err(d, w) <= 1e-4, name


@pytest.mark.parametrize("chunk_size", [8, 48, 100])
def test_chunk_size_must_be_a_power_of_two_of_at_least_16(chunk_size):
    x = as_f32(make_inputs(21, length=20))
    with pytest.raises(ValueError, match="chunk_size must be a power of two >= 16"):
        kda_ops.kda(**x, chunk_size=chunk_size)


def test_implementation_is_validated_and_auto_is_the_chunk_form_on_cpu():
    x = as_f32(make_inputs(22, length=20))
    with pytest.raises(ValueError, match="implementation must be one of"):
        kda_ops.kda(**x, implementation="xla")
    for got, want in zip(kda(**x, implementation="auto"), kda(**x, implementation="chunk")):
        np.testing.assert_array_equal(got, want)
