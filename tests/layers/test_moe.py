"""DenseGLU and MoE layers (SPEC §4) against a float64 NumPy forward built from their own parameters."""
import functools

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from k3jax.config import ConfigError, MoEConfig
from k3jax.layers.ffn import DenseGLU
from k3jax.layers.moe import MoE, RouterBias
from k3jax.layers.params import logical_axes
from k3jax.ops.moe import load_metrics, updated_router_bias
from tests.ops import numpy_moe as ref

D_MODEL, EXPERTS, TOP_K = 16, 8, 2
# Expert width 6: 4 shared experts make a shared GLU of width 24, 2 one of width 12.
LATENT_K3 = dict(latent_dim=8, latent_norm=True, num_shared_experts=4, activation="situ", routed_scale=1.0)
PLAIN_KIMI_LINEAR = dict(latent_dim=None, latent_norm=False, num_shared_experts=2, activation="swiglu",
                         routed_scale=2.446)
LATENT_NO_NORM_NO_SHARED = dict(latent_dim=8, latent_norm=False, num_shared_experts=0, activation="situ",
                                routed_scale=1.0)
LAYER_OPTIONS = ("activation", "situ_beta", "situ_beta_linear", "dtype")   # the MoE's own arguments; the rest are MoEConfig fields


def moe_config(**fields) -> MoEConfig:
    return MoEConfig(**{"num_experts": EXPERTS, "top_k": TOP_K, "expert_width": 6, **fields})


def make_moe(seed=0, **options):
    """A small MoE; the wide init keeps router scores well apart, so fp32 and float64 pick the same experts."""
    options = {**LATENT_K3, **options}
    layer = {name: options.pop(name) for name in LAYER_OPTIONS if name in options}
    return MoE(D_MODEL, moe_config(**options), init_std=0.5, rngs=nnx.Rngs(seed), **layer)


# Jitted forward: one compile per configuration instead of one per eager op (much faster on CPU).
forward = nnx.jit(lambda model, x, token_mask=None: model(x, token_mask))


def as64(variable):
    return np.asarray(variable[...], np.float64)


def numpy_params(model):
    """The module's parameter values in float64, keyed as the NumPy reference expects."""
    p = {
        "router": as64(model.router.weight),
        "bias": as64(model.router.e_score_correction_bias),
        "w_gate": as64(model.experts.w_gate),
        "w_up": as64(model.experts.w_up),
        "w_down": as64(model.experts.w_down),
    }
    if model.config.latent_dim is not None:
        p["latent_down"], p["latent_up"] = as64(model.latent_down), as64(model.latent_up)
    if model.config.latent_norm:
        p["latent_norm"] = as64(model.latent_norm_weight)
    if model.config.shared_width is not None:
        shared = model.shared
        p["shared_gate"], p["shared_up"], p["shared_down"] = (as64(w) for w in (shared.w_gate, shared.w_up, shared.w_down))
    return p


def perturb_non_matrix_params(model, seed):
    """Give the router bias and the latent norm weight non-trivial values (they start at 0 and 1)."""
    rng = np.random.default_rng(seed)
    model.router.e_score_correction_bias[...] = jnp.asarray(0.3 * rng.standard_normal(EXPERTS), jnp.float32)
    if model.config.latent_norm:
        model.latent_norm_weight[...] = jnp.asarray(1 + 0.5 * rng.standard_normal(model.config.latent_dim),
                                                    jnp.float32)


def inputs(seed, batch=2, length=6):
    return np.random.default_rng(seed).standard_normal((batch, length, D_MODEL))


@pytest.mark.parametrize("activation", ["situ", "swiglu"])
def test_dense_glu_matches_numpy(activation):
    layer = DenseGLU(D_MODEL, 24, activation=activation, init_std=0.3, rngs=nnx.Rngs(0))
    x = inputs(1)
    y = layer(jnp.asarray(x, jnp.float32))
    expected = ref.glu(x, as64(layer.w_gate), as64(layer.w_up), as64(layer.w_down), activation)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    assert logical_axes(layer.w_gate) == ("embed", "mlp") and logical_axes(layer.w_down) == ("mlp", "embed")
    assert set(nnx.state(layer, nnx.Param).flat_state().paths) == {("w_gate",), ("w_up",), ("w_down",)}


@pytest.mark.parametrize(
    "options", [LATENT_K3, PLAIN_KIMI_LINEAR, LATENT_NO_NORM_NO_SHARED], ids=["latent", "plain", "latent-bare"]
)
def test_moe_matches_numpy_forward_from_its_parameters(options):
    model = make_moe(**options)
    perturb_non_matrix_params(model, seed=2)
    x = inputs(3)
    y, stats = forward(model, jnp.asarray(x, jnp.float32))
    y_ref, scores_ref, indices_ref = ref.moe_forward(
        x.reshape(-1, D_MODEL), numpy_params(model), TOP_K, options["activation"], options["routed_scale"]
    )
    assert y.shape == x.shape
    np.testing.assert_allclose(y.reshape(-1, D_MODEL), y_ref, rtol=1e-4, atol=1e-4 * np.abs(y_ref).max())
    np.testing.assert_allclose(stats.router_scores, scores_ref, rtol=1e-5)
    np.testing.assert_array_equal(stats.expert_load, ref.expert_load(indices_ref, EXPERTS))


ROUTER_OPTIONS = dict(router_score="softmax", renormalize=False, expert_groups=4, topk_groups=2)
SITU_OPTIONS = dict(situ_beta=2.0, situ_beta_linear=None)


def test_moe_router_and_situ_options_match_numpy():
    model = make_moe(**ROUTER_OPTIONS, **SITU_OPTIONS)
    perturb_non_matrix_params(model, seed=2)
    x = inputs(3)
    y, stats = forward(model, jnp.asarray(x, jnp.float32))
    activation = functools.partial(ref.situ_glu, beta=2.0, beta_linear=None)
    y_ref, scores_ref, indices_ref = ref.moe_forward(
        x.reshape(-1, D_MODEL), numpy_params(model), TOP_K, activation, score="softmax", renormalize=False,
        expert_groups=4, topk_groups=2)
    np.testing.assert_allclose(y.reshape(-1, D_MODEL), y_ref, rtol=1e-4, atol=1e-4 * np.abs(y_ref).max())
    np.testing.assert_allclose(stats.router_scores, scores_ref, rtol=1e-5)
    np.testing.assert_array_equal(stats.expert_load, ref.expert_load(indices_ref, EXPERTS))


def test_softmax_router_weight_gradient_matches_numpy_finite_differences():
    model = make_moe(**ROUTER_OPTIONS)
    perturb_non_matrix_params(model, seed=4)
    x = inputs(5, batch=1, length=4)
    probe = np.random.default_rng(6).standard_normal(x.shape)
    grad = nnx.jit(nnx.grad(lambda m: jnp.sum(m(jnp.asarray(x, jnp.float32))[0] * probe)))(model)
    p = numpy_params(model)

    def numpy_loss(router):
        y, _, _ = ref.moe_forward(x.reshape(-1, D_MODEL), {**p, "router": router}, TOP_K, "situ", score="softmax",
                                  renormalize=False, expert_groups=4, topk_groups=2)
        return np.sum(y * probe.reshape(-1, D_MODEL))

    step, expected = 1e-6, np.zeros_like(p["router"])
    for index in np.ndindex(expected.shape):
        shift = np.zeros_like(expected)
        shift[index] = step
        expected[index] = (numpy_loss(p["router"] + shift) - numpy_loss(p["router"] - shift)) / (2 * step)
    actual = np.asarray(grad["router"]["weight"][...])
    np.testing.assert_allclose(actual, expected, atol=1e-4 * np.abs(expected).max())


def test_dense_glu_situ_betas_match_numpy():
    layer = DenseGLU(D_MODEL, 24, activation="situ", **SITU_OPTIONS, init_std=1.0, rngs=nnx.Rngs(0))
    x = 3 * inputs(1)   # large pre-activations: the betas matter
    y = layer(jnp.asarray(x, jnp.float32))
    weights = as64(layer.w_gate), as64(layer.w_up), as64(layer.w_down)
    expected = ref.glu(x, *weights, functools.partial(ref.situ_glu, beta=2.0, beta_linear=None))
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    assert np.abs(expected - ref.glu(x, *weights, "situ")).max() > 0.1 * np.abs(expected).max()


def test_token_mask_changes_load_statistics_but_not_outputs():
    model = make_moe()
    x = jnp.asarray(inputs(4), jnp.float32)
    mask = np.zeros(x.shape[:2], bool)
    mask[:, :3] = True
    y, stats = forward(model, x)
    y_masked, masked_stats = forward(model, x, jnp.asarray(mask))
    np.testing.assert_array_equal(y_masked, y)
    assert float(stats.expert_load.sum()) == x.shape[0] * x.shape[1] * TOP_K
    assert float(masked_stats.expert_load.sum()) == mask.sum() * TOP_K
    np.testing.assert_array_equal(masked_stats.token_mask, mask.reshape(-1))


def test_parameters_carry_logical_axes():
    latent, plain = make_moe(), make_moe(**PLAIN_KIMI_LINEAR)
    assert logical_axes(latent.router.weight) == ("embed", "experts")
    assert logical_axes(latent.router.e_score_correction_bias) == ("experts",)
    assert logical_axes(latent.experts.w_gate) == ("experts", "latent", "expert_mlp")
    assert logical_axes(latent.experts.w_down) == ("experts", "expert_mlp", "latent")
    assert logical_axes(latent.latent_down) == ("embed", "latent")
    assert logical_axes(latent.latent_up) == ("latent", "embed")
    assert logical_axes(plain.experts.w_up) == ("experts", "embed", "expert_mlp")
    assert not hasattr(plain, "latent_down") and not hasattr(plain, "latent_norm_weight")


def test_router_bias_gets_no_gradient_and_no_optimizer_update():
    model = make_moe(router_bias_in_weights=True)  # the quirk puts b into the weights: still no gradient
    perturb_non_matrix_params(model, seed=5)
    x = jnp.asarray(inputs(6), jnp.float32)
    loss = lambda m: jnp.sum(m(x)[0] ** 2)  # noqa: E731

    assert not isinstance(model.router.e_score_correction_bias, nnx.Param)
    param_paths = nnx.state(model, nnx.Param).flat_state().paths
    assert ("router", "e_score_correction_bias") not in param_paths
    bias_grad = nnx.jit(nnx.grad(loss, argnums=nnx.DiffState(0, RouterBias)))(model)
    np.testing.assert_array_equal(bias_grad["router"]["e_score_correction_bias"][...], 0.0)

    bias_before = np.asarray(model.router.e_score_correction_bias[...])
    router_before = np.asarray(model.router.weight[...])
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    nnx.jit(lambda m, o: o.update(m, nnx.grad(loss)(m)))(model, optimizer)
    np.testing.assert_array_equal(model.router.e_score_correction_bias[...], bias_before)
    assert np.abs(np.asarray(model.router.weight[...]) - router_before).max() > 0


def test_quantile_updates_through_the_module_balance_a_skewed_batch():
    model = make_moe()
    rng = np.random.default_rng(7)
    # Tokens share a strong common direction, so a few experts win almost every token.
    x = jnp.asarray(rng.standard_normal((4, 64, D_MODEL)) + 2.0 * rng.standard_normal(D_MODEL), jnp.float32)
    _, stats = forward(model, x)
    assert load_metrics(stats.expert_load).max_over_mean > 2.0
    for _ in range(4):
        bias = model.router.e_score_correction_bias
        bias[...] = updated_router_bias(bias[...], stats, method="quantile", top_k=TOP_K)
        _, stats = forward(model, x)
    assert load_metrics(stats.expert_load).max_over_mean < 1.2


def test_bf16_compute_is_close_to_fp32():
    x = jnp.asarray(inputs(8), jnp.float32)
    y32, stats32 = forward(make_moe(), x)
    y16, stats16 = forward(make_moe(dtype=jnp.bfloat16), x)
    assert y16.dtype == jnp.bfloat16 and stats16.router_scores.dtype == jnp.float32
    np.testing.assert_array_equal(stats16.expert_load, stats32.expert_load)
    assert np.abs(np.asarray(y16, np.float32) - y32).max() < 3e-2 * np.abs(y32).max()


def test_jit_matches_eager():
    model = make_moe(**PLAIN_KIMI_LINEAR)
    x = jnp.asarray(inputs(9), jnp.float32)
    y_jit, stats_jit = forward(model, x)
    y, stats = model(x)
    np.testing.assert_allclose(y_jit, y, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(stats_jit.expert_load, stats.expert_load)


def test_moe_reads_its_config():
    model = make_moe(**PLAIN_KIMI_LINEAR, router_bias_in_weights=True, expert_matmul="dense", quantile_bins=16)
    assert (model.router.top_k, model.router.routed_scale, model.router.bias_in_weights) == (TOP_K, 2.446, True)
    assert model.experts.expert_matmul == "dense" and model.experts.w_gate.shape == (EXPERTS, D_MODEL, 6)
    assert model.shared.w_gate.shape == (D_MODEL, 12)
    _, stats = forward(model, jnp.asarray(inputs(10), jnp.float32))
    assert stats.bias_histogram.shape[-1] == 16 and stats.router_scores is None


@pytest.mark.parametrize(
    "options, error, message",
    [
        (dict(latent_dim=None, latent_norm=True), ConfigError, "latent_norm: needs a latent_dim"),
        (dict(activation="relu"), ValueError, "unknown GLU activation"),
        (dict(top_k=EXPERTS), ConfigError, "top_k: must be below num_experts"),
        (dict(router_score="tanh"), ValueError, "unknown router score"),
        (dict(expert_groups=3), ConfigError, "expert_groups: must divide"),
    ],
)
def test_bad_configurations_fail_at_construction(options, error, message):
    with pytest.raises(error, match=message):
        make_moe(**options)
