"""Chunked KDA in XLA: the WY / UT form of SPEC §1, safe in fp32 for any gate, with its backward.

The sequence is cut into blocks of S = 16 tokens. Per value head and block (rows r, columns i,
key channels c), with the state S carried from block to block:

    Gamma_t    = sum_{j <= t} g_j                 sigma_t = Gamma_S - Gamma_t = sum_{j > t} g_j
    A_kk[r,i]  = beta_r sum_c k_r[c] k_i[c] exp(Gamma_r[c] - Gamma_i[c])      i <  r
    A_qk[r,i]  =        sum_c q_r[c] k_i[c] exp(Gamma_r[c] - Gamma_i[c])      i <= r
    P          = V - (exp(Gamma) * K) S_in
    V~         = (I + A_kk)^{-1} Diag(beta) P           (= U - W S_in of the WY form)
    O          = (Q * exp Gamma) S_in + A_qk V~
    S_out      = Diag(exp Gamma_S) S_in + (K * exp sigma)^T V~

Scores. exp(Gamma_r - Gamma_i) = exp(Gamma_r) exp(-Gamma_i), so each score matrix is one matmul of
the rows x_r exp(Gamma_r) against the columns k_i exp(-Gamma_i). Every Gamma is a sum of same-sign
terms (no cancellation), and |Gamma| is at most the block's total decay: for K3's bounded gate at
most 16 * 5 = 80, and exp(80) ~ 5.5e34 is finite in fp32. When a block decays by more than
`FACTORED_DECAY_LIMIT` (Kimi Linear's unbounded gate reaches -1000 per token), the scores are
computed from exact pairwise decays exp(sum_{i < j <= r} g_j), masked to -inf *before* exp.

Solve. A_kk is strictly lower triangular, so (I + A_kk)^{-1} = prod_m (I + (-A_kk)^(2^m)),
m < log2(S): three doublings for S = 16.

Scan steps. One `lax.scan` step handles a chunk of C = ``chunk_size`` tokens, G = C / S blocks:
the terms of its blocks that do not depend on the state are computed for all G at once, then the
state passes through the G blocks in order. Every intermediate is one chunk in size and stays in
cache, and the chunks are read from and written to the token-major arrays in place. (On 2 CPU
cores this is 2-4x faster than computing the terms of all chunks at once, whose intermediates
are sequence-sized, and than larger blocks, whose sub-block bookkeeping costs more than the
state passes it saves.)

Packed documents: with segment indices, pairs across a boundary are masked out of A_kk and
A_qk, rows after a boundary do not read the carried state, columns before the block's last
boundary do not write it, and the carried state is dropped when the block holds a boundary.

Backward (`jax.custom_vjp`): the forward saves its inputs, the state entering each chunk (one per
C tokens), and per block A_qk, A_kk, (I + A_kk)^{-1}, P and V~ (3 S + 2 V floats per token and
head; recomputing them made the backward 10-20% slower). Per chunk, in reverse: recompute the
decays, rebuild the states entering each block from S_in and V~ (one matmul per block), walk the
blocks backwards for dS (the only sequential part), taking each block's products with its S_in
and dS_out on the way (dO S_in^T, dP S_in^T, V~ dS_out^T, rowsum(dS_out * S_in)) so that no
state is stacked,

    dV~     = A_qk^T dO + (K * exp sigma) dS_out
    dRHS    = (I + A_kk)^{-T} dV~
    dS_in   = (Q * exp Gamma)^T dO - (exp(Gamma) K)^T Diag(beta) dRHS + Diag(exp Gamma_S) dS_out

and then, for all G blocks at once:

    dP      = Diag(beta) dRHS,   dbeta = rowsum(dRHS * P) + rowsum(dA_kk * A_kk / beta)
    dA_kk   = -dRHS V~^T,        dA_qk = dO V~^T
    scores  s[r,i] = sum_c x_r[c] k_i[c] E_ri[c]:  dx_r = sum_i ds E k_i,  dk_i += sum_r ds E x_r,
            dGamma_r += x_r dx_r,  dGamma_i -= k_i (dk_i from this term)
    dg_j    = sum_{t >= j} dGamma_t + sum_{t < j} dsigma_t + dGamma_S

XLA:CPU notes: concatenation and padding are several times slower than arithmetic there, so
masks replace assembly; and its dot with a transposed operand takes a slower library path, so
transposes are materialised first (`_transposed`).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

SUB_BLOCK = 16
FACTORED_DECAY_LIMIT = 80.0  # exp(80) ~ 5.5e34: products of such factors stay finite in fp32
_HIGHEST = jax.lax.Precision.HIGHEST


def effective_chunk_size(length: int, chunk_size: int) -> int:
    """The chunk actually used: ``chunk_size``, shrunk (to a multiple of 16) for short sequences."""
    if length >= chunk_size:
        return chunk_size
    return min(chunk_size, SUB_BLOCK * math.ceil(length / SUB_BLOCK))


def block_width(chunk: int) -> int:
    """Tokens per block between state passes: 16, or the whole chunk when it is shorter."""
    return SUB_BLOCK if chunk % SUB_BLOCK == 0 else chunk


def _sum_matrix(size: int, upper: bool = False, inclusive: bool = True) -> np.ndarray:
    """0/1 matrix M with (M @ x)[r] = sum_j x[j] over j <= r (lower) or j >= r (upper); strict
    inequalities when not ``inclusive``."""
    r, j = np.ogrid[:size, :size]
    if upper:
        return ((j >= r) if inclusive else (j > r)).astype(np.float32)
    return ((j <= r) if inclusive else (j < r)).astype(np.float32)


def _mm(a, b):
    return jnp.matmul(a, b, precision=_HIGHEST)


def _transposed(x):
    """``x`` with its last two axes swapped *in memory*: the barrier keeps XLA from folding the
    transpose into the consuming dot, whose transposed-operand form XLA:CPU runs through a
    slower library path (about 2x for one block's matrices)."""
    return jax.lax.optimization_barrier(jnp.swapaxes(x, -1, -2))


def _t_mm(a, b):
    """``a^T b`` over the last two axes."""
    return _mm(_transposed(a), b)


def _mm_t(a, b):
    """``a b^T`` over the last two axes."""
    return jnp.einsum("...ik,...jk->...ij", a, b, precision=_HIGHEST)


def _left_multiply(matrix: np.ndarray, x: jax.Array) -> jax.Array:
    """``matrix @ x`` for a constant ``matrix [m, j]`` and ``x [.., j, k]``, as a batched matmul so
    the result keeps ``x``'s layout (an einsum would contract into a transposed layout)."""
    return _mm(jnp.broadcast_to(matrix, (*x.shape[:-2], *matrix.shape)), x)


# ----------------------------------------------------------------------------- gate sums


class GateSums(NamedTuple):
    """Sums of log decays inside each block ``[.., S, K]`` (all <= 0, sums of same-sign terms)."""

    prefix: jax.Array   # Gamma: from the block start to the token, inclusive
    suffix: jax.Array   # sigma = Gamma_S - Gamma: from the token to the block end, exclusive
    total: jax.Array    # Gamma_S  [.., K]


def gate_sums(g: jax.Array) -> GateSums:
    """The gate sums of blocks ``g [.., S, K]``."""
    width = g.shape[-2]
    prefix = _left_multiply(_sum_matrix(width), g)
    return GateSums(prefix, _left_multiply(_sum_matrix(width, upper=True, inclusive=False), g), prefix[..., -1, :])


def gate_gradient(d_prefix, d_suffix, d_total):
    """dg from the gradients of Gamma (prefix), sigma (suffix) ``[.., S, K]`` and Gamma_S ``[.., K]``:
    dg_j = sum_{t >= j} dGamma_t + sum_{t < j} dsigma_t + dGamma_S."""
    width = d_prefix.shape[-2]
    return (_left_multiply(_sum_matrix(width, upper=True), d_prefix)
            + _left_multiply(_sum_matrix(width, inclusive=False), d_suffix) + d_total[..., None, :])


# ----------------------------------------------------------------------------- scores


def _exact_decay(g):
    """Exact pairwise decays exp(sum_{i<j<=r} g_j) for i <= r, else 0: ``[.., S, S, K]``."""
    width = g.shape[-2]
    r, i, j = np.ogrid[:width, :width, :width]
    path = ((i < j) & (j <= r)).astype(np.float32).reshape(width * width, width)
    pair_sum = _left_multiply(path, g)
    pair_sum = pair_sum.reshape(*pair_sum.shape[:-2], width, width, pair_sum.shape[-1])
    return jnp.exp(jnp.where(r >= i, pair_sum, -jnp.inf))


def block_scores(q, k, g, prefix, decayed_q, decayed_k, safe):
    """Unmasked ``(sum_c q_r k_i exp(Gamma_r - Gamma_i), same with k_r for q_r)`` ``[.., S, S]``, exact at
    and below the diagonal (above it: whatever the factored product gives, finite; masked later).
    ``decayed_q``, ``decayed_k`` are q exp(Gamma) and k exp(Gamma), the factored form's rows."""

    def factored():
        columns = k * jnp.exp(-prefix)
        return _mm_t(decayed_q, columns), _mm_t(decayed_k, columns)

    def exact():
        pair_terms = k[..., None, :, :] * _exact_decay(g)                      # [.., r, i, K]
        return (jnp.sum(q[..., :, None, :] * pair_terms, axis=-1),
                jnp.sum(k[..., :, None, :] * pair_terms, axis=-1))

    return jax.lax.cond(safe, factored, exact)


def block_score_gradients(q, k, g, prefix, decay_prefix, safe, d_query_scores, d_key_scores):
    """For the gradients of both `block_scores` outputs: ``(dq, dk, dGamma)``, each ``[.., S, K]``
    (``decay_prefix`` = exp(Gamma))."""
    decayed_q, decayed_k = q * decay_prefix, k * decay_prefix

    def factored():
        column_scale = jnp.exp(-prefix)
        columns = k * column_scale
        d_q = decay_prefix * _mm(d_query_scores, columns)
        d_k_rows = decay_prefix * _mm(d_key_scores, columns)
        d_k_columns = column_scale * (_t_mm(d_query_scores, decayed_q) + _t_mm(d_key_scores, decayed_k))
        return d_q, d_k_rows, d_k_columns

    def exact():
        decay = _exact_decay(g)
        d_q = jnp.sum(d_query_scores[..., None] * decay * k[..., None, :, :], axis=-2)
        d_k_rows = jnp.sum(d_key_scores[..., None] * decay * k[..., None, :, :], axis=-2)
        d_k_columns = jnp.sum((d_query_scores[..., None] * q[..., :, None, :]
                               + d_key_scores[..., None] * k[..., :, None, :]) * decay, axis=-3)
        return d_q, d_k_rows, d_k_columns

    d_q, d_k_rows, d_k_columns = jax.lax.cond(safe, factored, exact)
    return d_q, d_k_rows + d_k_columns, q * d_q + k * (d_k_rows - d_k_columns)


# ----------------------------------------------------------------------------- block terms


class Masks(NamedTuple):
    """Multiplicative masks (None: no packed-document boundaries): ``query``, ``key`` ``[.., S, S]``
    (causal resp. strictly causal, same segment); ``reads_carry``, ``writes_carry`` ``[.., S, 1]``
    and ``keeps_carry [.., 1]`` for the carried state."""

    query: jax.Array
    key: jax.Array
    reads_carry: jax.Array | None
    writes_carry: jax.Array | None
    keeps_carry: jax.Array | None


def block_masks(segments, width: int) -> Masks:
    """Masks from ``segments``: None, or (segment index per token ``[.., S]``, index carried into the
    block ``[.., 1]``)."""
    r, i = np.ogrid[:width, :width]
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


class BlockTerms(NamedTuple):
    """Terms of a chunk's blocks that do not depend on the carried state, ``[B, G, HV, ...]``."""

    sums: GateSums
    masks: Masks
    safe: jax.Array           # every block of the chunk decays by at most FACTORED_DECAY_LIMIT
    decay_prefix: jax.Array   # exp(Gamma)                                         [.., S, K]
    a_qk: jax.Array           # masked query scores                               [.., S, S]
    key_scores: jax.Array     # masked key scores, A_kk = Diag(beta) key_scores    [.., S, S]
    inverse: jax.Array        # (I + A_kk)^{-1}                                    [.., S, S]
    carried_keys: jax.Array   # exp(Gamma) K (rows reading the carried state)      [.., S, K]
    queries: jax.Array        # Q exp(Gamma)                                       [.., S, K]
    keys_to_end: jax.Array    # K exp(sigma) (columns writing the carried state)   [.., S, K]
    decay_total: jax.Array    # exp(Gamma_S)                                       [.., K]


class Solved(NamedTuple):
    """The block terms the backward takes from the forward instead of recomputing them."""

    a_qk: jax.Array
    key_scores: jax.Array
    inverse: jax.Array


def block_terms(q, k, g, beta, segments, solved: Solved | None = None) -> BlockTerms:
    """Everything of a chunk's blocks that does not depend on the carried state (fp32, q scaled);
    the scores and the inverse are taken from ``solved`` when given."""
    sums = gate_sums(g)
    safe = jnp.max(-sums.total) <= FACTORED_DECAY_LIMIT
    masks = block_masks(segments, g.shape[-2])
    decay_prefix = jnp.exp(sums.prefix)
    decayed_q, decayed_k = q * decay_prefix, k * decay_prefix
    if solved is None:
        query_scores, key_scores = block_scores(q, k, g, sums.prefix, decayed_q, decayed_k, safe)
        key_scores = key_scores * masks.key
        solved = Solved(query_scores * masks.query, key_scores,
                        unit_lower_inverse(key_scores * beta[..., :, None]))
    return BlockTerms(
        sums=sums,
        masks=masks,
        safe=safe,
        decay_prefix=decay_prefix,
        a_qk=solved.a_qk,
        key_scores=solved.key_scores,
        inverse=solved.inverse,
        carried_keys=_masked(decayed_k, masks.reads_carry),
        queries=_masked(decayed_q, masks.reads_carry),
        keys_to_end=_masked(k * jnp.exp(sums.suffix), masks.writes_carry),
        decay_total=_masked(jnp.exp(sums.total), masks.keeps_carry),
    )


class Pass(NamedTuple):
    """The state's walk through a chunk's G blocks (each ``[B, G, HV, ...]``)."""

    outputs: jax.Array      # O = (Q exp Gamma) S_in + A_qk V~   [.., S, V]
    residual: jax.Array     # P = V - exp(Gamma) K S_in          [.., S, V]
    new_values: jax.Array   # V~ = (I + A_kk)^{-1} Diag(beta) P  [.., S, V]
    final_state: jax.Array  # S_out of the last block            [B, HV, K, V]


def _state_after(terms: BlockTerms, keys_to_end_t, block: int, state, new_values):
    """S_out = Diag(exp Gamma_S) S_in + (K exp sigma)^T V~ of one block (``keys_to_end_t``: the
    transposed `BlockTerms.keys_to_end`)."""
    return terms.decay_total[:, block, ..., None] * state + _mm(keys_to_end_t[:, block], new_values)


def pass_blocks(terms: BlockTerms, v, beta, state) -> Pass:
    """The sequential part: the state through the G blocks (axis 1) of one chunk, in order. Each
    block's products with its S_in are taken as the state passes, so no state is stacked."""
    keys_to_end_t = _transposed(terms.keys_to_end)
    outputs, residuals, new_values = [], [], []
    for block in range(v.shape[1]):
        residuals.append(v[:, block] - _mm(terms.carried_keys[:, block], state))
        new_values.append(_mm(terms.inverse[:, block], beta[:, block, ..., None] * residuals[-1]))
        outputs.append(_mm(terms.queries[:, block], state) + _mm(terms.a_qk[:, block], new_values[-1]))
        state = _state_after(terms, keys_to_end_t, block, state, new_values[-1])
    return Pass(*(jnp.stack(x, axis=1) for x in (outputs, residuals, new_values)), state)


def entering_states(terms: BlockTerms, new_values, state) -> list:
    """The state entering each block (a list over the G blocks) from the chunk's S_in and V~."""
    keys_to_end_t = _transposed(terms.keys_to_end)
    entering = [state]
    for block in range(new_values.shape[1] - 1):
        entering.append(_state_after(terms, keys_to_end_t, block, entering[-1], new_values[:, block]))
    return entering


class ReversePass(NamedTuple):
    """What the backward walk through a chunk's blocks yields (each ``[B, G, HV, ...]``)."""

    d_rhs: jax.Array             # dRHS = (I + A_kk)^{-T} dV~                 [.., S, V]
    d_queries: jax.Array         # dO S_in^T (before the reads-carry mask)     [.., S, K]
    d_carried_keys: jax.Array    # -Diag(beta) dRHS S_in^T (same)              [.., S, K]
    d_keys_to_end: jax.Array     # V~ dS_out^T (before the writes-carry mask)  [.., S, K]
    d_decay_total: jax.Array     # rowsum(dS_out * S_in)                       [.., K]
    d_initial: jax.Array         # dS_in of the chunk                          [B, HV, K, V]


def reverse_pass(terms: BlockTerms, d_o, beta, new_values, entering, d_state) -> ReversePass:
    """Walk a chunk's blocks backwards from dS_out of its last block; the products with each block's
    S_in and dS_out are taken on the way, so no state is stacked."""
    from_outputs = _t_mm(terms.a_qk, d_o)
    state_from_outputs = _t_mm(terms.queries, d_o)
    carried_keys, inverse = _transposed(terms.carried_keys), _transposed(terms.inverse)
    blocks = d_o.shape[1]
    d_rhs, d_queries, d_carried_keys, d_keys_to_end, d_decay_total = ([None] * blocks for _ in range(5))
    for block in reversed(range(blocks)):
        state = entering[block]
        d_values = from_outputs[:, block] + _mm(terms.keys_to_end[:, block], d_state)
        d_rhs[block] = _mm(inverse[:, block], d_values)
        d_residual = beta[:, block, ..., None] * d_rhs[block]
        d_queries[block] = _mm_t(d_o[:, block], state)
        d_carried_keys[block] = -_mm_t(d_residual, state)
        d_keys_to_end[block] = _mm_t(new_values[:, block], d_state)
        d_decay_total[block] = jnp.sum(d_state * state, axis=-1)
        d_state = (state_from_outputs[:, block] - _mm(carried_keys[:, block], d_residual)
                   + terms.decay_total[:, block, ..., None] * d_state)
    stacked = (jnp.stack(x, axis=1) for x in (d_rhs, d_queries, d_carried_keys, d_keys_to_end, d_decay_total))
    return ReversePass(*stacked, d_state)


# ----------------------------------------------------------------------------- forward and backward


def _to_blocks(x, width: int):
    """One chunk, token-major ``[B, C, HV, ...]``, as blocks ``[B, G, HV, S, ...]``."""
    x = x.reshape(x.shape[0], x.shape[1] // width, width, *x.shape[2:])
    return jnp.swapaxes(x, 2, 3)


def _from_blocks(x):
    """Inverse of `_to_blocks`."""
    x = jnp.swapaxes(x, 2, 3)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _forward_step(state, inputs, width: int):
    """One chunk: ``(S_out, o [B, C, HV, V], what the backward keeps of it)`` from S_in and the
    chunk's token-major ``(q, k, v, g, beta, segments)``."""
    *chunk_inputs, segments = inputs
    q, k, v, g, beta = (_to_blocks(x, width) for x in chunk_inputs)
    terms = block_terms(q, k, g, beta, segments)
    walk = pass_blocks(terms, v, beta, state)
    kept = (Solved(terms.a_qk, terms.key_scores, terms.inverse), walk.residual, walk.new_values)
    return walk.final_state, _from_blocks(walk.outputs), kept


def _chunk(arrays, index):
    """Chunk ``index`` of arrays ``[B, N, ...]`` (a pytree; None stays None)."""
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, index, axis=1, keepdims=False), arrays)


def _write_chunk(buffers, values, index):
    """Write one chunk's ``values`` into ``buffers [B, N, ...]`` at chunk ``index`` (in place)."""
    return jax.tree.map(lambda buf, x: jax.lax.dynamic_update_index_in_dim(buf, x, index, axis=1), buffers, values)


def _forward(inputs, initial_state, width: int, keep: bool):
    """Scan the chunks. Returns ``(o, final state, None or per chunk [N, ...]: the entering state,
    the scores and inverse, P and V~)``."""

    def body(carry, index):
        state, o = carry
        next_state, o_chunk, kept = _forward_step(state, _chunk(inputs, index), width)
        return (next_state, _write_chunk(o, o_chunk, index)), ((state, *kept) if keep else None)

    o = jnp.zeros(inputs[2].shape, inputs[2].dtype)
    (final_state, o), kept = jax.lax.scan(body, (initial_state, o), jnp.arange(inputs[0].shape[1]))
    return o, final_state, kept


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def chunked(q, k, v, g, beta, initial_state, segments, width):
    """Chunked KDA on token-major fp32 arrays split into chunks, ``[B, N, C, HV, ...]``; returns
    ``(o, final_state)``."""
    o, final_state, _ = _forward((q, k, v, g, beta, segments), initial_state, width, keep=False)
    return o, final_state


def _chunked_fwd(q, k, v, g, beta, initial_state, segments, width):
    inputs = (q, k, v, g, beta, segments)
    o, final_state, kept = _forward(inputs, initial_state, width, keep=True)
    return (o, final_state), (inputs, kept)


def _backward_step(d_state, xs, width: int):
    """One chunk in reverse: from dS_out, the chunk's inputs, what the forward kept of it (S_in,
    scores and inverse, P, V~) and dO, returns dS_in and the gradients of the chunk's
    ``(q, k, v, g, beta)``, token-major."""
    (q, k, _, g, beta, segments), (state, solved, residual, new_values), d_o = xs
    q, k, g, beta, d_o = (_to_blocks(x, width) for x in (q, k, g, beta, d_o))
    terms = block_terms(q, k, g, beta, segments, solved)
    masks = terms.masks
    walk = reverse_pass(terms, d_o, beta, new_values, entering_states(terms, new_values, state), d_state)
    d_rhs = walk.d_rhs

    # Through the solve: V~ = (I + A_kk)^{-1} Diag(beta) P, P = V - exp(Gamma) K S_in.
    d_residual = beta[..., None] * d_rhs
    d_a_kk = -_mm_t(d_rhs, new_values) * masks.key
    d_beta = jnp.sum(d_rhs * residual, axis=-1) + jnp.sum(d_a_kk * terms.key_scores, axis=-1)

    # Through the scores.
    d_a_qk = _mm_t(d_o, new_values) * masks.query
    decay_prefix = terms.decay_prefix
    dq, dk, d_prefix = block_score_gradients(q, k, g, terms.sums.prefix, decay_prefix, terms.safe, d_a_qk,
                                             d_a_kk * beta[..., :, None])

    # Through Q exp(Gamma), exp(Gamma) K, K exp(sigma) and exp(Gamma_S).
    d_queries = _masked(walk.d_queries, masks.reads_carry)
    d_carried_keys = _masked(walk.d_carried_keys, masks.reads_carry)
    dq = dq + d_queries * decay_prefix
    dk = dk + d_carried_keys * decay_prefix
    d_prefix = d_prefix + d_queries * terms.queries + d_carried_keys * terms.carried_keys
    d_keys_to_end = _masked(walk.d_keys_to_end, masks.writes_carry)
    dk = dk + d_keys_to_end * jnp.exp(terms.sums.suffix)
    d_total = walk.d_decay_total * terms.decay_total
    dg = gate_gradient(d_prefix, d_keys_to_end * terms.keys_to_end, d_total)
    return walk.d_initial, tuple(_from_blocks(x) for x in (dq, dk, d_residual, dg, d_beta))


def _chunked_bwd(width, residuals, cotangents):
    inputs, kept = residuals
    d_o, d_final_state = cotangents

    def body(carry, index):
        d_state, grads = carry
        xs = (_chunk(inputs, index), jax.tree.map(lambda x: x[index], kept), _chunk(d_o, index))
        d_state, chunk_grads = _backward_step(d_state, xs, width)
        return (d_state, _write_chunk(grads, chunk_grads, index)), None

    grads = tuple(jnp.zeros_like(x) for x in inputs[:5])
    (d_initial, grads), _ = jax.lax.scan(body, (d_final_state, grads), jnp.arange(inputs[0].shape[1]),
                                         reverse=True)
    return (*grads, d_initial, None)


chunked.defvjp(_chunked_fwd, _chunked_bwd)


# ----------------------------------------------------------------------------- entry point


def _segment_index_blocks(segment_starts, padded_length, chunk, width):
    """Segment index of each token ``[B, N, G, 1, S]`` and the one carried into each block
    ``[B, N, G, 1, 1]`` (the 1: value heads).

    The index counts segment starts, so the initial state belongs to index 0.
    """
    index = jnp.cumsum(segment_starts.astype(jnp.int32), axis=1)
    index = jnp.pad(index, ((0, 0), (0, padded_length - index.shape[1])), mode="edge")
    batch = index.shape[0]
    blocks = index.reshape(batch, -1, width)
    carried = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), blocks[:, :-1, -1]], axis=1)
    per_chunk = (batch, padded_length // chunk, chunk // width)
    return blocks.reshape(*per_chunk, 1, width), carried.reshape(*per_chunk, 1, 1)


def chunk_kda(q, k, v, g, beta, initial_state, segment_starts, chunk_size: int):
    """Chunked KDA on fp32 arrays already expanded to value heads and scaled.

    Shapes as `reference.recurrent_kda`: q, k, g ``[B, T, HV, K]``, v ``[B, T, HV, V]``,
    beta ``[B, T, HV]``, initial_state ``[B, HV, K, V]``, segment_starts ``[B, T]`` or None.
    Any T: the tail is padded with tokens that leave the state unchanged (k = v = g = beta = 0).
    Internally ``[B, N, C, HV, ...]`` (a reshape, no copy).
    """
    batch, length, heads, _ = q.shape
    chunk = effective_chunk_size(length, chunk_size)
    width = block_width(chunk)
    n_chunks = -(-length // chunk)
    padded = n_chunks * chunk

    def to_chunks(x):  # [B, T, HV, ...] -> [B, N, C, HV, ...]
        if padded != length:
            x = jnp.pad(x, [(0, 0), (0, padded - length)] + [(0, 0)] * (x.ndim - 2))
        return x.reshape(batch, n_chunks, chunk, *x.shape[2:])

    segments = None if segment_starts is None else _segment_index_blocks(segment_starts, padded, chunk, width)
    o, final_state = chunked(*map(to_chunks, (q, k, v, g, beta)), initial_state, segments, width)
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
