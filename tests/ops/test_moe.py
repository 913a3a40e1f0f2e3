"""MoE ops (SPEC §4) against the independent float64 NumPy reference in tests/ops/numpy_moe.py."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from k3jax.ops import moe
from tests.helpers import rel_err
from tests.ops import numpy_moe as ref


def expert_weights(rng, num_experts, width, hidden):
    return (
        rng.standard_normal((num_experts, width, hidden)) / np.sqrt(width),
        rng.standard_normal((num_experts, width, hidden)) / np.sqrt(width),
        rng.standard_normal((num_experts, hidden, width)) / np.sqrt(hidden),
    )


def routing_case(seed, tokens=12, num_experts=6, top_k=2, width=8, hidden=5, starved_expert=True):
    """Tokens, their routing (expert 0 starved by a large negative bias) and expert weights."""
    rng = np.random.default_rng(seed)
    scores = ref.sigmoid(rng.standard_normal((tokens, num_experts)))
    bias = np.zeros(num_experts)
    if starved_expert:
        bias[0] = -10.0
    indices, weights = ref.route(scores, bias, top_k)
    x = rng.standard_normal((tokens, width))
    return x, indices, weights, expert_weights(rng, num_experts, width, hidden)


def f32(*arrays):
    return tuple(jnp.asarray(a, jnp.float32) for a in arrays)


# --- activations and router ------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, jax_fn, numpy_fn",
    [
        ("situ", moe.situ_glu, ref.situ_glu),
        ("situ betas 2, 3", functools.partial(moe.situ_glu, beta=2.0, beta_linear=3.0),
         functools.partial(ref.situ_glu, beta=2.0, beta_linear=3.0)),
        ("situ beta 2, no linear beta", functools.partial(moe.situ_glu, beta=2.0, beta_linear=None),
         functools.partial(ref.situ_glu, beta=2.0, beta_linear=None)),
        ("swiglu", moe.swiglu, ref.swiglu),
    ],
)
def test_glu_activations_match_numpy(name, jax_fn, numpy_fn):
    rng = np.random.default_rng(0)
    a, u = 12.0 * rng.standard_normal((2, 64, 16))  # wide range: both tanh factors saturate
    out = jax_fn(*f32(a, u))
    assert out.dtype == jnp.float32
    assert rel_err(out, numpy_fn(a, u)) < 1e-6


def test_glu_activation_keeps_bf16_dtype_and_rejects_unknown_names():
    a = jnp.ones((3, 4), jnp.bfloat16)
    assert moe.situ_glu(a, a).dtype == jnp.bfloat16
    assert moe.glu_activation("swiglu")(a, a).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="unknown GLU activation"):
        moe.glu_activation("gelu")


def test_router_scores_are_fp32_sigmoid():
    logits = np.random.default_rng(1).standard_normal((5, 7)) * 4
    scores = moe.router_scores(jnp.asarray(logits, jnp.bfloat16))
    assert scores.dtype == jnp.float32
    bf16_logits = np.asarray(jnp.asarray(logits, jnp.bfloat16), np.float64)
    np.testing.assert_allclose(scores, ref.sigmoid(bf16_logits), rtol=1e-6)


@pytest.mark.parametrize("routed_scale", [1.0, 2.446])
def test_select_experts_matches_numpy_and_weights_sum_to_routed_scale(routed_scale):
    rng = np.random.default_rng(2)
    scores = ref.sigmoid(rng.standard_normal((32, 8)))
    bias = 0.1 * rng.standard_normal(8)
    indices, weights = moe.select_experts(*f32(scores, bias), top_k=3, routed_scale=routed_scale)
    ref_indices, ref_weights = ref.route(scores, bias, 3, routed_scale)
    np.testing.assert_array_equal(indices, ref_indices)
    np.testing.assert_allclose(weights, ref_weights, rtol=1e-6)
    np.testing.assert_allclose(np.sum(weights, axis=-1), routed_scale, rtol=1e-6)


def test_selection_bias_changes_the_choice_and_nothing_else():
    rng = np.random.default_rng(3)
    scores = ref.sigmoid(rng.standard_normal((40, 8)))
    bias = np.array([0.5, 0, 0, 0, 0, 0, -0.5, 0.2])
    plain_indices, _ = moe.select_experts(*f32(scores, np.zeros(8)), top_k=2)
    indices, weights = moe.select_experts(*f32(scores, bias), top_k=2)
    assert np.mean(np.any(np.asarray(indices) != np.asarray(plain_indices), axis=-1)) > 0.3
    # Same weight formula, on the unbiased scores of the new selection.
    chosen = np.take_along_axis(scores, np.asarray(indices), axis=-1)
    np.testing.assert_allclose(weights, chosen / chosen.sum(-1, keepdims=True), rtol=1e-6)
    # The HF quirk: the same selection, weights from the biased scores.
    quirk_indices, quirk_weights = moe.select_experts(*f32(scores, bias), top_k=2, bias_in_weights=True)
    _, ref_quirk_weights = ref.route(scores, bias, 2, bias_in_weights=True)
    np.testing.assert_array_equal(quirk_indices, indices)
    np.testing.assert_allclose(quirk_weights, ref_quirk_weights, rtol=1e-5)
    assert np.abs(np.asarray(quirk_weights) - np.asarray(weights)).max() > 0.05


def test_router_scores_softmax_matches_numpy_and_unknown_names_fail():
    logits = np.random.default_rng(13).standard_normal((5, 7)) * 4
    scores = moe.router_scores(*f32(logits), score="softmax")
    np.testing.assert_allclose(scores, ref.softmax(logits), rtol=1e-5)
    with pytest.raises(ValueError, match="unknown router score"):
        moe.router_scores(*f32(logits), score="relu")


ROUTING_OPTIONS = {
    "unnormalised": dict(renormalize=False, routed_scale=2.446),
    "grouped 4 keep 2": dict(expert_groups=4, topk_groups=2),
    "grouped 2 keep 1, unnormalised": dict(expert_groups=2, topk_groups=1, renormalize=False),
    "grouped 2 keep 2 (plain top-k)": dict(expert_groups=2, topk_groups=2),
}


@pytest.mark.parametrize("options", ROUTING_OPTIONS.values(), ids=ROUTING_OPTIONS)
@pytest.mark.parametrize("score", ["sigmoid", "softmax"])
def test_select_experts_options_match_numpy(options, score):
    rng = np.random.default_rng(14)
    logits = 2 * rng.standard_normal((40, 8))
    scores = ref.sigmoid(logits) if score == "sigmoid" else ref.softmax(logits)
    bias = 0.05 * rng.standard_normal(8)
    indices, weights = moe.select_experts(*f32(scores, bias), top_k=3, **options)
    ref_indices, ref_weights = ref.route(scores, bias, 3, **options)
    np.testing.assert_array_equal(indices, ref_indices)
    np.testing.assert_allclose(weights, ref_weights, rtol=1e-5)


def test_grouped_top_k_skips_the_best_expert_of_a_weak_group():
    # groups of 2: top-2 sums 0.9, 0.99, 1.08, 0.2 -> groups 2 and 1 stay; expert 0 (the best) does not
    scores = np.array([[0.9, 0.0, 0.5, 0.49, 0.6, 0.48, 0.1, 0.1]])
    indices, weights = moe.select_experts(*f32(scores, np.zeros(8)), top_k=2, expert_groups=4, topk_groups=2)
    np.testing.assert_array_equal(indices, [[4, 2]])
    np.testing.assert_allclose(weights, [[0.6 / 1.1, 0.5 / 1.1]], rtol=1e-6)
    plain, _ = moe.select_experts(*f32(scores, np.zeros(8)), top_k=2)
    np.testing.assert_array_equal(plain, [[0, 4]])


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_router_weights_gradient_matches_numpy_finite_differences(renormalize):
    rng = np.random.default_rng(15)
    logits, bias, probe = rng.standard_normal((6, 8)), 0.1 * rng.standard_normal(8), rng.standard_normal((6, 3))
    options = dict(top_k=3, routed_scale=1.5, renormalize=renormalize, expert_groups=2, topk_groups=1)

    def jax_loss(logits):
        _, weights = moe.select_experts(moe.router_scores(logits, "softmax"), jnp.asarray(bias, jnp.float32), **options)
        return jnp.sum(weights * probe)

    def numpy_loss(logits):
        return np.sum(ref.route(ref.softmax(logits), bias, **options)[1] * probe)

    grad = jax.grad(jax_loss)(*f32(logits))
    step, expected = 1e-6, np.zeros_like(logits)
    for index in np.ndindex(logits.shape):
        shift = np.zeros_like(logits)
        shift[index] = step
        expected[index] = (numpy_loss(logits + shift) - numpy_loss(logits - shift)) / (2 * step)
    np.testing.assert_allclose(grad, expected, atol=2e-6 * np.abs(expected).max() + 1e-7, rtol=1e-4)


# --- dropless routed experts -----------------------------------------------------------------


def test_sort_by_expert_groups_copies_and_unsort_inverts_it():
    x, indices, weights, _ = routing_case(4)
    x_sorted, order, group_sizes = moe.sort_by_expert(*f32(x), jnp.asarray(indices), 6)
    experts_of_rows = indices.reshape(-1)[np.asarray(order)]
    assert np.all(np.diff(experts_of_rows) >= 0)
    np.testing.assert_array_equal(group_sizes, np.bincount(indices.reshape(-1), minlength=6))
    assert group_sizes[0] == 0
    np.testing.assert_array_equal(x_sorted, np.asarray(x, np.float32)[np.asarray(order) // 2])
    combined = moe.unsort_and_combine(x_sorted, order, *f32(weights))
    np.testing.assert_allclose(combined, x * weights.sum(-1, keepdims=True), rtol=1e-5)


@pytest.mark.parametrize("expert_matmul", ["ragged_dot", "dense"])
@pytest.mark.parametrize("activation", ["situ", "swiglu"])
def test_routed_experts_match_dense_numpy(activation, expert_matmul):
    x, indices, weights, (w_gate, w_up, w_down) = routing_case(5)
    y = moe.EXPERT_MATMULS[expert_matmul](
        *f32(x), jnp.asarray(indices), *f32(weights, w_gate, w_up, w_down), moe.glu_activation(activation)
    )
    expected = ref.routed_experts_dense(x, indices, weights, w_gate, w_up, w_down, activation)
    assert rel_err(y, expected) < 1e-5


@pytest.mark.parametrize("activation", ["situ", "swiglu"])
def test_ragged_and_dense_expert_gradients_agree(activation):
    x, indices, weights, experts = routing_case(6)
    probe = np.random.default_rng(7).standard_normal(x.shape)
    args = f32(x, weights, *experts)
    act = moe.glu_activation(activation)

    def loss(fn, x, weights, *experts):
        return jnp.sum(fn(x, jnp.asarray(indices), weights, *experts, act) * probe)

    grads = jax.grad(functools.partial(loss, moe.routed_experts), argnums=range(5))(*args)
    dense_grads = jax.grad(functools.partial(loss, moe.dense_experts), argnums=range(5))(*args)
    for name, grad, dense_grad in zip(["x", "weights", "w_gate", "w_up", "w_down"], grads, dense_grads):
        assert rel_err(grad, dense_grad) < 1e-5, name
    assert np.all(np.asarray(grads[2][0]) == 0)  # the starved expert gets no gradient


@pytest.mark.parametrize("expert_matmul", ["ragged_dot", "dense"])
def test_routed_experts_gradients_match_finite_differences_in_float64(expert_matmul):
    x, indices, weights, experts = routing_case(8, tokens=6, num_experts=4, width=4, hidden=3)
    with jax.enable_x64(True):
        def fn(x, weights, w_gate, w_up, w_down):
            return moe.EXPERT_MATMULS[expert_matmul](x, jnp.asarray(indices), weights, w_gate, w_up, w_down,
                                                     moe.situ_glu)

        check_grads(fn, tuple(jnp.asarray(a, jnp.float64) for a in (x, weights, *experts)), order=1, modes=("rev",))


# --- load statistics and balancing -----------------------------------------------------------


def test_expert_load_counts_unmasked_assignments():
    rng = np.random.default_rng(9)
    indices = np.stack([rng.choice(8, 3, replace=False) for _ in range(20)])
    mask = rng.random(20) < 0.7
    np.testing.assert_array_equal(moe.expert_load(jnp.asarray(indices), 8), ref.expert_load(indices, 8))
    np.testing.assert_array_equal(
        moe.expert_load(jnp.asarray(indices), 8, jnp.asarray(mask)), ref.expert_load(indices, 8, mask)
    )


def test_load_metrics():
    metrics = moe.load_metrics(jnp.array([0.0, 2.0, 6.0, 0.0]))
    np.testing.assert_allclose(metrics.max_over_mean, 3.0)
    np.testing.assert_allclose(metrics.zero_fraction, 0.5)
    np.testing.assert_allclose(moe.load_metrics(jnp.zeros(4)).max_over_mean, 0.0)


def test_sign_update_matches_numpy():
    bias = np.array([0.1, -0.2, 0.0, 0.3, 0.05])
    load = np.array([10.0, 2.0, 6.0, 6.0, 6.0])  # mean 6: one over, one under, three exact
    updated = moe.sign_bias_update(*f32(bias, load), 0.01)
    np.testing.assert_allclose(updated, ref.sign_update(bias, load, 0.01), rtol=1e-6)


@pytest.mark.parametrize("tokens, top_k, num_experts", [(64, 2, 8), (50, 3, 7), (13, 1, 4)])
@pytest.mark.parametrize("masked", [False, True])
def test_quantile_update_matches_numpy(tokens, top_k, num_experts, masked):
    rng = np.random.default_rng(tokens + top_k)
    scores = ref.sigmoid(rng.standard_normal((tokens, num_experts)) + np.linspace(-1, 1, num_experts))
    bias = 0.2 * rng.standard_normal(num_experts)
    mask = rng.random(tokens) < 0.6 if masked else None
    new = moe.quantile_bias_update(*f32(scores, bias), top_k, None if mask is None else jnp.asarray(mask))
    np.testing.assert_allclose(new, ref.quantile_update(scores, bias, top_k, mask), atol=1e-6)
    np.testing.assert_allclose(np.mean(new), 0.0, atol=1e-6)


def test_quantile_update_is_the_inverted_cdf_quantile():
    rng = np.random.default_rng(10)
    scores, bias = ref.sigmoid(rng.standard_normal((37, 6))), 0.3 * rng.standard_normal(6)
    alpha = np.sort(scores + bias, axis=-1)[:, -3]  # top_k = 2: the third largest
    quantiles = np.quantile(alpha[:, None] - scores, 2 / 6, axis=0, method="inverted_cdf")
    new = moe.quantile_bias_update(*f32(scores, bias), 2)
    np.testing.assert_allclose(new, quantiles - quantiles.mean(), atol=1e-6)


def test_quantile_updates_leave_bias_unchanged_without_counted_tokens():
    scores, bias = f32(np.full((4, 5), 0.5), np.arange(5.0))
    mask = jnp.zeros(4, bool)
    np.testing.assert_array_equal(moe.quantile_bias_update(scores, bias, 2, mask), bias)
    histogram = moe.required_bias_histogram(scores, bias, 2, num_bins=50, token_mask=mask)
    np.testing.assert_array_equal(moe.quantile_bias_from_histogram(histogram, bias, 2), bias)


def test_histogram_quantile_agrees_with_exact_within_two_bins():
    rng = np.random.default_rng(11)
    scores = ref.sigmoid(rng.standard_normal((3000, 8)) + np.linspace(-1.5, 1.5, 8))
    bias, num_bins = 0.3 * rng.standard_normal(8), 400
    halves = [moe.required_bias_histogram(*f32(part, bias), 2, num_bins) for part in np.split(scores, 2)]
    estimate = moe.quantile_bias_from_histogram(halves[0] + halves[1], *f32(bias), 2)
    bin_width = (bias.max() - bias.min() + 2.0) / num_bins
    np.testing.assert_allclose(estimate, ref.quantile_update(scores, bias, 2), atol=2 * bin_width)


def test_updated_router_bias_dispatches_on_method():
    rng = np.random.default_rng(12)
    scores = jnp.asarray(ref.sigmoid(rng.standard_normal((30, 6))), jnp.float32)
    bias = jnp.asarray(0.1 * rng.standard_normal(6), jnp.float32)
    indices, _ = moe.select_experts(scores, bias, 2)
    stats = moe.MoEStats(moe.expert_load(indices, 6), scores, jnp.ones(30, bool))
    sign = moe.updated_router_bias(bias, stats, method="sign", top_k=2, rate=0.01)
    quantile = moe.updated_router_bias(bias, stats, method="quantile", top_k=2)
    np.testing.assert_allclose(sign, ref.sign_update(np.asarray(bias), np.asarray(stats.expert_load), 0.01), rtol=1e-6)
    np.testing.assert_allclose(quantile, ref.quantile_update(np.asarray(scores), np.asarray(bias), 2), atol=1e-6)
    # A stack of layers: vmap over the leading layer axis of bias and stats.
    stacked = jax.vmap(functools.partial(moe.updated_router_bias, method="quantile", top_k=2))(
        jnp.stack([bias, -bias]), jax.tree.map(lambda a: jnp.stack([a, a]), stats)
    )
    np.testing.assert_allclose(stacked[0], quantile, atol=1e-6)
    np.testing.assert_allclose(stacked[1], ref.quantile_update(np.asarray(scores), -np.asarray(bias), 2), atol=1e-6)
    with pytest.raises(ValueError, match="unknown balancing method"):
        moe.updated_router_bias(bias, stats, method="aux_loss", top_k=2)


@pytest.mark.parametrize("groups, keep", [(4, 2), (2, 1)])
def test_quantile_update_with_groups_matches_numpy(groups, keep):
    rng = np.random.default_rng(16)
    scores = ref.sigmoid(rng.standard_normal((50, 8)) + np.linspace(-1, 1, 8))
    bias = 0.2 * rng.standard_normal(8)
    mask = rng.random(50) < 0.8
    stats = moe.MoEStats(jnp.zeros(8), *f32(scores), jnp.asarray(mask))
    update = moe.updated_router_bias(*f32(bias), stats, method="quantile", top_k=2, expert_groups=groups,
                                     topk_groups=keep)
    expected = ref.quantile_update(scores, bias, 2, mask, expert_groups=groups, topk_groups=keep)
    np.testing.assert_allclose(update, expected, atol=1e-6)
    assert np.abs(expected - ref.quantile_update(scores, bias, 2, mask)).max() > 1e-3   # groups matter here
    histogram = moe.required_bias_histogram(*f32(scores, bias), 2, 2000, jnp.asarray(mask), groups, keep)
    estimate = moe.quantile_bias_from_histogram(histogram, *f32(bias), 2)
    np.testing.assert_allclose(estimate, expected, atol=2 * (bias.max() - bias.min() + 2.0) / 2000)


# --- balancing simulations -------------------------------------------------------------------

NUM_EXPERTS, TOP_K, TOKENS = 16, 2, 2048
EXPERT_SKEW = jnp.linspace(-2.5, 2.5, NUM_EXPERTS)  # router prefers high-index experts


def skewed_scores(key):
    """One step's router scores: token-dependent noise on a strongly skewed expert preference."""
    return jax.nn.sigmoid(jax.random.normal(key, (TOKENS, NUM_EXPERTS)) + EXPERT_SKEW)


def load_under(bias, key):
    indices, _ = moe.select_experts(skewed_scores(key), bias, TOP_K)
    return moe.expert_load(indices, NUM_EXPERTS)


@functools.partial(jax.jit, static_argnames=("method", "steps"))
def balance(method, steps, rate=0.0):
    """Route fresh skewed batches for ``steps`` steps, updating the bias after each one."""

    def step(bias, key):
        scores = skewed_scores(key)
        indices, _ = moe.select_experts(scores, bias, TOP_K)
        stats = moe.MoEStats(moe.expert_load(indices, NUM_EXPERTS), scores, jnp.ones(TOKENS, bool))
        return moe.updated_router_bias(bias, stats, method=method, top_k=TOP_K, rate=rate), None

    bias, _ = jax.lax.scan(step, jnp.zeros(NUM_EXPERTS), jax.random.split(jax.random.key(0), steps))
    return bias


# With 256 assignments per expert and step, sampling noise alone puts max/mean near 1.1-1.2.
@pytest.mark.parametrize("method, steps, rate", [("quantile", 10, 0.0), ("sign", 300, 0.005)])
def test_balancing_makes_skewed_loads_near_uniform(method, steps, rate):
    held_out = jax.random.key(1)
    before = moe.load_metrics(load_under(jnp.zeros(NUM_EXPERTS), held_out))
    assert before.max_over_mean > 3.0 and before.zero_fraction > 0.2  # the skew really starves experts
    after = moe.load_metrics(load_under(balance(method, steps, rate), held_out))
    assert after.max_over_mean < 1.3
    assert after.zero_fraction == 0.0
