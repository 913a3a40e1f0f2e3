"""Causal softmax attention over packed documents (SPEC §2), without the score matrix.

    s[b,h,t,j] = scale * q[b,t,h] . k[b,j,g(h)]                   g(h) = h // (H / G)
    visible(t, j) = pos_k[b,j] <= pos_q[b,t]  and  seg_k[b,j] == seg_q[b,t]
    o[b,t,h]   = sum_j softmax_j(where(visible, s, -inf)) v[b,j,g(h)]        (fp32 softmax)

G key/value heads serve H query heads (G = H: the expanded MLA form; G = 1: one shared latent,
the absorbed form over the cache). A query row with no visible key (padding) yields zeros.

Implementations (one entry point, ``attention(..., implementation=)``):
  ``dense``  the [B, H, T, S] score matrix; the readable reference.
  ``xla``    blockwise online softmax (FlashAttention's recurrence) in plain XLA: for each query
             block, over key blocks j,
                 m' = max(m, max_j s_j);  l' = e^(m - m') l + sum_j e^(s_j - m');
                 acc' = e^(m - m') acc + e^(s_j - m') v_j;     o = acc / l,  lse = m + log l,
             skipping key blocks every query of the block is causally before. Memory
             O(T * block); the backward (custom VJP) recomputes p = e^(s - lse) block by block:
                 D = rowsum(dO * O);  dV = p^T dO;  dS = p * (dO V^T - D);
                 dQ = scale dS K;  dK = scale dS^T Q.
  ``cudnn``  ``jax.nn.dot_product_attention(implementation="cudnn")`` (GPU): causal self-attention
             without segment ids (its public API has none); V is zero-padded to the q/k width.
  ``splash`` the Pallas TPU splash-attention kernel: causal self-attention with segment ids.
`paged_attention` runs the xla recurrence over a paged cache, fetching each key block from its pages.
``None`` picks by platform: cudnn on GPU (when there are no segments), splash on TPU, else xla;
attention over a cache (explicit positions) always runs xla. Only dense and xla run on CPU (and
splash interpreted, under `k3jax.ops.kda.pallas.forced_kernels("tpu")`, for tests). Splash is a
Pallas call XLA cannot split over a mesh (`KERNEL_IMPLEMENTATIONS`): under one, MLA runs it on each
device's heads (`k3jax.sharding.heads.HeadParallel.attention`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k3jax.ops.residuals import forward_rule

IMPLEMENTATIONS = ("dense", "xla", "cudnn", "splash")
KERNEL_IMPLEMENTATIONS = ("splash",)        # custom calls XLA cannot partition: run per device under a mesh
_NEVER_SEEN = jnp.iinfo(jnp.int32).max      # position of a padded key: after every query


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: float,
    query_positions: jax.Array | None = None,
    key_positions: jax.Array | None = None,
    query_segments: jax.Array | None = None,
    key_segments: jax.Array | None = None,
    implementation: str | None = None,
    block_size: int = 512,
) -> jax.Array:
    """q ``[B, T, H, D]``, k ``[B, S, G, D]``, v ``[B, S, G, Dv]`` -> ``[B, T, H, Dv]`` in v.dtype.

    Args:
      scale: multiplies q . k.
      query_positions, key_positions: ``[B, T]`` / ``[B, S]`` int; None for both: causal
        self-attention (T = S, positions 0..T-1).
      query_segments, key_segments: ``[B, T]`` / ``[B, S]`` int document ids, or None (one document).
      implementation: one of ``IMPLEMENTATIONS`` or None for the platform default.
      block_size: query and key block length of the xla implementation.
    """
    _check_shapes(q, k, v, query_positions, key_positions, query_segments, key_segments, block_size)
    self_attention = query_positions is None
    implementation = resolved_implementation(implementation, self_attention, query_segments is not None)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
    if implementation in ("cudnn", "splash") and not self_attention:
        raise ValueError(f"implementation {implementation!r} supports causal self-attention only (positions None)")
    if implementation == "cudnn" and query_segments is not None:
        raise ValueError("implementation 'cudnn' does not support segment ids; use 'xla'")
    if implementation == "cudnn":
        return _cudnn_attention(q, k, v, scale)
    if implementation == "splash":
        return _splash_attention(q, k, v, scale, query_segments)
    batch, length, source = q.shape[0], q.shape[1], k.shape[1]
    if self_attention:
        query_positions = key_positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    if query_segments is None:
        query_segments, key_segments = jnp.zeros((batch, length), jnp.int32), jnp.zeros((batch, source), jnp.int32)
    if implementation == "dense":
        mask = causal_mask(query_positions, key_positions, query_segments, key_segments)
        return dense_attention(q, k, v, mask, scale=scale)
    return blockwise_attention(q, k, v, query_positions.astype(jnp.int32), key_positions.astype(jnp.int32),
                               query_segments.astype(jnp.int32), key_segments.astype(jnp.int32),
                               scale=scale, block_size=block_size)


def resolved_implementation(implementation: str | None, self_attention: bool, has_segments: bool) -> str:
    """``implementation``, or for None the platform's default (`default_implementation`)."""
    return implementation or default_implementation(self_attention, has_segments)


def default_implementation(self_attention: bool, has_segments: bool) -> str:
    """cudnn on GPU for unsegmented self-attention, splash on TPU for self-attention, else xla."""
    backend = jax.default_backend()
    if self_attention and backend == "gpu" and not has_segments:
        return "cudnn"
    if self_attention and backend == "tpu":
        return "splash"
    return "xla"


def _check_shapes(q, k, v, query_positions, key_positions, query_segments, key_segments, block_size):
    """One-line ValueErrors for inconsistent shapes or arguments."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [B, T, H, D], got {q.shape}, {k.shape}, {v.shape}")
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape} do not agree on batch, length, heads or dims")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads {q.shape[2]} are not a multiple of key heads {k.shape[2]}")
    if (query_positions is None) != (key_positions is None) or (query_segments is None) != (key_segments is None):
        raise ValueError("give both query and key positions (segments) or neither")
    if query_positions is None and q.shape[1] != k.shape[1]:
        raise ValueError(f"self-attention needs T = S, got {q.shape[1]} and {k.shape[1]}; pass positions")
    for name, array, length in (("query_positions", query_positions, q.shape[1]),
                                ("key_positions", key_positions, k.shape[1]),
                                ("query_segments", query_segments, q.shape[1]),
                                ("key_segments", key_segments, k.shape[1])):
        if array is not None and array.shape != (q.shape[0], length):
            raise ValueError(f"{name} must be {(q.shape[0], length)}, got {array.shape}")
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, scale: float) -> jax.Array:
    """The reference: q ``[B, T, H, D]``, k ``[B, S, G, D]``, v ``[B, S, G, Dv]``, mask ``[B, T, S]``
    bool -> ``[B, T, H, Dv]``; the full fp32 score matrix, rows without a visible key give zeros."""
    batch, length, heads, dim = q.shape
    groups = k.shape[2]
    q = q.reshape(batch, length, groups, heads // groups, dim)
    scores = jnp.einsum("btgmd,bsgd->bgmts", q, k, preferred_element_type=jnp.float32) * scale
    mask = mask[:, None, None]
    weights = jnp.where(mask, jax.nn.softmax(jnp.where(mask, scores, jnp.finfo(jnp.float32).min), axis=-1), 0.0)
    o = jnp.einsum("bgmts,bsgd->btgmd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(batch, length, heads, -1).astype(v.dtype)


def causal_mask(query_positions: jax.Array, key_positions: jax.Array,
                query_segments: jax.Array | None = None, key_segments: jax.Array | None = None) -> jax.Array:
    """``[B, T, S]``: key j visible to query i iff pos_j <= pos_i and both are in the same segment.

    Positions ``[B, T]`` / ``[B, S]`` (or broadcastable over B), segments ``[B, T]`` / ``[B, S]``.
    Cache slots past the newest token have larger positions than every query, so they are never seen.
    """
    mask = key_positions[:, None, :] <= query_positions[:, :, None]
    if query_segments is not None:
        mask = mask & (key_segments[:, None, :] == query_segments[:, :, None])
    return mask


# ----------------------------------------------------------------------------------------------
# xla: blockwise online softmax with a recomputing backward


def _to_blocks(x: jax.Array, block: int, fill) -> jax.Array:
    """``[B, L, ...]`` -> ``[L' / block, B, block, ...]``, padded with ``fill`` to L' = ceil(L / block) block."""
    length = x.shape[1]
    padded = -(-length // block) * block
    x = jnp.pad(x, [(0, 0), (0, padded - length)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    return jnp.moveaxis(x.reshape(x.shape[0], padded // block, block, *x.shape[2:]), 1, 0)


def _from_blocks(x: jax.Array, length: int) -> jax.Array:
    """Inverse of ``_to_blocks``: ``[n, B, block, ...]`` -> ``[B, length, ...]``."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :length]


def _block_scores(q_block, k_block, scale, q_pos, k_pos, q_seg, k_seg):
    """Scores ``[B, G, M, bq, bk]`` (fp32) of q ``[B, bq, G, M, D]`` against k ``[B, bk, G, D]``,
    and the visibility mask broadcast to them."""
    scores = jnp.einsum("bqgmd,bkgd->bgmqk", q_block, k_block, preferred_element_type=jnp.float32) * scale
    visible = (k_pos[:, None, :] <= q_pos[:, :, None]) & (k_seg[:, None, :] == q_seg[:, :, None])
    return scores, visible[:, None, None]


def _any_visible(q_pos, k_pos) -> jax.Array:
    """False when every key of the block comes causally after every query of the block."""
    return jnp.min(k_pos) <= jnp.max(q_pos)


def _forward_blocks(q, k, v, q_pos, k_pos, q_seg, k_seg, scale, block_size):
    """Output ``[B, T, H, Dv]``, log-sum-exp in blocks ``[nq, B, G, M, bq]`` (fp32, 0 where no key is
    visible) and where some key is visible (bool, in the same blocks)."""
    bk = min(block_size, k.shape[1])
    key_blocks = (_to_blocks(k, bk, 0), _to_blocks(v, bk, 0), _to_blocks(k_pos, bk, _NEVER_SEEN),
                  _to_blocks(k_seg, bk, 0))
    return _online_softmax(q, q_pos, q_seg, key_blocks, lambda block: block[2:], lambda block: block[:2],
                           k.shape[2], v.shape[-1], v.dtype, scale, block_size)


def _online_softmax(q, q_pos, q_seg, key_blocks, positions_of, keys_of, groups, value_dim, value_dtype, scale,
                    block_size):
    """The forward recurrence (module docstring) of q ``[B, T, H, D]`` over the key blocks
    ``key_blocks`` (a pytree scanned over its leading axis): ``positions_of(block)`` gives a
    block's key positions and segments ``[B, bk]``, ``keys_of(block)`` its keys ``[B, bk, G, D]``
    and values ``[B, bk, G, Dv]``, only for a block some query can see. Returns as `_forward_blocks`."""
    batch, length, heads, dim = q.shape
    bq = min(block_size, length)
    q_blocks = _to_blocks(q.reshape(batch, length, groups, heads // groups, dim), bq, 0)
    query_blocks = (q_blocks, _to_blocks(q_pos, bq, -1), _to_blocks(q_seg, bq, 0))

    def one_query_block(query):
        q_block, qp, qs = query
        stats_shape = (batch, groups, heads // groups, bq)

        def add_key_block(carry, block):
            kp, ks = positions_of(block)

            def update(carry):
                m, l, acc = carry
                k_block, v_block = keys_of(block)
                scores, visible = _block_scores(q_block, k_block, scale, qp, kp, qs, ks)
                m_new = jnp.maximum(m, jnp.max(jnp.where(visible, scores, -jnp.inf), axis=-1))
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                p = jnp.where(visible, jnp.exp(scores - m_safe[..., None]), 0.0)
                decay = jnp.exp(m - m_safe)
                pv = jnp.einsum("bgmqk,bkgd->bgmqd", p.astype(value_dtype), v_block, preferred_element_type=jnp.float32)
                return m_new, decay * l + jnp.sum(p, axis=-1), decay[..., None] * acc + pv

            return jax.lax.cond(_any_visible(qp, kp), update, lambda c: c, carry), None

        init = (jnp.full(stats_shape, -jnp.inf), jnp.zeros(stats_shape), jnp.zeros((*stats_shape, value_dim)))
        (m, l, acc), _ = jax.lax.scan(add_key_block, init, key_blocks)
        seen = l > 0
        o = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)
        return jnp.einsum("bgmqd->bqgmd", o).astype(value_dtype), lse, seen

    o_blocks, lse, seen = jax.lax.map(one_query_block, query_blocks)
    return _from_blocks(o_blocks, length).reshape(batch, length, heads, value_dim), lse, seen


def paged_attention(q: jax.Array, pool: jax.Array, layer, tables: jax.Array, query_positions: jax.Array, *,
                    value_width: int, scale: float, block_size: int = 512) -> jax.Array:
    """The absorbed MLA attention (one shared key head) of q ``[B, T, H, L]`` over the rows a paged
    pool holds, read page by page where they lie: no sequence's cache is gathered whole.

    ``pool [N, pages, page * L]`` (`k3jax.memory`: a page is one row of ``page`` tokens' L values),
    ``layer`` its index, ``tables [B, P]`` each sequence's pages in order (ids outside the pool read
    as zeros): token j of sequence b is row j % page of page tables[b, j // page], with key
    k_j = its L values and value v_j = its first ``value_width``. Query t (position
    ``query_positions[b, t]``) sees keys j <= its position:

        o[b,t,h] = sum_{j <= pos_t} softmax_j(scale q[b,t,h] . k_j) v_j

    by `_online_softmax` over key blocks of ``block_size // page`` pages (at least one, at most P),
    gathered one block at a time; blocks after every query are skipped. Returns ``[B, T, H, value_width]`` in
    q.dtype. Forward only (serving)."""
    batch, width = q.shape[0], q.shape[-1]
    num_pages, page = pool.shape[1], pool.shape[2] // width
    per_block = max(1, min(block_size // page, tables.shape[1]))
    blocks = -(-tables.shape[1] // per_block)
    tables = jnp.pad(tables, [(0, 0), (0, blocks * per_block - tables.shape[1])], constant_values=num_pages)
    key_blocks = (jnp.moveaxis(tables.reshape(batch, blocks, per_block), 1, 0), jnp.arange(blocks))  # [nk, B, pages]
    bk = per_block * page

    def positions_of(block):
        positions = jnp.broadcast_to(block[1] * bk + jnp.arange(bk, dtype=jnp.int32), (batch, bk))
        return positions, jnp.zeros((batch, bk), jnp.int32)

    def keys_of(block):
        rows = pool.at[layer, block[0]].get(mode="fill", fill_value=0).reshape(batch, bk, 1, width).astype(q.dtype)
        return rows, rows[..., :value_width]

    segments = jnp.zeros(query_positions.shape, jnp.int32)
    o, _, _ = _online_softmax(q, query_positions.astype(jnp.int32), segments, key_blocks, positions_of, keys_of, 1,
                              value_width, q.dtype, scale, block_size)
    return o


def _backward_blocks(q, k, v, q_pos, k_pos, q_seg, k_seg, o, lse, d_o, scale, block_size, d_lse=None):
    """dq, dk, dv (fp32) by recomputing each block's probabilities p = exp(s - lse); ``d_lse``
    ``[B, T, H]``: the cotangent of lse too, when it is an output."""
    batch, length, heads, dim = q.shape
    groups, source = k.shape[2], k.shape[1]
    per_group = heads // groups
    bq, bk = min(block_size, length), min(block_size, source)
    grouped = lambda x: x.reshape(batch, length, groups, per_group, x.shape[-1])
    delta = jnp.einsum("bqgmd,bqgmd->bgmq", grouped(d_o).astype(jnp.float32), grouped(o).astype(jnp.float32))
    if d_lse is not None:
        delta = delta - jnp.einsum("bqgm->bgmq", d_lse.reshape(batch, length, groups, per_group).astype(jnp.float32))
    delta_blocks = jnp.moveaxis(_to_blocks(jnp.moveaxis(delta, 3, 1), bq, 0), 2, -1)   # [nq, B, G, M, bq]
    queries = (_to_blocks(grouped(q), bq, 0), _to_blocks(grouped(d_o), bq, 0), lse, delta_blocks,
               _to_blocks(q_pos, bq, -1), _to_blocks(q_seg, bq, 0))
    keys = (_to_blocks(k, bk, 0), _to_blocks(v, bk, 0), _to_blocks(k_pos, bk, _NEVER_SEEN), _to_blocks(k_seg, bk, 0))

    def one_key_block(dq, key):
        k_block, v_block, kp, ks = key

        def add_query_block(carry, query):
            q_block, do_block, lse_block, delta_block, qp, qs = query

            def gradients(carry):
                dk, dv = carry
                scores, visible = _block_scores(q_block, k_block, scale, qp, kp, qs, ks)
                p = jnp.where(visible, jnp.exp(scores - lse_block[..., None]), 0.0)
                dv = dv + jnp.einsum("bgmqk,bqgmd->bkgd", p.astype(do_block.dtype), do_block,
                                     preferred_element_type=jnp.float32)
                dp = jnp.einsum("bqgmd,bkgd->bgmqk", do_block, v_block, preferred_element_type=jnp.float32)
                ds = (p * (dp - delta_block[..., None]) * scale).astype(q_block.dtype)
                dk = dk + jnp.einsum("bgmqk,bqgmd->bkgd", ds, q_block, preferred_element_type=jnp.float32)
                dq_block = jnp.einsum("bgmqk,bkgd->bqgmd", ds, k_block, preferred_element_type=jnp.float32)
                return (dk, dv), dq_block

            def skip(carry):
                return carry, jnp.zeros(q_block.shape, jnp.float32)

            return jax.lax.cond(_any_visible(qp, kp), gradients, skip, carry)

        init = (jnp.zeros(k_block.shape, jnp.float32), jnp.zeros(v_block.shape, jnp.float32))
        (dk, dv), dq_blocks = jax.lax.scan(add_query_block, init, queries)
        return dq + dq_blocks, (dk, dv)

    dq0 = jnp.zeros(queries[0].shape, jnp.float32)
    dq, (dk, dv) = jax.lax.scan(one_key_block, dq0, keys)
    return (_from_blocks(dq, length).reshape(q.shape), _from_blocks(dk, source), _from_blocks(dv, source))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def blockwise_attention(q, k, v, query_positions, key_positions, query_segments, key_segments, scale, block_size):
    """The ``xla`` implementation: arguments as ``attention`` with explicit int32 positions and
    segments; memory O(T * block_size), a backward that recomputes blocks."""
    o, _, _ = _forward_blocks(q, k, v, query_positions, key_positions, query_segments, key_segments, scale,
                              block_size)
    return o


# Forward rules keep only their residuals inside scans (`k3jax.ops.residuals`).
_saved_forward_blocks = forward_rule(_forward_blocks, static_argnums=(7, 8))


def _blockwise_forward(q, k, v, q_pos, k_pos, q_seg, k_seg, scale, block_size):
    o, lse, _ = _saved_forward_blocks(q, k, v, q_pos, k_pos, q_seg, k_seg, scale, block_size)
    return o, (q, k, v, q_pos, k_pos, q_seg, k_seg, o, lse)


def _blockwise_backward(scale, block_size, residuals, d_o):
    q, k, v, q_pos, k_pos, q_seg, k_seg, o, lse = residuals
    dq, dk, dv = _backward_blocks(q, k, v, q_pos, k_pos, q_seg, k_seg, o, lse, d_o, scale, block_size)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


blockwise_attention.defvjp(_blockwise_forward, _blockwise_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def blockwise_attention_with_lse(q, k, v, query_positions, key_positions, query_segments, key_segments, scale,
                                 block_size):
    """The ``xla`` implementation with its softmax statistics, for merging attention over key parts:
    ``(o [B, T, H, Dv], lse [B, T, H] fp32)``, lse = log sum_j e^(s_j) over the visible keys (-inf
    where none is, o = 0 there). Arguments as `blockwise_attention`. The backward recomputes blocks
    as `blockwise_attention`'s does; lse's cotangent enters as ds_j += p_j dlse, i.e. D -> D - dlse."""
    return _lse_forward(q, k, v, query_positions, key_positions, query_segments, key_segments, scale,
                        block_size)[0]


def _lse_forward(q, k, v, q_pos, k_pos, q_seg, k_seg, scale, block_size):
    batch, length, heads, _ = q.shape
    o, lse, seen = _saved_forward_blocks(q, k, v, q_pos, k_pos, q_seg, k_seg, scale, block_size)
    per_token = jnp.moveaxis(jnp.where(seen, lse, -jnp.inf), -1, 2).swapaxes(0, 1)     # [B, nq, bq, G, M]
    return (o, per_token.reshape(batch, -1, heads)[:, :length]), (q, k, v, q_pos, k_pos, q_seg, k_seg, o, lse)


def _lse_backward(scale, block_size, residuals, cotangents):
    d_o, d_lse = cotangents
    q, k, v, q_pos, k_pos, q_seg, k_seg, o, lse = residuals
    dq, dk, dv = _backward_blocks(q, k, v, q_pos, k_pos, q_seg, k_seg, o, lse, d_o, scale, block_size, d_lse)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


blockwise_attention_with_lse.defvjp(_lse_forward, _lse_backward)


# ----------------------------------------------------------------------------------------------
# accelerator kernels (not runnable on CPU)


def _cudnn_attention(q, k, v, scale):
    """cuDNN fused causal attention; V is zero-padded to the q/k head width (cuDNN's API needs one
    head dim) and the padding sliced off the output."""
    value_dim = v.shape[-1]
    v_padded = jnp.pad(v, [(0, 0)] * 3 + [(0, q.shape[-1] - value_dim)]) if value_dim < q.shape[-1] else v
    o = jax.nn.dot_product_attention(q, k, v_padded, scale=scale, is_causal=True, implementation="cudnn")
    return o[..., :value_dim]


def _splash_attention(q, k, v, scale, segments):
    """Pallas TPU splash attention (causal, segment ids), one kernel per sequence of the batch;
    interpreted under `forced_kernels("tpu")` (tests on CPU)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    from k3jax.ops.kda.pallas import forced_family

    batch, length, heads, dim = q.shape
    groups = k.shape[2]
    causal = splash.CausalMask((length, length))
    forced, interpret = forced_family()
    interpret = forced == "tpu" and interpret
    if groups == heads:
        kernel = splash.make_splash_mha_single_device(splash.MultiHeadMask([causal] * heads), interpret=interpret)
    elif groups == 1:
        kernel = splash.make_splash_mqa_single_device(splash.MultiHeadMask([causal] * heads), interpret=interpret)
    else:
        raise ValueError(f"implementation 'splash' needs G = H or G = 1 key heads, got {groups} for {heads}")
    segments = jnp.zeros((batch, length), jnp.int32) if segments is None else segments.astype(jnp.int32)
    heads_first = lambda x: jnp.moveaxis(x, 2, 1)
    q, k, v = heads_first(q * scale), heads_first(k), heads_first(v)
    if groups != heads:                                   # MQA: the one key head, unstacked
        k, v = k[:, 0], v[:, 0]
    o = jax.vmap(lambda qb, kb, vb, sb: kernel(qb, kb, vb, segment_ids=splash.SegmentIds(sb, sb)))(q, k, v, segments)
    return jnp.moveaxis(o, 1, 2).astype(v.dtype)
