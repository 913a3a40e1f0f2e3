"""Feed-forward math of SPEC §4: GLU activations, the sigmoid router, dropless routed experts
and the auxiliary-loss-free balancing of the router's selection bias.

Shapes: N tokens (flattened batch), d input width (the latent width for LatentMoE), E experts,
k experts per token, F expert (or dense) hidden width.

    situ_glu(a, u)   = [beta tanh(a/beta) sigmoid(a)] * [beta_lin tanh(u/beta_lin)]   fp32 inside
    swiglu(a, u)     = SiLU(a) * u                                                      fp32 inside
    glu_ffn(x)       = act(x W_gate, x W_up) W_down                                     dense GLU
    s                = sigmoid(logits)  or  softmax_E(logits)                           router, fp32
    indices          = top-k_j (s_j + b_j)  (within the top groups when grouped, see below)
    p_i              = s_i / (sum_selected s + 1e-20) * routed_scale   (renormalize; else s_i * routed_scale)
    grouped top-k    : E experts in G equal groups; group score = sum of its top-2 s + b; the
                       best ``topk_groups`` groups stay, the others' experts are excluded
    routed_experts   : y_t = sum_i p_ti * E_{e_ti}(x_t), dropless, grouped with lax.ragged_dot
    dense_experts    : the same function, every expert on every token weighted by a dense
                       [N, E] routing matrix (zero off the chosen experts): E/k times the FLOPs,
                       no sorting -- faster for a few experts on CPU, where ragged_dot is slow

Balancing (after each optimizer step, never through gradients):
    sign:      b_j += rate * sign(mean_load - load_j)
    quantile:  alpha_t = (k+1)-th largest s_t + b (among the token's allowed experts when grouped);
               r_tj = alpha_t - s_tj;  b_j = k/E quantile of {r_tj}_t;  b <- b - mean(b)

The routed path is three pieces so that an expert-parallel dispatch (shard_map + all_to_all over
an "expert" mesh axis) can replace the movement around the unchanged grouped computation:
``sort_by_expert`` -> ``expert_glu`` -> ``unsort_and_combine``. Expert weights are dense arrays
or `k3jax.ops.mxfp4.Mxfp4Experts` (packed MXFP4, decoded per tile inside the grouped GEMMs).
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from k3jax.ops.mxfp4 import Mxfp4Experts, grouped_matmul
from k3jax.ops.products import product

ACTIVATIONS = ("situ", "swiglu")
BALANCING = ("sign", "quantile")
ROUTER_SCORES = ("sigmoid", "softmax")
ROUTE_NORM_EPS = 1e-20

GLUActivation = Callable[[jax.Array, jax.Array], jax.Array]


# --- GLU activations -------------------------------------------------------------------------


def _at_least_fp32(x: jax.Array) -> jax.Array:
    """x in fp32, or in its own dtype when that is wider (float64 under x64)."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def situ_glu(gate: jax.Array, up: jax.Array, beta: float = 4.0, beta_linear: float | None = 25.0) -> jax.Array:
    """SiTU-GLU (K3): ``[beta tanh(a/beta) sigmoid(a)] * [beta_lin tanh(u/beta_lin)]``.

    ``gate`` (a) and ``up`` (u) have the same shape [..., F]; computed in fp32, returned in
    ``gate.dtype``. Both factors are soft-clipped: |gate factor| < beta, |up factor| < beta_lin;
    ``beta_linear=None`` leaves u unclipped (the HF reference without a linear beta).
    """
    a, u = _at_least_fp32(gate), _at_least_fp32(up)
    gated = beta * jnp.tanh(a / beta) * jax.nn.sigmoid(a)
    linear = u if beta_linear is None else beta_linear * jnp.tanh(u / beta_linear)
    return (gated * linear).astype(gate.dtype)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """SwiGLU (Kimi Linear): ``SiLU(a) * u = a sigmoid(a) u``, fp32 inside, returned in ``gate.dtype``."""
    a, u = _at_least_fp32(gate), _at_least_fp32(up)
    return (jax.nn.silu(a) * u).astype(gate.dtype)


def glu_activation(name: str, situ_beta: float = 4.0, situ_beta_linear: float | None = 25.0) -> GLUActivation:
    """The GLU activation ``(gate, up) -> hidden`` called ``name`` ("situ" or "swiglu")."""
    if name == "situ":
        return functools.partial(situ_glu, beta=situ_beta, beta_linear=situ_beta_linear)
    if name == "swiglu":
        return swiglu
    raise ValueError(f"unknown GLU activation {name!r}; expected one of {ACTIVATIONS}")


def glu_ffn(
    x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, activation: GLUActivation
) -> jax.Array:
    """Dense GLU feed-forward: ``y = act(x W_gate, x W_up) W_down``.

    x [..., d], W_gate / W_up [d, F] (w1 / w3), W_down [F, d] (w2) -> y [..., d] in x.dtype.
    """
    hidden = activation(x @ w_gate, x @ w_up)
    return hidden @ w_down


# --- router ----------------------------------------------------------------------------------


def router_scores(logits: jax.Array, score: str = "sigmoid") -> jax.Array:
    """Router affinities in fp32, logits [N, E] -> s [N, E]: ``sigmoid(logits)`` (K3, Kimi Linear)
    or ``softmax(logits)`` over the experts."""
    logits = _at_least_fp32(logits)
    if score == "sigmoid":
        return jax.nn.sigmoid(logits)
    if score == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    raise ValueError(f"unknown router score {score!r}; expected one of {ROUTER_SCORES}")


def limit_to_top_groups(biased: jax.Array, expert_groups: int = 1, topk_groups: int = 1) -> jax.Array:
    """Grouped top-k's expert mask applied to the biased scores (DeepSeek-V3 / Kimi's noaux_tc).

    The E experts form ``expert_groups`` contiguous groups of E/G; group g scores
    ``sum of the 2 largest (s + b) in g``; the ``topk_groups`` best groups keep their scores, every
    other expert gets -inf. biased [N, E] -> [N, E]; the identity when G = 1 or topk_groups = G.
    """
    if expert_groups == 1 or topk_groups == expert_groups:
        return biased
    num_tokens, num_experts = biased.shape
    grouped = biased.reshape(num_tokens, expert_groups, num_experts // expert_groups)
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
    _, best = jax.lax.top_k(group_scores, topk_groups)
    kept = jnp.any(jax.nn.one_hot(best, expert_groups, dtype=bool), axis=-2)     # [N, G]
    return jnp.where(kept[:, :, None], grouped, -jnp.inf).reshape(num_tokens, num_experts)


def select_experts(
    scores: jax.Array,
    bias: jax.Array,
    top_k: int,
    routed_scale: float = 1.0,
    bias_in_weights: bool = False,
    renormalize: bool = True,
    expert_groups: int = 1,
    topk_groups: int = 1,
) -> tuple[jax.Array, jax.Array]:
    """Top-k selection on biased scores; weights from the unbiased scores.

        indices_t = top-k_j (s_tj + b_j)   over the experts `limit_to_top_groups` leaves   [N, k] int32
        p_ti      = s_{t,e_i} / (sum_{j in indices_t} s_tj + 1e-20) * routed_scale         [N, k] fp32
                    (``renormalize=False``: p_ti = s_{t,e_i} * routed_scale)

    so with renormalisation each token's weights sum to ``routed_scale``, and the bias b [E] only
    changes *which* experts are chosen (vLLM's behaviour, which k3jax follows).
    ``bias_in_weights=True`` reproduces the Kimi Linear Hugging Face code, whose in-place add
    leaks b into the weights: p uses (s + b) in place of s.
    """
    biased = scores + bias.astype(scores.dtype)
    _, indices = jax.lax.top_k(limit_to_top_groups(biased, expert_groups, topk_groups), top_k)
    weight_source = biased if bias_in_weights else scores
    chosen = jnp.take_along_axis(weight_source, indices, axis=-1)
    if renormalize:
        chosen = chosen / (jnp.sum(chosen, axis=-1, keepdims=True) + ROUTE_NORM_EPS)
    return indices.astype(jnp.int32), _at_least_fp32(chosen * routed_scale)


# --- dropless routed experts -----------------------------------------------------------------


def sort_by_expert(x: jax.Array, indices: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Copy each token once per chosen expert and group the copies by expert.

    The N*k assignments a = t*k + i (token t, slot i) are stably sorted by expert id.
    x [N, d], indices [N, k] -> (x_sorted [N*k, d], order [N*k], group_sizes [E] int32), where
    x_sorted[r] = x[order[r] // k]; expert j owns the contiguous rows [o_j, o_j + group_sizes[j])
    with o_j = sum(group_sizes[:j]).
    """
    top_k = indices.shape[-1]
    flat_experts = indices.reshape(-1)
    order = jnp.argsort(flat_experts, stable=True)
    group_sizes = jnp.bincount(flat_experts, length=num_experts).astype(jnp.int32)
    return x[order // top_k], order, group_sizes


def unsort_and_combine(y_sorted: jax.Array, order: jax.Array, weights: jax.Array) -> jax.Array:
    """Inverse of ``sort_by_expert`` followed by the weighted sum over each token's experts.

    y_sorted [N*k, d] (rows in ``order``), weights [N, k] -> y [N, d] with
    y_t = sum_i weights[t, i] * y_assign[t*k + i], summed in fp32, returned in y_sorted.dtype.
    """
    y_assign = jnp.zeros_like(y_sorted).at[order].set(y_sorted, unique_indices=True)
    return combine_assignments(y_assign, weights)


def combine_assignments(y_assign: jax.Array, weights: jax.Array) -> jax.Array:
    """The weighted sum over each token's experts: ``y_t = sum_i weights[t, i] * y_assign[t*k + i]``.

    y_assign [N*k, d] in assignment order, weights [N, k] -> y [N, d], summed in fp32, returned in
    y_assign.dtype.
    """
    num_tokens, top_k = weights.shape
    wide = _at_least_fp32(y_assign.reshape(num_tokens, top_k, -1))
    return jnp.einsum("tkd,tk->td", wide, weights.astype(wide.dtype)).astype(y_assign.dtype)


def expert_glu(
    x_sorted: jax.Array,
    group_sizes: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    activation: GLUActivation,
) -> jax.Array:
    """Each expert's GLU on its contiguous group of rows (grouped GEMMs, `k3jax.ops.mxfp4.grouped_matmul`:
    ``lax.ragged_dot`` for dense weights, decoded per tile for `Mxfp4Experts`).

    x_sorted [M, d] grouped by expert, group_sizes [E], W_gate / W_up [E, d, F], W_down [E, F, d]:
    rows r of group j -> act(x_r W_gate[j], x_r W_up[j]) W_down[j]. Returns [M, d] in x_sorted.dtype.
    """
    gate = grouped_matmul(x_sorted, w_gate, group_sizes)
    up = grouped_matmul(x_sorted, w_up, group_sizes)
    return grouped_matmul(activation(gate, up), w_down, group_sizes)


def equal_groups_glu(x: jax.Array, w_gate, w_up, w_down, activation: GLUActivation) -> jax.Array:
    """Expert j's GLU on its own R rows: x [E, R, d] -> [E, R, d] in x.dtype; batched GEMMs for dense
    weights [E, d, F] / [E, F, d], `expert_glu` over E groups of R rows for `Mxfp4Experts` (decoded per tile)."""
    if not isinstance(w_gate, Mxfp4Experts):
        return glu_ffn(x, w_gate, w_up, w_down, activation)
    experts, rows, width = x.shape
    sizes = jnp.full((experts,), rows, jnp.int32)
    return expert_glu(x.reshape(experts * rows, width), sizes, w_gate, w_up, w_down, activation).reshape(x.shape)


def routed_experts(
    x: jax.Array,
    indices: jax.Array,
    weights: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    activation: GLUActivation,
) -> jax.Array:
    """Dropless mixture of GLU experts: ``y_t = sum_i p_ti E_{e_ti}(x_t)``.

    E_j(x) = act(x W_gate[j], x W_up[j]) W_down[j]. x [N, d], indices / weights [N, k],
    W_gate / W_up [E, d, F], W_down [E, F, d] -> y [N, d] in x.dtype. Every assignment is
    computed (no capacity, no dropped tokens): sort by expert, grouped GEMMs, unsort, combine.
    """
    x_sorted, order, group_sizes = sort_by_expert(x, indices, w_gate.shape[0])
    y_sorted = expert_glu(x_sorted, group_sizes, w_gate, w_up, w_down, activation)
    return unsort_and_combine(y_sorted, order, weights)


def dense_experts(
    x: jax.Array,
    indices: jax.Array,
    weights: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    activation: GLUActivation,
) -> jax.Array:
    """``routed_experts`` computed densely: ``y_t = sum_j P_tj E_j(x_t)`` with ``P_tj = p_ti`` when
    ``e_ti = j`` and 0 otherwise, so unchosen experts contribute nothing (and get no gradient).

    As three plain GEMMs over all experts at once: ``h = act(x [W_gate_1 .. W_gate_E],
    x [W_up_1 .. W_up_E])`` ([N, E*F]), each expert's block scaled by P_tj, then
    ``y = h [W_down_1; ..; W_down_E]`` (the sum over experts is the GEMM's, accumulated in fp32).
    x [N, d], indices / weights [N, k], W_gate / W_up [E, d, F], W_down [E, F, d] -> y [N, d] in x.dtype.
    """
    num_experts, width, hidden = w_gate.shape
    routing = jnp.einsum("nk,nke->ne", _at_least_fp32(weights),
                         jax.nn.one_hot(indices, num_experts, dtype=_at_least_fp32(weights).dtype))
    side_by_side = lambda w: jnp.moveaxis(w, 0, 1).reshape(width, num_experts * hidden)  # noqa: E731
    h = activation(product(x, side_by_side(w_gate)), product(x, side_by_side(w_up))).reshape(-1, num_experts, hidden)
    h = (h * routing[..., None].astype(h.dtype)).reshape(-1, num_experts * hidden)
    y = jnp.matmul(h, w_down.reshape(num_experts * hidden, -1), preferred_element_type=_at_least_fp32(h).dtype)
    return y.astype(x.dtype)


EXPERT_MATMULS = {"ragged_dot": routed_experts, "dense": dense_experts}


# --- load statistics -------------------------------------------------------------------------


class MoEStats(NamedTuple):
    """What one MoE layer's forward pass reports to the trainer (a pytree, no gradients).

    expert_load   [E] fp32  tokens routed to each expert (masked tokens not counted)
    router_scores [N, E] fp32  router affinities s, the input of the exact quantile update
                            (None when the layer reports ``bias_histogram`` instead)
    token_mask    [N] bool  which tokens count for balancing (False: padding)
    dropped       [] fp32   (token, expert) assignments a capacity dispatch dropped
                            (`k3jax.sharding.expert_parallel`; 0 when dropless; None in stats built by hand)
    bias_histogram [E, bins] int32  ``required_bias_histogram`` of the counted tokens, the input
                            of the histogram quantile update (histograms of shards add up)
    """

    expert_load: jax.Array
    router_scores: jax.Array | None
    token_mask: jax.Array
    dropped: jax.Array | None = None
    bias_histogram: jax.Array | None = None


class LoadMetrics(NamedTuple):
    """Balance of one layer's routing: max_over_mean = max_j load_j / mean_j load_j (1 is perfect),
    zero_fraction = share of experts that received no token."""

    max_over_mean: jax.Array
    zero_fraction: jax.Array


def expert_load(indices: jax.Array, num_experts: int, token_mask: jax.Array | None = None) -> jax.Array:
    """Tokens per expert: load_j = #{(t, i): indices[t, i] = j, token_mask[t]}. indices [N, k] -> [E] fp32."""
    counted = jnp.ones(indices.shape, jnp.float32)
    if token_mask is not None:
        counted = counted * token_mask.astype(jnp.float32)[:, None]
    return jnp.zeros(num_experts, jnp.float32).at[indices].add(counted)


def load_metrics(load: jax.Array) -> LoadMetrics:
    """``LoadMetrics`` of a load vector [E] (or stacked [..., E]); max/mean is 0 when no token was routed."""
    mean = jnp.mean(load, axis=-1)
    max_over_mean = jnp.max(load, axis=-1) / jnp.where(mean > 0, mean, 1.0)
    return LoadMetrics(max_over_mean, jnp.mean((load == 0).astype(jnp.float32), axis=-1))


# --- balancing updates of the selection bias -------------------------------------------------


def sign_bias_update(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
    """Sign balancing (DeepSeek-V3, Kimi Linear): ``b_j + rate * sign(mean_j' load_j' - load_j)``.

    Under-loaded experts gain ``rate``, over-loaded ones lose it, exactly balanced ones keep b_j.
    bias, load [E] -> new bias [E] in bias.dtype.
    """
    step = rate * jnp.sign(jnp.mean(load) - load)
    return (bias + step).astype(bias.dtype)


def required_bias(
    scores: jax.Array, bias: jax.Array, top_k: int, expert_groups: int = 1, topk_groups: int = 1
) -> jax.Array:
    """The bias each expert would need to enter each token's top-k: ``r_tj = alpha_t - s_tj``.

    alpha_t is the (k+1)-th largest biased score s_t + b (the token's cutoff): expert j is
    chosen for t exactly when s_tj + b_j beats the cutoff, i.e. when b_j > r_tj (other biases
    held fixed). With grouped top-k the cutoff is taken among the experts of the token's selected
    groups (`limit_to_top_groups`), so r_tj is exact for those experts and, for an expert outside
    them, the bias it would need once its group is selected. scores [N, E], bias [E] -> r [N, E]
    fp32. Needs more than top_k experts in the selected groups.
    """
    biased = scores.astype(jnp.float32) + bias.astype(jnp.float32)
    cutoff = jax.lax.top_k(limit_to_top_groups(biased, expert_groups, topk_groups), top_k + 1)[0][:, top_k]
    return cutoff[:, None] - scores.astype(jnp.float32)


def _target_rank(num_tokens: jax.Array, top_k: int, num_experts: int) -> jax.Array:
    """m = ceil(k n / E) in exact integer arithmetic: the rank of the k/E quantile of n values."""
    return (top_k * num_tokens + num_experts - 1) // num_experts


def quantile_bias_update(
    scores: jax.Array,
    bias: jax.Array,
    top_k: int,
    token_mask: jax.Array | None = None,
    expert_groups: int = 1,
    topk_groups: int = 1,
) -> jax.Array:
    """Quantile balancing (K3): the bias that would give every expert its k/E share of the tokens.

        r_tj  = alpha_t - s_tj                         (``required_bias``, current bias b, groups)
        b'_j  = r_j,(m),  m = ceil(k n / E)            (m-th smallest of {r_tj} over the n counted tokens)
        b'    <- b' - mean(b')

    Quantile convention: the lower ("inverted CDF") k/E quantile, i.e. the smallest r whose
    empirical CDF reaches k/E — ``numpy.quantile(r, k/E, method="inverted_cdf")``; it is the
    limit of the histogram estimate (``quantile_bias_from_histogram``) as the bins shrink.
    Centring is free (only differences of b change the selection) and keeps b from drifting.
    The result overwrites b once per optimizer step. scores [N, E] (sigmoid, fp32),
    bias [E], token_mask [N] bool or None -> new bias [E] fp32; b is unchanged when no token counts.
    """
    required = required_bias(scores, bias, top_k, expert_groups, topk_groups)
    num_experts = scores.shape[-1]
    if token_mask is None:
        num_tokens = jnp.asarray(scores.shape[0])
    else:
        required = jnp.where(token_mask[:, None], required, jnp.inf)
        num_tokens = jnp.sum(token_mask.astype(jnp.int32))
    rank = _target_rank(num_tokens, top_k, num_experts)
    quantile = jnp.take(jnp.sort(required, axis=0), jnp.maximum(rank - 1, 0), axis=0)
    centred = quantile - jnp.mean(quantile)
    return jnp.where(num_tokens > 0, centred, bias.astype(jnp.float32))


def _histogram_range(bias: jax.Array, num_bins: int) -> tuple[jax.Array, jax.Array]:
    """Lower edge and bin width covering every possible r: r_tj = s_tk' + b_k' - s_tj lies in
    (min b - 1, max b + 1) because sigmoid and softmax scores lie in (0, 1)."""
    low = jnp.min(bias) - 1.0
    return low, (jnp.max(bias) + 1.0 - low) / num_bins


def required_bias_histogram(
    scores: jax.Array,
    bias: jax.Array,
    top_k: int,
    num_bins: int = 1000,
    token_mask: jax.Array | None = None,
    expert_groups: int = 1,
    topk_groups: int = 1,
) -> jax.Array:
    """Per-expert histogram of ``required_bias`` over uniform bins spanning [min b - 1, max b + 1].

    The scalable form of the quantile update's input: histograms of micro-batches and of
    data-parallel ranks add (sum / psum them), all computed with the same bias b, which stays
    fixed until the optimizer step. scores [N, E], bias [E] -> counts [E, num_bins] int32.
    """
    low, width = _histogram_range(bias.astype(jnp.float32), num_bins)
    required = required_bias(scores, bias, top_k, expert_groups, topk_groups)
    bins = jnp.clip(jnp.floor((required - low) / width), 0, num_bins - 1).astype(jnp.int32)
    counted = jnp.ones(required.shape, jnp.int32)
    if token_mask is not None:
        counted = counted * token_mask.astype(jnp.int32)[:, None]
    experts = jnp.broadcast_to(jnp.arange(scores.shape[-1]), required.shape)
    return jnp.zeros((scores.shape[-1], num_bins), jnp.int32).at[experts, bins].add(counted)


def quantile_bias_from_histogram(histogram: jax.Array, bias: jax.Array, top_k: int) -> jax.Array:
    """The quantile update read from ``required_bias_histogram`` counts (summed over the step).

    For expert j with n counted tokens, the target count is c = k n / E; the quantile lies in the
    first bin whose cumulative count reaches c, at the linear interpolation
    position = bin + (c - count before the bin) / count in the bin (uniform mass inside a bin);
    b'_j = low + position * width, then centred. Agrees with ``quantile_bias_update`` to within
    two bin widths; b is unchanged when no token was counted.
    histogram [E, B], bias [E] (the bias the histogram was built with) -> [E] fp32.
    """
    num_experts, num_bins = histogram.shape
    _, width = _histogram_range(bias.astype(jnp.float32), num_bins)
    cumulative = jnp.cumsum(histogram, axis=-1)
    target = cumulative[:, -1].astype(jnp.float32) * (top_k / num_experts)
    target_bin = jnp.minimum(jnp.sum(cumulative < target[:, None], axis=-1), num_bins - 1)
    in_bin = jnp.take_along_axis(histogram, target_bin[:, None], axis=-1)[:, 0]
    before = jnp.take_along_axis(cumulative, target_bin[:, None], axis=-1)[:, 0] - in_bin
    position = target_bin + (target - before) / jnp.maximum(in_bin, 1)
    centred = (position - jnp.mean(position)) * width
    return jnp.where(cumulative[0, -1] > 0, centred, bias.astype(jnp.float32))


def updated_router_bias(
    bias: jax.Array,
    stats: MoEStats,
    *,
    method: str,
    top_k: int,
    rate: float = 1e-3,
    expert_groups: int = 1,
    topk_groups: int = 1,
) -> jax.Array:
    """The selection bias after one optimizer step, by ``method`` ("sign" or "quantile").

    "sign" moves b by ``rate`` per step using ``stats.expert_load`` (1e-3 is DeepSeek-V3's rate);
    "quantile" overwrites b from ``stats.bias_histogram`` when the layer reported one (built with
    the same groups), else from ``stats.router_scores`` and ``stats.token_mask`` with the cutoffs
    of grouped top-k (rate unused).
    For a stack of layers whose stats carry a leading layer axis, ``jax.vmap`` this function.
    """
    if method == "sign":
        return sign_bias_update(bias, stats.expert_load, rate)
    if method == "quantile" and stats.bias_histogram is not None:
        return quantile_bias_from_histogram(stats.bias_histogram, bias, top_k)
    if method == "quantile":
        return quantile_bias_update(stats.router_scores, bias, top_k, stats.token_mask, expert_groups, topk_groups)
    raise ValueError(f"unknown balancing method {method!r}; expected one of {BALANCING}")
