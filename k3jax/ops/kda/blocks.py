"""The KDA block math, written once: used by the XLA chunk form (`chunk`), the Pallas kernels
(`pallas_gpu`, `pallas_tpu`), the token-serial reference and the memory-bank decode.

Every function works on arrays whose last two axes are a matrix -- 2-D tiles inside a Pallas
kernel, ``[B, G, HV, ...]`` batches of blocks in XLA -- with products through a `backend.Dots`
and only the ops both Pallas backends lower (elementwise, reductions, iota masks; tiles are kept
in Python lists because Triton has no value slicing or concatenation).

Chunking. ``chunk_size`` means the same everywhere: the tokens whose state-independent terms are
computed together, a power of two >= 16, shrunk for short sequences (`chunk_length`). A chunk
of C tokens is C/16 tiles of 16 tokens. The Pallas kernels pass the state once per chunk and
couple the tiles through off-diagonal score blocks; the XLA form treats each tile as a chunk of
its own (state passed every 16 tokens, faster on CPUs) and batches the tiles of a chunk.

Per chunk (rows r, columns i, channels c; q already scaled; e_t = segment starts counted from
the chunk start up to t, so e = 0 before the chunk's first boundary):

    Gamma_r    = sum_{m <= r} g_m                       (inclusive, restarts every chunk)
    A_qk[r,i]  = [i <= r][e_i = e_r]        sum_c q_r k_i exp(Gamma_r - Gamma_i)
    A_kk[r,i]  = [i <  r][e_i = e_r] beta_r sum_c k_r k_i exp(Gamma_r - Gamma_i)
    K^ = K exp(Gamma) [e = 0],  Q^ = Q exp(Gamma) [e = 0],  K- = K exp(Gamma_C - Gamma) [e = e_C]
    D  = exp(Gamma_C) [e_C = 0]
    [W | U]    = (I + A_kk)^-1 Diag(beta) [K^ | V]
    advance:   V~ = U - W S;   O = Q^ S + A_qk V~;   S' = D S + K-^T V~

One token (`token_step`):  S <- Diag(exp g) S;  S <- S + beta k (v - S^T k)^T;  o = S^T q.

Numerics: every exponent is a sum of gates (<= 0) taken as a sum of same-sign terms by an
exact 0/1 matmul, never a difference of cumulative sums. Off-diagonal score blocks factor
exp(Gamma_r - Gamma_i) = exp(lam_r) exp(rho_i + between(I, R)) with lam_r the inclusive sum
from the start of tile R, rho_i the exclusive sum to the end of tile I and between the tiles
strictly in between -- all <= 0. Diagonal blocks use exact pairwise sums sum_{i < m <= r} g_m
one column at a time, with the masked exponents set to -inf before exp, so no gate magnitude
(-1000 per token included) produces inf or NaN; where the backend allows it (`Dots`), a
diagonal block decaying by at most 80 is instead one product exp(lam_r) x exp(-lam_i).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from k3jax.ops.kda.backend import FACTORED_DECAY_LIMIT, Dots

TILE = 16


def check_chunk_size(chunk_size: int) -> None:
    """Raise ValueError unless ``chunk_size`` is a power of two >= 16."""
    if not isinstance(chunk_size, int) or chunk_size < TILE or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= {TILE}, got {chunk_size!r}")


def chunk_length(length: int, chunk_size: int) -> int:
    """Tokens per chunk for a sequence of ``length``: ``chunk_size`` (a power of two >= 16), or
    the smallest power of two >= ``length`` (at least 16) when the sequence is shorter."""
    check_chunk_size(chunk_size)
    chunk = chunk_size
    while chunk > TILE and chunk // 2 >= length:
        chunk //= 2
    return chunk


def start_counts(segment_starts, batch: int, length: int, padded: int, width: int, dtype):
    """Segment starts counted from the start of each ``width``-token chunk, inclusive, ``[B, padded
    / width, width]`` in ``dtype``: 0 marks the tokens still in the segment carried into the chunk.
    ``segment_starts [B, length]`` bool or None; the padding continues the last segment."""
    if segment_starts is None:
        return jnp.zeros((batch, padded // width, width), dtype)
    starts = jnp.pad(segment_starts.astype(jnp.int32), ((0, 0), (0, padded - length)))
    return jnp.cumsum(starts.reshape(starts.shape[0], -1, width), axis=-1).astype(dtype)


def _iota(shape, axis):
    return jax.lax.broadcasted_iota(jnp.int32, shape, axis)


def select_row(x, j):
    """Row ``j`` of ``x [..., n, d]`` as ``[..., 1, d]`` (a masked sum: no dynamic value slicing)."""
    return jnp.sum(jnp.where(_iota(x.shape[-2:], 0) == j, x, 0.0), axis=-2, keepdims=True)


def select_column(x, j):
    """Column ``j`` of ``x [..., n, m]`` as ``[..., n, 1]``."""
    return jnp.sum(jnp.where(_iota(x.shape[-2:], 1) == j, x, 0.0), axis=-1, keepdims=True)


def token_step(state, q, k, v, g, beta):
    """One KDA token on a state ``[..., K, V]``: q (scaled), k, g columns ``[..., K, 1]``, v row
    ``[..., 1, V]``, beta ``[..., 1, 1]``. Returns ``(o [..., 1, V], new state)``:
    S <- Diag(exp g) S;  S <- S + beta k (v - S^T k)^T;  o = S^T q."""
    state = jnp.exp(g) * state
    predicted = jnp.sum(k * state, axis=-2, keepdims=True)
    state = state + (beta * k) * (v - predicted)
    return jnp.sum(q * state, axis=-2, keepdims=True), state


# ----------------------------------------------------------------------------- gates


class Gates(NamedTuple):
    """Decay factors of one chunk, per tile R (every exponent <= 0)."""

    raw: list        # g                                                     [.., 16, K]
    log_within: list  # lam: from the tile start to the token, inclusive      [.., 16, K]
    within: list     # exp(lam)                                              [.., 16, K]
    to_end: list     # rho (log): after the token to the tile end             [.., 16, K]
    totals: list     # each tile's gate sum (log)                              [.., 1, K]
    prefix: list     # exp(Gamma): from the chunk start to the token          [.., 16, K]
    suffix: list     # exp(Gamma_C - Gamma): after the token to the chunk end [.., 16, K]
    total: jax.Array  # exp(Gamma_C)                                           [.., 1, K]

    def column_factor(self, column_block: int, row_block: int):
        """exp(rho_i + between(I, R)): decay from key i (tile I) to the start of tile R > I."""
        between = self.to_end[column_block]
        for t in range(column_block + 1, row_block):
            between = between + self.totals[t]
        return jnp.exp(between)


def gate_factors(g: list) -> Gates:
    """All decay factors of a chunk from its gate tiles ``g`` (log space, <= 0)."""
    shape = (TILE, TILE)
    inclusive = (_iota(shape, 1) <= _iota(shape, 0)).astype(g[0].dtype)   # [r, m]: m <= r
    exclusive_after = (_iota(shape, 1) > _iota(shape, 0)).astype(g[0].dtype)
    lam = [Dots.sums(inclusive, tile) for tile in g]
    rho = [Dots.sums(exclusive_after, tile) for tile in g]
    totals = [jnp.sum(tile, axis=-2, keepdims=True) for tile in g]
    count = len(g)
    before = [sum(totals[:t], jnp.zeros_like(totals[0])) for t in range(count)]
    after = [sum(totals[t + 1 :], jnp.zeros_like(totals[0])) for t in range(count)]
    return Gates(
        raw=g,
        log_within=lam,
        within=[jnp.exp(x) for x in lam],
        to_end=rho,
        totals=totals,
        prefix=[jnp.exp(before[t] + lam[t]) for t in range(count)],
        suffix=[jnp.exp(rho[t] + after[t]) for t in range(count)],
        total=jnp.exp(sum(totals[1:], totals[0])),
    )


def path_decay(g, j):
    """Column ``j`` of a diagonal block: exp(sum_{j < m <= r} g_m) for rows r >= j, 0 above.

    Shape ``[.., 16, K]``; the sums are exact (0/1 matmul), the exponent is masked before exp.
    """
    shape = (TILE, TILE)
    rows, cols = _iota(shape, 0), _iota(shape, 1)
    path = ((cols > j) & (cols <= rows)).astype(g.dtype)
    exponent = Dots.sums(path, g)
    return jnp.exp(jnp.where(_iota((TILE, 1), 0) >= j, exponent, -jnp.inf))


# ----------------------------------------------------------------------------- segments


class Segments(NamedTuple):
    """Packed-document masks of one chunk (1.0 keep, 0.0 drop)."""

    reads: list      # [e = 0]: the row reads the carried state        [.., 16, 1]
    writes: list     # [e = e_C]: the row writes the state carried on   [.., 16, 1]
    keep: jax.Array  # [e_C = 0]: the carried state survives the chunk  [.., 1, 1]
    query_mask: list  # [i <= r][e_i = e_r] per block pair (R, I <= R)  [.., 16, 16]
    key_mask: list    # [i <  r][e_i = e_r]

    @staticmethod
    def from_counts(columns: list, rows: list) -> "Segments":
        """From the in-chunk start counts as columns ``[.., 16, 1]`` and rows ``[.., 1, 16]`` per tile."""
        last = jnp.max(columns[-1], axis=-2, keepdims=True)
        dtype = last.dtype
        same = [[column == rows[i] for i in range(r + 1)] for r, column in enumerate(columns)]

        def lower_blocks(diagonal):
            return [[s.astype(dtype) for s in row[:-1]] + [(row[-1] & diagonal).astype(dtype)] for row in same]

        shape = (TILE, TILE)
        return Segments(
            reads=[(c == 0).astype(c.dtype) for c in columns],
            writes=[(c == last).astype(c.dtype) for c in columns],
            keep=(last == 0).astype(last.dtype),
            query_mask=lower_blocks(_iota(shape, 1) <= _iota(shape, 0)),
            key_mask=lower_blocks(_iota(shape, 1) < _iota(shape, 0)),
        )


# ----------------------------------------------------------------------------- scores and solve


def _factored_ok(gates: Gates, block: int, dots: Dots):
    """Whether tile ``block``'s diagonal scores may be taken in factored form (a traced bool)."""
    if not dots.factored_diagonal:
        return None
    return jnp.max(-gates.totals[block]) <= FACTORED_DECAY_LIMIT


def _exact_diagonal_scores(q, k, g):
    """Unmasked diagonal blocks ``(sum_c q_r k_j decay, sum_c k_r k_j decay)`` for one tile
    (elementwise products and reductions, one column j at a time)."""

    def column(j, blocks):
        qk, kk = blocks
        weighted = select_row(k, j) * path_decay(g, j)            # k_j exp(...)   [.., 16, K]
        here = _iota((TILE, TILE), 1) == j
        qk = qk + jnp.where(here, jnp.sum(q * weighted, axis=-1, keepdims=True), 0.0)
        kk = kk + jnp.where(here, jnp.sum(k * weighted, axis=-1, keepdims=True), 0.0)
        return qk, kk

    zeros = jnp.zeros((*q.shape[:-1], TILE), q.dtype)
    return jax.lax.fori_loop(0, TILE, column, (zeros, zeros))


def diagonal_scores(q, k, gates: Gates, block: int, dots: Dots):
    """Unmasked diagonal score blocks of tile ``block`` (exact at and below the diagonal)."""
    g = gates.raw[block]
    factored_ok = _factored_ok(gates, block, dots)
    if factored_ok is None:
        return _exact_diagonal_scores(q, k, g)

    def factored():
        columns = k * jnp.exp(-gates.log_within[block])
        within = gates.within[block]
        return dots.mm_nt(q * within, columns), dots.mm_nt(k * within, columns)

    return jax.lax.cond(factored_ok, factored, lambda: _exact_diagonal_scores(q, k, g))


def unit_lower_inverse(lower, dots: Dots):
    """(I + L)^-1 for a strictly lower [.., 16, 16] block, by forward substitution one row at a time:
    X_r = e_r - sum_{i < r} L_ri X_i, the rows i < r already solved. Stable where the doubling
    product prod_m (I + (-L)^(2^m)) is not: with keys nearly repeated and beta near 1 its terms are
    up to C(15, 7) times its result and cancel (7e-5 relative error in o where this gives 5e-7,
    `tests/ops/test_kda.py`); as fast: 0.98-1.05x the doubling's speed, forward and forward+backward
    at `bench.kda`'s shapes (XLA, 2 CPU cores, interleaved)."""
    shape = lower.shape[-2:]
    eye = (_iota(shape, 0) == _iota(shape, 1)).astype(lower.dtype)

    def row(r, inverse):
        weights = dots.vector_t(select_row(lower, r))                                # L_r. as a column [.., 16, 1]
        solved = select_row(eye, r) - jnp.sum(weights * inverse, axis=-2, keepdims=True)
        return jnp.where(_iota(shape, 0) == r, solved, inverse)

    return jax.lax.fori_loop(1, shape[-1], row, jnp.broadcast_to(eye, lower.shape))


class Scores(NamedTuple):
    """Masked score blocks per pair (R, I <= R) and the diagonal inverses."""

    query: list    # A_qk blocks
    key: list      # A_kk blocks without beta
    lower: list    # beta_R * key: the L of (I + L)
    inverse: list  # (I + L_RR)^-1 per tile


def chunk_scores(q, k, beta, gates: Gates, segments: Segments, dots: Dots) -> Scores:
    """A_qk and A_kk block by block, anchored at each row tile's start (see module docstring)."""
    query, key = [], []
    for r_block in range(len(q)):
        q_anchored = q[r_block] * gates.within[r_block]
        k_anchored = k[r_block] * gates.within[r_block]
        row_q, row_k = [], []
        for i_block in range(r_block):
            columns = k[i_block] * gates.column_factor(i_block, r_block)
            row_q.append(dots.mm_nt(q_anchored, columns))
            row_k.append(dots.mm_nt(k_anchored, columns))
        diagonal_q, diagonal_k = diagonal_scores(q[r_block], k[r_block], gates, r_block, dots)
        row_q.append(diagonal_q)
        row_k.append(diagonal_k)
        query.append([a * m for a, m in zip(row_q, segments.query_mask[r_block])])
        key.append([a * m for a, m in zip(row_k, segments.key_mask[r_block])])
    lower = [[beta[r_block] * a for a in row] for r_block, row in enumerate(key)]
    inverse = [unit_lower_inverse(row[-1], dots) for row in lower]
    return Scores(query, key, lower, inverse)


def solve_lower(scores: Scores, rhs: list, dots: Dots) -> list:
    """X with (I + L) X = rhs, by block forward substitution over the tiles."""
    solved = []
    for r_block, acc in enumerate(rhs):
        for i_block in range(r_block):
            acc = acc - dots.mm(scores.lower[r_block][i_block], solved[i_block])
        solved.append(dots.mm(scores.inverse[r_block], acc))
    return solved


def solve_upper(scores: Scores, rhs: list, dots: Dots) -> list:
    """X with (I + L)^T X = rhs, by block backward substitution over the tiles."""
    count = len(rhs)
    solved = [None] * count
    for i_block in reversed(range(count)):
        acc = rhs[i_block]
        for r_block in range(i_block + 1, count):
            acc = acc - dots.mm_tn(scores.lower[r_block][i_block], solved[r_block])
        solved[i_block] = dots.mm_tn(scores.inverse[i_block], acc)
    return solved


# ----------------------------------------------------------------------------- chunk terms and walk


class Chunk(NamedTuple):
    """Everything about one chunk that does not depend on the carried state or on V."""

    q: list       # scaled queries        [.., 16, K]
    k: list
    beta: list    # [.., 16, 1]
    gates: Gates
    segments: Segments
    scores: Scores
    read_queries: list  # Q^ = Q exp(Gamma) [e = 0]
    read_keys: list     # K^ = K exp(Gamma) [e = 0]
    write_keys: list    # K- = K exp(Gamma_C - Gamma) [e = e_C]
    decay: jax.Array    # D = exp(Gamma_C) [e_C = 0]   [.., 1, K]
    w: list             # (I + A_kk)^-1 Diag(beta) K^


def chunk_terms(q: list, k: list, g: list, beta: list, counts: list, count_rows: list, dots: Dots) -> Chunk:
    """The state-independent terms of one chunk from its tiles: q (scaled), k, g ``[.., 16, K]``,
    beta ``[.., 16, 1]``, in-chunk segment start counts as columns ``[.., 16, 1]`` and rows
    ``[.., 1, 16]``."""
    gates = gate_factors(g)
    segments = Segments.from_counts(counts, count_rows)
    scores = chunk_scores(q, k, beta, gates, segments, dots)
    tiles = range(len(q))
    read_keys = [k[t] * gates.prefix[t] * segments.reads[t] for t in tiles]
    return Chunk(
        q=q, k=k, beta=beta, gates=gates, segments=segments, scores=scores,
        read_queries=[q[t] * gates.prefix[t] * segments.reads[t] for t in tiles],
        read_keys=read_keys,
        write_keys=[k[t] * gates.suffix[t] * segments.writes[t] for t in tiles],
        decay=gates.total * segments.keep,
        w=solve_lower(scores, [b * x for b, x in zip(beta, read_keys)], dots),
    )


def solve_values(chunk: Chunk, v: list, dots: Dots) -> list:
    """U = (I + A_kk)^-1 Diag(beta) V for value tiles ``v`` (any column block of V)."""
    return solve_lower(chunk.scores, [b * x for b, x in zip(chunk.beta, v)], dots)


def new_values(w, u, state, dots: Dots) -> list:
    """V~ = U - W S per tile."""
    return [u_t - dots.mm(w_t, state) for u_t, w_t in zip(u, w)]


def next_state(write_keys, values, decay_column, state, dots: Dots):
    """S' = D S + K-^T V~ (``decay_column``: D as ``[.., K, 1]``)."""
    state_out = decay_column * state
    for keys, tile in zip(write_keys, values):
        state_out = state_out + dots.mm_tn(keys, tile)
    return state_out


def outputs(read_queries, query_scores, values, state, dots: Dots) -> list:
    """O = Q^ S + A_qk V~ per tile."""
    out = []
    for r_block, queries in enumerate(read_queries):
        o = dots.mm(queries, state)
        for i_block, a in enumerate(query_scores[r_block]):
            o = o + dots.mm(a, values[i_block])
        out.append(o)
    return out


def advance(w, u, read_queries, query_scores, write_keys, decay_column, state, dots: Dots):
    """One chunk of the recurrence: ``(O tiles, S')`` with V~ = U - W S, O = Q^ S + A_qk V~,
    S' = D S + K-^T V~. Tiles may be 16-token tiles or one whole-chunk tile."""
    values = new_values(w, u, state, dots)
    return outputs(read_queries, query_scores, values, state, dots), next_state(write_keys, values, decay_column,
                                                                                state, dots)


# ----------------------------------------------------------------------------- backward


def new_value_gradient(query_scores, write_keys, d_out, d_next_state, dots: Dots):
    """dV~_I = sum_{R >= I} A_qk[R, I]^T dO_R + K-_I dS'."""
    grads = [dots.mm(keys, d_next_state) for keys in write_keys]
    for r_block, row in enumerate(query_scores):
        for i_block, a in enumerate(row):
            grads[i_block] = grads[i_block] + dots.mm_tn(a, d_out[r_block])
    return grads


def state_gradient(w, read_queries, d_out, d_new_values, decay_column, d_next_state, dots: Dots):
    """dS = D dS' + Q^^T dO - W^T dV~: the gradient carried to the previous chunk."""
    grad = decay_column * d_next_state
    for queries, d_o in zip(read_queries, d_out):
        grad = grad + dots.mm_tn(queries, d_o)
    for w_t, d_v in zip(w, d_new_values):
        grad = grad - dots.mm_tn(w_t, d_v)
    return grad


class ValueBlock(NamedTuple):
    """One column block of V with what the backward needs from it."""

    v: list              # value tiles                     [.., 16, BV]
    d_out: list          # dO tiles                        [.., 16, BV]
    state: jax.Array     # S entering the chunk            [.., K, BV]
    d_next_state: jax.Array  # dL/dS' of the leaving state [.., K, BV]
    new_values: list | None = None    # V~ tiles, when the caller has them (else recomputed)


class ChunkGradients(NamedTuple):
    """Gradients of one chunk, per 16-token tile."""

    q: list      # w.r.t. the scaled queries   [.., 16, K]
    k: list
    g: list
    beta: list   # [.., 16, 1]
    v: list      # per value block: tiles [.., 16, BV]
    new_values: list  # per value block: dV~ tiles (for `state_gradient`)


class ContractedGradients(NamedTuple):
    """Gradients that contract V away, summed over the value blocks."""

    read_queries: list   # dQ^ = dO S^T                        [.., 16, K]
    read_keys: list      # dK^ = -beta dX S^T
    write_keys: list     # dK- = V~ dS'^T
    beta: list           # rowsum(dX * (V - K^ S))              [.., 16, 1]
    query_scores: list   # dA_qk = dO V~^T per block pair       [.., 16, 16]
    lower: list          # dL = -dX V~^T per block pair
    decay: jax.Array     # rowsum(S * dS')                      [.., K, 1]


def value_block_gradients(chunk: Chunk, block: ValueBlock, dots: Dots):
    """One column block of V: ``(ContractedGradients part, dV tiles, dV~ tiles)``."""
    count = len(chunk.q)
    values = block.new_values
    if values is None:
        values = new_values(chunk.w, solve_values(chunk, block.v, dots), block.state, dots)
    d_new_values = new_value_gradient(chunk.scores.query, chunk.write_keys, block.d_out, block.d_next_state, dots)
    d_x = solve_upper(chunk.scores, d_new_values, dots)
    d_x_state = [dots.mm_nt(d, block.state) for d in d_x]   # dX S^T
    part = ContractedGradients(
        read_queries=[dots.mm_nt(d_o, block.state) for d_o in block.d_out],
        read_keys=[-b * d for b, d in zip(chunk.beta, d_x_state)],
        write_keys=[dots.mm_nt(v, block.d_next_state) for v in values],
        # rowsum(dX * (V - K^ S)) = rowsum(dX * V) - rowsum(K^ * dX S^T): no product with S
        beta=[jnp.sum(d * v, axis=-1, keepdims=True) - jnp.sum(keys * ds, axis=-1, keepdims=True)
              for d, v, keys, ds in zip(d_x, block.v, chunk.read_keys, d_x_state)],
        query_scores=[[dots.mm_nt(block.d_out[r], values[i]) for i in range(r + 1)] for r in range(count)],
        lower=[[-dots.mm_nt(d_x[r], values[i]) for i in range(r + 1)] for r in range(count)],
        decay=jnp.sum(block.state * block.d_next_state, axis=-1, keepdims=True),
    )
    return part, [b * d for b, d in zip(chunk.beta, d_x)], d_new_values


def _exact_diagonal_score_gradients(q, k, g, grad_query, grad_key):
    """Gradients of one diagonal block pair w.r.t. its row vectors (q and k) and column keys."""

    def column(j, acc):
        d_q, d_k_rows, d_k_columns = acc
        decay = path_decay(g, j)
        weighted = select_row(k, j) * decay
        g_q, g_k = select_column(grad_query, j), select_column(grad_key, j)
        d_q = d_q + g_q * weighted
        d_k_rows = d_k_rows + g_k * weighted
        into_column = jnp.sum((g_q * q + g_k * k) * decay, axis=-2, keepdims=True)
        d_k_columns = d_k_columns + jnp.where(_iota((TILE, 1), 0) == j, into_column, 0.0)
        return d_q, d_k_rows, d_k_columns

    zeros = jnp.zeros_like(q)
    return jax.lax.fori_loop(0, TILE, column, (zeros, zeros, zeros))


def diagonal_score_gradients(chunk: Chunk, block: int, grad_query, grad_key, dots: Dots):
    """`diagonal_scores`' gradients w.r.t. the tile's q rows, k rows and k columns."""
    q, k, gates = chunk.q[block], chunk.k[block], chunk.gates
    factored_ok = _factored_ok(gates, block, dots)
    exact = lambda: _exact_diagonal_score_gradients(q, k, gates.raw[block], grad_query, grad_key)  # noqa: E731
    if factored_ok is None:
        return exact()

    def factored():
        within, column_scale = gates.within[block], jnp.exp(-gates.log_within[block])
        columns = k * column_scale
        d_k_columns = column_scale * (dots.mm_tn(grad_query, q * within) + dots.mm_tn(grad_key, k * within))
        return within * dots.mm(grad_query, columns), within * dots.mm(grad_key, columns), d_k_columns

    return jax.lax.cond(factored_ok, factored, exact)


def score_gradients(chunk: Chunk, grad_query, grad_key, dots: Dots):
    """Back through A[r, i] = sum_c x_r y_i exp(Gamma_r - Gamma_i) (x = q or k rows, y = k).

    ``grad_query``/``grad_key``: dL/dA per block, already masked (grad_key includes beta).
    Returns ``(dq, dk as row vectors, dk as column keys)`` tiles.
    """
    gates = chunk.gates
    count = len(chunk.q)
    d_q, d_k_rows, d_k_columns = [], [], [jnp.zeros_like(x) for x in chunk.k]
    for r_block in range(count):
        within = gates.within[r_block]
        q_anchored, k_anchored = chunk.q[r_block] * within, chunk.k[r_block] * within
        acc_q, acc_k = jnp.zeros_like(within), jnp.zeros_like(within)
        for i_block in range(r_block):
            factor = gates.column_factor(i_block, r_block)
            columns = chunk.k[i_block] * factor
            g_q, g_k = grad_query[r_block][i_block], grad_key[r_block][i_block]
            acc_q = acc_q + dots.mm(g_q, columns)
            acc_k = acc_k + dots.mm(g_k, columns)
            d_k_columns[i_block] = d_k_columns[i_block] + factor * (
                dots.mm_tn(g_q, q_anchored) + dots.mm_tn(g_k, k_anchored))
        diag_q, diag_k_rows, diag_k_columns = diagonal_score_gradients(
            chunk, r_block, grad_query[r_block][r_block], grad_key[r_block][r_block], dots)
        d_q.append(within * acc_q + diag_q)
        d_k_rows.append(within * acc_k + diag_k_rows)
        d_k_columns[r_block] = d_k_columns[r_block] + diag_k_columns
    return d_q, d_k_rows, d_k_columns


def _suffix_sums(tiles: list, extra_row):
    """Per token: sum of ``tiles`` rows from that token to the chunk end, plus ``extra_row``."""
    shape = (TILE, TILE)
    from_here = (_iota(shape, 1) >= _iota(shape, 0)).astype(tiles[0].dtype)
    out, later = [], extra_row
    for tile in reversed(tiles):
        out.append(Dots.sums(from_here, tile) + later)
        later = later + jnp.sum(tile, axis=-2, keepdims=True)
    return out[::-1]


def chunk_gradients(chunk: Chunk, blocks: list, dots: Dots) -> ChunkGradients:
    """Gradients of one chunk's outputs (O and S') w.r.t. its inputs, given the state S entering
    it and the gradient dS' of the state leaving it; V is handled in column ``blocks``.

    With X = Diag(beta)(V - K^ S), V~ = (I + L)^-1 X and L = Diag(beta) A'_kk (A'_kk: A_kk
    without beta):
        dV~ = A_qk^T dO + K- dS',   dX = (I + L)^-T dV~,   dV = beta dX,   dL = -dX V~^T,
        dQ^ = dO S^T,   dK- = V~ dS'^T,   dK^ = -beta dX S^T,   dA_qk = dO V~^T,
        dA'_kk = Diag(beta) dL,   dbeta = rowsum(dX (V - K^ S)) + rowsum(dL A'_kk),
        dD = rowsum(S dS');
    the log-gate gradient collects x dx - y dy from every exp(Gamma_r - Gamma_i) factor (and the
    like from Q^, K^, K-, D) and is summed from each token to the chunk end.
    """
    return gradients_from_parts(chunk, [value_block_gradients(chunk, block, dots) for block in blocks], dots)


def gradients_from_parts(chunk: Chunk, value_parts: list, dots: Dots) -> ChunkGradients:
    """`chunk_gradients` from the `value_block_gradients` of each column block of V."""
    parts, d_v, d_new_values = zip(*value_parts)
    summed = jax.tree.map(lambda *xs: sum(xs[1:], xs[0]), *parts)
    segments, gates = chunk.segments, chunk.gates
    mask = lambda grads, masks: [[d * m for d, m in zip(*row)] for row in zip(grads, masks)]  # noqa: E731
    grad_query = mask(summed.query_scores, segments.query_mask)
    grad_lower = mask(summed.lower, segments.key_mask)
    d_beta = [b + sum(jnp.sum(d * a, axis=-1, keepdims=True) for d, a in zip(row_d, row_a))
              for b, row_d, row_a in zip(summed.beta, grad_lower, chunk.scores.key)]
    grad_key = [[b * d for d in row] for b, row in zip(chunk.beta, grad_lower)]
    d_q_scores, d_k_rows, d_k_columns = score_gradients(chunk, grad_query, grad_key, dots)

    d_gamma, d_q, d_k = [], [], []
    d_gamma_total = dots.vector_t(summed.decay) * chunk.decay
    for r, (q, k) in enumerate(zip(chunk.q, chunk.k)):
        d_read_q, d_read_k, d_write_k = summed.read_queries[r], summed.read_keys[r], summed.write_keys[r]
        d_gamma.append(q * d_q_scores[r] + k * (d_k_rows[r] - d_k_columns[r])
                       + chunk.read_queries[r] * d_read_q + chunk.read_keys[r] * d_read_k
                       - chunk.write_keys[r] * d_write_k)
        d_gamma_total = d_gamma_total + jnp.sum(chunk.write_keys[r] * d_write_k, axis=-2, keepdims=True)
        read = gates.prefix[r] * segments.reads[r]
        d_q.append(d_q_scores[r] + d_read_q * read)
        d_k.append(d_k_rows[r] + d_k_columns[r] + d_read_k * read
                   + d_write_k * gates.suffix[r] * segments.writes[r])
    return ChunkGradients(q=d_q, k=d_k, g=_suffix_sums(d_gamma, d_gamma_total), beta=d_beta,
                          v=list(d_v), new_values=list(d_new_values))
