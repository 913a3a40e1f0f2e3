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

The chunk is split into sub-blocks of 16 tokens; every C x C matrix is kept as row blocks (the
diagonal 16 x 16 block and the block of earlier columns), never assembled.

Numerics. Gate sums are sums of same-sign terms (never differences of cumulative sums, so no
precision is lost to cancellation), and no exp sees an argument that could overflow:

* an off-diagonal block pair (row block R, column block I < R) factors
  exp(Gamma_r - Gamma_i) = exp(lam_r) * exp(rho_i + between(I, R)), with lam_r the inclusive
  gate sum from the start of block R to r, rho_i the exclusive sum from i to the end of block I,
  and between(I, R) the sum over the blocks strictly between -- all <= 0;
* a diagonal block factors as exp(lam_r) * exp(-lam_i) when no sub-block decays by more than
  `FACTORED_DECAY_LIMIT` (always so for K3's bounded gate: 16 * 5 = 80). Otherwise (Kimi
  Linear's unbounded gate can reach -1000 per token) diagonal blocks use exact pairwise decays
  exp(sum_{i < j <= r} g_j), with masked exponents set to -inf *before* exp. The factored
  column scale is clamped so it stays finite even when discarded.

Packed documents: with segment indices, pairs across a boundary are masked out of A_kk and
A_qk, rows after a boundary do not read the carried state, columns before the chunk's last
boundary do not write it, and the carried state is dropped when the chunk holds a boundary.

Backward (`jax.custom_vjp`): the forward saves only its inputs, the state entering each chunk
and V~; the backward recomputes the intra-chunk terms, walks the chunks in reverse for dS (two
matmuls per chunk, like the forward), and does everything else for all chunks at once:

    dV~     = A_qk^T dO + (K * exp sigma) dS_out
    dS_in   = (Q * exp Gamma)^T dO - W^T dV~ + Diag(exp Gamma_C) dS_out
    dRHS    = (I + A_kk)^{-T} [-dV~ S_in^T | dV~],   dA_kk = -dRHS [W | U]^T,   dA_qk = dO V~^T
    scores  s[r,i] = sum_c x_r[c] k_i[c] E_ri[c]:  dx_r = sum_i ds E k_i,  dk_i += sum_r ds E x_r,
            dGamma_r += x_r dx_r,  dGamma_i -= k_i (dk_i from this term)
    dg_j    = sum_{t >= j} dGamma_t + sum_{t < j} dsigma_t + dGamma_C
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
    return einsum("...ij,...jk->...ik", a, b)


def _mm_t(a, b):
    return einsum("...ik,...jk->...ij", a, b)


def _t_mm(a, b):
    return einsum("...ji,...jk->...ik", a, b)


def _pad_rows(x, rows: int):
    """Zero-pad axis -2 of ``x`` at the end to ``rows``."""
    return jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, rows - x.shape[-2]), (0, 0)])


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


def _left_multiply(matrix: np.ndarray, x: jax.Array) -> jax.Array:
    """``matrix @ x`` for a constant ``matrix [m, j]`` and ``x [.., j, k]``, as a batched matmul so
    the result keeps ``x``'s layout (an einsum would contract into a transposed layout)."""
    return jnp.matmul(jnp.broadcast_to(matrix, (*x.shape[:-2], *matrix.shape)), x,
                      precision=jax.lax.Precision.HIGHEST)


def gate_sums(g: jax.Array, width: int) -> GateSums:
    """All gate sums the chunk form needs, from the gates of each chunk ``g [.., C, K]``."""
    gb = _split(g, width)
    blocks = gb.shape[-3]
    within = _left_multiply(np.concatenate([_sum_matrix(width), _sum_matrix(width, upper=True, inclusive=False)]), gb)
    local, to_block_end = within[..., :width, :], within[..., width:, :]
    block_total = local[..., -1, :]
    R, I, b = np.ogrid[:blocks, :blocks, :blocks]
    strictly_between = ((I < b) & (b < R)).astype(np.float32).reshape(blocks * blocks, blocks)
    across = _left_multiply(
        np.concatenate([_sum_matrix(blocks, inclusive=False), _sum_matrix(blocks, upper=True, inclusive=False),
                        strictly_between]), block_total)
    before, after = across[..., :blocks, :], across[..., blocks: 2 * blocks, :]
    between = across[..., 2 * blocks:, :].reshape(*block_total.shape[:-2], blocks, blocks, block_total.shape[-1])
    return GateSums(
        local=local,
        to_block_end=to_block_end,
        block_total=block_total,
        prefix=_merge(before[..., None, :] + local),
        suffix=_merge(after[..., None, :] + to_block_end),
        total=jnp.sum(block_total, axis=-2),
        between=between,
    )


def gate_gradient(d_prefix, d_suffix, d_total):
    """dg from the gradients of Gamma (prefix), sigma (suffix) ``[.., C, K]`` and Gamma_C ``[.., K]``:
    dg_j = sum_{t >= j} dGamma_t + sum_{t < j} dsigma_t + dGamma_C."""
    chunk = d_prefix.shape[-2]
    both = np.concatenate([_sum_matrix(chunk, upper=True), _sum_matrix(chunk, inclusive=False)], axis=1)
    return _left_multiply(both, jnp.concatenate([d_prefix, d_suffix], axis=-2)) + d_total[..., None, :]


# ----------------------------------------------------------------------------- scores


class ScoreFactors(NamedTuple):
    """Anchored decay factors (see the module docstring); scores are products of these with q, k.

    ``row_scale [.., n, S, K]`` exp(lam); ``own_scale [.., n, S, K]`` exp(-lam) (clamped);
    ``earlier_scale[R - 1] [.., R*S, K]`` exp(rho + between(., R)) for the columns before block R;
    ``safe``: whether the diagonal blocks may use the factored form.
    """

    row_scale: jax.Array
    own_scale: jax.Array
    earlier_scale: tuple
    safe: jax.Array


class Scores(NamedTuple):
    """Scores by row block: ``diagonal [.., n, 2S, S]`` and ``earlier[R - 1] [.., 2S, R*S]``.
    Rows 0..S-1 of each block are queries, S..2S-1 keys."""

    diagonal: jax.Array
    earlier: tuple


def score_factors(sums: GateSums) -> ScoreFactors:
    blocks, width = sums.local.shape[-3:-1]
    rho_scale = jnp.exp(sums.to_block_end)
    between_scale = jnp.exp(sums.between)
    earlier = tuple(
        _merge(rho_scale[..., :R, :, :] * between_scale[..., R, :R, None, :]) for R in range(1, blocks)
    )
    return ScoreFactors(
        row_scale=jnp.exp(sums.local),
        own_scale=jnp.exp(jnp.minimum(-sums.local, FACTORED_DECAY_LIMIT)),
        earlier_scale=earlier,
        safe=jnp.max(-sums.block_total) <= FACTORED_DECAY_LIMIT,
    )


def _row_blocks(q, k, width):
    """Query rows then key rows per sub-block: ``[.., n, 2S, K]``."""
    return jnp.concatenate([_split(q, width), _split(k, width)], axis=-2)


def _pairwise_decay(g, width):
    """Exact diagonal-block decays exp(sum_{i<j<=r} g_j) for i <= r, else 0, for query and key rows:
    ``[.., n, 2S, S, K]``."""
    r, i, j = np.ogrid[:width, :width, :width]
    path = ((i < j) & (j <= r)).astype(np.float32)
    pair_sum = _left_multiply(path.reshape(width * width, width), _split(g, width))
    pair_sum = pair_sum.reshape(*pair_sum.shape[:-2], width, width, pair_sum.shape[-1])
    decay = jnp.exp(jnp.where(r >= i, pair_sum, -jnp.inf))
    return jnp.concatenate([decay, decay], axis=-3)


def scores(q, k, g, f: ScoreFactors, width: int) -> Scores:
    """sum_c x_r[c] k_i[c] exp(Gamma_r[c] - Gamma_i[c]) for query and key rows x_r and every column i
    at or before the row's sub-block."""
    x, kb = _row_blocks(q, k, width), _split(k, width)
    rows = x * jnp.concatenate([f.row_scale, f.row_scale], axis=-2)

    def factored():
        return _mm_t(rows, kb * f.own_scale)

    def exact():
        decay = _pairwise_decay(g, width)
        return jnp.sum(x[..., :, None, :] * kb[..., None, :, :] * decay, axis=-1)

    earlier = tuple(_mm_t(rows[..., R, :, :], k[..., : R * width, :] * scale)
                    for R, scale in enumerate(f.earlier_scale, start=1))
    return Scores(jax.lax.cond(f.safe, factored, exact), earlier)


def score_gradients(q, k, g, f: ScoreFactors, d: Scores, width: int):
    """Given dScores, the gradients (dq, dk, dGamma) of `scores`, each ``[.., C, K]``."""
    blocks = q.shape[-2] // width
    x, kb = _row_blocks(q, k, width), _split(k, width)
    row_scale2 = jnp.concatenate([f.row_scale, f.row_scale], axis=-2)
    rows = x * row_scale2

    def factored():  # dx for the diagonal part, and the column-side dk
        return row_scale2 * _mm(d.diagonal, kb * f.own_scale), f.own_scale * _t_mm(d.diagonal, rows)

    def exact():
        weighted = d.diagonal[..., None] * _pairwise_decay(g, width)      # [.., n, 2S, S, K]
        return jnp.sum(weighted * kb[..., None, :, :], axis=-2), jnp.sum(weighted * x[..., :, None, :], axis=-3)

    d_x, d_own = jax.lax.cond(f.safe, factored, exact)
    d_cols = _merge(d_own)
    d_x_earlier = [jnp.zeros_like(d_x[..., 0, :, :])]
    for R, scale in enumerate(f.earlier_scale, start=1):
        d_x_earlier.append(row_scale2[..., R, :, :] * _mm(d.earlier[R - 1], k[..., : R * width, :] * scale))
        d_cols = d_cols + _pad_rows(scale * _t_mm(d.earlier[R - 1], rows[..., R, :, :]), blocks * width)
    d_x = d_x + jnp.stack(d_x_earlier, axis=-3)
    d_q, d_k_rows = _merge(d_x[..., :width, :]), _merge(d_x[..., width:, :])
    d_gamma = q * d_q + k * d_k_rows - k * d_cols
    return d_q, d_k_rows + d_cols, d_gamma


# ----------------------------------------------------------------------------- intra-chunk terms


class Masks(NamedTuple):
    """Multiplicative masks of the chunk terms (None entries: no packed-document boundaries).

    ``diagonal [.., n, 2S, S]`` and ``earlier[R - 1] [.., 2S, R*S]`` for the scores (causal for
    query rows, strictly causal for key rows, same segment); ``reads_carry``, ``writes_carry``
    ``[.., C, 1]`` and ``keeps_carry [.., 1]`` for the carried state.
    """

    diagonal: jax.Array
    earlier: tuple | None
    reads_carry: jax.Array | None
    writes_carry: jax.Array | None
    keeps_carry: jax.Array | None


def chunk_masks(segments, chunk: int, width: int) -> Masks:
    """Masks from ``segments``: None, or (segment index per token ``[.., C]``, index carried into the
    chunk ``[.., 1]``)."""
    r, i = np.ogrid[:width, :width]
    causal = np.concatenate([r >= i, r > i]).astype(np.float32)            # [2S, S]
    if segments is None:
        return Masks(causal, None, None, None, None)
    index, carried = segments
    blocks = _split(index, width, axis=-1)                                  # [.., n, S]
    same = lambda rows, cols: (rows[..., :, None] == cols[..., None, :]).astype(jnp.float32)  # noqa: E731
    twice = lambda m: jnp.concatenate([m, m], axis=-2)  # noqa: E731
    earlier = tuple(twice(same(blocks[..., R, :], index[..., : R * width])) for R in range(1, chunk // width))
    reads = (index == carried).astype(jnp.float32)[..., None]
    return Masks(
        diagonal=causal * twice(same(blocks, blocks)),
        earlier=earlier,
        reads_carry=reads,
        writes_carry=(index == index[..., -1:]).astype(jnp.float32)[..., None],
        keeps_carry=reads[..., -1, :],
    )


def _masked(x, mask):
    return x if mask is None else x * mask


def mask_scores(s: Scores, m: Masks) -> Scores:
    earlier = s.earlier if m.earlier is None else tuple(a * b for a, b in zip(s.earlier, m.earlier))
    return Scores(s.diagonal * m.diagonal, earlier)


def unit_lower_inverse(lower):
    """(I + L)^{-1} for strictly lower-triangular ``L [.., S, S]`` by doubling:
    prod_m (I + (-L)^(2^m)), m = 0 .. log2(S) - 1."""
    power = -lower
    inverse = jnp.eye(lower.shape[-1], dtype=lower.dtype) + power
    for _ in range(int(math.log2(lower.shape[-1])) - 1):
        power = _mm(power, power)
        inverse = inverse + _mm(inverse, power)
    return inverse


class Intra(NamedTuple):
    """Per-chunk terms that do not depend on the carried state, ``[N, B, HV, ...]``."""

    sums: GateSums
    factors: ScoreFactors
    masks: Masks
    scores: Scores            # masked; query rows are A_qk, key rows are A_kk before beta
    inverse: jax.Array        # (I + A_kk)^{-1} diagonal blocks                    [.., n, S, S]
    written: jax.Array        # [exp(Gamma) K | V] (the solve's right side before Diag(beta)) [.., C, K + V]
    solved: jax.Array         # [W | U]                                              [.., C, K + V]
    queries: jax.Array        # Q exp(Gamma)                                         [.., C, K]
    keys_to_end: jax.Array    # K exp(sigma)                                         [.., C, K]
    decay_total: jax.Array    # exp(Gamma_C)                                         [.., K]


def _beta_rows(beta_blocks):
    """beta per key row of the row blocks: ``[.., n, S] -> [.., n, S, 1]``."""
    return beta_blocks[..., None]


def intra_chunk(q, k, v, g, beta, segments, width: int) -> Intra:
    """Everything that does not depend on the carried state, for all chunks at once (fp32,
    q scaled; ``[.., C, ...]``)."""
    chunk, key_dim = q.shape[-2:]
    blocks = chunk // width
    sums = gate_sums(g, width)
    factors = score_factors(sums)
    masks = chunk_masks(segments, chunk, width)
    s = mask_scores(scores(q, k, g, factors, width), masks)
    beta_b = _split(beta, width, axis=-1)[..., None]                        # [.., n, S, 1]
    a_kk_diagonal = s.diagonal[..., width:, :] * beta_b
    inverse = unit_lower_inverse(a_kk_diagonal)

    decay_prefix = jnp.exp(sums.prefix)
    carried_keys = _masked(k * decay_prefix, masks.reads_carry)
    written = jnp.concatenate([carried_keys, v], axis=-1)
    rhs_b = _split(beta[..., None] * written, width)
    solved = [_mm(inverse[..., 0, :, :], rhs_b[..., 0, :, :])]
    for R in range(1, blocks):
        a_kk_earlier = s.earlier[R - 1][..., width:, :] * beta_b[..., R, :, :]
        acc = rhs_b[..., R, :, :] - _mm(a_kk_earlier, jnp.concatenate(solved, axis=-2))
        solved.append(_mm(inverse[..., R, :, :], acc))
    return Intra(
        sums=sums,
        factors=factors,
        masks=masks,
        scores=s,
        inverse=inverse,
        written=written,
        solved=jnp.concatenate(solved, axis=-2),
        queries=_masked(q * decay_prefix, masks.reads_carry),
        keys_to_end=_masked(k * jnp.exp(sums.suffix), masks.writes_carry),
        decay_total=_masked(jnp.exp(sums.total), masks.keeps_carry),
    )


def _query_scores(s: Scores, width: int) -> Scores:
    return Scores(s.diagonal[..., :width, :], tuple(e[..., :width, :] for e in s.earlier))


def apply_query_scores(s: Scores, values, width: int):
    """A_qk @ values by row blocks: ``[.., C, V] -> [.., C, V]``."""
    q = _query_scores(s, width)
    out = _mm(q.diagonal, _split(values, width))
    rows = [out[..., 0, :, :]] + [
        out[..., R, :, :] + _mm(q.earlier[R - 1], values[..., : R * width, :]) for R in range(1, out.shape[-3])
    ]
    return jnp.concatenate(rows, axis=-2)


def apply_query_scores_transposed(s: Scores, d_out, width: int):
    """A_qk^T @ d_out by row blocks: ``[.., C, V] -> [.., C, V]``."""
    q = _query_scores(s, width)
    d_blocks = _split(d_out, width)
    result = _merge(_t_mm(q.diagonal, d_blocks))
    chunk = d_out.shape[-2]
    for R in range(1, d_blocks.shape[-3]):
        result = result + _pad_rows(_t_mm(q.earlier[R - 1], d_blocks[..., R, :, :]), chunk)
    return result


# ----------------------------------------------------------------------------- forward and backward


def pass_state(intra: Intra, initial_state):
    """The sequential part, over axis 0 (chunks): per chunk one matmul [W; Q exp Gamma] S_in gives the
    delta rule's prediction and the state's share of the outputs.

    Returns ``(new_values V~, outputs_from_state, entering states S_in [N, B, HV, K, V], final_state)``.
    """
    chunk, key_dim = intra.queries.shape[-2:]
    w = intra.solved[..., :key_dim]
    u = intra.solved[..., key_dim:]

    def body(state, xs):
        w_and_queries, u_c, keys_to_end, decay_total = xs
        read = _mm(w_and_queries, state)
        new_values = u_c - read[..., :chunk, :]
        next_state = decay_total[..., None] * state + _t_mm(keys_to_end, new_values)
        return next_state, (new_values, read[..., chunk:, :], state)

    stacked = jnp.concatenate([w, intra.queries], axis=-2)
    final_state, (new_values, from_state, entering) = jax.lax.scan(
        body, initial_state, (stacked, u, intra.keys_to_end, intra.decay_total)
    )
    return new_values, from_state, entering, final_state


def _forward(q, k, v, g, beta, initial_state, segments, width):
    intra = intra_chunk(q, k, v, g, beta, segments, width)
    new_values, from_state, entering, final_state = pass_state(intra, initial_state)
    o = from_state + apply_query_scores(intra.scores, new_values, width)
    return o, final_state, entering, new_values


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def chunked(q, k, v, g, beta, initial_state, segments, width):
    """Chunked KDA on chunk-major fp32 arrays ``[N, B, HV, C, ...]``; returns ``(o, final_state)``."""
    o, final_state, _, _ = _forward(q, k, v, g, beta, initial_state, segments, width)
    return o, final_state


def _chunked_fwd(q, k, v, g, beta, initial_state, segments, width):
    o, final_state, entering, new_values = _forward(q, k, v, g, beta, initial_state, segments, width)
    return (o, final_state), (q, k, v, g, beta, segments, entering, new_values)


def _reverse_pass(intra: Intra, d_o, d_final_state):
    """Walk the chunks backwards: returns ``(dV~, dS_out per chunk, d initial_state)``."""
    key_dim = intra.queries.shape[-1]
    w = intra.solved[..., :key_dim]
    from_outputs = apply_query_scores_transposed(intra.scores, d_o, intra.inverse.shape[-1])
    state_from_outputs = _t_mm(intra.queries, d_o)                           # [.., K, V]

    def body(d_state, xs):
        from_out, state_out, w_c, keys_to_end, decay_total = xs
        d_values = from_out + _mm(keys_to_end, d_state)
        d_state_in = state_out - _t_mm(w_c, d_values) + decay_total[..., None] * d_state
        return d_state_in, (d_values, d_state)

    d_initial, (d_values, d_state_out) = jax.lax.scan(
        body, d_final_state, (from_outputs, state_from_outputs, w, intra.keys_to_end, intra.decay_total),
        reverse=True,
    )
    return d_values, d_state_out, d_initial


def _solve_backward(intra: Intra, d_solved, beta_blocks, width):
    """Gradients through [W | U] = (I + A_kk)^{-1} rhs: returns ``(d rhs, d A_kk diagonal, d A_kk earlier)``."""
    blocks = d_solved.shape[-2] // width
    d_blocks, solved = _split(d_solved, width), intra.solved
    a_kk_earlier = [e[..., width:, :] * beta_blocks[..., R, :, :] for R, e in enumerate(intra.scores.earlier, 1)]
    pending = jnp.zeros_like(d_solved)            # -sum_J A_kk[J, I]^T d_acc_J for earlier blocks I
    d_acc = [None] * blocks
    for R in reversed(range(blocks)):
        rows = slice(R * width, (R + 1) * width)
        d_acc[R] = _t_mm(intra.inverse[..., R, :, :], d_blocks[..., R, :, :] + pending[..., rows, :])
        if R:
            pending = pending - _pad_rows(_t_mm(a_kk_earlier[R - 1], d_acc[R]), d_solved.shape[-2])
    d_rhs = jnp.concatenate(d_acc, axis=-2)
    d_diagonal = -_mm_t(_split(d_rhs, width), _split(solved, width))            # [.., n, S, S]
    d_earlier = tuple(-_mm_t(d_acc[R], solved[..., : R * width, :]) for R in range(1, blocks))
    return d_rhs, d_diagonal, d_earlier


def _chunked_bwd(width, residuals, cotangents):
    q, k, v, g, beta, segments, entering, new_values = residuals
    d_o, d_final_state = cotangents
    key_dim = q.shape[-1]
    intra = intra_chunk(q, k, v, g, beta, segments, width)
    d_values, d_state_out, d_initial = _reverse_pass(intra, d_o, d_final_state)

    # Through the carried state.
    d_queries = _mm_t(d_o, entering)                                         # [.., C, K]
    d_keys_to_end = _mm_t(new_values, d_state_out)
    d_decay_total = jnp.sum(d_state_out * entering, axis=-1) * intra.decay_total
    d_solved = jnp.concatenate([-_mm_t(d_values, entering), d_values], axis=-1)

    # Through the solve and beta.
    beta_b = _split(beta, width, axis=-1)[..., None]
    d_rhs, d_kk_diagonal, d_kk_earlier = _solve_backward(intra, d_solved, beta_b, width)
    key_rows = lambda x: x[..., width:, :]  # noqa: E731
    d_beta_rows = jnp.sum(d_kk_diagonal * key_rows(intra.scores.diagonal), axis=-1)          # [.., n, S]
    d_beta_earlier = [jnp.zeros_like(d_beta_rows[..., 0, :])] + [
        jnp.sum(d_e * key_rows(s_e), axis=-1) for d_e, s_e in zip(d_kk_earlier, intra.scores.earlier)
    ]
    d_beta = jnp.sum(d_rhs * intra.written, axis=-1) + _merge(d_beta_rows + jnp.stack(d_beta_earlier, -2), axis=-2)

    # Through the scores (query rows: dA_qk = dO V~^T; key rows: beta dA_kk), masked as in the forward.
    d_o_b, values_b = _split(d_o, width), _split(new_values, width)
    d_scores = Scores(
        diagonal=jnp.concatenate([_mm_t(d_o_b, values_b), d_kk_diagonal * beta_b], axis=-2),
        earlier=tuple(
            jnp.concatenate([_mm_t(d_o_b[..., R, :, :], new_values[..., : R * width, :]),
                             d_kk_earlier[R - 1] * beta_b[..., R, :, :]], axis=-2)
            for R in range(1, d_o_b.shape[-3])
        ),
    )
    d_q, d_k, d_prefix = score_gradients(q, k, g, intra.factors, mask_scores(d_scores, intra.masks), width)

    # Through Q exp(Gamma), exp(Gamma) K, K exp(sigma) and exp(Gamma_C).
    decay_prefix = jnp.exp(intra.sums.prefix)
    d_carried_keys = _masked(beta[..., None] * d_rhs[..., :key_dim], intra.masks.reads_carry)
    d_queries = _masked(d_queries, intra.masks.reads_carry)
    d_q = d_q + d_queries * decay_prefix
    d_k = d_k + d_carried_keys * decay_prefix
    d_prefix = d_prefix + (d_queries * q + d_carried_keys * k) * decay_prefix
    d_keys_to_end = _masked(d_keys_to_end, intra.masks.writes_carry)
    d_k = d_k + d_keys_to_end * jnp.exp(intra.sums.suffix)
    d_suffix = d_keys_to_end * intra.keys_to_end
    d_g = gate_gradient(d_prefix, d_suffix, d_decay_total)
    d_v = beta[..., None] * d_rhs[..., key_dim:]
    return d_q, d_k, d_v, d_g, d_beta, d_initial, None


chunked.defvjp(_chunked_fwd, _chunked_bwd)


# ----------------------------------------------------------------------------- entry point


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
    width = SUB_BLOCK if chunk % SUB_BLOCK == 0 else chunk
    n_chunks = -(-length // chunk)
    padded = n_chunks * chunk

    def to_chunks(x):  # [B, T, HV, ...] -> [N, B, HV, C, ...]
        x = jnp.pad(x, [(0, 0), (0, padded - length)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(batch, n_chunks, chunk, heads, *x.shape[3:])
        return jnp.moveaxis(x, (1, 3), (0, 2))

    segments = None if segment_starts is None else _segment_index_chunks(segment_starts, padded, chunk)
    o, final_state = chunked(*map(to_chunks, (q, k, v, g, beta)), initial_state, segments, width)
    o = jnp.moveaxis(o, (0, 2), (1, 3)).reshape(batch, padded, heads, -1)[:, :length]
    return o, final_state


def chunk_matmul_flops(batch: int, length: int, value_heads: int, key_dim: int, value_dim: int,
                       chunk: int, sub_block: int = SUB_BLOCK) -> int:
    """Matmul FLOPs (2 per multiply-add) of one forward of `chunk_kda`, as it computes them
    (factored diagonal blocks); elementwise work (exp, masks) is not counted.

    Per (batch, head, chunk), with n = C / S sub-blocks, D = K + V:
        gate sums  2 (2 S^2 K) n                                  lam and rho
        scores     n 2 (2S) S K + sum_{R>=1} 2 (2S) (R S) K       query and key rows
        solve      n (log2 S - 1) 4 S^3 + n 2 S^2 D + sum_{R>=1} 2 S (R S) D
        state      2 (2C) K V + 2 C K V                           [W; Q] S_in and K^T V~
        output     n 2 S^2 V + sum_{R>=1} 2 S (R S) V             A_qk V~
    """
    s = min(sub_block, chunk)
    blocks, d = chunk // s, key_dim + value_dim
    lower_pairs = blocks * (blocks - 1) // 2
    gates = 2 * 2 * s * s * key_dim * blocks
    scores_ = blocks * 2 * (2 * s) * s * key_dim + lower_pairs * 2 * (2 * s) * s * key_dim
    solve = blocks * (int(math.log2(s)) - 1) * 4 * s**3 + blocks * 2 * s * s * d + lower_pairs * 2 * s * s * d
    state = 2 * (2 * chunk) * key_dim * value_dim + 2 * chunk * key_dim * value_dim
    output = blocks * 2 * s * s * value_dim + lower_pairs * 2 * s * s * value_dim
    return batch * value_heads * -(-length // chunk) * (gates + scores_ + solve + state + output)
