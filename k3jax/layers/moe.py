"""Mixture-of-experts feed-forward (SPEC §4): router, routed experts, Stable LatentMoE / plain MoE.

Stable LatentMoE (K3), for a pre-normed token x in R^d:
    (or softmax scores, unnormalised weights, grouped top-k: `k3jax.ops.moe.select_experts`)
    s = sigmoid(W_r x);  indices = top-k(s + b);  p = s_sel / (sum s_sel + 1e-20) * routed_scale
    z = W_down x                                  (d -> l, shared by all routed experts)
    u = sum_i p_i E_i(z)                          (E_i a GLU of width m on l-dim inputs)
    y = W_up RMSNorm(u) + Shared(x)               (l -> d; Shared one GLU of width n_shared * m)
Plain MoE (Kimi Linear): l = d and no W_down / W_up / norm: y = u + Shared(x).

The selection bias b is a ``RouterBias`` variable, not an ``nnx.Param``: gradients and optimizers
filtered on ``nnx.Param`` never see it (nor the frozen MXFP4 routed experts, ``ExpertCodes``). The
trainer overwrites it after each optimizer step with ``k3jax.ops.moe.updated_router_bias(bias,
stats, ...)`` from the ``MoEStats`` the layer returns.

The routed experts run where the tokens are unless `k3jax.sharding.parallelize` stored an
``expert_dispatch`` on the layer (expert parallelism: only the latents z cross devices).
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import MoEConfig
from k3jax.layers.ffn import DenseGLU
from k3jax.layers.linear import project
from k3jax.layers.lora import ADAPTER_SUFFIX, adapted_weight
from k3jax.layers.params import logical_axes, param, truncated_normal
from k3jax.layers.scope import scoped
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
from k3jax.ops.mxfp4 import Mxfp4Experts, tile_size
from k3jax.ops.mxfp4_format import BLOCK, encode
from k3jax.ops.norms import rms_norm
from k3jax.ops.precision import einsum

# (x, indices, weights, w_gate, w_up, w_down, activation) -> (u, dropped assignments): the routed
# experts computed elsewhere (`k3jax.sharding.ExpertDispatch`); hashable, a static attribute.
ExpertDispatchFn = Callable[..., tuple[jax.Array, jax.Array]]


class RouterBias(nnx.Variable):
    """The router's selection bias (``e_score_correction_bias``): changed only by the balancing
    updates, never by gradients."""


class Router(nnx.Module):
    """Top-k router on the full-width x: weight [d, E] ("embed", "experts"), bias [E].

    Args:
      d_model: d.
      config: E = ``num_experts``, k = ``top_k``, ``routed_scale`` (each token's routing weights
        sum to it, times the scores' sum without ``renormalize``), ``router_bias_in_weights`` (the
        Kimi Linear HF quirk), ``router_score`` ("sigmoid" or "softmax"), ``renormalize`` and the
        grouped top-k ``expert_groups`` / ``topk_groups`` of `k3jax.ops.moe.select_experts`.
      init_std: weight init std (the bias is always fp32, zeros).
    """

    def __init__(self, d_model: int, config: MoEConfig, *, init_std: float, rngs: nnx.Rngs):
        if config.router_score not in ROUTER_SCORES:
            raise ValueError(f"unknown router score {config.router_score!r}; expected one of {ROUTER_SCORES}")
        experts = config.num_experts
        self.weight = param(rngs, truncated_normal(init_std), (d_model, experts), ("embed", "experts"))
        self.e_score_correction_bias = param(
            rngs, nnx.initializers.zeros, (experts,), ("experts",), jnp.float32, variable_type=RouterBias
        )
        self.top_k = config.top_k
        self.routed_scale = config.routed_scale
        self.bias_in_weights = config.router_bias_in_weights
        self.score, self.renormalize = config.router_score, config.renormalize
        self.expert_groups, self.topk_groups = config.expert_groups, config.topk_groups

    @scoped
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [N, d] -> (indices [N, k] int32, weights [N, k] fp32, scores [N, E] fp32), all in fp32."""
        logits = einsum("nd,de->ne", x.astype(jnp.float32), self.weight[...].astype(jnp.float32))
        scores = router_scores(logits, self.score)
        bias = jax.lax.stop_gradient(self.e_score_correction_bias[...])
        indices, weights = select_experts(scores, bias, self.top_k, self.routed_scale, self.bias_in_weights,
                                          self.renormalize, self.expert_groups, self.topk_groups)
        return indices, weights, scores


class ExpertCodes(nnx.Variable):
    """Packed MXFP4 routed-expert codes or scales (uint8, `k3jax.ops.mxfp4`): frozen, never an
    ``nnx.Param`` (no gradient, no optimizer state, no adapter); saved with the buffers."""


EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")


def _mxfp4_experts_init(key: jax.Array, init, shape: tuple[int, int, int], tile: int) -> tuple[jax.Array, jax.Array]:
    """(codes [E, out, in/2], scales [E, out, in/32]) of weights drawn by ``init`` in the dense layout
    ``shape`` [E, in, out] and encoded, ``tile`` experts at a time (never all experts dense at once;
    under the depth scan's vmap, one tile per stacked layer)."""
    experts, inputs, out = shape
    group = tile_size(experts, tile)

    def one_tile(tile_key):
        return encode(jnp.swapaxes(init(tile_key, (group, inputs, out), jnp.float32), 1, 2))

    codes, scales = jax.lax.map(one_tile, jax.random.split(key, experts // group))
    return codes.reshape(experts, out, inputs // 2), scales.reshape(experts, out, inputs // BLOCK)


class RoutedExperts(nnx.Module):
    """E GLU experts of width m on ``input_axis``-named inputs of width ``input_width``, stacked:
    w_gate / w_up [E, in, m] ("experts", in, "expert_mlp"), w_down [E, m, in].

    With ``config.expert_format == "mxfp4"`` each of them is instead two frozen `ExpertCodes`
    in the release layout (SPEC §7, `k3jax.ops.mxfp4`), ``{name}_packed`` [E, out, in/2] and
    ``{name}_scale`` [E, out, in/32]: w_gate / w_up ("experts", "expert_mlp", in), w_down
    ("experts", in, "expert_mlp"); a fresh model draws them as the dense init would and encodes
    them a tile of ``config.expert_tile`` experts at a time.

    The call is ``k3jax.ops.moe.routed_experts`` (dropless, ``lax.ragged_dot``; MXFP4 decoded per
    tile) or, with ``config.expert_matmul == "dense"``, ``dense_experts`` (the same function, every
    expert on every token); a ``dispatch`` given to the call replaces both on these weights. LoRA
    adapters (a shared A, one B per expert) of dense experts are merged into the weights they are
    computed with; those of MXFP4 experts (QLoRA) ride along in their `Mxfp4Experts`, whose grouped
    matmul adds ``s (x A) B_e`` beside the decoded product (the codes stay packed).
    """

    LORA_WEIGHTS = {"w_gate": 1, "w_up": 1, "w_down": 1}   # after the experts axis: {name: input axes}
    LORA_ROUTED = True

    def __init__(self, input_width: int, config: MoEConfig, *, input_axis: str, activation: str,
                 situ_beta: float, situ_beta_linear: float | None, init_std: float, dtype, rngs: nnx.Rngs):
        glu_activation(activation)  # fail at construction on an unknown name
        init = truncated_normal(init_std)
        experts, width = config.num_experts, config.expert_width
        shapes = {"w_gate": (experts, input_width, width), "w_up": (experts, input_width, width),
                  "w_down": (experts, width, input_width)}
        up_axes, down_axes = ("experts", input_axis, "expert_mlp"), ("experts", "expert_mlp", input_axis)
        self.expert_format, self.tile, self.implementation = (config.expert_format, config.expert_tile,
                                                              config.mxfp4_implementation)
        for name, shape in shapes.items():
            axes = down_axes if name == "w_down" else up_axes
            if self.expert_format == "mxfp4":
                codes, scales = _mxfp4_experts_init(rngs.params(), init, shape, config.expert_tile)
                packed_axes = (axes[0], axes[2], axes[1])          # [E, out, in]: the release layout
                setattr(self, f"{name}_packed", ExpertCodes(codes, logical_axes=packed_axes))
                setattr(self, f"{name}_scale", ExpertCodes(scales, logical_axes=packed_axes))
            else:
                setattr(self, name, param(rngs, init, shape, axes))
        self.expert_matmul = config.expert_matmul
        self.activation = activation
        self.situ_beta, self.situ_beta_linear = situ_beta, situ_beta_linear
        self.dtype = dtype

    def lora_layout(self, name: str) -> tuple[tuple, tuple] | None:
        """``(shape, logical axes)`` of MXFP4 expert weight ``name`` in the dense layout [.., E, in, out]
        (from its codes [.., E, out, in/2]; `k3jax.layers.lora`), None when it is not packed."""
        codes = getattr(self, f"{name}_packed", None)
        if codes is None:
            return None
        *lead, out, half = codes.shape
        *lead_axes, out_axis, in_axis = logical_axes(codes)
        return (*lead, 2 * half, out), (*lead_axes, in_axis, out_axis)

    def expert_weights(self) -> tuple:
        """(W_gate, W_up, W_down): dense arrays in ``dtype`` (adapters merged), or `Mxfp4Experts`
        (decoded to the input's dtype per tile where they are used; with their adapters beside)."""
        if self.expert_format == "mxfp4":
            return tuple(self._mxfp4_weight(name) for name in EXPERT_WEIGHTS)
        return tuple(adapted_weight(self, name, self.dtype) for name in EXPERT_WEIGHTS)

    def _mxfp4_weight(self, name: str) -> Mxfp4Experts:
        adapter = getattr(self, name + ADAPTER_SUFFIX, None)
        factors = {} if adapter is None else dict(adapter_a=adapter.a[...], adapter_b=adapter.b[...],
                                                  adapter_scale=adapter.scale)
        return Mxfp4Experts(getattr(self, f"{name}_packed")[...], getattr(self, f"{name}_scale")[...], self.tile,
                            self.implementation, **factors)

    @scoped
    def __call__(self, x: jax.Array, indices: jax.Array, weights: jax.Array,
                 dispatch: ExpertDispatchFn | None = None) -> tuple[jax.Array, jax.Array]:
        """x [N, in], indices / weights [N, k] -> (sum_i weights_i E_{indices_i}(x) [N, in] in ``dtype``,
        (token, expert) assignments dropped by a capacity dispatch [] fp32)."""
        w_gate, w_up, w_down = self.expert_weights()
        activation = glu_activation(self.activation, self.situ_beta, self.situ_beta_linear)
        x = x.astype(self.dtype)
        if dispatch is not None:
            return dispatch(x, indices, weights, w_gate, w_up, w_down, activation)
        compute = EXPERT_MATMULS[self.expert_matmul]
        return compute(x, indices, weights, w_gate, w_up, w_down, activation), jnp.zeros((), jnp.float32)


class MoE(nnx.Module):
    """Stable LatentMoE (``config.latent_dim`` set) or plain MoE (None) with shared experts.

    Args:
      d_model: model width d.
      config: the `MoEConfig` (experts, top-k, widths, latent, shared experts, routing, balancing
        histogram bins, expert matmul); the layer reads its fields from it.
      activation: "situ" or "swiglu", for routed and shared experts; situ_beta, situ_beta_linear
        are SiTU's beta and beta_lin (None: no clipping of the linear branch).
      norm_eps: eps of the latent RMSNorm.
      init_std: truncated-normal std of every weight matrix.
      dtype: compute dtype (fp32 or bf16); router, norm and activations run in fp32; weights are
        stored in fp32 (the router bias too).
      rngs: ``nnx.Rngs`` with a ``params`` stream.

    Parameters: ``router`` (weight, e_score_correction_bias), ``experts`` (w_gate, w_up, w_down
    stacked over E), ``latent_down`` [d, l], ``latent_up`` [l, d], ``latent_norm_weight`` [l]
    (Stable LatentMoE only), ``shared`` (a ``DenseGLU``, when ``config.shared_width``).
    Static: ``expert_dispatch`` (None: experts computed locally; set by `k3jax.sharding.parallelize`).
    """

    def __init__(self, d_model: int, config: MoEConfig, *, activation: str = "situ", situ_beta: float = 4.0,
                 situ_beta_linear: float | None = 25.0, norm_eps: float = 1e-5, init_std: float = 0.02,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        latent = config.latent_dim
        init = truncated_normal(init_std)
        self.router = Router(d_model, config, init_std=init_std, rngs=rngs)
        self.experts = RoutedExperts(d_model if latent is None else latent, config,
                                     input_axis="embed" if latent is None else "latent", activation=activation,
                                     situ_beta=situ_beta, situ_beta_linear=situ_beta_linear, init_std=init_std,
                                     dtype=dtype, rngs=rngs)
        if latent is not None:
            self.latent_down = param(rngs, init, (d_model, latent), ("embed", "latent"))
            self.latent_up = param(rngs, init, (latent, d_model), ("latent", "embed"))
        if config.latent_norm:
            self.latent_norm_weight = param(rngs, nnx.initializers.ones, (latent,), ("latent",))
        if config.shared_width is not None:
            self.shared = DenseGLU(d_model, config.shared_width, activation=activation, situ_beta=situ_beta,
                                   situ_beta_linear=situ_beta_linear, init_std=init_std, dtype=dtype, rngs=rngs)
        self.config = config
        self.norm_eps = norm_eps
        self.dtype = dtype
        self.expert_dispatch: ExpertDispatchFn | None = None

    @scoped
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
        if self.config.shared_width is not None:
            y = y + self.shared(tokens)
        scores = jax.lax.stop_gradient(scores)
        bins = self.config.quantile_bins
        router = self.router
        histogram = None if bins is None else required_bias_histogram(
            scores, router.e_score_correction_bias[...], router.top_k, bins, mask, router.expert_groups,
            router.topk_groups)
        stats = MoEStats(
            expert_load=expert_load(indices, self.config.num_experts, mask),
            router_scores=scores if histogram is None else None,
            token_mask=mask,
            dropped=jax.lax.stop_gradient(dropped),
            bias_histogram=histogram,
        )
        return y.reshape(batch, length, d_model), stats

    def _routed(self, tokens: jax.Array, indices: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The routed branch: plain sum_i p_i E_i(x), or W_up RMSNorm(sum_i p_i E_i(W_down x)),
        and the count of dropped assignments."""
        if self.config.latent_dim is None:
            return self.experts(tokens, indices, weights, self.expert_dispatch)
        latent, dropped = self.experts(project(tokens, self.latent_down[...], self.dtype), indices, weights,
                                       self.expert_dispatch)
        if self.config.latent_norm:
            latent = rms_norm(latent, self.latent_norm_weight[...], self.norm_eps)
        return project(latent, self.latent_up[...], self.dtype), dropped
