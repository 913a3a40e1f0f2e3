"""Blockwise attention (k3jax.ops.attention, SPEC §2) against float64 NumPy dense attention:
values and gradients with packed documents, grouped heads, cache positions and ragged blocks; the
paged form over a pool's pages."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.attention import attention, paged_attention
from tests.helpers import rel_err


def numpy_attention(q, k, v, scale, q_pos, k_pos, q_seg, k_seg, d_o):
    """float64 SPEC §2 attention and its gradients (softmax backward dS = P (dP - rowsum(dP P)))."""
    q, k, v, d_o = (np.asarray(x, np.float64) for x in (q, k, v, d_o))
    batch, length, heads, _ = q.shape
    group_of_head = np.arange(heads) // (heads // k.shape[2])
    kh, vh = k[:, :, group_of_head], v[:, :, group_of_head]                  # [B, S, H, *]
    visible = (k_pos[:, None, :] <= q_pos[:, :, None]) & (k_seg[:, None, :] == q_seg[:, :, None])
    visible = visible[:, None]                                               # [B, 1, T, S]
    s = np.einsum("bthd,bshd->bhts", q, kh) * scale
    s = np.where(visible, s, -np.inf)
    row_max = np.max(s, axis=-1, keepdims=True)
    p = np.where(visible, np.exp(s - np.where(np.isfinite(row_max), row_max, 0.0)), 0.0)
    total = p.sum(-1, keepdims=True)
    p = np.where(total > 0, p / np.where(total > 0, total, 1.0), 0.0)
    o = np.einsum("bhts,bshd->bthd", p, vh)
    dp = np.einsum("bthd,bshd->bhts", d_o, vh)
    ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True)) * scale
    dq = np.einsum("bhts,bshd->bthd", ds, kh)
    dk_heads = np.einsum("bhts,bthd->bshd", ds, q)
    dv_heads = np.einsum("bhts,bthd->bshd", p, d_o)
    fold = lambda x: np.stack([x[:, :, group_of_head == g].sum(2) for g in range(k.shape[2])], axis=2)
    return o, dq, fold(dk_heads), fold(dv_heads)


def inputs(batch, length, source, heads, groups, dim, value_dim, seed):
    rng = np.random.default_rng(seed)
    shapes = [(batch, length, heads, dim), (batch, source, groups, dim), (batch, source, groups, value_dim),
              (batch, length, heads, value_dim)]
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


@pytest.mark.parametrize("heads,groups,block", [(4, 4, 4), (4, 1, 5), (2, 2, 64)])
def test_self_attention_with_segments_matches_numpy(heads, groups, block):
    """T = 19 with blocks of 4 / 5 (ragged last block) / 64 (one block); documents end inside a
    block and at a block boundary (t = 8)."""
    q, k, v, d_o = inputs(2, 19, 19, heads, groups, 6, 5, seed=heads + groups + block)
    segments = np.array([[0] * 8 + [1] * 5 + [2] * 6, [3] * 19], np.int32)
    positions = np.broadcast_to(np.arange(19), (2, 19))
    scale = 6**-0.5

    def loss(q, k, v):
        o = attention(q, k, v, scale=scale, query_segments=jnp.asarray(segments), key_segments=jnp.asarray(segments),
                      implementation="xla", block_size=block)
        return jnp.sum(o * d_o), o

    (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    expected = numpy_attention(q, k, v, scale, positions, positions, segments, segments, d_o)
    for got, want in zip((o, *grads), expected):
        assert rel_err(got, want) <= 1e-5


def test_cache_positions_and_invisible_rows_match_numpy():
    """Queries at positions 6..8 over 13 cache slots (absorbed form: G = 1, Dv < D); slots past the
    newest token are never seen; the second sequence's first query sees no key (zeros)."""
    q, k, v, d_o = inputs(2, 3, 13, 3, 1, 7, 4, seed=7)
    q_pos = np.array([[6, 7, 8], [6, 7, 8]], np.int32)
    k_pos = np.broadcast_to(np.arange(13, dtype=np.int32), (2, 13))
    q_seg = np.array([[1, 1, 2], [5, 1, 1]], np.int32)
    k_seg = np.array([[1] * 8 + [2] * 5, [1] * 13], np.int32)
    args = {name: jnp.asarray(x) for name, x in
            dict(query_positions=q_pos, key_positions=k_pos, query_segments=q_seg, key_segments=k_seg).items()}

    def loss(q, k, v, implementation):
        o = attention(q, k, v, scale=0.4, implementation=implementation, block_size=4, **args)
        return jnp.sum(o * d_o), o

    expected = numpy_attention(q, k, v, 0.4, q_pos, k_pos, q_seg, k_seg, d_o)
    np.testing.assert_array_equal(expected[0][1, 0], 0.0)
    value_and_grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnums=3)
    for implementation in ("xla", "dense"):
        (_, o), grads = value_and_grads(q, k, v, implementation)
        for got, want in zip((o, *grads), expected):
            assert rel_err(got, want) <= 1e-5, implementation


@pytest.mark.parametrize("block", [8, 12, 64])
def test_paged_attention_reads_each_sequences_pages_where_they_lie(block):
    """Two sequences over a shared pool of 4-token pages in scrambled order (layer 1 of 2): keys
    and values are the rows their tables name (values: the first 3 of 5 values), queries at
    positions [5, 6] and [10, 11] see the keys up to their own; blocks of 2 / 3 (ragged: P = 4
    pages) / all pages; a table entry outside the pool reads zeros, after every query."""
    rng = np.random.default_rng(block)
    page, width, value_width, heads = 4, 5, 3, 2
    pool = rng.standard_normal((2, 9, page * width)).astype(np.float32)
    tables = np.array([[7, 2, 9, 9], [4, 0, 8, 9]], np.int32)                     # 9: outside the pool
    positions = np.array([[5, 6], [10, 11]], np.int32)
    q = rng.standard_normal((2, 2, heads, width)).astype(np.float32)
    got = jax.jit(functools.partial(paged_attention, value_width=value_width, scale=0.6, block_size=block))(
        q, pool, 1, tables, positions)
    rows = np.concatenate([np.zeros((1, page * width), np.float32), pool[1]])[np.where(tables < 9, tables + 1, 0)]
    keys = rows.reshape(2, -1, 1, width)                                           # [B, P * page, 1, L]
    key_positions = np.broadcast_to(np.arange(keys.shape[1]), (2, keys.shape[1]))
    zeros = np.zeros((2, keys.shape[1]), np.int32)
    want = numpy_attention(q, keys, keys[..., :value_width], 0.6, positions, key_positions, zeros[:, :2], zeros,
                           np.zeros((2, 2, heads, value_width)))[0]
    assert rel_err(got, want) <= 1e-5


def test_bf16_inputs_and_extreme_scores_stay_finite():
    q, k, v, d_o = inputs(1, 16, 16, 2, 2, 8, 8, seed=3)
    q = jnp.asarray(q * 300.0, jnp.bfloat16)                                 # scores ~ 1e4

    def loss(q, k, v):
        return jnp.sum(attention(q, k, v, scale=1.0, implementation="xla", block_size=8).astype(jnp.float32) * d_o)

    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, jnp.asarray(k, jnp.bfloat16),
                                                                         jnp.asarray(v, jnp.bfloat16))
    assert np.isfinite(float(value))
    assert all(g.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(g))) for g in grads)


@pytest.mark.parametrize("kwargs,message", [
    (dict(implementation="flash"), "implementation must be one of"),
    (dict(implementation="cudnn", query_segments=jnp.zeros((1, 4), jnp.int32),
          key_segments=jnp.zeros((1, 4), jnp.int32)), "does not support segment ids"),
    (dict(implementation="splash", query_positions=jnp.zeros((1, 4), jnp.int32),
          key_positions=jnp.zeros((1, 4), jnp.int32)), "causal self-attention only"),
    (dict(query_segments=jnp.zeros((1, 4), jnp.int32)), "both query and key"),
    (dict(block_size=0), "block_size must be positive"),
])
def test_bad_arguments_raise_one_line_errors(kwargs, message):
    x = jnp.zeros((1, 4, 2, 3))
    with pytest.raises(ValueError, match=message):
        attention(x, x, x, scale=1.0, **kwargs)
