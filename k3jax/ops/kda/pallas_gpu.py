"""Chunked KDA for GPUs: Pallas kernels lowered through Triton (runs in interpret mode on CPU).

Layout: the model's own [B, T, heads, dim] arrays, read in place (no transposes); T padded to
whole chunks, K and V to powers of two >= 16 (Triton needs power-of-two tiles).

A GPU needs thousands of independent programs, and B * HV alone gives too few at long context,
so the work is split the way the math allows (tile math in `blocks`):

forward
  1. `_terms_kernel`,   grid (B, HV, chunk), all parallel: per chunk the state-independent terms
     W, U, Q^, K-, A_qk, D (16-token tiles, anchored gates, exact diagonal blocks).
  2. `_advance_kernel`, grid (B, HV, V block), parallel: walks the chunks in order with the
     [K, BV] state block in registers:  V~ = U - W S;  O = Q^ S + A_qk V~;  S <- D S + K-^T V~.
     Columns of V are independent, which is what splits it. Saves the state entering each chunk.
backward (custom_vjp, from those saved states)
  3. `_terms_kernel` again (recompute, cheaper than storing),
  4. `_retreat_kernel`, grid (B, HV, V block): walks the chunks backwards carrying dS:
     dV~ = A_qk^T dO + K- dS';  dS = D dS' + Q^^T dO - W^T dV~;  saves dS' per chunk.
  5. `_gradients_kernel`, grid (B, HV, chunk), parallel: each chunk's dq, dk, dv, dg, dbeta
     from its entering state and dS' (`pallas_blocks.chunk_gradients`), V in blocks.

Matmuls run in TF32x3 on the GPU (tensor cores, ~fp32 accuracy); gate sums in exact fp32.
Triton rather than Mosaic GPU: the jnp-level tile code shared with the TPU kernels lowers as it
is, and the backend is stable on Hopper; Mosaic GPU wants warpgroup-level code (explicit SMEM/TMA
pipelines, WGMMA tiles of >= 64 rows) behind an API documented as changing weekly.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from k3jax.ops.kda import blocks
from k3jax.ops.kda import pallas_tiles as tiles
from k3jax.ops.kda.backend import pallas_dots
from k3jax.ops.kda.blocks import TILE

_TARGET_PROGRAMS = 256      # enough V blocks in the sequential kernels to fill an H100/H200
_GRADIENT_VALUE_BLOCK = 64  # V columns per step inside `_gradients_kernel` (bounds registers)
_TILE_WARPS = 8             # per-chunk kernels hold dozens of [16, K] fp32 tiles: spread them out
_WALK_WARPS = 4             # chunk walks hold one [K, BV] state block


def _dots(dtype, interpret: bool):
    """TF32x3 on tensor cores when compiled for fp32; full precision when interpreted or fp64."""
    if interpret or dtype != jnp.float32:
        return pallas_dots(jax.lax.Precision.HIGHEST)
    return pallas_dots(jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3)


def _sequential_value_block(programs: int, value_dim: int) -> int:
    """V columns per program of the chunk-walking kernels: split V until there are enough programs."""
    block = min(value_dim, 64)
    while block > TILE and programs * (value_dim // block) < _TARGET_PROGRAMS:
        block //= 2
    return block


def _call(kernel, *, grid, in_specs, out_specs, out_shape, warps, interpret):
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=1),
    )


def _chunk_input_specs(chunk, key_dim, value_dim, group):
    """q, k, v, g (time-major, in place), beta ``[B, HV, T, 1]``, start counts ``[B, T, 1]`` and
    ``[B, N, C/16, 16]``, for a (batch, value head, chunk) grid."""
    return [
        pl.BlockSpec((None, chunk, None, key_dim), lambda b, h, n: (b, n, jax.lax.div(h, group), 0)),
        pl.BlockSpec((None, chunk, None, key_dim), lambda b, h, n: (b, n, jax.lax.div(h, group), 0)),
        pl.BlockSpec((None, chunk, None, value_dim), lambda b, h, n: (b, n, h, 0)),
        pl.BlockSpec((None, chunk, None, key_dim), lambda b, h, n: (b, n, h, 0)),
        pl.BlockSpec((None, None, chunk, 1), lambda b, h, n: (b, h, n, 0)),
        pl.BlockSpec((None, chunk, 1), lambda b, h, n: (b, n, 0)),
        pl.BlockSpec((None, None, chunk // TILE, TILE), lambda b, h, n: (b, n, 0, 0)),
    ]


def _terms_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, count_ref, count_row_ref,
                  w_ref, u_ref, read_q_ref, write_k_ref, scores_ref, decay_ref, *, scale, dots):
    dtype = w_ref.dtype
    chunk = tiles.load_chunk(q_ref, k_ref, g_ref, beta_ref, count_ref, count_row_ref,
                             scale=scale, dtype=dtype, dots=dots)
    count = len(chunk.q)
    tiles.store_tiles(w_ref, chunk.w)
    tiles.store_tiles(u_ref, blocks.solve_values(chunk, tiles.load_tiles(v_ref, count, dtype), dots))
    tiles.store_tiles(read_q_ref, chunk.read_queries)
    tiles.store_tiles(write_k_ref, chunk.write_keys)
    for r in range(count):
        for i in range(count):
            block = chunk.scores.query[r][i] if i <= r else jnp.zeros((TILE, TILE), dtype)
            scores_ref[TILE * r : TILE * (r + 1), TILE * i : TILE * (i + 1)] = block
    decay_ref[...] = chunk.decay


def _terms(q, k, v, g, beta, counts, count_rows, *, scale, chunk, dtype, dots, interpret):
    """Per-chunk W, U, Q^, K- ``[B, HV, N, C, .]``, A_qk ``[B, HV, N, C, C]``, D ``[B, HV, N, 1, K]``."""
    batch, padded, heads, key_dim = q.shape
    value_heads, value_dim = v.shape[2:]
    n_chunks = padded // chunk

    def per_chunk(width):
        return pl.BlockSpec((None, None, None, chunk, width), lambda b, h, n: (b, h, n, 0, 0))

    shape = lambda *tail: jax.ShapeDtypeStruct((batch, value_heads, n_chunks, *tail), dtype)  # noqa: E731
    return _call(
        functools.partial(_terms_kernel, scale=scale, dots=dots),
        grid=(batch, value_heads, n_chunks),
        in_specs=_chunk_input_specs(chunk, key_dim, value_dim, value_heads // heads),
        out_specs=[per_chunk(key_dim), per_chunk(value_dim), per_chunk(key_dim), per_chunk(key_dim),
                   per_chunk(chunk),
                   pl.BlockSpec((None, None, None, 1, key_dim), lambda b, h, n: (b, h, n, 0, 0))],
        out_shape=[shape(chunk, key_dim), shape(chunk, value_dim), shape(chunk, key_dim),
                   shape(chunk, key_dim), shape(chunk, chunk), shape(1, key_dim)],
        warps=_TILE_WARPS,
        interpret=interpret,
    )(q, k, v, g, beta, counts, count_rows)


def _advance_kernel(w_ref, u_ref, read_q_ref, write_k_ref, scores_ref, decay_ref, state_ref,
                    o_ref, states_ref, final_ref, *, chunk, dots):
    def step(n, state):
        states_ref[n] = state
        o, state = blocks.advance([w_ref[n]], [u_ref[n]], [read_q_ref[n]], [[scores_ref[n]]],
                                 [write_k_ref[n]], dots.vector_t(decay_ref[n]), state, dots)
        o_ref[pl.ds(n * chunk, chunk), :] = o[0].astype(o_ref.dtype)
        return state

    final_ref[...] = jax.lax.fori_loop(0, states_ref.shape[0], step, state_ref[...])


def _retreat_kernel(w_ref, read_q_ref, write_k_ref, scores_ref, decay_ref, d_o_ref, d_final_ref,
                    d_next_ref, d_initial_ref, *, chunk, dots):
    n_chunks = d_next_ref.shape[0]

    def step(i, d_state):
        n = n_chunks - 1 - i
        d_next_ref[n] = d_state
        d_o = [d_o_ref[pl.ds(n * chunk, chunk), :].astype(d_state.dtype)]
        d_new_values = blocks.new_value_gradient([[scores_ref[n]]], [write_k_ref[n]], d_o, d_state, dots)
        return blocks.state_gradient([w_ref[n]], [read_q_ref[n]], d_o, d_new_values,
                                    dots.vector_t(decay_ref[n]), d_state, dots)

    d_initial_ref[...] = jax.lax.fori_loop(0, n_chunks, step, d_final_ref[...])


def _sequential_specs(n_chunks, chunk, key_dim, value_block):
    """Whole-sequence blocks of the per-chunk terms for a (batch, value head, V block) grid."""
    whole = lambda width, cols: pl.BlockSpec((None, None, n_chunks, chunk, width), cols)  # noqa: E731
    keys = whole(key_dim, lambda b, h, j: (b, h, 0, 0, 0))
    values = whole(value_block, lambda b, h, j: (b, h, 0, 0, j))
    scores = whole(chunk, lambda b, h, j: (b, h, 0, 0, 0))
    decay = pl.BlockSpec((None, None, n_chunks, 1, key_dim), lambda b, h, j: (b, h, 0, 0, 0))
    state = pl.BlockSpec((None, None, key_dim, value_block), lambda b, h, j: (b, h, 0, j))
    states = pl.BlockSpec((None, None, n_chunks, key_dim, value_block), lambda b, h, j: (b, h, 0, 0, j))
    tokens = pl.BlockSpec((None, n_chunks * chunk, None, value_block), lambda b, h, j: (b, 0, h, j))
    return keys, values, scores, decay, state, states, tokens


def forward(q, k, v, g, beta, counts, count_rows, initial_state, *, scale, chunk, interpret):
    """``(o [B, T, HV, V] in v.dtype, final_state, states entering each chunk [B, HV, N, K, V])``."""
    dtype = initial_state.dtype
    dots = _dots(dtype, interpret)
    batch, padded, value_heads, value_dim = v.shape
    key_dim, n_chunks = q.shape[-1], padded // chunk
    w, u, read_q, write_k, scores, decay = _terms(
        q, k, v, g, beta, counts, count_rows, scale=scale, chunk=chunk, dtype=dtype,
        dots=dots, interpret=interpret)
    value_block = _sequential_value_block(batch * value_heads, value_dim)
    keys, values, scores_spec, decay_spec, state, states, tokens = _sequential_specs(
        n_chunks, chunk, key_dim, value_block)
    o, states_out, final = _call(
        functools.partial(_advance_kernel, chunk=chunk, dots=dots),
        grid=(batch, value_heads, value_dim // value_block),
        in_specs=[keys, values, keys, keys, scores_spec, decay_spec, state],
        out_specs=[tokens, states, state],
        out_shape=[jax.ShapeDtypeStruct(v.shape, v.dtype),
                   jax.ShapeDtypeStruct((batch, value_heads, n_chunks, key_dim, value_dim), dtype),
                   jax.ShapeDtypeStruct(initial_state.shape, dtype)],
        warps=_WALK_WARPS,
        interpret=interpret,
    )(w, u, read_q, write_k, scores, decay, initial_state)
    return o, final, states_out


def _gradients_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, count_ref, count_row_ref,
                      d_o_ref, state_ref, d_next_ref,
                      d_q_ref, d_k_ref, d_v_ref, d_g_ref, d_beta_ref, *, scale, dots):
    dtype = d_q_ref.dtype
    chunk = tiles.load_chunk(q_ref, k_ref, g_ref, beta_ref, count_ref, count_row_ref,
                             scale=scale, dtype=dtype, dots=dots)
    count = len(chunk.q)
    value_dim = v_ref.shape[-1]
    width = min(value_dim, _GRADIENT_VALUE_BLOCK)
    columns = [slice(j, j + width) for j in range(0, value_dim, width)]
    value_blocks = [blocks.ValueBlock(tiles.load_tiles(v_ref, count, dtype, cols),
                                      tiles.load_tiles(d_o_ref, count, dtype, cols),
                                      state_ref[:, cols], d_next_ref[:, cols]) for cols in columns]
    grads = blocks.chunk_gradients(chunk, value_blocks, dots)
    tiles.store_tiles(d_q_ref, [d * scale for d in grads.q])
    tiles.store_tiles(d_k_ref, grads.k)
    tiles.store_tiles(d_g_ref, grads.g)
    tiles.store_tiles(d_beta_ref, grads.beta)
    for cols, d_v in zip(columns, grads.v):
        tiles.store_tiles(d_v_ref, d_v, cols)


def backward(q, k, v, g, beta, counts, count_rows, states, d_o, d_final, *, scale, chunk, interpret):
    """Gradients ``(dq, dk per value head [B, T, HV, K], dv, dg, dbeta [B, HV, T, 1], d_initial)``."""
    dtype = states.dtype
    dots = _dots(dtype, interpret)
    batch, padded, value_heads, value_dim = v.shape
    key_dim, n_chunks = q.shape[-1], padded // chunk
    w, _, read_q, write_k, scores, decay = _terms(
        q, k, v, g, beta, counts, count_rows, scale=scale, chunk=chunk, dtype=dtype,
        dots=dots, interpret=interpret)
    value_block = _sequential_value_block(batch * value_heads, value_dim)
    keys, _, scores_spec, decay_spec, state, states_spec, tokens = _sequential_specs(
        n_chunks, chunk, key_dim, value_block)
    d_next, d_initial = _call(
        functools.partial(_retreat_kernel, chunk=chunk, dots=dots),
        grid=(batch, value_heads, value_dim // value_block),
        in_specs=[keys, keys, keys, scores_spec, decay_spec, tokens, state],
        out_specs=[states_spec, state],
        out_shape=[jax.ShapeDtypeStruct(states.shape, dtype), jax.ShapeDtypeStruct(d_final.shape, dtype)],
        warps=_WALK_WARPS,
        interpret=interpret,
    )(w, read_q, write_k, scores, decay, d_o, d_final)

    per_token = lambda width: pl.BlockSpec((None, chunk, None, width), lambda b, h, n: (b, n, h, 0))  # noqa: E731
    chunk_state = pl.BlockSpec((None, None, None, key_dim, value_dim), lambda b, h, n: (b, h, n, 0, 0))
    token_shape = lambda width: jax.ShapeDtypeStruct((batch, padded, value_heads, width), dtype)  # noqa: E731
    d_q, d_k, d_v, d_g, d_beta = _call(
        functools.partial(_gradients_kernel, scale=scale, dots=dots),
        grid=(batch, value_heads, n_chunks),
        in_specs=[*_chunk_input_specs(chunk, key_dim, value_dim, value_heads // q.shape[2]),
                  per_token(value_dim), chunk_state, chunk_state],
        out_specs=[per_token(key_dim), per_token(key_dim), per_token(value_dim), per_token(key_dim),
                   pl.BlockSpec((None, None, chunk, 1), lambda b, h, n: (b, h, n, 0))],
        out_shape=[token_shape(key_dim), token_shape(key_dim), token_shape(value_dim), token_shape(key_dim),
                   jax.ShapeDtypeStruct(beta.shape, dtype)],
        warps=_TILE_WARPS,
        interpret=interpret,
    )(q, k, v, g, beta, counts, count_rows, d_o, states, d_next)
    return d_q, d_k, d_v, d_g, d_beta, d_initial
