"""Pallas kernels of the one-token KDA decode over pools of rows, updated in place: the
``implementation="pallas"`` forms of `decode_pool.kda_pool_step`, `decode_pool.conv_pool_step`
and `k3jax.ops.kda.kda_step` (same equations; see `decode_pool`).

The kernels read and write only the addressed rows of the aliased pool (``input_output_aliases``):
on TPU (Mosaic) the row indices are prefetched to SMEM and drive the BlockSpec index maps; on GPU
(Triton) each program loads its row index and addresses the pool with it. The family follows the
target platform (`pallas.on_target_platform`; interpreted GPU kernels elsewhere) or
`pallas.forced_kernels`. Compiled for a GPU, K must be a power of two (Triton loads whole key
columns); V and the conv channels are split into power-of-two blocks that divide them.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from k3jax.ops.kda.blocks import token_step
from k3jax.ops.kda.pallas import forced_family, on_target_platform

_GPU_VALUE_BLOCK = 64      # V columns per GPU program, at most: [K, 64] fp32 = 32 KiB of state in registers
_GPU_CHANNEL_BLOCK = 1024  # conv channels per GPU program, at most


def _gpu_block(size: int, limit: int) -> int:
    """The largest power of two up to ``limit`` that divides ``size``: a GPU program's columns."""
    block = 1
    while block < limit and size % (2 * block) == 0:
        block *= 2
    return block


def _kda_pool_kernel(*refs, scale, slot_in_index_map):
    """Refs: (slots,) q, k, v, g, beta, pool block | o, pool block (aliased)."""
    slots_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, pool_ref, o_ref, pool_out_ref = refs
    if slot_in_index_map:  # TPU: the BlockSpecs already selected this session's slot
        index = (slice(None), slice(None))
    else:                  # GPU: whole-pool refs, indexed (in one indexer) by the slot loaded here
        index = (slots_ref[pl.program_id(0)], pl.program_id(1), slice(None),
                 pl.ds(pl.program_id(2) * o_ref.shape[-1], o_ref.shape[-1]))
    dtype = pool_out_ref.dtype
    o, state = token_step(pool_ref[index], q_ref[...].astype(dtype) * scale, k_ref[...].astype(dtype),
                          v_ref[...].astype(dtype), g_ref[...].astype(dtype), beta_ref[...].astype(dtype))
    o_ref[...] = o.astype(o_ref.dtype)
    pool_out_ref[index] = state


def _kda_pool_call(backend, interpret, *, scale, group, value_block):
    """A pallas_call over (session, value head, V block) for `pallas_kda_pool_step`'s column-shaped inputs."""

    def call(slots, q, k, v, g, beta, pool):
        batch, value_heads = beta.shape[:2]
        key_dim, value_dim = pool.shape[2:]
        block = value_dim if backend == "tpu" else value_block
        o_shape = jax.ShapeDtypeStruct((batch, value_heads, 1, value_dim), v.dtype)
        kernel = functools.partial(_kda_pool_kernel, scale=scale, slot_in_index_map=backend == "tpu")
        grid = (batch, value_heads, value_dim // block)
        specs = [
            lambda b, h, j, *_: (b, jax.lax.div(h, group), 0, 0),   # q
            lambda b, h, j, *_: (b, jax.lax.div(h, group), 0, 0),   # k
            lambda b, h, j, *_: (b, h, 0, j),                       # v
            lambda b, h, j, *_: (b, h, 0, 0),                       # g
            lambda b, h, j, *_: (b, h, 0, 0),                       # beta
        ]
        shapes = [(key_dim, 1), (key_dim, 1), (1, block), (key_dim, 1), (1, 1)]
        in_specs = [pl.BlockSpec((None, None, *shape), index) for shape, index in zip(shapes, specs)]
        o_spec = pl.BlockSpec((None, None, 1, block), lambda b, h, j, *_: (b, h, 0, j))
        if backend == "tpu":
            pool_spec = pl.BlockSpec((None, None, key_dim, block), lambda b, h, j, slots_ref: (slots_ref[b], h, 0, j))
            return pl.pallas_call(
                kernel,
                grid_spec=pltpu.PrefetchScalarGridSpec(
                    num_scalar_prefetch=1, grid=grid, in_specs=[*in_specs, pool_spec],
                    out_specs=[o_spec, pool_spec]),
                out_shape=[o_shape, jax.ShapeDtypeStruct(pool.shape, pool.dtype)],
                input_output_aliases={6: 1},
                compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel")),
                interpret=pltpu.InterpretParams() if interpret else False,
            )(slots, q, k, v, g, beta, pool)
        whole = pl.BlockSpec()
        return pl.pallas_call(
            kernel, grid=grid, in_specs=[whole, *in_specs, whole], out_specs=[o_spec, whole],
            out_shape=[o_shape, jax.ShapeDtypeStruct(pool.shape, pool.dtype)],
            input_output_aliases={6: 1}, interpret=interpret,
            compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        )(slots, q, k, v, g, beta, pool)

    return call


def pallas_kda_pool_step(pool, slots, q, k, v, g, beta, *, scale: float):
    """`decode_pool.kda_pool_step` by Pallas kernels, on inputs already checked there: pool
    ``[N, HV, K, V]``, slots ``[B]``, q, k ``[B, H, K]``, v ``[B, HV, V]``, g ``[B, HV, K]``,
    beta ``[B, HV]``. Returns ``(o [B, HV, V] in v.dtype, pool)``; the arithmetic is in the
    pool's dtype."""
    value_heads, _, value_dim = pool.shape[1:]
    columns = (q[..., None], k[..., None], v[:, :, None, :], g[..., None], beta[..., None, None])
    make_call = functools.partial(_kda_pool_call, scale=float(scale), group=value_heads // q.shape[1],
                                  value_block=_gpu_block(value_dim, _GPU_VALUE_BLOCK))
    backend, interpret = forced_family()
    o, pool = on_target_platform(make_call, slots.astype(jnp.int32), *columns, pool,
                                 backend=backend, interpret=interpret)
    return o[:, :, 0, :], pool


def conv_window_step(rows, weights):
    """Depthwise conv output for the newest token: ``sum_i weights[i] * rows[i]`` over the window
    rows (oldest first, the new input last), each ``[1, C]``; accumulated in fp32."""
    return sum(w.astype(jnp.float32) * r.astype(jnp.float32) for w, r in zip(weights, rows))


def _conv_pool_kernel(*refs, taps, channel_block, tail_in_index_map, interpret):
    """Refs: slots, x, weight^T [W, C], tail block | y, tail block (aliased)."""
    slots_ref, x_ref, weight_ref, tail_ref, y_ref, tail_out_ref = refs
    if tail_in_index_map:  # TPU: the BlockSpecs selected this session's tail
        row = lambda i: (pl.ds(i, 1), slice(None))  # noqa: E731
    else:                  # GPU: whole-pool refs, indexed (in one indexer) by the slot loaded here
        slot, columns = slots_ref[pl.program_id(0)], pl.ds(pl.program_id(1) * channel_block, channel_block)
        row = lambda i: (slot, pl.ds(i, 1), columns)  # noqa: E731
    rows = [tail_ref[row(i)] for i in range(taps - 1)] + [x_ref[...]]
    weights = [weight_ref[i : i + 1, :] for i in range(taps)]
    y_ref[...] = conv_window_step(rows, weights).astype(y_ref.dtype)
    if not (tail_in_index_map or interpret):
        pltriton.debug_barrier()  # every thread's reads of the tail precede the shifted writes
    for i in range(taps - 1):
        tail_out_ref[row(i)] = rows[i + 1].astype(tail_out_ref.dtype)


def _conv_pool_call(backend, interpret):
    def call(slots, x, weight_t, pool):
        batch, taps, channels = x.shape[0], weight_t.shape[0], x.shape[-1]
        tpu = backend == "tpu"
        block = channels if tpu else _gpu_block(channels, _GPU_CHANNEL_BLOCK)
        kernel = functools.partial(_conv_pool_kernel, taps=taps, channel_block=block,
                                   tail_in_index_map=tpu, interpret=interpret)
        grid = (batch, channels // block)
        x_spec = pl.BlockSpec((None, 1, block), lambda b, c, *_: (b, 0, c))
        weight_spec = pl.BlockSpec((taps, block), lambda b, c, *_: (0, c))
        y_shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
        pool_shape = jax.ShapeDtypeStruct(pool.shape, pool.dtype)
        if tpu:
            tail_spec = pl.BlockSpec((None, taps - 1, block), lambda b, c, slots_ref: (slots_ref[b], 0, c))
            return pl.pallas_call(
                kernel,
                grid_spec=pltpu.PrefetchScalarGridSpec(
                    num_scalar_prefetch=1, grid=grid, in_specs=[x_spec, weight_spec, tail_spec],
                    out_specs=[x_spec, tail_spec]),
                out_shape=[y_shape, pool_shape], input_output_aliases={3: 1},
                compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
                interpret=pltpu.InterpretParams() if interpret else False,
            )(slots, x, weight_t, pool)
        whole = pl.BlockSpec()
        return pl.pallas_call(
            kernel, grid=grid, in_specs=[whole, x_spec, weight_spec, whole], out_specs=[x_spec, whole],
            out_shape=[y_shape, pool_shape], input_output_aliases={3: 1}, interpret=interpret,
            compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        )(slots, x, weight_t, pool)

    return call


def pallas_conv_pool_step(pool, slots, x, weight):
    """`decode_pool.conv_pool_step` by Pallas kernels, on inputs already checked there: pool
    ``[N, W-1, C]``, slots ``[B]``, x ``[B, C]``, weight ``[C, W]``. Returns ``(y [B, C] in
    x.dtype, pool)``."""
    backend, interpret = forced_family()
    y, pool = on_target_platform(_conv_pool_call, slots.astype(jnp.int32), x[:, None, :], weight.T, pool,
                                 backend=backend, interpret=interpret)
    return y[:, 0, :], pool
