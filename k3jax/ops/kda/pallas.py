"""KDA through Pallas kernels: `pallas_kda`, the ``implementation="pallas"`` of `k3jax.ops.kda.kda`,
and the choice of Pallas kernel family that every KDA Pallas kernel (this forward and backward,
the one-token decode kernels of `pallas_decode`) shares.

Same equations as the other implementations (the block math is `blocks`). This module
owns what the kernels share: padding (T to whole chunks, K and V to powers of two >= 16),
packed-document bookkeeping (segment starts counted inside each chunk), the `jax.custom_vjp`
(forward kernels save the state entering every chunk; backward kernels start from them) and
the choice of kernels by *target* platform, made at lowering time:

    tpu  -> `pallas_tpu` (Mosaic, fused, state in VMEM across an "arbitrary" chunk axis)
    cuda -> `pallas_gpu` (Triton: parallel per-chunk terms + a V-split chunk walk)
    else -> `pallas_gpu` in interpret mode (CPU: for tests; the fast CPU path is "chunk")

Tests force a family in interpret mode on any platform with `forced_kernels` (both families run
on CPU that way); nothing else overrides the choice.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from k3jax.ops.kda import pallas_gpu, pallas_tpu
from k3jax.ops.kda.blocks import TILE, chunk_length, start_counts

BACKENDS = {"tpu": pallas_tpu, "gpu": pallas_gpu}


_FORCED_FAMILY = jax.make_user_context(default_value=None)


def forced_kernels(backend: str, interpret: bool = True):
    """A context manager (for tests) under which every KDA Pallas kernel traced is the ``backend``
    family ("tpu": Mosaic, "gpu": Triton), interpreted when ``interpret``, whatever the platform.

    It is part of jit's cache key (`jax.make_user_context`): programs traced under it are not
    reused outside it, nor the other way round. A kernel reads it where it is entered (`pallas_kda`
    keeps it for its backward)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {tuple(BACKENDS)}, got {backend!r}")
    return _FORCED_FAMILY((backend, bool(interpret)))


def forced_family() -> tuple[str | None, bool]:
    """``(backend, interpret)`` set by the enclosing `forced_kernels`; ``(None, False)`` outside one."""
    return _FORCED_FAMILY.value or (None, False)


def on_target_platform(make_call, *args, backend: str | None = None, interpret: bool = False):
    """``make_call(backend, interpret)(*args)`` for the platform the computation is lowered for:
    TPU -> ("tpu", compiled), CUDA -> ("gpu", compiled), anything else -> ("gpu", interpreted).
    An explicit ``backend`` ("tpu" or "gpu", from `forced_family`) skips the choice."""
    if backend is not None:
        return make_call(backend, interpret)(*args)
    return jax.lax.platform_dependent(
        *args, tpu=make_call("tpu", False), cuda=make_call("gpu", False), default=make_call("gpu", True))


def _feature_size(dim: int) -> int:
    return max(TILE, 1 << (dim - 1).bit_length())


def _start_counts(segment_starts, batch, length, padded, chunk, dtype):
    """`blocks.start_counts` per chunk as ``[B, T, 1]`` and ``[B, N, C/16, 16]``."""
    counts = start_counts(segment_starts, batch, length, padded, chunk, dtype)
    return counts.reshape(batch, padded, 1), counts.reshape(batch, padded // chunk, chunk // TILE, TILE)


@dataclasses.dataclass(frozen=True)
class _Config:
    scale: float
    chunk: int
    backend: str | None
    interpret: bool

    def call(self, direction: str, *args):
        def make_call(backend, interpret):
            kernel = getattr(BACKENDS[backend], direction)
            return functools.partial(kernel, scale=self.scale, chunk=self.chunk, interpret=interpret)

        return on_target_platform(make_call, *args, backend=self.backend, interpret=self.interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _kda(q, k, v, g, beta, counts, count_rows, initial_state, config: _Config):
    o, final_state, _ = config.call("forward", q, k, v, g, beta, counts, count_rows, initial_state)
    return o, final_state


def _kda_forward(q, k, v, g, beta, counts, count_rows, initial_state, config):
    o, final_state, states = config.call("forward", q, k, v, g, beta, counts, count_rows, initial_state)
    return (o, final_state), (q, k, v, g, beta, counts, count_rows, states)


def _sum_groups(x, heads, dtype):
    """Per-value-head gradients ``[B, T, HV, K]`` summed onto the ``heads`` key heads they read."""
    batch, length, value_heads, dim = x.shape
    return x.reshape(batch, length, heads, value_heads // heads, dim).sum(axis=3).astype(dtype)


def _kda_backward(config, residuals, cotangents):
    q, k, v, g, beta, counts, count_rows, states = residuals
    d_o, d_final = cotangents
    d_q, d_k, d_v, d_g, d_beta, d_initial = config.call(
        "backward", q, k, v, g, beta, counts, count_rows, states, d_o, d_final.astype(states.dtype))
    heads = q.shape[2]
    return (_sum_groups(d_q, heads, q.dtype), _sum_groups(d_k, heads, k.dtype), d_v.astype(v.dtype),
            d_g.astype(g.dtype), d_beta.astype(beta.dtype), None, None, d_initial)


_kda.defvjp(_kda_forward, _kda_backward)


def pallas_kda(q, k, v, g, beta, initial_state, segment_starts, *, scale: float, chunk_size: int):
    """KDA with Pallas kernels on the raw (unscaled, un-repeated) inputs of `k3jax.ops.kda.kda`.

    Shapes: q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g ``[B, T, HV, K]``; beta ``[B, T, HV]``;
    initial_state ``[B, HV, K, V]`` or None; segment_starts ``[B, T]`` bool or None.
    The kernel family is the target platform's (`on_target_platform`) or the one `forced_kernels`
    sets here (the backward runs the same family).
    Returns ``(o [B, T, HV, V] in v.dtype, final_state [B, HV, K, V])``, the state in fp32
    (float64 when an input is float64).
    """
    batch, length, _, key_dim = q.shape
    value_heads, value_dim = v.shape[2:]
    inputs = (q, k, v, g, beta, initial_state)
    dtype = jnp.float64 if any(x is not None and x.dtype == jnp.float64 for x in inputs) else jnp.float32
    chunk = chunk_length(length, chunk_size)
    padded = -(-length // chunk) * chunk
    keys, values = _feature_size(key_dim), _feature_size(value_dim)

    def pad(x, dim):
        return jnp.pad(x, ((0, 0), (0, padded - length), (0, 0), (0, dim - x.shape[-1])))

    if initial_state is None:
        initial_state = jnp.zeros((batch, value_heads, key_dim, value_dim), dtype)
    state = jnp.pad(initial_state.astype(dtype), ((0, 0), (0, 0), (0, keys - key_dim), (0, values - value_dim)))
    beta = jnp.pad(jnp.swapaxes(beta.astype(dtype), 1, 2), ((0, 0), (0, 0), (0, padded - length)))[..., None]
    counts, count_rows = _start_counts(segment_starts, batch, length, padded, chunk, dtype)
    backend, interpret = forced_family()
    config = _Config(scale=float(scale), chunk=chunk, backend=backend, interpret=interpret)
    o, final_state = _kda(pad(q, keys), pad(k, keys), pad(v, values), pad(g, keys), beta,
                          counts, count_rows, state, config)
    return o[:, :length, :, :value_dim], final_state[:, :, :key_dim, :value_dim]
