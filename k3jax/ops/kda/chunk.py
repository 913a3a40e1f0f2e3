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

The chunk is split into sub-blocks of S = 16 tokens; every C x C matrix is kept as row
blocks (a diagonal S x S block and the S x R*S block of earlier columns), never assembled.

Numerics. Gate sums are sums of same-sign terms (never differences of cumulative sums, so
no precision is lost to cancellation), and no exp sees an argument that could overflow:

* an off-diagonal block pair (row block R, column block I < R) factors
  exp(Gamma_r - Gamma_i) = exp(lam_r) * exp(rho_i) * exp(between(I, R)), with lam_r the
  inclusive gate sum from the start of block R to r, rho_i the exclusive sum from i to the end
  of block I, and between(I, R) the sum over the blocks strictly between -- all three <= 0;
* a diagonal block factors as exp(lam_r) * exp(-lam_i) when no sub-block decays by more than
  `FACTORED_DECAY_LIMIT` (always so for K3's bounded gate: 16 * 5 = 80). Otherwise (Kimi
  Linear's unbounded gate can reach -1000 per token) the diagonal blocks are recomputed from
  exact pairwise sums sum_{i < j <= r} g_j, with masked exponents set to -inf *before* exp,
  so neither values nor gradients meet exp(+huge) * 0. The factored columns are clamped so
  they stay finite even when they are discarded.

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


def _sum_matrix(size: int, upper: bool = False, inclusive: bool = True) -> np.ndarray:
    """0/1 matrix M with (M @ x)[r] = sum_j x[j] over j <= r (lower) or j > r (upper, exclusive)."""
    r, j = np.ogrid[:size, :size]
    if upper:
        return ((j >= r) if inclusive else (j > r)).astype(np.float32)
    return ((j <= r) if inclusive else (j < r)).astype(np.float32)


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
    blocks, width = gb.shape[-3:-1]
    local = einsum("rj,...jk->...rk", _sum_matrix(width), gb)
    to_block_end = einsum("rj,...jk->...rk", _sum_matrix(width, upper=True, inclusive=False), gb)
    block_total = local[..., -1, :]
    before = einsum("bj,...jk->...bk", _sum_matrix(blocks, inclusive=False), block_total)
    after = einsum("bj,...jk->...bk", _sum_matrix(blocks, upper=True, inclusive=False), block_total)
    R, I, b = np.ogrid[:blocks, :blocks, :blocks]
    strictly_between = ((I < b) & (b < R)).astype(np.float32)
    chunk_shape = (*gb.shape[:-3], blocks * width, gb.shape[-1])
    return GateSums(
        local=local,
        to_block_end=to_block_end,
        block_total=block_total,
        prefix=(before[..., None, :] + local).reshape(chunk_shape),
        suffix=(after[..., None, :] + to_block_end).reshape(chunk_shape),
        total=jnp.sum(block_total, axis=-2),
        between=einsum("RIb,...bk->...RIk", strictly_between, block_total),
    )


def _exact_diagonal(rows, kb, gb):
    """Diagonal blocks ``[.., n, R, S]`` for raw ``rows [.., n, R, K]`` (query rows then key rows,
    R = 2S) from exact pairwise sums sum_{i<j<=r} g_j: valid for any gate magnitude."""
    width = gb.shape[-2]
    r, i, j = np.ogrid[:width, :width, :width]
    path = ((i < j) & (j <= r)).astype(np.float32)
    pair_sum = einsum("rij,...njk->...nrik", path, gb)                     # [.., n, S, S, K]
    decay = _masked_exp(r >= i, pair_sum)
    decay = jnp.concatenate([decay, decay], axis=-3)                       # rows: queries, keys
    return jnp.sum(rows[..., :, None, :] * kb[..., None, :, :] * decay, axis=-1)


class RowBlockScores(NamedTuple):
    """Scores sum_c row_r[c] k_i[c] exp(Gamma_r[c] - Gamma_i[c]) by row block, unmasked.

    ``diagonal [.., n, 2S, S]``: block R against its own columns; ``earlier[R] [.., 2S, R*S]``
    (R >= 1): block R against the columns of blocks < R. Rows 0..S-1 are queries, S..2S-1 keys.
    """

    diagonal: jax.Array
    earlier: tuple


def row_block_scores(qb, kb, gb, sums: GateSums) -> RowBlockScores:
    """Query-row and key-row scores for all chunks, anchored at each row block's start."""
    blocks, width = qb.shape[-3:-1]
    local_twice = jnp.concatenate([sums.local, sums.local], axis=-2)
    raw_rows = jnp.concatenate([qb, kb], axis=-2)                           # [.., n, 2S, K]
    rows = raw_rows * jnp.exp(local_twice)
    own_columns = kb * jnp.exp(jnp.minimum(-sums.local, FACTORED_DECAY_LIMIT))
    factored = einsum("...nrc,...nic->...nri", rows, own_columns)
    safe = jnp.max(-sums.block_total) <= FACTORED_DECAY_LIMIT
    # The exact branch is rematerialised: differentiating a cond saves the union of both branches'
    # intermediates (zero-filled for the branch not taken), which for [.., S, S, K] would dominate.
    exact = jax.lax.cond(
        safe, lambda: jnp.zeros_like(factored), lambda: jax.checkpoint(_exact_diagonal)(raw_rows, kb, gb)
    )
    keys_to_block_end = kb * jnp.exp(sums.to_block_end)
    decay_between = jnp.exp(sums.between)                                   # [.., R, I, K]
    earlier = []
    for R in range(1, blocks):
        cols = keys_to_block_end[..., :R, :, :] * decay_between[..., R, :R, None, :]
        cols = cols.reshape(*cols.shape[:-3], R * width, cols.shape[-1])
        earlier.append(einsum("...rc,...ic->...ri", rows[..., R, :, :], cols))
    return RowBlockScores(jnp.where(safe, factored, exact), tuple(earlier))


def unit_lower_inverse(lower):
    """(I + L)^{-1} for strictly lower-triangular ``L [.., S, S]`` by doubling:
    prod_m (I + (-L)^(2^m)), m = 0 .. log2(S) - 1."""
    power = -lower
    inverse = jnp.eye(lower.shape[-1], dtype=lower.dtype) + power
    for _ in range(int(math.log2(lower.shape[-1])) - 1):
        power = einsum("...ij,...jk->...ik", power, power)
        inverse = inverse + einsum("...ij,...jk->...ik", inverse, power)
    return inverse


class ChunkTerms(NamedTuple):
    """Per-chunk tensors that do not depend on the carried state, ``[N, B, HV, ...]``."""

    w: jax.Array            # (I + A_kk)^-1 Diag(beta) (exp(Gamma) * K)     [.., C, K]
    u: jax.Array            # (I + A_kk)^-1 Diag(beta) V                    [.., C, V]
    queries: jax.Array      # Q * exp(Gamma)                                [.., C, K]
    a_qk_diagonal: jax.Array  # causal query scores, diagonal blocks       [.., n, S, S]
    a_qk_earlier: tuple     # query scores against earlier blocks           [.., S, R*S]
    keys_to_end: jax.Array  # K * exp(Gamma_C - Gamma)                      [.., C, K]
    decay_total: jax.Array  # exp(Gamma_C)                                  [.., K]


def intra_chunk(q, k, v, g, beta, segments, sub_block: int) -> ChunkTerms:
    """Everything that does not depend on the carried state, for all chunks at once.

    Inputs ``[.., C, ...]`` (fp32, q scaled); ``segments`` is None or a pair of segment indices
    ``([.., C], [.., 1])``: each token's, and the one carried into the chunk.
    """
    chunk, key_dim = q.shape[-2:]
    blocks, width = chunk // sub_block, sub_block

    def to_blocks(x, axis=-2):  # split the chunk axis into [n, S]
        axis %= x.ndim
        return x.reshape(*x.shape[:axis], blocks, width, *x.shape[axis + 1:])

    qb, kb, gb, beta_b = to_blocks(q), to_blocks(k), to_blocks(g), to_blocks(beta, axis=-1)
    sums = gate_sums(gb)
    scores = row_block_scores(qb, kb, gb, sums)

    r, i = np.ogrid[:width, :width]
    q_diagonal = scores.diagonal[..., :width, :] * (r >= i)
    k_diagonal = scores.diagonal[..., width:, :] * (r > i) * beta_b[..., :, None]
    q_earlier = [s[..., :width, :] for s in scores.earlier]
    k_earlier = [s[..., width:, :] * beta_b[..., R + 1, :, None] for R, s in enumerate(scores.earlier)]

    decay_prefix = jnp.exp(sums.prefix)
    carried_keys, queries = k * decay_prefix, q * decay_prefix
    keys_to_end, decay_total = k * jnp.exp(sums.suffix), jnp.exp(sums.total)
    if segments is not None:
        index, carried = segments
        index_b = to_blocks(index, axis=-1)
        same = lambda rows, cols: (rows[..., :, None] == cols[..., None, :]).astype(q.dtype)  # noqa: E731
        diagonal_same = same(index_b, index_b)
        q_diagonal, k_diagonal = q_diagonal * diagonal_same, k_diagonal * diagonal_same
        earlier_same = [same(index_b[..., R + 1, :], index[..., : (R + 1) * width]) for R in range(blocks - 1)]
        q_earlier = [a * m for a, m in zip(q_earlier, earlier_same)]
        k_earlier = [a * m for a, m in zip(k_earlier, earlier_same)]
        reads_carry = (index == carried).astype(q.dtype)[..., None]
        writes_carry = (index == index[..., -1:]).astype(q.dtype)[..., None]
        carried_keys, queries = carried_keys * reads_carry, queries * reads_carry
        keys_to_end, decay_total = keys_to_end * writes_carry, decay_total * reads_carry[..., -1, :]

    # Block forward substitution for (I + A_kk) X = Diag(beta) [exp(Gamma) K | V].
    rhs = to_blocks(beta[..., None] * jnp.concatenate([carried_keys, v], axis=-1))
    inverse = unit_lower_inverse(k_diagonal)
    solved = [einsum("...ij,...jd->...id", inverse[..., 0, :, :], rhs[..., 0, :, :])]
    for R in range(1, blocks):
        acc = rhs[..., R, :, :] - einsum("...ij,...jd->...id", k_earlier[R - 1], jnp.concatenate(solved, axis=-2))
        solved.append(einsum("...ij,...jd->...id", inverse[..., R, :, :], acc))
    solved = jnp.concatenate(solved, axis=-2)
    return ChunkTerms(solved[..., :key_dim], solved[..., key_dim:], queries, q_diagonal, tuple(q_earlier),
                      keys_to_end, decay_total)


def pass_state(terms: ChunkTerms, initial_state):
    """The sequential part: carry S across chunks (axis 0 of the terms).

    Per chunk, one matmul [W; Q exp Gamma] S gives both the state's prediction for the delta rule
    and the state's contribution to the outputs. Returns ``(new_values V~ [N, B, HV, C, V],
    outputs_from_state [N, B, HV, C, V], final_state)``.
    """
    chunk = terms.w.shape[-2]

    def body(state, xs):
        w_and_queries, u, keys_to_end, decay_total = xs
        read = einsum("bhck,bhkv->bhcv", w_and_queries, state)
        new_values = u - read[..., :chunk, :]
        next_state = decay_total[..., None] * state + einsum("bhck,bhcv->bhkv", keys_to_end, new_values)
        return next_state, (new_values, read[..., chunk:, :])

    stacked = jnp.concatenate([terms.w, terms.queries], axis=-2)
    final_state, (new_values, from_state) = jax.lax.scan(
        body, initial_state, (stacked, terms.u, terms.keys_to_end, terms.decay_total)
    )
    return new_values, from_state, final_state


def intra_outputs(terms: ChunkTerms, new_values):
    """A_qk V~ by row blocks: the diagonal blocks in one batched matmul, then earlier columns."""
    *lead, chunk, value_dim = new_values.shape
    blocks, width = terms.a_qk_diagonal.shape[-3:-1]
    values_b = new_values.reshape(*lead, blocks, width, value_dim)
    out = einsum("...nri,...niv->...nrv", terms.a_qk_diagonal, values_b)
    rows = [out[..., 0, :, :]]
    for R in range(1, blocks):
        rows.append(out[..., R, :, :] + einsum("...ri,...iv->...rv", terms.a_qk_earlier[R - 1],
                                               new_values[..., : R * width, :]))
    return jnp.concatenate(rows, axis=-2)


def _segment_index_chunks(segment_starts, padded_length, chunk):
    """Segment index of each token ``[N, B, 1, C]`` and the one carried into each chunk ``[N, B, 1, 1]``.

    The index counts segment starts, so the initial state belongs to index 0.
    """
    index = jnp.cumsum(segment_starts.astype(jnp.int32), axis=1)
    index = jnp.pad(index, ((0, 0), (0, padded_length - index.shape[1])), mode="edge")
    batch = index.shape[0]
    chunks = index.reshape(batch, -1, chunk)
    carried = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), chunks[:, :-1, -1]], axis=1)
    return jnp.moveaxis(chunks, 1, 0)[:, :, None], jnp.moveaxis(carried, 1, 0)[:, :, None, None]


def chunk_kda(q, k, v, g, beta, initial_state, segment_starts, chunk_size: int):
    """Chunked KDA on fp32 arrays already expanded to value heads and scaled.

    Shapes as `reference.recurrent_kda`: q, k, g ``[B, T, HV, K]``, v ``[B, T, HV, V]``,
    beta ``[B, T, HV]``, initial_state ``[B, HV, K, V]``, segment_starts ``[B, T]`` or None.
    Any T: the tail is padded with tokens that leave the state unchanged (k = v = g = beta = 0).
    Internally chunk-major: ``[N, B, HV, C, ...]``.
    """
    batch, length, heads, _ = q.shape
    chunk = effective_chunk_size(length, chunk_size)
    sub_block = SUB_BLOCK if chunk % SUB_BLOCK == 0 else chunk
    n_chunks = -(-length // chunk)
    padded = n_chunks * chunk

    def to_chunks(x):  # [B, T, HV, ...] -> [N, B, HV, C, ...]
        x = jnp.pad(x, [(0, 0), (0, padded - length)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(batch, n_chunks, chunk, heads, *x.shape[3:])
        return jnp.moveaxis(x, (1, 3), (0, 2))

    segments = None if segment_starts is None else _segment_index_chunks(segment_starts, padded, chunk)
    terms = jax.checkpoint(functools.partial(intra_chunk, sub_block=sub_block))(
        *map(to_chunks, (q, k, v, g, beta)), segments
    )
    new_values, from_state, final_state = pass_state(terms, initial_state)
    o = from_state + intra_outputs(terms, new_values)                      # [N, B, HV, C, V]
    o = jnp.moveaxis(o, (0, 2), (1, 3)).reshape(batch, padded, heads, -1)[:, :length]
    return o, final_state


def chunk_matmul_flops(batch: int, length: int, value_heads: int, key_dim: int, value_dim: int,
                       chunk: int, sub_block: int = SUB_BLOCK) -> int:
    """Matmul FLOPs (2 per multiply-add) of one forward of `chunk_kda`, as it computes them
    (factored diagonal blocks); elementwise work (exp, masks, gate sums) is not counted.

    Per (batch, head, chunk), with n = C / S sub-blocks, D = K + V:
        scores   n 2 (2S) S K + sum_{R>=1} 2 (2S) (R S) K     query and key rows
        solve    n (log2 S - 1) 4 S^3 + n 2 S^2 D + sum_{R>=1} 2 S (R S) D
        state    2 (2C) K V + 2 C K V                         [W; Q] S and K^T V~
        output   n 2 S^2 V + sum_{R>=1} 2 S (R S) V           A_qk V~
    """
    sub_block = min(sub_block, chunk)
    blocks, d = chunk // sub_block, key_dim + value_dim
    s = sub_block
    lower_pairs = sum(range(1, blocks))  # number of (R, I < R) block pairs
    scores_ = blocks * 2 * (2 * s) * s * key_dim + lower_pairs * 2 * (2 * s) * s * key_dim
    solve = blocks * (int(math.log2(s)) - 1) * 4 * s**3 + blocks * 2 * s * s * d + lower_pairs * 2 * s * s * d
    state = 2 * (2 * chunk) * key_dim * value_dim + 2 * chunk * key_dim * value_dim
    output = blocks * 2 * s * s * value_dim + lower_pairs * 2 * s * s * value_dim
    return batch * value_heads * -(-length // chunk) * (scores_ + solve + state + output)
