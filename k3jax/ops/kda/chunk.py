"""Chunked KDA in XLA: the WY / UT form of SPEC §1, safe in fp32 for any gate, with its backward.

Per value head and chunk of C tokens (rows r, columns i, key channels c), with the state S
carried between chunks:

    Gamma_t    = sum_{j <= t} g_j                 sigma_t = Gamma_C - Gamma_t = sum_{j > t} g_j
    A_kk[r,i]  = beta_r sum_c k_r[c] k_i[c] exp(Gamma_r[c] - Gamma_i[c])      i <  r
    A_qk[r,i]  =        sum_c q_r[c] k_i[c] exp(Gamma_r[c] - Gamma_i[c])      i <= r
    [W | U]    = (I + A_kk)^{-1} Diag(beta) [exp(Gamma) * K | V]
    V~         = U - W S_in                              (sequential over chunks)
    O          = (Q * exp Gamma) S_in + A_qk V~
    S_out      = Diag(exp Gamma_C) S_in + (K * exp sigma)^T V~

Scores. The chunk is split into n sub-blocks of S = 16 tokens. For the rows of block R the
decay factors as exp(Gamma_r - Gamma_i) = exp(lam_r) * exp(e_{R,i}), with lam_r the gate sum from
the start of block R to r (inclusive) and, for a column i in block I,

    e_{R,i} = rho_i + between(I, R)     I < R   (rho_i: from i to the end of block I, exclusive;
                                                  between: the blocks strictly between I and R)
    e_{R,i} = -lam_i                    I = R   (only when no sub-block decays by more than
                                                  `FACTORED_DECAY_LIMIT`; always so for K3's
                                                  bounded gate, 16 * 5 = 80)
    e_{R,i} = -inf                      I > R

so each score matrix is one batched matmul of rows x_r exp(lam_r) against the columns
k_i exp(e_{R,i}) of every anchor R. Every gate sum is a sum of same-sign terms (never a
difference of cumulative sums, so no precision is lost to cancellation) and every exponent
except the clamped -lam is <= 0. When a sub-block decays faster (Kimi Linear's unbounded gate
reaches -1000 per token), the diagonal blocks are recomputed from exact pairwise decays
exp(sum_{i < j <= r} g_j), masked to -inf *before* exp.

Solve. With A_kk = D + O (D its diagonal blocks, O the rest) and N = (I + D)^{-1} O, which is
nilpotent (N^n = 0): (I + A_kk)^{-1} = prod_m (I + (-N)^(2^m)) (I + D)^{-1}, the 16 x 16 blocks
of (I + D)^{-1} again by doubling.

Packed documents: with segment indices, pairs across a boundary are masked out of A_kk and
A_qk, rows after a boundary do not read the carried state, columns before the chunk's last
boundary do not write it, and the carried state is dropped when the chunk holds a boundary.

Layout of the work: one `lax.scan` step per chunk computes that chunk's intra-chunk terms and
then passes the state, so every intermediate is one chunk in size and stays in cache (on 2 CPU
cores this runs 2-3x faster than computing the intra-chunk terms of all chunks at once, whose
intermediates are the size of the sequence). The solve is applied once, to the combined
right-hand side: V~ = (I + A_kk)^{-1} Diag(beta) P with P = V - exp(Gamma) K S_in (= U - W S_in).

Backward (`jax.custom_vjp`): the forward saves only its inputs and the state entering each chunk;
a reverse scan recomputes each chunk's intra-chunk terms and V~, and with dS_out from the chunk
after it:

    dV~     = A_qk^T dO + (K * exp sigma) dS_out
    dRHS    = (I + A_kk)^{-T} dV~,   dP = Diag(beta) dRHS,   dbeta += rowsum(dRHS * P)
    dS_in   = (Q * exp Gamma)^T dO - (exp(Gamma) K)^T dP + Diag(exp Gamma_C) dS_out
    dA_kk   = -dRHS V~^T,   dA_qk = dO V~^T
    scores  s[r,i] = sum_c x_r[c] k_i[c] E_ri[c]:  dx_r = sum_i ds E k_i,  dk_i += sum_r ds E x_r,
            dGamma_r += x_r dx_r,  dGamma_i -= k_i (dk_i from this term)
    dg_j    = sum_{t >= j} dGamma_t + sum_{t < j} dsigma_t + dGamma_C

XLA:CPU note: concatenation and padding are several times slower than arithmetic there, so the
blocks are kept in place with masks and reshapes, never assembled.
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
_HIGHEST = jax.lax.Precision.HIGHEST


def effective_chunk_size(length: int, chunk_size: int) -> int:
    """The chunk actually used: ``chunk_size``, shrunk (to a multiple of 16) for short sequences."""
    if length >= chunk_size:
        return chunk_size
    return min(chunk_size, SUB_BLOCK * math.ceil(length / SUB_BLOCK))


def _sum_matrix(size: int, upper: bool = False, inclusive: bool = True) -> np.ndarray:
    """0/1 matrix M with (M @ x)[r] = sum_j x[j] over j <= r (lower) or j >= r (upper); strict
    inequalities when not ``inclusive``."""
    r, j = np.ogrid[:size, :size]
    if upper:
        return ((j >= r) if inclusive else (j > r)).astype(np.float32)
    return ((j <= r) if inclusive else (j < r)).astype(np.float32)


def _split(x, width: int, axis: int = -2):
    """Split the chunk axis of ``x`` into ``[n, width]`` sub-blocks."""
    axis %= x.ndim
    return x.reshape(*x.shape[:axis], x.shape[axis] // width, width, *x.shape[axis + 1:])


def _merge(x, axis: int = -3):
    """Inverse of `_split`: merge the ``[n, width]`` axes at ``axis, axis + 1``."""
    axis %= x.ndim
    return x.reshape(*x.shape[:axis], x.shape[axis] * x.shape[axis + 1], *x.shape[axis + 2:])


def _mm(a, b):
    return jnp.matmul(a, b, precision=_HIGHEST)


def _mm_t(a, b):
    return einsum("...ik,...jk->...ij", a, b)


def _transposed(x):
    """``x`` with its last two axes swapped *in memory*: the barrier keeps XLA from folding the
    transpose into the consuming dot, whose transposed-operand form XLA:CPU runs through a
    slower library path (about 2x for one chunk's matrices)."""
    return jax.lax.optimization_barrier(jnp.swapaxes(x, -1, -2))


def _t_mm(a, b):
    """``a^T b`` over the last two axes."""
    return _mm(_transposed(a), b)


def _left_multiply(matrix: np.ndarray, x: jax.Array) -> jax.Array:
    """``matrix @ x`` for a constant ``matrix [m, j]`` and ``x [.., j, k]``, as a batched matmul so
    the result keeps ``x``'s layout (an einsum would contract into a transposed layout)."""
    return _mm(jnp.broadcast_to(matrix, (*x.shape[:-2], *matrix.shape)), x)


# ----------------------------------------------------------------------------- gate sums


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
    suffix: jax.Array        # sigma = Gamma_C - Gamma: from the token to the chunk end, exclusive
    total: jax.Array         # Gamma_C
    between: jax.Array       # over the sub-blocks strictly between I and R


def gate_sums(g: jax.Array, width: int) -> GateSums:
    """All gate sums the chunk form needs, from the gates of each chunk ``g [.., C, K]``."""
    gb = _split(g, width)
    blocks = gb.shape[-3]
    local = _left_multiply(_sum_matrix(width), gb)
    to_block_end = _left_multiply(_sum_matrix(width, upper=True, inclusive=False), gb)
    block_total = local[..., -1, :]
    R, I, b = np.ogrid[:blocks, :blocks, :blocks]
    strictly_between = ((I < b) & (b < R)).astype(np.float32).reshape(blocks * blocks, blocks)
    between = _left_multiply(strictly_between, block_total)
    return GateSums(
        local=local,
        to_block_end=to_block_end,
        block_total=block_total,
        prefix=_merge(_left_multiply(_sum_matrix(blocks, inclusive=False), block_total)[..., None, :] + local),
        suffix=_merge(_left_multiply(_sum_matrix(blocks, upper=True, inclusive=False), block_total)[..., None, :]
                      + to_block_end),
        total=jnp.sum(block_total, axis=-2),
        between=between.reshape(*block_total.shape[:-2], blocks, blocks, block_total.shape[-1]),
    )


def gate_gradient(d_prefix, d_suffix, d_total):
    """dg from the gradients of Gamma (prefix), sigma (suffix) ``[.., C, K]`` and Gamma_C ``[.., K]``:
    dg_j = sum_{t >= j} dGamma_t + sum_{t < j} dsigma_t + dGamma_C."""
    chunk = d_prefix.shape[-2]
    return (_left_multiply(_sum_matrix(chunk, upper=True), d_prefix)
            + _left_multiply(_sum_matrix(chunk, inclusive=False), d_suffix) + d_total[..., None, :])


# ----------------------------------------------------------------------------- scores


class ScoreFactors(NamedTuple):
    """Decay factors whose products with q and k are the scores (see the module docstring).

    ``row_scale [.., n, S, K]`` = exp(lam); ``column_scale [.., n (anchor R), C, K]`` = exp(e_{R,i}),
    with the diagonal blocks zero when ``safe`` is False (they are then computed exactly).
    """

    row_scale: jax.Array
    column_scale: jax.Array
    safe: jax.Array


def score_factors(sums: GateSums) -> ScoreFactors:
    """Row scales exp(lam) and, per anchor R, column scales exp(rho) exp(between(I, R)) (I < R),
    exp(-lam) (I = R, when safe), 0 (I > R): only [.., C, K]-sized exps, the rest products."""
    blocks = sums.local.shape[-3]
    R = np.arange(blocks)[:, None, None, None]
    I = np.arange(blocks)[None, :, None, None]
    safe = jnp.max(-sums.block_total) <= FACTORED_DECAY_LIMIT
    earlier = jnp.exp(sums.to_block_end)[..., None, :, :, :] * jnp.exp(sums.between)[..., :, :, None, :]
    own = jnp.exp(jnp.where(safe, -sums.local, -jnp.inf))[..., None, :, :, :]
    column_scale = jnp.where(I < R, earlier, jnp.where(I == R, own, 0.0))      # [.., R, I, S, K]
    return ScoreFactors(jnp.exp(sums.local), _merge(column_scale), safe)


def _exact_decay(g, width):
    """Exact diagonal-block decays exp(sum_{i<j<=r} g_j) for i <= r, else 0: ``[.., n, S, S, K]``."""
    r, i, j = np.ogrid[:width, :width, :width]
    path = ((i < j) & (j <= r)).astype(np.float32).reshape(width * width, width)
    pair_sum = _left_multiply(path, _split(g, width))
    pair_sum = pair_sum.reshape(*pair_sum.shape[:-2], width, width, pair_sum.shape[-1])
    return jnp.exp(jnp.where(r >= i, pair_sum, -jnp.inf))


def _embed_diagonal(diagonal):
    """Place diagonal blocks ``[.., n, S, S]`` into row blocks ``[.., n, S, C]`` (zeros elsewhere)."""
    blocks = diagonal.shape[-3]
    placed = diagonal[..., :, :, None, :] * np.eye(blocks, dtype=np.float32)[:, None, :, None]
    return placed.reshape(*diagonal.shape[:-1], blocks * diagonal.shape[-1])


def _diagonal_of(row_blocks):
    """The diagonal blocks ``[.., n, S, S]`` of row blocks ``[.., n, S, C]``."""
    blocks = row_blocks.shape[-3]
    split = row_blocks.reshape(*row_blocks.shape[:-1], blocks, row_blocks.shape[-1] // blocks)
    return jnp.sum(split * np.eye(blocks, dtype=np.float32)[:, None, :, None], axis=-2)


def scores(x, k, g, f: ScoreFactors, width: int):
    """sum_c x_r[c] k_i[c] exp(Gamma_r[c] - Gamma_i[c]) as row blocks ``[.., n, S, C]`` for rows ``x``
    (queries or keys, ``[.., C, K]``), exact for every column at or before the row's sub-block."""
    xb = _split(x, width)
    factored = einsum("...rc,...ic->...ri", xb * f.row_scale, k[..., None, :, :] * f.column_scale)

    def with_exact_diagonal():
        kb = _split(k, width)
        diagonal = jnp.sum(xb[..., :, None, :] * kb[..., None, :, :] * _exact_decay(g, width), axis=-1)
        return factored + _embed_diagonal(diagonal)

    return jax.lax.cond(f.safe, lambda: factored, with_exact_diagonal)


def score_gradients(x, k, g, f: ScoreFactors, d_scores, width: int):
    """For d_scores ``[.., n, S, C]`` of `scores`: ``(dx, dk, dGamma)``, each ``[.., C, K]``."""
    xb = _split(x, width)
    d_x = f.row_scale * _mm(d_scores, k[..., None, :, :] * f.column_scale)  # [.., n, S, K]
    d_k = jnp.sum(f.column_scale * _t_mm(d_scores, xb * f.row_scale), axis=-3)

    def with_exact_diagonal():
        weighted = _diagonal_of(d_scores)[..., None] * _exact_decay(g, width)  # [.., n, S, S, K]
        return (d_x + jnp.sum(weighted * _split(k, width)[..., None, :, :], axis=-2),
                d_k + _merge(jnp.sum(weighted * xb[..., :, None, :], axis=-3)))

    d_x, d_k = jax.lax.cond(f.safe, lambda: (d_x, d_k), with_exact_diagonal)
    d_x = _merge(d_x)
    return d_x, d_k, x * d_x - k * d_k


# ----------------------------------------------------------------------------- intra-chunk terms


class Masks(NamedTuple):
    """Multiplicative masks (None: no packed-document boundaries): ``query``, ``key`` ``[.., C, C]``
    (causal resp. strictly causal, same segment); ``reads_carry``, ``writes_carry`` ``[.., C, 1]``
    and ``keeps_carry [.., 1]`` for the carried state."""

    query: jax.Array
    key: jax.Array
    reads_carry: jax.Array | None
    writes_carry: jax.Array | None
    keeps_carry: jax.Array | None


def chunk_masks(segments, chunk: int) -> Masks:
    """Masks from ``segments``: None, or (segment index per token ``[.., C]``, index carried into the
    chunk ``[.., 1]``)."""
    r, i = np.ogrid[:chunk, :chunk]
    causal, strict = (r >= i).astype(np.float32), (r > i).astype(np.float32)
    if segments is None:
        return Masks(causal, strict, None, None, None)
    index, carried = segments
    same = (index[..., :, None] == index[..., None, :]).astype(jnp.float32)
    reads = (index == carried).astype(jnp.float32)[..., None]
    return Masks(causal * same, strict * same, reads,
                 (index == index[..., -1:]).astype(jnp.float32)[..., None], reads[..., -1, :])


def _masked(x, mask):
    return x if mask is None else x * mask


def unit_lower_inverse(lower):
    """(I + L)^{-1} for strictly lower-triangular ``L [.., S, S]`` by doubling:
    prod_m (I + (-L)^(2^m)), m = 0 .. log2(S) - 1."""
    power = -lower
    inverse = jnp.eye(lower.shape[-1], dtype=lower.dtype) + power
    for _ in range(math.ceil(math.log2(lower.shape[-1])) - 1):
        power = _mm(power, power)
        inverse = inverse + _mm(inverse, power)
    return inverse


def _neumann(coupling, x, blocks: int, transpose: bool = False):
    """(I + N)^{-1} x (or (I + N^T)^{-1} x) for N nilpotent of index ``blocks``:
    prod_m (I + (-N)^(2^m)) x, m < ceil(log2(blocks))."""
    factors = math.ceil(math.log2(blocks)) if blocks > 1 else 0
    power = -coupling if factors else None
    for m in range(factors):
        x = x + (_t_mm(power, x) if transpose else _mm(power, x))
        if m < factors - 1:
            power = _mm(power, power)
    return x


def _block_solve(inverse, coupling, rhs, transpose: bool = False):
    """(I + A)^{-1} rhs = (I + N)^{-1} (I + D)^{-1} rhs, or its transpose (I + A)^{-T} rhs =
    (I + D)^{-T} (I + N^T)^{-1} rhs, with ``inverse`` the blocks of (I + D)^{-1} ``[.., n, S, S]``."""
    blocks, width = inverse.shape[-3:-1]
    if transpose:
        return _merge(_t_mm(inverse, _split(_neumann(coupling, rhs, blocks, transpose=True), width)))
    return _neumann(coupling, _merge(_mm(inverse, _split(rhs, width))), blocks)


class Intra(NamedTuple):
    """Terms of one chunk that do not depend on the carried state, ``[B, HV, ...]``."""

    sums: GateSums
    factors: ScoreFactors
    masks: Masks
    a_qk: jax.Array              # masked query scores                              [.., C, C]
    key_scores: jax.Array        # masked key scores, A_kk = Diag(beta) key_scores   [.., C, C]
    inverse: jax.Array           # (I + D)^{-1}, D the diagonal blocks of A_kk       [.., n, S, S]
    coupling: jax.Array | None   # N = (I + D)^{-1} (A_kk - D); None for one block   [.., C, C]
    carried_keys: jax.Array      # exp(Gamma) K (rows reading the carried state)     [.., C, K]
    queries: jax.Array           # Q exp(Gamma)                                      [.., C, K]
    keys_to_end: jax.Array       # K exp(sigma) (columns writing the carried state)  [.., C, K]
    decay_total: jax.Array       # exp(Gamma_C)                                      [.., K]


def intra_chunk(q, k, g, beta, segments, width: int) -> Intra:
    """Everything of one chunk that does not depend on the carried state (fp32, q scaled;
    ``[.., C, ...]``)."""
    chunk = q.shape[-2]
    blocks = chunk // width
    sums = gate_sums(g, width)
    factors = score_factors(sums)
    masks = chunk_masks(segments, chunk)
    a_qk = _merge(scores(q, k, g, factors, width)) * masks.query
    key_scores = _merge(scores(k, k, g, factors, width)) * masks.key
    a_kk = _split(key_scores * beta[..., :, None], width)                    # [.., n, S, C]
    inverse = unit_lower_inverse(_diagonal_of(a_kk))
    coupling = None
    if blocks > 1:
        off_diagonal = 1.0 - np.kron(np.eye(blocks, dtype=np.float32), np.ones((width, width), np.float32))
        coupling = _merge(_mm(inverse, a_kk * _split(off_diagonal, width)))
    decay_prefix = jnp.exp(sums.prefix)
    return Intra(
        sums=sums,
        factors=factors,
        masks=masks,
        a_qk=a_qk,
        key_scores=key_scores,
        inverse=inverse,
        coupling=coupling,
        carried_keys=_masked(k * decay_prefix, masks.reads_carry),
        queries=_masked(q * decay_prefix, masks.reads_carry),
        keys_to_end=_masked(k * jnp.exp(sums.suffix), masks.writes_carry),
        decay_total=_masked(jnp.exp(sums.total), masks.keeps_carry),
    )


# ----------------------------------------------------------------------------- forward and backward


def _new_values(intra: Intra, v, beta, state):
    """``(P, V~)`` with P = V - exp(Gamma) K S_in and V~ = (I + A_kk)^{-1} Diag(beta) P = U - W S_in."""
    residual = v - _mm(intra.carried_keys, state)
    return residual, _block_solve(intra.inverse, intra.coupling, beta[..., None] * residual)


def _heads_major(chunk_inputs):
    """One chunk's ``(q, k, v, g, beta)`` from token-major ``[B, C, HV, ...]`` to ``[B, HV, C, ...]``
    (the transposes of one chunk stay in cache; whole-sequence transposes cost as much as the
    arithmetic on 2 CPU cores)."""
    return tuple(jnp.swapaxes(x, 1, 2) for x in chunk_inputs)


def _forward_step(state, inputs, width: int):
    """One chunk: ``(S_out, o [B, C, HV, V])`` from S_in and the chunk's token-major
    ``(q, k, v, g, beta, segments)``."""
    *chunk_inputs, segments = inputs
    q, k, v, g, beta = _heads_major(chunk_inputs)
    intra = intra_chunk(q, k, g, beta, segments, width)
    _, new_values = _new_values(intra, v, beta, state)
    o = _mm(intra.queries, state) + _mm(intra.a_qk, new_values)
    next_state = intra.decay_total[..., None] * state + _t_mm(intra.keys_to_end, new_values)
    return next_state, jnp.swapaxes(o, 1, 2)


def _chunk(arrays, index):
    """Chunk ``index`` of token-major arrays ``[B, N, ...]`` (a pytree; None stays None)."""
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, index, axis=1, keepdims=False), arrays)


def _write_chunk(buffers, values, index):
    """Write one chunk's ``values`` into ``buffers [B, N, ...]`` at chunk ``index`` (in place)."""
    return jax.tree.map(lambda buf, x: jax.lax.dynamic_update_index_in_dim(buf, x, index, axis=1), buffers, values)


def _forward(inputs, initial_state, width: int, keep_states: bool):
    """Scan the chunks. Returns ``(o, final state, states entering each chunk [N, ...] or None)``.

    Chunks are read from and written to the token-major arrays in place, so no sequence-sized
    transpose or copy is made."""
    n_chunks = inputs[0].shape[1]

    def body(carry, index):
        state, o = carry
        next_state, o_chunk = _forward_step(state, _chunk(inputs, index), width)
        return (next_state, _write_chunk(o, o_chunk, index)), (state if keep_states else None)

    o = jnp.zeros(inputs[2].shape, inputs[2].dtype)
    (final_state, o), entering = jax.lax.scan(body, (initial_state, o), jnp.arange(n_chunks))
    return o, final_state, entering


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def chunked(q, k, v, g, beta, initial_state, segments, width):
    """Chunked KDA on token-major fp32 arrays split into chunks, ``[B, N, C, HV, ...]``; returns
    ``(o, final_state)``."""
    o, final_state, _ = _forward((q, k, v, g, beta, segments), initial_state, width, keep_states=False)
    return o, final_state


def _chunked_fwd(q, k, v, g, beta, initial_state, segments, width):
    inputs = (q, k, v, g, beta, segments)
    o, final_state, entering = _forward(inputs, initial_state, width, keep_states=True)
    return (o, final_state), (inputs, entering)


def _backward_step(d_state, xs, width: int):
    """One chunk in reverse: from dS_out and the chunk's inputs, S_in and dO, returns dS_in and the
    gradients of the chunk's ``(q, k, v, g, beta)``."""
    (*chunk_inputs, segments), state, d_o = xs
    q, k, v, g, beta = _heads_major(chunk_inputs)
    d_o = jnp.swapaxes(d_o, 1, 2)
    intra = intra_chunk(q, k, g, beta, segments, width)
    masks = intra.masks
    residual, new_values = _new_values(intra, v, beta, state)

    # Through o = Q~ S_in + A_qk V~ and S_out = Diag(exp Gamma_C) S_in + (K exp sigma)^T V~.
    d_values = _t_mm(intra.a_qk, d_o) + _mm(intra.keys_to_end, d_state)
    # Through the solve: V~ = (I + A_kk)^{-1} Diag(beta) P, P = V - exp(Gamma) K S_in.
    d_rhs = _block_solve(intra.inverse, intra.coupling, d_values, transpose=True)
    d_residual = beta[..., None] * d_rhs
    d_state_in = (_t_mm(intra.queries, d_o) - _t_mm(intra.carried_keys, d_residual)
                  + intra.decay_total[..., None] * d_state)
    d_a_kk = -_mm_t(d_rhs, new_values) * masks.key
    d_beta = jnp.sum(d_rhs * residual, axis=-1) + jnp.sum(d_a_kk * intra.key_scores, axis=-1)

    # Through the scores.
    d_a_qk = _mm_t(d_o, new_values) * masks.query
    dq, dk_from_queries, d_prefix = score_gradients(q, k, g, intra.factors, _split(d_a_qk, width), width)
    dk_rows, dk_columns, d_prefix_keys = score_gradients(
        k, k, g, intra.factors, _split(d_a_kk * beta[..., :, None], width), width)
    dk = dk_from_queries + dk_rows + dk_columns
    d_prefix = d_prefix + d_prefix_keys

    # Through Q exp(Gamma), exp(Gamma) K, K exp(sigma) and exp(Gamma_C).
    decay_prefix = jnp.exp(intra.sums.prefix)
    d_queries = _masked(_mm_t(d_o, state), masks.reads_carry)
    d_carried_keys = _masked(-_mm_t(d_residual, state), masks.reads_carry)
    dq = dq + d_queries * decay_prefix
    dk = dk + d_carried_keys * decay_prefix
    d_prefix = d_prefix + d_queries * intra.queries + d_carried_keys * intra.carried_keys
    d_keys_to_end = _masked(_mm_t(new_values, d_state), masks.writes_carry)
    dk = dk + d_keys_to_end * jnp.exp(intra.sums.suffix)
    d_total = jnp.sum(d_state * state, axis=-1) * intra.decay_total
    dg = gate_gradient(d_prefix, d_keys_to_end * intra.keys_to_end, d_total)
    return d_state_in, tuple(jnp.swapaxes(x, 1, 2) for x in (dq, dk, d_residual, dg, d_beta))


def _chunked_bwd(width, residuals, cotangents):
    inputs, entering = residuals
    d_o, d_final_state = cotangents

    def body(carry, index):
        d_state, grads = carry
        xs = (_chunk(inputs, index), entering[index], _chunk(d_o, index))
        d_state, chunk_grads = _backward_step(d_state, xs, width)
        return (d_state, _write_chunk(grads, chunk_grads, index)), None

    grads = tuple(jnp.zeros_like(x) for x in inputs[:5])
    (d_initial, grads), _ = jax.lax.scan(body, (d_final_state, grads), jnp.arange(inputs[0].shape[1]),
                                         reverse=True)
    return (*grads, d_initial, None)


chunked.defvjp(_chunked_fwd, _chunked_bwd)


# ----------------------------------------------------------------------------- entry point


def _segment_index_chunks(segment_starts, padded_length, chunk):
    """Segment index of each token ``[B, N, 1, C]`` and the one carried into each chunk ``[B, N, 1, 1]``.

    The index counts segment starts, so the initial state belongs to index 0.
    """
    index = jnp.cumsum(segment_starts.astype(jnp.int32), axis=1)
    index = jnp.pad(index, ((0, 0), (0, padded_length - index.shape[1])), mode="edge")
    batch = index.shape[0]
    chunks = index.reshape(batch, -1, chunk)
    carried = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), chunks[:, :-1, -1]], axis=1)
    return chunks[:, :, None], carried[:, :, None, None]


def chunk_kda(q, k, v, g, beta, initial_state, segment_starts, chunk_size: int):
    """Chunked KDA on fp32 arrays already expanded to value heads and scaled.

    Shapes as `reference.recurrent_kda`: q, k, g ``[B, T, HV, K]``, v ``[B, T, HV, V]``,
    beta ``[B, T, HV]``, initial_state ``[B, HV, K, V]``, segment_starts ``[B, T]`` or None.
    Any T: the tail is padded with tokens that leave the state unchanged (k = v = g = beta = 0).
    Internally ``[B, N, C, HV, ...]`` (a reshape, no copy).
    """
    batch, length, heads, _ = q.shape
    chunk = effective_chunk_size(length, chunk_size)
    width = SUB_BLOCK if chunk % SUB_BLOCK == 0 else chunk
    n_chunks = -(-length // chunk)
    padded = n_chunks * chunk

    def to_chunks(x):  # [B, T, HV, ...] -> [B, N, C, HV, ...]
        if padded != length:
            x = jnp.pad(x, [(0, 0), (0, padded - length)] + [(0, 0)] * (x.ndim - 2))
        return x.reshape(batch, n_chunks, chunk, *x.shape[2:])

    segments = None if segment_starts is None else _segment_index_chunks(segment_starts, padded, chunk)
    o, final_state = chunked(*map(to_chunks, (q, k, v, g, beta)), initial_state, segments, width)
    o = o.reshape(batch, padded, heads, -1)[:, :length]
    return o, final_state


def chunk_algorithm_flops(batch: int, length: int, value_heads: int, key_dim: int, value_dim: int,
                          chunk: int) -> int:
    """FLOPs (2 per multiply-add) of the chunk algorithm's forward, counting only the work the
    algorithm needs (causal halves of the C x C matrices, a triangular solve) -- not what this
    implementation computes in full squares and masks away:

        scores   A_qk (causal) and A_kk (strictly causal)        C^2 * 2K
        solve    (I + A_kk)^{-1} [exp(Gamma) K | V]             C^2 (K + V)
        state    W S_in, (Q exp Gamma) S_in, (K exp sigma)^T V~   3 * 2 C K V
        output   A_qk V~ (causal)                                 C^2 V
    per (batch, value head, chunk).
    """
    per_chunk = (2 * chunk * chunk * key_dim + chunk * chunk * (key_dim + value_dim)
                 + 6 * chunk * key_dim * value_dim + chunk * chunk * value_dim)
    return batch * value_heads * -(-length // chunk) * per_chunk
