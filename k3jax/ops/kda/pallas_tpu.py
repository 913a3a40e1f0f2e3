"""Chunked KDA for TPUs: fused Pallas Mosaic kernels (`pltpu.InterpretParams()` on CPU).

Layout: head-major ``[B, heads, T, dim]`` so each chunk is one contiguous [C, dim] DMA; T padded
to whole chunks, K and V to powers of two >= 16.

forward  `_forward_kernel`, grid (B, HV, chunk) with the chunk axis "arbitrary" (sequential): the
         [K, V] fp32 state stays in a VMEM scratch buffer while the kernel walks the chunks; per
         chunk it computes the state-independent terms (`blocks.chunk_terms`: 16-token tiles,
         anchored gates, exact diagonal blocks) and advances
             V~ = U - W S;   O = Q^ S + A_qk V~;   S <- D S + K-^T V~,
         writing O, the state entering the chunk (saved for the backward) and the final state.
backward `_backward_kernel`, same grid walked from the last chunk to the first with dS in VMEM:
         per chunk, from the saved entering state S and the carried dS', the chunk's gradients
         (`pallas_blocks.chunk_gradients`) and  dS <- D dS' + Q^^T dO - W^T dV~.
A TensorCore has no use for more programs than B * HV, so one fused kernel per direction is
enough here (the GPU version splits the work instead). Matmuls use full fp32 precision.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from k3jax.ops.kda import blocks
from k3jax.ops.kda import pallas_tiles as tiles
from k3jax.ops.kda.backend import pallas_dots
from k3jax.ops.kda.blocks import TILE

_DOTS = pallas_dots(jax.lax.Precision.HIGHEST)


def _head_major(x):
    return jnp.swapaxes(x, 1, 2)


def _chunk_input_specs(chunk, key_dim, value_dim, group, n_chunks, reverse):
    """q, k, v, g (head-major), beta ``[B, HV, T, 1]``, start counts ``[B, T, 1]`` and
    ``[B, N, C/16, 16]`` for a (batch, value head, step) grid; ``reverse`` walks chunks backwards."""
    at = (lambda n: n_chunks - 1 - n) if reverse else (lambda n: n)
    return [
        pl.BlockSpec((None, None, chunk, key_dim), lambda b, h, n: (b, jax.lax.div(h, group), at(n), 0)),
        pl.BlockSpec((None, None, chunk, key_dim), lambda b, h, n: (b, jax.lax.div(h, group), at(n), 0)),
        pl.BlockSpec((None, None, chunk, value_dim), lambda b, h, n: (b, h, at(n), 0)),
        pl.BlockSpec((None, None, chunk, key_dim), lambda b, h, n: (b, h, at(n), 0)),
        pl.BlockSpec((None, None, chunk, 1), lambda b, h, n: (b, h, at(n), 0)),
        pl.BlockSpec((None, chunk, 1), lambda b, h, n: (b, at(n), 0)),
        pl.BlockSpec((None, None, chunk // TILE, TILE), lambda b, h, n: (b, at(n), 0, 0)),
    ]


def _call(kernel, *, grid, in_specs, out_specs, out_shape, state, interpret):
    """A chunk-walking kernel with a VMEM scratch buffer for one [K, V] block of ``state`` [B, HV, K, V]."""
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM(state.shape[-2:], state.dtype)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
    )


def _forward_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, count_ref, count_row_ref, initial_ref,
                    o_ref, states_ref, final_ref, state_scratch, *, scale):
    n = pl.program_id(2)
    dtype = states_ref.dtype

    @pl.when(n == 0)
    def _():
        state_scratch[...] = initial_ref[...]

    state = state_scratch[...]
    states_ref[...] = state
    chunk = tiles.load_chunk(q_ref, k_ref, g_ref, beta_ref, count_ref, count_row_ref,
                             scale=scale, dtype=dtype, dots=_DOTS)
    u = blocks.solve_values(chunk, tiles.load_tiles(v_ref, len(chunk.q), dtype), _DOTS)
    o, state = blocks.advance(chunk.w, u, chunk.read_queries, chunk.scores.query, chunk.write_keys,
                             _DOTS.vector_t(chunk.decay), state, _DOTS)
    tiles.store_tiles(o_ref, o)
    state_scratch[...] = state

    @pl.when(n == pl.num_programs(2) - 1)
    def _():
        final_ref[...] = state


def forward(q, k, v, g, beta, counts, count_rows, initial_state, *, scale, chunk, interpret):
    """``(o [B, T, HV, V] in v.dtype, final_state, states entering each chunk [B, HV, N, K, V])``.

    Takes time-major ``[B, T, heads, dim]`` inputs like the GPU version and returns the same.
    """
    dtype = initial_state.dtype
    batch, padded, value_heads, value_dim = v.shape
    key_dim, n_chunks = q.shape[-1], padded // chunk
    state = pl.BlockSpec((None, None, key_dim, value_dim), lambda b, h, n: (b, h, 0, 0))
    o, states, final = _call(
        functools.partial(_forward_kernel, scale=scale),
        grid=(batch, value_heads, n_chunks),
        in_specs=[*_chunk_input_specs(chunk, key_dim, value_dim, value_heads // q.shape[2], n_chunks,
                                      reverse=False), state],
        out_specs=[pl.BlockSpec((None, None, chunk, value_dim), lambda b, h, n: (b, h, n, 0)),
                   pl.BlockSpec((None, None, None, key_dim, value_dim), lambda b, h, n: (b, h, n, 0, 0)),
                   state],
        out_shape=[jax.ShapeDtypeStruct((batch, value_heads, padded, value_dim), v.dtype),
                   jax.ShapeDtypeStruct((batch, value_heads, n_chunks, key_dim, value_dim), dtype),
                   jax.ShapeDtypeStruct(initial_state.shape, dtype)],
        state=initial_state,
        interpret=interpret,
    )(*map(_head_major, (q, k, v, g)), beta, counts, count_rows, initial_state)
    return _head_major(o), final, states


def _backward_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, count_ref, count_row_ref,
                     d_o_ref, state_ref, d_final_ref,
                     d_q_ref, d_k_ref, d_v_ref, d_g_ref, d_beta_ref, d_initial_ref, d_state_scratch,
                     *, scale):
    n = pl.program_id(2)
    dtype = d_q_ref.dtype

    @pl.when(n == 0)
    def _():
        d_state_scratch[...] = d_final_ref[...]

    d_next = d_state_scratch[...]
    chunk = tiles.load_chunk(q_ref, k_ref, g_ref, beta_ref, count_ref, count_row_ref,
                             scale=scale, dtype=dtype, dots=_DOTS)
    count = len(chunk.q)
    d_o = tiles.load_tiles(d_o_ref, count, dtype)
    block = blocks.ValueBlock(tiles.load_tiles(v_ref, count, dtype), d_o, state_ref[...], d_next)
    grads = blocks.chunk_gradients(chunk, [block], _DOTS)
    tiles.store_tiles(d_q_ref, [d * scale for d in grads.q])
    tiles.store_tiles(d_k_ref, grads.k)
    tiles.store_tiles(d_v_ref, grads.v[0])
    tiles.store_tiles(d_g_ref, grads.g)
    tiles.store_tiles(d_beta_ref, grads.beta)
    d_state = blocks.state_gradient(chunk.w, chunk.read_queries, d_o, grads.new_values[0],
                                   _DOTS.vector_t(chunk.decay), d_next, _DOTS)
    d_state_scratch[...] = d_state

    @pl.when(n == pl.num_programs(2) - 1)
    def _():
        d_initial_ref[...] = d_state


def backward(q, k, v, g, beta, counts, count_rows, states, d_o, d_final, *, scale, chunk, interpret):
    """Gradients ``(dq, dk per value head [B, T, HV, K], dv, dg, dbeta [B, HV, T, 1], d_initial)``."""
    dtype = states.dtype
    batch, padded, value_heads, value_dim = v.shape
    key_dim, n_chunks = q.shape[-1], padded // chunk
    last = n_chunks - 1
    state = pl.BlockSpec((None, None, key_dim, value_dim), lambda b, h, n: (b, h, 0, 0))

    def per_token(width):
        return pl.BlockSpec((None, None, chunk, width), lambda b, h, n: (b, h, last - n, 0))

    token_shape = lambda width: jax.ShapeDtypeStruct((batch, value_heads, padded, width), dtype)  # noqa: E731
    d_q, d_k, d_v, d_g, d_beta, d_initial = _call(
        functools.partial(_backward_kernel, scale=scale),
        grid=(batch, value_heads, n_chunks),
        in_specs=[*_chunk_input_specs(chunk, key_dim, value_dim, value_heads // q.shape[2], n_chunks,
                                      reverse=True),
                  per_token(value_dim),
                  pl.BlockSpec((None, None, None, key_dim, value_dim), lambda b, h, n: (b, h, last - n, 0, 0)),
                  state],
        out_specs=[per_token(key_dim), per_token(key_dim), per_token(value_dim), per_token(key_dim),
                   pl.BlockSpec((None, None, chunk, 1), lambda b, h, n: (b, h, last - n, 0)), state],
        out_shape=[token_shape(key_dim), token_shape(key_dim), token_shape(value_dim), token_shape(key_dim),
                   jax.ShapeDtypeStruct(beta.shape, dtype), jax.ShapeDtypeStruct(d_final.shape, dtype)],
        state=d_final,
        interpret=interpret,
    )(*map(_head_major, (q, k, v, g)), beta, counts, count_rows, _head_major(d_o), states, d_final)
    return (*map(_head_major, (d_q, d_k, d_v, d_g)), d_beta, d_initial)
