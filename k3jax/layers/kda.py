"""The KDA token mixer (SPEC §1): projections, short convolution, gates, the delta rule, output.

For x in R^d, with H query/key heads, HV = m H value heads, K = V = head_dim, P = H K:

    q, k, v = SiLU(CausalDepthwiseConv_W([W_q x | W_k x | W_v x]))       per channel, carried tail
    q, k    = l2_normalize per head (fp32); q is scaled by K^-0.5 inside the op
    g       = kda_gate(W_fb W_fa x, A_log, dt_bias)                      softplus or lower_bound form
    beta    = sigmoid(W_b x)                                             one scalar per value head
    o, S    = kda(q, k, v, g, beta, S)                                   the delta rule, state S fp32
    y       = W_o [RMSNorm_V(o) * sigmoid(gate(x))]                      gate full (W_g x) or low rank (W_gb W_ga x);
                                                                         RMSNorm eps config.output_norm_eps

The low-rank gates have rank K. Parameters are stored per head ([d, H, K] etc.) so per-head
optimizers and head sharding see the head axis. ``config.implementation`` picks the KDA kernels
of all three paths, by the one rule of `k3jax.ops.kda`: the forward over a sequence (`kda`), the
one-token decode of a contiguous bank (`kda_step`) and the pooled decode (`kda_pool_step` and
`conv_pool_step`); the short convolution of a contiguous bank is XLA in every implementation.
"""
from __future__ import annotations

import dataclasses
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.config import KDAConfig
from k3jax.layers.lora import adapted_project
from k3jax.layers.params import param, truncated_normal
from k3jax.layers.scope import scoped
from k3jax.memory import KDAMemory, KDAPool, KDAPositions
from k3jax.ops.conv import causal_depthwise_conv, conv_tails
from k3jax.ops.kda import kda, kda_gate, kda_step, kda_steps, l2_normalize
from k3jax.ops.kda.decode_pool import conv_pool_step, kda_pool_step
from k3jax.ops.norms import rms_norm

# The KDA ops a layer runs when no mesh splits its heads (`KDALayer._ops`).
WHOLE_ARRAY_OPS = types.SimpleNamespace(kda=kda, kda_step=kda_step, kda_steps=kda_steps, kda_pool_step=kda_pool_step,
                                        conv_pool_step=conv_pool_step)


def _conv_init(key, shape, dtype):
    """PyTorch's Conv1d default: U(-1/sqrt(W), 1/sqrt(W)) for W taps (the last axis)."""
    bound = 1.0 / math.sqrt(shape[-1])
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def _a_log_init(key, shape, dtype):
    """A_log = log U(1, 16)."""
    return jnp.log(jax.random.uniform(key, shape, dtype, 1.0, 16.0))


def _dt_bias_init(key, shape, dtype):
    """Mamba's dt bias: dt ~ logU[1e-3, 1e-1], stored as softplus^-1(dt) = dt + log(1 - exp(-dt))."""
    dt = jnp.exp(jax.random.uniform(key, shape, dtype, np.log(1e-3), np.log(1e-1)))
    return dt + jnp.log(-jnp.expm1(-dt))


class KDALayer(nnx.Module):
    """Kimi Delta Attention with its projections (SPEC §1); every projection can carry a LoRA adapter.

    Args:
      d_model: model width d.
      config: heads, head dim, grouped value heads, conv taps, gate forms, chunking.
      init_std: truncated-normal std of the projections.
      dtype: compute dtype of the projections (the gate, beta, norms and the state are fp32).
    """

    # Weights a LoRA adapter can join (`k3jax.layers.lora`): {attribute: input axes}.
    LORA_WEIGHTS = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "f_a_proj": 1, "f_b_proj": 1, "b_proj": 1,
                    "g_proj": 1, "g_a_proj": 1, "g_b_proj": 1, "o_proj": 2}

    def __init__(self, d_model: int, config: KDAConfig, *, init_std: float, dtype=jnp.float32, rngs: nnx.Rngs):
        heads, value_heads, dim, taps = config.num_heads, config.num_value_heads, config.head_dim, config.conv_size
        linear = truncated_normal(init_std)
        self.q_proj = param(rngs, linear, (d_model, heads, dim), ("embed", "heads", "head_dim"))
        self.k_proj = param(rngs, linear, (d_model, heads, dim), ("embed", "heads", "head_dim"))
        self.v_proj = param(rngs, linear, (d_model, value_heads, dim), ("embed", "value_heads", "head_dim"))
        self.q_conv = param(rngs, _conv_init, (heads, dim, taps), ("heads", "head_dim", "conv"))
        self.k_conv = param(rngs, _conv_init, (heads, dim, taps), ("heads", "head_dim", "conv"))
        self.v_conv = param(rngs, _conv_init, (value_heads, dim, taps), ("value_heads", "head_dim", "conv"))
        self.f_a_proj = param(rngs, linear, (d_model, dim), ("embed", "gate_rank"))
        self.f_b_proj = param(rngs, linear, (dim, value_heads, dim), ("gate_rank", "value_heads", "head_dim"))
        self.A_log = param(rngs, _a_log_init, (value_heads,), ("value_heads",))
        self.dt_bias = param(rngs, _dt_bias_init, (value_heads, dim), ("value_heads", "head_dim"))
        self.b_proj = param(rngs, linear, (d_model, value_heads), ("embed", "value_heads"))
        if config.output_gate == "full":
            self.g_proj = param(rngs, linear, (d_model, value_heads, dim), ("embed", "value_heads", "head_dim"))
        else:
            self.g_a_proj = param(rngs, linear, (d_model, dim), ("embed", "gate_rank"))
            self.g_b_proj = param(rngs, linear, (dim, value_heads, dim), ("gate_rank", "value_heads", "head_dim"))
        self.o_norm = param(rngs, nnx.initializers.ones, (dim,), ("head_dim",))
        self.o_proj = param(rngs, linear, (value_heads, dim, d_model), ("value_heads", "head_dim", "embed"))
        self.config = config
        self.dtype = dtype
        self.context_parallel = None     # a `k3jax.sharding.context.ContextParallel`, set by parallelize
        self.head_parallel = None        # a `k3jax.sharding.heads.HeadParallel`, set by parallelize

    @scoped
    def __call__(
        self, x: jax.Array, memory: KDAMemory | KDAPool | None = None, segment_ids: jax.Array | None = None
    ) -> tuple[jax.Array, KDAMemory | KDAPool]:
        """x ``[B, T, d]`` -> ``(y [B, T, d] in dtype, updated KDAMemory)``.

        ``memory`` (state ``[B, HV, K, V]``, conv ``[B, W-1, C]``) continues a sequence; None
        starts from zeros. ``segment_ids [B, T]`` restarts state and conv window at boundaries.
        A `KDAPool` (T = 1, no segments) decodes from and into its pools (`decode_pooled`); a
        `KDAPositions` (no segments) feeds the tokens one at a time and returns every token's
        state and conv tail (`kda_steps`, `conv_tails`).
        """
        if isinstance(memory, KDAPool):
            return self.decode_pooled(x, memory)
        cfg = self.config
        batch, length, _ = x.shape
        projected = self._projections(x)
        conv_weight = self._conv_weight()
        conv_state = None if memory is None else memory.conv
        split = self.context_parallel is not None and memory is None
        segments = jnp.zeros((batch, length), jnp.int32) if split and segment_ids is None else segment_ids
        if split:
            mixed, conv_tail = self.context_parallel.conv(projected, conv_weight, segments), None
        else:
            mixed, conv_tail = causal_depthwise_conv(projected, conv_weight, conv_state, segment_ids)
        q, k, v = self._heads(mixed)
        g, beta = self._gates(x)

        state = None if memory is None else memory.state
        ops = self._ops()
        if isinstance(memory, KDAPositions):
            if segment_ids is not None:
                raise ValueError("a KDAPositions bank feeds one sequence per row: no segment_ids")
            o, states = ops.kda_steps(q, k, v, g, beta, state, implementation=cfg.implementation)
            return self._output(o, x), KDAPositions(states, conv_tails(projected, memory.conv))
        if length == 1 and state is not None:
            o, state = ops.kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state,
                                    implementation=cfg.implementation)
            o = o[:, None]
        elif split:
            o, state = self.context_parallel.kda(q, k, v, g, beta, segments, chunk_size=cfg.chunk_size,
                                                 implementation=cfg.implementation)
        else:
            o, state = ops.kda(q, k, v, g, beta, initial_state=state, segment_ids=segment_ids,
                               chunk_size=cfg.chunk_size, implementation=cfg.implementation)
        if memory is not None:
            conv_tail = conv_tail.astype(memory.conv.dtype)
        return self._output(o, x), KDAMemory(state=state, conv=conv_tail)

    def decode_pooled(self, x: jax.Array, memory: KDAPool) -> tuple[jax.Array, KDAPool]:
        """One token per sequence, x ``[B, 1, d]``, whose state and conv tail are rows
        ``memory.rows [B]`` of the pools: `conv_pool_step` and `kda_pool_step` (the kernels of
        ``config.implementation``) read and write only those rows (in place when the pools are
        donated). -> ``(y [B, 1, d], KDAPool with the updated pools)``; the same numbers as
        ``__call__`` on the gathered rows."""
        if x.shape[1] != 1:
            raise ValueError(f"pooled KDA decode takes one token per sequence, got x {x.shape}")
        implementation, ops = self.config.implementation, self._ops()
        mixed, conv = ops.conv_pool_step(memory.conv, memory.rows, self._projections(x)[:, 0], self._conv_weight(),
                                         implementation=implementation)
        q, k, v = self._heads(mixed[:, None])
        g, beta = self._gates(x)
        o, state = ops.kda_pool_step(memory.state, memory.rows, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0],
                                     implementation=implementation)
        return self._output(o[:, None], x), dataclasses.replace(memory, state=state, conv=conv)

    def _ops(self):
        """The KDA ops this layer runs: split over the mesh's head axes (a
        `k3jax.sharding.heads.HeadParallel`, set by `k3jax.sharding.parallelize`, with the same
        names) or on whole arrays (`WHOLE_ARRAY_OPS`)."""
        return self.head_parallel or WHOLE_ARRAY_OPS

    def _projections(self, x: jax.Array) -> jax.Array:
        """The conv inputs ``[W_q x | W_k x | W_v x]`` ``[B, T, C]``."""
        batch, length, _ = x.shape
        return jnp.concatenate(
            [adapted_project(self, name, x, self.dtype).reshape(batch, length, -1) for name in ("q_proj", "k_proj", "v_proj")],
            axis=-1,
        )

    def _conv_weight(self) -> jax.Array:
        """The q|k|v conv taps ``[C, W]``."""
        return jnp.concatenate([w[...].reshape(-1, self.config.conv_size) for w in (self.q_conv, self.k_conv, self.v_conv)])

    def _heads(self, mixed: jax.Array):
        """Conv outputs ``[B, T, C]`` -> SiLU, split, L2-normalised q, k ``[B, T, H, K]`` fp32 and v ``[B, T, HV, V]``."""
        cfg = self.config
        batch, length, _ = mixed.shape
        q, k, v = jnp.split(jax.nn.silu(mixed), [cfg.key_width, 2 * cfg.key_width], axis=-1)
        q = l2_normalize(q.reshape(batch, length, cfg.num_heads, cfg.head_dim).astype(jnp.float32))
        k = l2_normalize(k.reshape(batch, length, cfg.num_heads, cfg.head_dim).astype(jnp.float32))
        return q, k, v.reshape(batch, length, cfg.num_value_heads, cfg.head_dim)

    def _gates(self, x: jax.Array):
        """Forget gate g ``[B, T, HV, K]`` and beta ``[B, T, HV]``, fp32."""
        cfg = self.config
        raw_gate = adapted_project(self, "f_b_proj", adapted_project(self, "f_a_proj", x, self.dtype), self.dtype)
        lower_bound = cfg.lower_bound if cfg.gate == "lower_bound" else None
        g = kda_gate(raw_gate, self.A_log[...], self.dt_bias[...], lower_bound=lower_bound)
        return g, jax.nn.sigmoid(adapted_project(self, "b_proj", x, self.dtype).astype(jnp.float32))

    def _output(self, o: jax.Array, x: jax.Array) -> jax.Array:
        """y = W_o [RMSNorm_V(o) * sigmoid(gate(x))] ``[B, T, d]``."""
        o = rms_norm(o.astype(jnp.float32), self.o_norm[...], self.config.output_norm_eps)
        o = o * jax.nn.sigmoid(self._output_gate(x).astype(jnp.float32))
        return adapted_project(self, "o_proj", o, self.dtype, contract=2)

    def _output_gate(self, x: jax.Array) -> jax.Array:
        """Gate pre-activation ``[B, T, HV, V]``: W_g x (full rank) or W_gb W_ga x (rank K)."""
        if self.config.output_gate == "full":
            return adapted_project(self, "g_proj", x, self.dtype)
        return adapted_project(self, "g_b_proj", adapted_project(self, "g_a_proj", x, self.dtype), self.dtype)
