"""Chunked KDA in XLA: the WY / UT form of SPEC §1, safe in fp32 for any gate.

Per value head and chunk of C tokens (rows r, columns i, key channels c), with the state S
carried between chunks:

    Gamma_t    = sum_{j <= t} g_j                     (inclusive, restarts every chunk)
    A_kk[r,i]  = beta_r sum_c k_r[c] k_i[c] exp(Gamma_r[c] - Gamma_i[c])      i <  r
    A_qk[r,i]  =        sum_c q_r[c] k_i[c] exp(Gamma_r[c] - Gamma_i[c])      i <= r
    [W | U]    = (I + A_kk)^{-1} Diag(beta) [exp(Gamma) * K | V]
    V~         = U - W S                                   (sequential over chunks)
    S         <- Diag(exp Gamma_C) S + (K * exp(Gamma_C - Gamma))^T V~
    O          = (Q * exp Gamma) S_in + A_qk V~           (S_in: the state entering the chunk)

Numerics. Gate sums are sums of same-sign terms (never differences of cumulative sums, so
no precision is lost to cancellation), and no exp sees an argument that could overflow:

* the chunk is split into sub-blocks of 16 tokens; a block pair (row block R, column block
  I < R) factors exp(Gamma_r - Gamma_i) = exp(lam_r) * exp(rho_i) * exp(between(I, R)), with
  lam_r the inclusive gate sum from the start of block R to r, rho_i the exclusive sum from
  i to the end of block I, and between(I, R) the sum over the blocks strictly between -- all
  three <= 0, anchored at the row block's start;
* diagonal blocks factor as exp(lam_r) * exp(-lam_i) when every sub-block decays by at most
  `FACTORED_DECAY_LIMIT` (always so for K3's bounded gate, -5 * 16 = -80); otherwise (Kimi
  Linear's unbounded gate can reach -1000 per token) they use exact pairwise sums
  sum_{i < j <= r} g_j, with masked exponents replaced by -inf *before* exp, so neither
  values nor gradients meet exp(+huge) * 0.

Packed documents: with segment indices, pairs across a boundary are masked out of A_kk and
A_qk, rows after a boundary do not read the carried state, columns before the chunk's last
boundary do not write it, and the carried state is dropped when the chunk holds a boundary.

Gradients come from autodiff: the intra-chunk part is rematerialised (`jax.checkpoint`), so
the backward pass stores one state per chunk and per-chunk [C, K] tensors, never a state per
token.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.ops.precision import einsum

SUB_BLOCK = 16
FACTORED_DECAY_LIMIT = 80.0  # exp(80) ~ 5.5e34: products of such factors stay finite in fp32


def effective_chunk_size(length: int, chunk_size: int) -> int:
    """The chunk actually used: ``chunk_size``, shrunk (to a multiple of 16) for short sequences."""
    if length >= chunk_size:
        return chunk_size
    return min(chunk_size, SUB_BLOCK * math.ceil(length / SUB_BLOCK))


def _cumsum(x, axis: int, reverse: bool = False, exclusive: bool = False):
    """Cumulative sum along a short axis (a 16-token sub-block) by a parallel prefix scan.

    ``exclusive`` shifts instead of subtracting, so a sum of same-sign terms keeps full relative
    precision.
    """
    axis = axis % x.ndim
    inclusive = jax.lax.associative_scan(jnp.add, x, axis=axis, reverse=reverse)
    if not exclusive:
        return inclusive
    zeros = jnp.zeros_like(jax.lax.slice_in_dim(x, 0, 1, axis=axis))
    if reverse:
        return jnp.concatenate([jax.lax.slice_in_dim(inclusive, 1, None, axis=axis), zeros], axis=axis)
    return jnp.concatenate([zeros, jax.lax.slice_in_dim(inclusive, 0, -1, axis=axis)], axis=axis)


def _masked_exp(mask, exponent):
    """exp(exponent) where mask, 0 elsewhere; the exponent is masked before exp (NaN-safe)."""
    return jnp.exp(jnp.where(mask, exponent, -jnp.inf))


class GateSums(NamedTuple):
    """Sums of log decays inside each chunk (all <= 0, each a sum of same-sign terms).

    Shapes: ``local``, ``to_block_end`` ``[.., n, S, K]``; ``block_total`` ``[.., n, K]``;
    ``prefix``, ``suffix`` ``[.., C, K]``; ``total`` ``[.., K]``;
    ``between`` ``[.., n (row block R), n (column block I), K]``.
    """

    local: jax.Array         # lam: from the start of the token's sub-block to the token, inclusive
    to_block_end: jax.Array  # rho: from the token to the end of its sub-block, exclusive
    block_total: jax.Array   # each sub-block's total
    prefix: jax.Array        # Gamma: from the chunk start to the token, inclusive
    suffix: jax.Array        # Gamma_C - Gamma: from the token to the chunk end, exclusive
    total: jax.Array         # Gamma_C
    between: jax.Array       # over the sub-blocks strictly between I and R


def gate_sums(gb: jax.Array) -> GateSums:
    """All gate sums the chunk form needs, from the gates in sub-blocks ``gb [.., n, S, K]``."""
    local = _cumsum(gb, axis=-2)
    to_block_end = _cumsum(gb, axis=-2, reverse=True, exclusive=True)
    block_total = local[..., -1, :]
    before = _cumsum(block_total, axis=-2, exclusive=True)
    after = _cumsum(block_total, axis=-2, reverse=True, exclusive=True)
    blocks = gb.shape[-3]
    idx = np.arange(blocks)
    strictly_between = (idx[None, :, None] < idx[None, None, :]) & (idx[None, None, :] < idx[:, None, None])
    chunk_shape = (*gb.shape[:-3], blocks * gb.shape[-2], gb.shape[-1])
    return GateSums(
        local=local,
        to_block_end=to_block_end,
        block_total=block_total,
        prefix=(before[..., None, :] + local).reshape(chunk_shape),
        suffix=(after[..., None, :] + to_block_end).reshape(chunk_shape),
        total=jnp.sum(block_total, axis=-2),
        between=einsum("RIb,...bk->...RIk", strictly_between.astype(np.float32), block_total),
    )


def _diagonal_exact(qb, kb, gb):
    """Diagonal sub-blocks ``[.., n, 2S, S]`` (query rows, then key rows) from exact pairwise sums
    sum_{i<j<=r} g_j, valid for any gate magnitude."""
    size = gb.shape[-2]
    r, i, j = np.ogrid[:size, :size, :size]
    path = ((i < j) & (j <= r)).astype(np.float32)                 # [r, i, j]
    pair_sum = einsum("rij,...njk->...nrik", path, gb)
    causal = (np.arange(size)[:, None] >= np.arange(size)[None, :])[:, :, None]
    decay = _masked_exp(causal, pair_sum)                          # [.., n, S, S, K]
    rows = jnp.concatenate([qb, kb], axis=-2)[..., :, None, :]     # [.., n, 2S, 1, K]
    return jnp.sum(rows * kb[..., None, :, :] * jnp.concatenate([decay, decay], axis=-3), axis=-1)


def scores(qb, kb, gb, sums: GateSums):
    """Lower-block scores for query rows and key rows, unmasked inside diagonal blocks: ``[2, .., C, C]``.

    Entry [x, r, i] = sum_c row_r[c] k_i[c] exp(Gamma_r[c] - Gamma_i[c]) for i in a sub-block at or
    before r's (x = 0: rows are queries, x = 1: rows are keys); blocks above the diagonal are zero.
    Row block R is one matmul of its anchored rows against every column it sees; the diagonal
    block's columns are k_i exp(-lam_i) when that is safe, else it is recomputed exactly.
    """
    blocks, sub_block = qb.shape[-3], qb.shape[-2]
    lead = qb.shape[:-3]
    rows = jnp.concatenate([qb, kb], axis=-2) * jnp.concatenate([jnp.exp(sums.local)] * 2, axis=-2)
    keys_to_block_end = kb * jnp.exp(sums.to_block_end)
    decay_between = jnp.exp(sums.between)                          # [.., R, I, K]
    factored = jnp.max(-sums.block_total) <= FACTORED_DECAY_LIMIT
    keys_from_block_start = kb * jnp.exp(jnp.where(factored, -sums.local, 0.0))
    row_blocks = []
    for R in range(blocks):
        cols = keys_to_block_end[..., :R, :, :] * decay_between[..., R, :R, None, :]
        cols = jnp.concatenate([cols, keys_from_block_start[..., R : R + 1, :, :]], axis=-3)
        cols = cols.reshape(*lead, (R + 1) * sub_block, -1)
        block = einsum("...rc,...ic->...ri", rows[..., R, :, :], cols)       # [.., 2S, (R+1)S]
        pad = jnp.zeros((*lead, 2 * sub_block, (blocks - 1 - R) * sub_block), qb.dtype)
        row_blocks.append(jnp.concatenate([block, pad], axis=-1))
    both = jnp.stack(row_blocks, axis=-3)                          # [.., n, 2S, C]
    diagonal = jax.lax.cond(
        factored,
        lambda: jnp.stack([both[..., R, :, R * sub_block : (R + 1) * sub_block] for R in range(blocks)], -3),
        lambda: _diagonal_exact(qb, kb, gb),
    )
    both = jnp.concatenate(
        [jnp.concatenate([both[..., R, :, : R * sub_block], diagonal[..., R, :, :],
                          both[..., R, :, (R + 1) * sub_block :]], axis=-1)[..., None, :, :]
         for R in range(blocks)], axis=-3)
    both = both.reshape(*lead, blocks, 2, sub_block, blocks * sub_block)
    return jnp.moveaxis(both, -3, 0).reshape(2, *lead, blocks * sub_block, blocks * sub_block)


def unit_lower_solve(a, rhs, block: int):
    """Solve (I + a) X = rhs for strictly lower-triangular ``a [.., C, C]`` by block substitution.

    Diagonal blocks are inverted by doubling, (I + L)^{-1} = prod_m (I + (-L)^(2^m)); the rest is
    matmuls. Shapes: rhs ``[.., C, D]`` -> X ``[.., C, D]``.
    """
    chunk = a.shape[-1]
    eye = jnp.eye(block, dtype=a.dtype)
    solved = []
    for start in range(0, chunk, block):
        rows = slice(start, start + block)
        acc = rhs[..., rows, :]
        if start:
            acc = acc - einsum("...rj,...jd->...rd", a[..., rows, :start], jnp.concatenate(solved, axis=-2))
        power = -a[..., rows, rows]
        inverse = eye + power
        for _ in range(int(math.log2(block)) - 1):
            power = einsum("...ij,...jk->...ik", power, power)
            inverse = inverse + einsum("...ij,...jk->...ik", inverse, power)
        solved.append(einsum("...rj,...jd->...rd", inverse, acc))
    return jnp.concatenate(solved, axis=-2)


class ChunkTerms(NamedTuple):
    """Per-chunk tensors that do not depend on the carried state, ``[B, HV, N, ...]``."""

    w: jax.Array            # (I + A_kk)^-1 Diag(beta) (exp(Gamma) * K)     [.., C, K]
    u: jax.Array            # (I + A_kk)^-1 Diag(beta) V                    [.., C, V]
    queries: jax.Array      # Q * exp(Gamma)                                [.., C, K]
    a_qk: jax.Array         # causal query-key scores                       [.., C, C]
    keys_to_end: jax.Array  # K * exp(Gamma_C - Gamma)                      [.., C, K]
    decay_total: jax.Array  # exp(Gamma_C)                                  [.., K]


def intra_chunk(q, k, v, g, beta, segments, sub_block: int) -> ChunkTerms:
    """Everything that does not depend on the carried state, for all chunks at once.

    Inputs ``[B, HV, N, C, ...]`` (fp32, q scaled); ``segments`` is None or a pair of segment
    indices ``([B, 1, N, C], [B, 1, N, 1])``: each token's, and the one carried into the chunk.
    """
    *lead, chunk, key_dim = q.shape
    blocks = chunk // sub_block
    to_blocks = lambda x: x.reshape(*lead, blocks, sub_block, x.shape[-1])  # noqa: E731
    gb = to_blocks(g)
    sums = gate_sums(gb)
    both = scores(to_blocks(q), to_blocks(k), gb, sums)

    t = np.arange(chunk)
    a_qk = both[0] * (t[:, None] >= t[None, :])
    a_kk = both[1] * (t[:, None] > t[None, :]) * beta[..., :, None]
    decay_prefix = jnp.exp(sums.prefix)
    carried_keys, queries = k * decay_prefix, q * decay_prefix
    keys_to_end, decay_total = k * jnp.exp(sums.suffix), jnp.exp(sums.total)
    if segments is not None:
        segment_index, carried_segment = segments
        same = (segment_index[..., :, None] == segment_index[..., None, :]).astype(q.dtype)
        a_qk, a_kk = a_qk * same, a_kk * same
        reads_carry = (segment_index == carried_segment).astype(q.dtype)[..., None]
        writes_carry = (segment_index == segment_index[..., -1:]).astype(q.dtype)[..., None]
        carried_keys, queries = carried_keys * reads_carry, queries * reads_carry
        keys_to_end, decay_total = keys_to_end * writes_carry, decay_total * reads_carry[..., -1, :]

    rhs = beta[..., None] * jnp.concatenate([carried_keys, v], axis=-1)
    solved = unit_lower_solve(a_kk, rhs, sub_block)
    return ChunkTerms(solved[..., :key_dim], solved[..., key_dim:], queries, a_qk, keys_to_end, decay_total)


def pass_state(terms: ChunkTerms, initial_state):
    """The sequential part: carry S across chunks.

    Returns ``(new_values V~ [B, HV, N, C, V], entering states [B, HV, N, K, V], final_state)``.
    """

    def body(state, chunk):
        w, u, keys_to_end, decay_total = chunk
        new_values = u - einsum("bhck,bhkv->bhcv", w, state)
        next_state = decay_total[..., None] * state + einsum("bhck,bhcv->bhkv", keys_to_end, new_values)
        return next_state, (new_values, state)

    chunk_major = [jnp.moveaxis(x, 2, 0) for x in (terms.w, terms.u, terms.keys_to_end, terms.decay_total)]
    final_state, (new_values, entering) = jax.lax.scan(body, initial_state, chunk_major)
    return jnp.moveaxis(new_values, 0, 2), jnp.moveaxis(entering, 0, 2), final_state


def _segment_index_chunks(segment_starts, padded_length, chunk):
    """Segment index of each token ``[B, 1, N, C]`` and the index carried into each chunk ``[B, 1, N, 1]``.

    The index counts segment starts, so the initial state belongs to index 0.
    """
    index = jnp.cumsum(segment_starts.astype(jnp.int32), axis=1)
    index = jnp.pad(index, ((0, 0), (0, padded_length - index.shape[1])), mode="edge")
    batch = index.shape[0]
    chunks = index.reshape(batch, -1, chunk)
    carried = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), chunks[:, :-1, -1]], axis=1)
    return chunks[:, None], carried[:, None, :, None]


def chunk_kda(q, k, v, g, beta, initial_state, segment_starts, chunk_size: int):
    """Chunked KDA on fp32 arrays already expanded to value heads and scaled.

    Shapes as `reference.recurrent_kda`: q, k, g ``[B, T, HV, K]``, v ``[B, T, HV, V]``,
    beta ``[B, T, HV]``, initial_state ``[B, HV, K, V]``, segment_starts ``[B, T]`` or None.
    Any T: the tail is padded with tokens that leave the state unchanged (k = v = g = beta = 0).
    """
    batch, length, heads, _ = q.shape
    chunk = effective_chunk_size(length, chunk_size)
    sub_block = SUB_BLOCK if chunk % SUB_BLOCK == 0 else chunk
    n_chunks = -(-length // chunk)
    padded = n_chunks * chunk

    def to_chunks(x):
        x = jnp.pad(x, [(0, 0), (0, padded - length)] + [(0, 0)] * (x.ndim - 2))
        x = jnp.moveaxis(x, 2, 1)
        return x.reshape(batch, heads, n_chunks, chunk, *x.shape[3:])

    segments = None if segment_starts is None else _segment_index_chunks(segment_starts, padded, chunk)
    terms = jax.checkpoint(functools.partial(intra_chunk, sub_block=sub_block))(
        *map(to_chunks, (q, k, v, g, beta)), segments
    )
    new_values, entering, final_state = pass_state(terms, initial_state)
    o = einsum("bhnck,bhnkv->bhncv", terms.queries, entering) + einsum(
        "bhnrc,bhncv->bhnrv", terms.a_qk, new_values
    )
    o = o.reshape(batch, heads, padded, -1)[:, :, :length]
    return jnp.moveaxis(o, 1, 2), final_state
