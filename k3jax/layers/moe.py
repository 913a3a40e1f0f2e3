"""Mixture-of-experts feed-forward (SPEC §4): router, routed experts, Stable LatentMoE / plain MoE.

Stable LatentMoE (K3), for a pre-normed token x in R^d:
    s = sigmoid(W_r x);  indices = top-k(s + b);  p = s_sel / (sum s_sel + 1e-20) * routed_scale
    (or softmax scores, unnormalised weights, grouped top-k: `k3jax.ops.moe.select_experts`)
    z = W_down x                                  (d -> l, shared by all routed experts)
    u = sum_i p_i E_i(z)                          (E_i a GLU of width m on l-dim inputs)
    y = W_up RMSNorm(u) + Shared(x)               (l -> d; Shared one GLU of width n_shared * m)
Plain MoE (Kimi Linear): l = d and no W_down / W_up / norm: y = u + Shared(x).

The selection bias b is a ``RouterBias`` variable, not an ``nnx.Param``: gradients and optimizers
filtered on ``nnx.Param`` never see it. The trainer overwrites it after each optimizer step with
``k3jax.ops.moe.updated_router_bias(bias, stats, ...)`` from the ``MoEStats`` the layer returns.

Under `k3jax.sharding.use_mesh` with an expert dispatch configured, the routed experts run
expert-parallel (`k3jax.expert_parallel`): only the latents z cross devices.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.expert_parallel import expert_parallel_experts
from k3jax.layers.ffn import DenseGLU
from k3jax.layers.params import param, truncated_normal
from k3jax.ops.moe import (
    EXPERT_MATMULS,
    ROUTER_SCORES,
    MoEStats,
    expert_load,
    glu_activation,
    required_bias_histogram,
    router_scores,
    select_experts,
)
from k3jax.ops.norms import rms_norm
from k3jax.ops.precision import einsum
from k3jax.sharding import expert_placement


class RouterBias(nnx.Variable):
    """The router's selection bias (``e_score_correction_bias``): changed only by the balancing
    updates, never by gradients."""


class Router(nnx.Module):
    """Top-k router on the full-width x: weight [d, E] ("embed", "experts"), bias [E].

    Args:
      d_model, num_experts, top_k: d, E, k.
      routed_scale: the routing weights of each token sum to this (times the scores' sum
        without ``renormalize``).
      bias_in_weights: reproduce the Kimi Linear HF quirk (bias leaks into the weights).
      score, renormalize, expert_groups, topk_groups: the router score function ("sigmoid" or
        "softmax"), renormalisation and grouped top-k of `k3jax.ops.moe.select_experts`.
      init_std, param_dtype: weight init std and storage dtype (the bias is always fp32, zeros).
    """

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        top_k: int,
        *,
        routed_scale: float = 1.0,
        bias_in_weights: bool = False,
        score: str = "sigmoid",
        renormalize: bool = True,
        expert_groups: int = 1,
        topk_groups: int = 1,
        init_std: float = 0.02,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        if score not in ROUTER_SCORES:
            raise ValueError(f"unknown router score {score!r}; expected one of {ROUTER_SCORES}")
        if num_experts % expert_groups or not 0 < topk_groups <= expert_groups:
            raise ValueError(f"expert_groups must divide num_experts and topk_groups be in [1, expert_groups], got "
                             f"{expert_groups}, {topk_groups} for {num_experts} experts")
        if not 0 < top_k < num_experts:
            raise ValueError(f"top_k must be in [1, num_experts - 1], got top_k={top_k}, num_experts={num_experts}")
        self.weight = param(rngs, truncated_normal(init_std), (d_model, num_experts), ("embed", "experts"), param_dtype)
        self.e_score_correction_bias = param(
            rngs, nnx.initializers.zeros, (num_experts,), ("experts",), jnp.float32, variable_type=RouterBias
        )
        self.top_k = top_k
        self.routed_scale = routed_scale
        self.bias_in_weights = bias_in_weights
        self.score, self.renormalize = score, renormalize
        self.expert_groups, self.topk_groups = expert_groups, topk_groups

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [N, d] -> (indices [N, k] int32, weights [N, k] fp32, scores [N, E] fp32), all in fp32."""
        logits = einsum("nd,de->ne", x.astype(jnp.float32), self.weight[...].astype(jnp.float32))
        scores = router_scores(logits, self.score)
        bias = jax.lax.stop_gradient(self.e_score_correction_bias[...])
        indices, weights = select_experts(scores, bias, self.top_k, self.routed_scale, self.bias_in_weights,
                                          self.renormalize, self.expert_groups, self.topk_groups)
        return indices, weights, scores


class RoutedExperts(nnx.Module):
    """E GLU experts of width m on ``input_axis``-named inputs of width ``input_width``, stacked:
    w_gate / w_up [E, in, m] ("experts", in, "expert_mlp"), w_down [E, m, in].

    The call is ``k3jax.ops.moe.routed_experts`` (dropless, ``lax.ragged_dot``) or, with
    ``expert_matmul="dense"``, ``dense_experts`` (the same function, every expert on every token);
    when `k3jax.sharding.expert_placement` returns a placement (an active mesh with an expert
    dispatch), `k3jax.expert_parallel.expert_parallel_experts` replaces that call on these weights.
    """

    def __init__(
        self,
        num_experts: int,
        input_width: int,
        expert_width: int,
        *,
        input_axis: str,
        activation: str,
        situ_beta: float,
        situ_beta_linear: float | None,
        init_std: float,
        dtype,
        param_dtype,
        rngs: nnx.Rngs,
        expert_matmul: str = "ragged_dot",
    ):
        glu_activation(activation)  # fail at construction on an unknown name
        if expert_matmul not in EXPERT_MATMULS:
            raise ValueError(f"expert_matmul must be one of {tuple(EXPERT_MATMULS)}, got {expert_matmul!r}")
        self.expert_matmul = expert_matmul
        init = truncated_normal(init_std)
        up_axes = ("experts", input_axis, "expert_mlp")
        self.w_gate = param(rngs, init, (num_experts, input_width, expert_width), up_axes, param_dtype)
        self.w_up = param(rngs, init, (num_experts, input_width, expert_width), up_axes, param_dtype)
        self.w_down = param(
            rngs, init, (num_experts, expert_width, input_width), ("experts", "expert_mlp", input_axis), param_dtype
        )
        self.activation = activation
        self.situ_beta = situ_beta
        self.situ_beta_linear = situ_beta_linear
        self.dtype = dtype

    def __call__(self, x: jax.Array, indices: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [N, in], indices / weights [N, k] -> (sum_i weights_i E_{indices_i}(x) [N, in] in ``dtype``,
        (token, expert) assignments dropped by a capacity dispatch [] fp32)."""
        w_gate, w_up, w_down = (w[...].astype(self.dtype) for w in (self.w_gate, self.w_up, self.w_down))
        activation = glu_activation(self.activation, self.situ_beta, self.situ_beta_linear)
        x = x.astype(self.dtype)
        placement = expert_placement(x.shape[0], w_gate.shape[-1])
        if placement is not None:
            return expert_parallel_experts(x, indices, weights, w_gate, w_up, w_down, activation, placement)
        compute = EXPERT_MATMULS[self.expert_matmul]
        return compute(x, indices, weights, w_gate, w_up, w_down, activation), jnp.zeros((), jnp.float32)


class MoE(nnx.Module):
    """Stable LatentMoE (``latent_dim`` set) or plain MoE (``latent_dim=None``) with shared experts.

    Args (keyword only):
      d_model: model width d.
      num_experts, top_k: E routed experts, k chosen per token.
      expert_width: hidden width m of each routed expert.
      latent_dim: latent width l of LatentMoE (W_down d -> l, W_up l -> d), or None for plain MoE.
      latent_norm: RMSNorm on the combined expert output u before W_up (Stable LatentMoE);
        requires ``latent_dim``.
      shared_width: width of the one shared GLU (n_shared * m), or None for no shared expert.
      activation: "situ" or "swiglu", for routed and shared experts; situ_beta, situ_beta_linear
        are SiTU's beta and beta_lin.
      routed_scale: routing weights of each token sum to this (K3 1.0, Kimi Linear 2.446).
      bias_in_weights: the Kimi Linear HF routing quirk (see ``select_experts``); default off.
      router_score, renormalize, expert_groups, topk_groups: see `Router` (score, ...).
      norm_eps: eps of the latent RMSNorm.
      init_std: truncated-normal std of every weight matrix.
      dtype: compute dtype (fp32 or bf16); router, norm and activations run in fp32.
      param_dtype: storage dtype of the weights (the router bias is always fp32).
      expert_matmul: "ragged_dot" (grouped GEMMs, for many experts / accelerators) or "dense"
        (every expert on every token; faster for a few experts on CPU). Same function.
      quantile_bins: report ``MoEStats.bias_histogram`` with this many bins (for the histogram
        quantile balancing; summed over data-parallel shards) instead of the token scores.
      rngs: ``nnx.Rngs`` with a ``params`` stream.

    Parameters: ``router`` (weight, e_score_correction_bias), ``experts`` (w_gate, w_up, w_down
    stacked over E), ``latent_down`` [d, l], ``latent_up`` [l, d], ``latent_norm_weight`` [l]
    (LatentMoE only), ``shared`` (a ``DenseGLU``, when ``shared_width``).
    """

    def __init__(
        self,
        *,
        d_model: int,
        num_experts: int,
        top_k: int,
        expert_width: int,
        latent_dim: int | None = None,
        latent_norm: bool = False,
        shared_width: int | None = None,
        activation: str = "situ",
        routed_scale: float = 1.0,
        bias_in_weights: bool = False,
        router_score: str = "sigmoid",
        renormalize: bool = True,
        expert_groups: int = 1,
        topk_groups: int = 1,
        situ_beta: float = 4.0,
        situ_beta_linear: float | None = 25.0,
        norm_eps: float = 1e-5,
        init_std: float = 0.02,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        expert_matmul: str = "ragged_dot",
        quantile_bins: int | None = None,
        rngs: nnx.Rngs,
    ):
        if latent_norm and latent_dim is None:
            raise ValueError("latent_norm=True needs a latent_dim (plain MoE has no latent norm)")
        init = truncated_normal(init_std)
        self.router = Router(
            d_model,
            num_experts,
            top_k,
            routed_scale=routed_scale,
            bias_in_weights=bias_in_weights,
            score=router_score,
            renormalize=renormalize,
            expert_groups=expert_groups,
            topk_groups=topk_groups,
            init_std=init_std,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        self.experts = RoutedExperts(
            num_experts,
            d_model if latent_dim is None else latent_dim,
            expert_width,
            input_axis="embed" if latent_dim is None else "latent",
            activation=activation,
            situ_beta=situ_beta,
            situ_beta_linear=situ_beta_linear,
            init_std=init_std,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
            expert_matmul=expert_matmul,
        )
        if latent_dim is not None:
            self.latent_down = param(rngs, init, (d_model, latent_dim), ("embed", "latent"), param_dtype)
            self.latent_up = param(rngs, init, (latent_dim, d_model), ("latent", "embed"), param_dtype)
        if latent_norm:
            self.latent_norm_weight = param(rngs, nnx.initializers.ones, (latent_dim,), ("latent",), param_dtype)
        if shared_width is not None:
            self.shared = DenseGLU(
                d_model,
                shared_width,
                activation=activation,
                situ_beta=situ_beta,
                situ_beta_linear=situ_beta_linear,
                init_std=init_std,
                dtype=dtype,
                param_dtype=param_dtype,
                rngs=rngs,
            )
        self.num_experts = num_experts
        self.quantile_bins = quantile_bins
        self.latent_dim = latent_dim
        self.latent_norm = latent_norm
        self.shared_width = shared_width
        self.norm_eps = norm_eps
        self.dtype = dtype

    def __call__(self, x: jax.Array, token_mask: jax.Array | None = None) -> tuple[jax.Array, MoEStats]:
        """x [B, T, d] (already RMS-normed by the block), token_mask [B, T] bool or None (False:
        padding, routed and computed but not counted for balancing) -> (y [B, T, d] in ``dtype``,
        ``MoEStats`` over the N = B*T tokens)."""
        batch, length, d_model = x.shape
        tokens = x.reshape(batch * length, d_model)
        mask = jnp.ones(batch * length, bool) if token_mask is None else token_mask.reshape(-1).astype(bool)
        indices, weights, scores = self.router(tokens)
        tokens = tokens.astype(self.dtype)
        y, dropped = self._routed(tokens, indices, weights)
        if self.shared_width is not None:
            y = y + self.shared(tokens)
        scores = jax.lax.stop_gradient(scores)
        router = self.router
        histogram = None if self.quantile_bins is None else required_bias_histogram(
            scores, router.e_score_correction_bias[...], router.top_k, self.quantile_bins, mask,
            router.expert_groups, router.topk_groups)
        stats = MoEStats(
            expert_load=expert_load(indices, self.num_experts, mask),
            router_scores=scores if histogram is None else None,
            token_mask=mask,
            dropped=jax.lax.stop_gradient(dropped),
            bias_histogram=histogram,
        )
        return y.reshape(batch, length, d_model), stats

    def _routed(self, tokens: jax.Array, indices: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The routed branch: plain sum_i p_i E_i(x), or W_up RMSNorm(sum_i p_i E_i(W_down x)),
        and the count of dropped assignments."""
        if self.latent_dim is None:
            return self.experts(tokens, indices, weights)
        latent, dropped = self.experts(tokens @ self.latent_down[...].astype(self.dtype), indices, weights)
        if self.latent_norm:
            latent = rms_norm(latent, self.latent_norm_weight[...], self.norm_eps)
        return latent @ self.latent_up[...].astype(self.dtype), dropped
