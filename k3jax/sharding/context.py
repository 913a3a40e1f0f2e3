"""Context parallelism for KDA: the sequence split over a mesh axis (SPEC §1, chunk form).

Within a shard the KDA recurrence is affine in the entering state S_in (per value head, K x V):

    S_t = M_t S_{t-1} + beta_t k_t v_t^T,   M_t = (I - beta_t k_t k_t^T) Diag(exp g_t)  (0 at a reset)
    S_out = A S_in + B,    o_t = o_t|zero + S_in^T (A_t^T q_t),   A_t = M_t ... M_1,  A = A_T

so one run of the public `k3jax.ops.kda.kda` with values [v | 0_K] from the state [0 | I] gives,
in its two column blocks, the zero-state outputs o|zero and q~_t = A_t^T q_t, and the final
[B | A] (a reset inside the shard zeroes both blocks, so later tokens ignore S_in). The shards'
(A, B) are all-gathered and every shard runs the P-step prefix S_in(i+1) = A_i keep_i S_in(i) + B_i
(keep_i = 0 when shard i starts a new document): P small matmuls, cheaper than P - 1 dependent
ring hops. Each shard then adds S_in^T q~_t to its outputs.

The short convolution reads a W-1-token halo, the previous shard's last inputs of its last
token's document, zeroed when this shard starts a new document.

MLA: each shard all-gathers the compact latent [c~ | k_r] (kv_lora + r values per token, 576 in
K3) rather than the expanded keys and values (H (n + r + V) per token), expands it locally and
runs the blockwise attention from its queries' global positions; causal block skipping limits
shard i to the key blocks before its end (no zig-zag load balance). The ring form passes each
shard's latent around the axis instead (P - 1 one-hop steps, the same bytes), holding one shard's
keys at a time, and merges the partial attentions by their log-sum-exp.

The ``*_across_shards`` functions run inside ``shard_map`` over ``axis_name`` on per-shard
``[B, T/P, ...]`` arrays; `ContextParallel` wraps them for global arrays.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from k3jax.ops.attention import attention, blockwise_attention_with_lse
from k3jax.ops.conv import causal_depthwise_conv
from k3jax.ops.kda import kda


def _from_previous_shard(x: jax.Array, axis_name: str) -> jax.Array:
    """The previous shard's ``x`` (zeros on shard 0): a one-step ring shift along the axis."""
    size = jax.lax.axis_size(axis_name)
    return jax.lax.ppermute(x, axis_name, [(i, i + 1) for i in range(size - 1)])


def shard_position(axis_name: str, shard_index: jax.Array | None = None) -> jax.Array:
    """This shard's position along ``axis_name``: ``shard_index`` (this shard's ``[1]`` block of
    ``arange(P)`` split over the axis, as `ContextParallel` passes it: it works where other mesh axes
    stay automatic, which ``axis_index`` does not) or, when None, ``jax.lax.axis_index``."""
    return jax.lax.axis_index(axis_name) if shard_index is None else shard_index[0]


def continues_previous_shard(segment_ids: jax.Array, axis_name: str, shard_index: jax.Array | None = None) -> jax.Array:
    """``[B]`` bool: this shard's first token is in the document the previous shard ended with
    (False on shard 0)."""
    previous_last = _from_previous_shard(segment_ids[:, -1], axis_name)
    first_shard = shard_position(axis_name, shard_index) == 0
    return (previous_last == segment_ids[:, 0]) & ~first_shard


def conv_across_shards(x: jax.Array, weight: jax.Array, segment_ids: jax.Array, axis_name: str,
                       shard_index: jax.Array | None = None) -> jax.Array:
    """`causal_depthwise_conv` of a sequence split over ``axis_name``: x ``[B, T/P, C]`` (T/P >= W-1),
    weight ``[C, W]``, segment_ids ``[B, T/P]`` -> y ``[B, T/P, C]`` (``shard_index``: `shard_position`)."""
    taps = weight.shape[-1]
    tail = x[:, x.shape[1] - (taps - 1):]
    same_document = segment_ids[:, x.shape[1] - (taps - 1):] == segment_ids[:, -1:]
    halo = _from_previous_shard(jnp.where(same_document[..., None], tail, 0), axis_name)
    halo = jnp.where(continues_previous_shard(segment_ids, axis_name, shard_index)[:, None, None], halo, 0)
    y, _ = causal_depthwise_conv(x, weight, halo, segment_ids)
    return y


def _entering_states(transition: jax.Array, offset: jax.Array, keep: jax.Array, axis_name: str,
                     shard_index: jax.Array | None) -> tuple:
    """(S_in of this shard, S_out of the last shard) from every shard's S_out = A keep S_in + B."""
    transitions = jax.lax.all_gather(transition, axis_name)          # [P, B, HV, K, K]
    offsets = jax.lax.all_gather(offset, axis_name)                  # [P, B, HV, K, V]
    keeps = jax.lax.all_gather(keep, axis_name)                      # [P, B]
    entering = [jnp.zeros_like(offset)]
    for shard in range(transitions.shape[0]):
        kept = jnp.where(keeps[shard][:, None, None, None], entering[-1], 0.0)
        entering.append(jnp.einsum("bhij,bhjv->bhiv", transitions[shard], kept) + offsets[shard])
    this_shard = jnp.stack(entering[:-1])[shard_position(axis_name, shard_index)]
    return this_shard, entering[-1]


def kda_across_shards(q, k, v, g, beta, segment_ids, shard_index=None, *, axis_name: str, scale: float | None = None,
                      chunk_size: int = 64, implementation: str | None = None) -> tuple[jax.Array, jax.Array]:
    """`k3jax.ops.kda.kda` (from a zero state) of a sequence split over ``axis_name``.

    Per-shard q, k ``[B, T/P, H, K]``, v ``[B, T/P, HV, V]``, g ``[B, T/P, HV, K]``, beta
    ``[B, T/P, HV]``, segment_ids ``[B, T/P]``, shard_index (`shard_position`) -> ``(o [B, T/P, HV, V]
    in v.dtype, the whole sequence's final state [B, HV, K, V] fp32 on every shard)``.
    """
    batch, _, value_heads, value_dim = v.shape
    key_dim = q.shape[-1]
    values = jnp.concatenate([v.astype(jnp.float32), jnp.zeros((*v.shape[:3], key_dim), jnp.float32)], axis=-1)
    identity = jnp.broadcast_to(jnp.eye(key_dim, dtype=jnp.float32), (batch, value_heads, key_dim, key_dim))
    start = jnp.concatenate([jnp.zeros((batch, value_heads, key_dim, value_dim), jnp.float32), identity], axis=-1)
    o, final = kda(q, k, values, g, beta, scale=scale, initial_state=start, segment_ids=segment_ids,
                   chunk_size=chunk_size, implementation=implementation)
    o_zero, carried_queries = o[..., :value_dim], o[..., value_dim:]             # q~_t = A_t^T q_t
    offset, transition = final[..., :value_dim], final[..., value_dim:]
    keep = continues_previous_shard(segment_ids, axis_name, shard_index)
    entering, last = _entering_states(transition, offset, keep, axis_name, shard_index)
    entering = jnp.where(keep[:, None, None, None], entering, 0.0)
    o = o_zero + jnp.einsum("bthk,bhkv->bthv", carried_queries, entering)
    return o.astype(v.dtype), last


def attention_across_shards(q, latent, segment_ids, expand_weight, shard_index=None, *, expand, axis_name: str,
                            scale: float, implementation: str | None = None, block_size: int = 512) -> jax.Array:
    """Causal MLA attention with the sequence split over ``axis_name``: each shard all-gathers the
    compact latent ``[B, T/P, kv_lora + r]`` (not the expanded per-head keys and values), expands it
    with ``expand(latent, expand_weight) -> (k [B, T, H, D], v [B, T, H, Dv])`` and attends from its
    queries ``q [B, T/P, H, D]`` at their global positions (``shard_index``: `shard_position`).
    Returns ``[B, T/P, H, Dv]``."""
    local = q.shape[1]
    full_latent = jax.lax.all_gather(latent, axis_name, axis=1, tiled=True)
    key_segments = jax.lax.all_gather(segment_ids, axis_name, axis=1, tiled=True)
    keys, values = expand(full_latent, expand_weight)
    batch, length = key_segments.shape
    query_positions = shard_position(axis_name, shard_index) * local + jnp.arange(local, dtype=jnp.int32)
    implementation = "dense" if implementation == "dense" else "xla"
    return attention(q, keys, values, scale=scale, query_positions=jnp.broadcast_to(query_positions, (batch, local)),
                     key_positions=jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length)),
                     query_segments=segment_ids, key_segments=key_segments, implementation=implementation,
                     block_size=block_size)


def _merge_attention(part_a, part_b):
    """Softmax attention over the union of two disjoint key sets from each one's ``(o, lse)``
    (lse -inf where no key is visible): lse = log(e^lse_a + e^lse_b),
    o = e^(lse_a - lse) o_a + e^(lse_b - lse) o_b."""
    (o_a, lse_a), (o_b, lse_b) = part_a, part_b
    seen_a, seen_b = jnp.isfinite(lse_a), jnp.isfinite(lse_b)
    seen = seen_a | seen_b
    top = jnp.where(seen, jnp.maximum(lse_a, lse_b), 0.0)
    w_a = jnp.where(seen_a, jnp.exp(jnp.where(seen_a, lse_a, top) - top), 0.0)
    w_b = jnp.where(seen_b, jnp.exp(jnp.where(seen_b, lse_b, top) - top), 0.0)
    total = jnp.where(seen, w_a + w_b, 1.0)
    o = (w_a[..., None] * o_a.astype(jnp.float32) + w_b[..., None] * o_b.astype(jnp.float32)) / total[..., None]
    return o, jnp.where(seen, top + jnp.log(total), -jnp.inf)


def _ring_shift(x: jax.Array, axis_name: str) -> jax.Array:
    """Shard i's ``x`` moved to shard i + 1 (the last shard's to shard 0)."""
    size = jax.lax.axis_size(axis_name)
    return jax.lax.ppermute(x, axis_name, [(i, (i + 1) % size) for i in range(size)])


def ring_attention_across_shards(q, latent, segment_ids, expand_weight, shard_index=None, *, expand,
                                 axis_name: str, scale: float, implementation: str | None = None,
                                 block_size: int = 512) -> jax.Array:
    """`attention_across_shards` by ring passing instead of one all-gather: in P steps every shard's
    compact latent visits every shard (a one-hop ``ppermute`` per step), is expanded there and
    attended to; the partial results merge by their log-sum-exp (`_merge_attention`). The same bytes
    cross the axis, but a shard holds one shard's expanded keys and values at a time (O(T/P)
    instead of O(T); the backward keeps the P latents, recomputing each step's expansion).
    ``implementation`` is ignored (always blockwise)."""
    del implementation
    batch, local = segment_ids.shape
    shards, shard = jax.lax.axis_size(axis_name), shard_position(axis_name, shard_index)
    offsets = jnp.arange(local, dtype=jnp.int32)
    query_positions = jnp.broadcast_to(shard * local + offsets, (batch, local))

    @jax.checkpoint   # the backward keeps each step's latent, not its expanded keys and values
    def attend(q, block, block_segments, expand_weight, source):
        keys, values = expand(block, expand_weight)
        key_positions = jnp.broadcast_to(source * local + offsets, (batch, local))
        return blockwise_attention_with_lse(q, keys, values, query_positions, key_positions, segment_ids,
                                            block_segments, scale, block_size)

    merged, block, block_segments = None, latent, segment_ids
    for step in range(shards):
        part = attend(q, block, block_segments, expand_weight, (shard - step) % shards)
        merged = part if merged is None else _merge_attention(merged, part)
        if step < shards - 1:
            block, block_segments = _ring_shift(block, axis_name), _ring_shift(block_segments, axis_name)
    return merged[0].astype(q.dtype)


CONTEXT_SCOPE = "context_parallel"    # the name scope of every context-parallel region
CONTEXT_ATTENTION = {"all_gather": attention_across_shards, "ring": ring_attention_across_shards}


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """The sequence (dim 1 of ``[B, T, ...]`` activations) split over ``mesh`` axis ``axis``; set on
    KDA and MLA layers by `k3jax.sharding.parallelize` (a static attribute). Each method takes and
    returns global arrays and runs the per-shard function above in a ``shard_map`` that is manual
    over ``axis`` only (the other mesh axes stay automatic)."""

    mesh: Mesh
    axis: str = "context"
    attention_method: str = "all_gather"     # a key of CONTEXT_ATTENTION

    def _run(self, fn, args, out_specs):
        """``fn(*per-shard args, shard_index=...)`` in the shard_map; ``args``: (array, 1 if split
        along the sequence else None) pairs."""
        sequence = PartitionSpec(None, self.axis)
        specs = tuple(PartitionSpec() if spec is None else sequence for spec in (a[1] for a in args))
        shard_index = jnp.arange(self.mesh.shape[self.axis], dtype=jnp.int32)
        with jax.named_scope(CONTEXT_SCOPE):      # names its collectives for `k3jax.training.plan`
            return jax.shard_map(lambda *a: fn(*a[:-1], shard_index=a[-1]), mesh=self.mesh,
                                 in_specs=(*specs, PartitionSpec(self.axis)), out_specs=out_specs,
                                 axis_names={self.axis}, check_vma=False)(*(a[0] for a in args), shard_index)

    def conv(self, x, weight, segment_ids):
        """`conv_across_shards` of x ``[B, T, C]``."""
        fn = functools.partial(conv_across_shards, axis_name=self.axis)
        return self._run(fn, [(x, 1), (weight, None), (segment_ids, 1)],
                         PartitionSpec(None, self.axis))

    def kda(self, q, k, v, g, beta, segment_ids, **kwargs):
        """`kda_across_shards`: ``(o [B, T, HV, V], final state)``."""
        fn = functools.partial(kda_across_shards, axis_name=self.axis, **kwargs)
        return self._run(fn, [(x, 1) for x in (q, k, v, g, beta, segment_ids)],
                         (PartitionSpec(None, self.axis), PartitionSpec()))

    def attention(self, q, latent, segment_ids, expand_weight, **kwargs):
        """`attention_across_shards` (or its ring form, as ``attention_method`` says): ``[B, T, H, Dv]``."""
        fn = functools.partial(CONTEXT_ATTENTION[self.attention_method], axis_name=self.axis, **kwargs)
        return self._run(fn, [(q, 1), (latent, 1), (segment_ids, 1), (expand_weight, None)],
                         PartitionSpec(None, self.axis))
