"""Chunked KDA in XLA: the block math of `blocks`, batched, with its hand-written backward.

The sequence is cut into chunks of C = `blocks.chunk_length` tokens, each G = C / 16 blocks of
16 tokens. Every block is a chunk of the block math on its own (state passed every 16 tokens:
on CPUs the state passes cost less than coupling the blocks through off-diagonal scores):

    per chunk, for all G blocks at once   `blocks.chunk_terms` (scores, (I + A_kk)^{-1}, W, Q^, K-, D)
                                          U = (I + A_kk)^{-1} Diag(beta) V
    then block by block, in order         V~ = U - W S;  O = Q^ S + A_qk V~;  S <- D S + K-^T V~

One `lax.scan` step handles one chunk: its intermediates stay in cache, and the chunks are read
from and written to the token-major arrays in place. Packed documents: the in-block segment
start counts drive the masks of `blocks.Segments`.

Backward (`jax.custom_vjp`): the forward saves its inputs, the state entering each chunk and
V~ (V floats per token and head; recomputing V~ instead made forward+backward about 15%
slower in an interleaved A/B). Per chunk, in reverse: recompute the block terms, rebuild the
states entering each block from V~, walk the blocks backwards for dS, taking each block's
products with its S_in and dS_out on the way (`blocks.value_block_gradients`,
`blocks.state_gradient`: no state is stacked), then the rest of all G blocks' gradients at
once (`blocks.gradients_from_parts`). Autodiff of the same forward with each chunk's step
rematerialised instead measured 0.34x main's forward+backward speed at (1, 4096, 4, 128, 128)
and 129 MiB of temporaries at T = 8192 (this backward: 80 MiB).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.ops.kda import blocks
from k3jax.ops.kda.backend import XLA_DOTS as DOTS
from k3jax.ops.kda.blocks import TILE, chunk_length
from k3jax.ops.residuals import forward_rule

SUB_BLOCK = TILE  # tokens between state passes


def effective_chunk_size(length: int, chunk_size: int) -> int:
    """The chunk actually used (`blocks.chunk_length`)."""
    return chunk_length(length, chunk_size)


def block_width(chunk: int) -> int:
    """Tokens between state passes for a chunk of ``chunk`` tokens (always 16 here), for
    `chunk_algorithm_flops`."""
    del chunk
    return SUB_BLOCK


def _to_blocks(x):
    """One chunk, token-major ``[B, C, HV, ...]``, as blocks ``[B, G, HV, 16, ...]``."""
    x = x.reshape(x.shape[0], x.shape[1] // TILE, TILE, *x.shape[2:])
    return jnp.swapaxes(x, 2, 3)


def _from_blocks(x):
    """Inverse of `_to_blocks`."""
    x = jnp.swapaxes(x, 2, 3)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _chunk_terms(q, k, g, beta, counts):
    """The block math's terms of one chunk's G blocks, batched ``[B, G, HV, ...]``, each block a
    one-tile chunk; ``counts [B, G, 16]`` are the in-block segment start counts."""
    counts = counts[:, :, None, :]   # broadcast over value heads
    return blocks.chunk_terms([_to_blocks(q)], [_to_blocks(k)], [_to_blocks(g)], [_to_blocks(beta)[..., None]],
                              [counts[..., None]], [counts[..., None, :]], DOTS)


class _BlockView:
    """The terms of block ``b`` of a chunk in the list form the block math takes."""

    def __init__(self, terms: blocks.Chunk, b: int):
        self.w = [terms.w[0][:, b]]
        self.read_queries = [terms.read_queries[0][:, b]]
        self.query_scores = [[terms.scores.query[0][0][:, b]]]
        self.write_keys = [terms.write_keys[0][:, b]]
        self.decay_column = DOTS.vector_t(terms.decay[:, b])


def _forward_step(state, chunk_inputs):
    """One chunk: ``(S_out, o [B, C, HV, V], V~ [B, G, HV, 16, V])`` from S_in and the chunk's
    ``(q, k, v, g, beta, counts)``."""
    q, k, v, g, beta, counts = chunk_inputs
    terms = _chunk_terms(q, k, g, beta, counts)
    u = blocks.solve_values(terms, [_to_blocks(v)], DOTS)[0]
    outputs, values = [], []
    for b in range(u.shape[1]):
        view = _BlockView(terms, b)
        values.append(blocks.new_values(view.w, [u[:, b]], state, DOTS)[0])
        outputs.append(blocks.outputs(view.read_queries, view.query_scores, [values[-1]], state, DOTS)[0])
        state = blocks.next_state(view.write_keys, [values[-1]], view.decay_column, state, DOTS)
    return state, _from_blocks(jnp.stack(outputs, axis=1)), jnp.stack(values, axis=1)


def _backward_step(d_state, xs):
    """One chunk in reverse: from dS_out, the chunk's inputs, the state entering it, its V~ and dO,
    returns dS_in and the gradients of the chunk's ``(q, k, v, g, beta)``, token-major."""
    (q, k, v, g, beta, counts), (state, values), d_o = xs
    terms = _chunk_terms(q, k, g, beta, counts)
    views = [_BlockView(terms, b) for b in range(values.shape[1])]
    entering = [state]
    for b, view in enumerate(views[:-1]):
        entering.append(blocks.next_state(view.write_keys, [values[:, b]], view.decay_column, entering[-1], DOTS))
    v, d_o = _to_blocks(v), _to_blocks(d_o)
    parts = [None] * len(views)
    for b in reversed(range(len(views))):
        view, d_out = views[b], [d_o[:, b]]
        block = blocks.ValueBlock([v[:, b]], d_out, entering[b], d_state, [values[:, b]])
        parts[b] = blocks.value_block_gradients(jax.tree.map(lambda x: x[:, b], terms), block, DOTS)
        d_state = blocks.state_gradient(view.w, view.read_queries, d_out, parts[b][2], view.decay_column, d_state, DOTS)
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs, axis=1), *parts)
    grads = blocks.gradients_from_parts(terms, [stacked], DOTS)
    d_inputs = (grads.q[0], grads.k[0], grads.v[0][0], grads.g[0], grads.beta[0][..., 0])
    return d_state, tuple(_from_blocks(x) for x in d_inputs)


def _chunk(arrays, index):
    """Chunk ``index`` of arrays ``[B, N, ...]`` (a pytree)."""
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, index, axis=1, keepdims=False), arrays)


def _write_chunk(buffers, values, index):
    """Write one chunk's ``values`` into ``buffers [B, N, ...]`` at chunk ``index`` (in place)."""
    return jax.tree.map(lambda buf, x: jax.lax.dynamic_update_index_in_dim(buf, x, index, axis=1), buffers, values)


def _forward(inputs, initial_state):
    """Scan the chunks: ``(o, final state, per chunk [N, ...]: the entering state and V~)``."""

    def body(carry, index):
        state, o = carry
        next_state, o_chunk, values = _forward_step(state, _chunk(inputs, index))
        return (next_state, _write_chunk(o, o_chunk, index)), (state, values)

    o = jnp.zeros(inputs[2].shape, inputs[2].dtype)
    (final_state, o), states = jax.lax.scan(body, (initial_state, o), jnp.arange(inputs[0].shape[1]))
    return o, final_state, states


@jax.custom_vjp
def chunked(q, k, v, g, beta, initial_state, counts):
    """Chunked KDA on token-major arrays split into chunks, ``[B, N, C, HV, ...]`` (counts
    ``[B, N, G, 16]``); returns ``(o, final_state)``."""
    o, final_state, _ = _forward((q, k, v, g, beta, counts), initial_state)
    return o, final_state


def _chunked_fwd(q, k, v, g, beta, initial_state, counts):
    inputs = (q, k, v, g, beta, counts)
    o, final_state, kept = forward_rule(_forward)(inputs, initial_state)   # `k3jax.ops.residuals`
    return (o, final_state), (inputs, kept)


def _chunked_bwd(residuals, cotangents):
    inputs, kept = residuals
    d_o, d_final_state = cotangents

    def body(carry, index):
        d_state, grads = carry
        chunk_kept = jax.tree.map(lambda x: x[index], kept)
        d_state, chunk_grads = _backward_step(d_state, (_chunk(inputs, index), chunk_kept, _chunk(d_o, index)))
        return (d_state, _write_chunk(grads, chunk_grads, index)), None

    grads = tuple(jnp.zeros_like(x) for x in inputs[:5])
    (d_initial, grads), _ = jax.lax.scan(body, (d_final_state, grads), jnp.arange(inputs[0].shape[1]),
                                         reverse=True)
    return (*grads, d_initial, None)


chunked.defvjp(_chunked_fwd, _chunked_bwd)


def chunk_kda(q, k, v, g, beta, initial_state, segment_starts, chunk_size: int):
    """Chunked KDA on fp32 arrays already expanded to value heads and scaled.

    Shapes as `reference.recurrent_kda`: q, k, g ``[B, T, HV, K]``, v ``[B, T, HV, V]``,
    beta ``[B, T, HV]``, initial_state ``[B, HV, K, V]``, segment_starts ``[B, T]`` or None.
    Any T: the tail is padded with tokens that leave the state unchanged (k = v = g = beta = 0).
    Internally ``[B, N, C, HV, ...]`` (a reshape, no copy).
    """
    batch, length, heads, _ = q.shape
    chunk = chunk_length(length, chunk_size)
    n_chunks = -(-length // chunk)
    padded = n_chunks * chunk

    def to_chunks(x):  # [B, T, HV, ...] -> [B, N, C, HV, ...]
        if padded != length:
            x = jnp.pad(x, [(0, 0), (0, padded - length)] + [(0, 0)] * (x.ndim - 2))
        return x.reshape(batch, n_chunks, chunk, *x.shape[2:])

    counts = blocks.start_counts(segment_starts, batch, length, padded, TILE, q.dtype)
    counts = counts.reshape(batch, n_chunks, chunk // TILE, TILE)
    o, final_state = chunked(*map(to_chunks, (q, k, v, g, beta)), initial_state, counts)
    return o.reshape(batch, padded, heads, -1)[:, :length], final_state


def chunk_algorithm_flops(batch: int, length: int, value_heads: int, key_dim: int, value_dim: int,
                          chunk: int) -> int:
    """FLOPs (2 per multiply-add) of the chunk algorithm's forward with state passes every
    ``chunk`` tokens (`block_width` of the chunk size for this implementation), counting only
    the work the algorithm needs (causal halves of the C x C matrices, a triangular inverse) --
    not what an implementation computes in full squares and masks away:

        scores   A_qk (causal) and A_kk (strictly causal)           C^2 * 2K
        solve    (I + A_kk)^{-1} (C^3 / 3) applied to Diag(beta) P  C^3 / 3 + C^2 V
        state    exp(Gamma) K S_in, (Q exp Gamma) S_in, (K exp sigma)^T V~   3 * 2 C K V
        output   A_qk V~ (causal)                                    C^2 V
    per (batch, value head, chunk).
    """
    per_chunk = (2 * chunk * chunk * key_dim + chunk**3 // 3 + chunk * chunk * value_dim
                 + 6 * chunk * key_dim * value_dim + chunk * chunk * value_dim)
    return batch * value_heads * -(-length // chunk) * per_chunk
