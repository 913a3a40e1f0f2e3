"""Gated Multi-head Latent Attention without positional encoding (SPEC §2).

For x in R^d, H heads of n (nope) + r (rope, never rotated) query/key dims and V value dims:

    q            = W_qb RMSNorm(W_qa x)   (q-LoRA)   or   W_q x             [H, n + r]
    [c | k_r]    = W_kva x                                                  [kv_lora + r]
    c~           = RMSNorm(c);  [k_nope | v] = W_kvb c~                     [H, n + V]
    k            = [k_nope | k_r broadcast to every head]
    o            = softmax(q k^T (n + r)^-0.5, causal, same segment) v
    y            = W_o (o * sigmoid(W_g x))      (the gate only when configured)

Training (no cache) runs this expanded form. With a cache, each call appends [c~ | k_r] for its
tokens and attends in the absorbed form: queries q_lat = W_kvb,k^T q_nope (per head) and [q_lat | q_r]
score against the shared cached [c~ | k_r]; the mixed latent is expanded by W_kvb,v afterwards.

Served with an adapter bank on W_kvb (`k3jax.layers.lora.AdapterBank`, one adapter per token), the
absorbed form keeps W_kvb and adds each token's low-rank term beside it, with w_n the token's
slot weight (s_n on its own slot, 0 elsewhere):

    q_lat += sum_{n,r} A_n[:, r] w_n (q_nope . B_n,k[r])       o += sum_{n,r} (o_lat . A_n[:, r]) w_n B_n,v[r]
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import MLAConfig
from k3jax.layers.linear import project
from k3jax.layers.lora import AdapterBank, adapted_project, adapted_weight, adapter_bank
from k3jax.layers.params import param, truncated_normal
from k3jax.layers.scope import scoped
from k3jax.memory import MLAMemory, MLAPages, set_latent_rows
from k3jax.ops.attention import KERNEL_IMPLEMENTATIONS, attention, paged_attention, resolved_implementation
from k3jax.ops.norms import rms_norm


def _expand_keys_values(latent: jax.Array, kv_b_proj: jax.Array, *, config: MLAConfig, dtype,
                        bank: AdapterBank | None = None) -> tuple:
    """``[c~ | k_r]`` ``[B, T, kv_lora + r]`` -> keys ``[k_nope | k_r] [B, T, H, n + r]`` (k_r shared
    by every head) and values ``[B, T, H, V]`` (with ``bank``: each token's adapter term added)."""
    c, k_rope = latent[..., : config.kv_lora_rank], latent[..., config.kv_lora_rank :]
    kv = project(c, kv_b_proj, dtype)                                                # [B, T, H, n + V]
    if bank is not None:
        kv = kv + bank(c, dtype)
    k_nope, v = kv[..., : config.nope_head_dim], kv[..., config.nope_head_dim :]
    k_rope = jnp.broadcast_to(k_rope[:, :, None].astype(dtype), (*k_nope.shape[:-1], config.rope_head_dim))
    return jnp.concatenate([k_nope, k_rope], axis=-1), v


def _write_rows(buffer: jax.Array, rows: jax.Array, start: jax.Array) -> jax.Array:
    """``buffer [B, S, ...]`` with ``rows [B, T, ...]`` written at ``start[b]`` of each sequence."""
    return jax.vmap(lambda b, r, s: jax.lax.dynamic_update_slice_in_dim(b, r, s, axis=0))(buffer, rows, start)


class MLALayer(nnx.Module):
    """Gated MLA (SPEC §2) with an optional query low rank and an optional output gate.

    Args:
      d_model: model width d.
      config: heads, ranks, head dims, gate, norm eps.
      init_std: truncated-normal std of the projections.
      dtype: compute dtype of the projections (norms and softmax are fp32).
    """

    # Weights a LoRA adapter can join (`k3jax.layers.lora`): {attribute: input axes}. kv_b_proj's
    # adapter is merged into the weight (the cached path absorbs it into the queries).
    LORA_WEIGHTS = {"q_proj": 1, "q_a_proj": 1, "q_b_proj": 1, "kv_a_proj": 1, "kv_b_proj": 1, "g_proj": 1,
                    "o_proj": 2}

    def __init__(self, d_model: int, config: MLAConfig, *, init_std: float, dtype=jnp.float32, rngs: nnx.Rngs):
        heads = config.num_heads
        linear = truncated_normal(init_std)
        ones = nnx.initializers.ones
        if config.q_lora_rank is None:
            self.q_proj = param(rngs, linear, (d_model, heads, config.qk_head_dim), ("embed", "heads", "head_dim"))
        else:
            self.q_a_proj = param(rngs, linear, (d_model, config.q_lora_rank), ("embed", "q_lora"))
            self.q_a_norm = param(rngs, ones, (config.q_lora_rank,), ("q_lora",))
            self.q_b_proj = param(rngs, linear, (config.q_lora_rank, heads, config.qk_head_dim), ("q_lora", "heads", "head_dim"))
        self.kv_a_proj = param(rngs, linear, (d_model, config.latent_width), ("embed", "kv_lora"))
        self.kv_a_norm = param(rngs, ones, (config.kv_lora_rank,), ("kv_lora",))
        self.kv_b_proj = param(
            rngs, linear, (config.kv_lora_rank, heads, config.nope_head_dim + config.value_head_dim),
            ("kv_lora", "heads", "head_dim"),
        )
        if config.output_gate:
            self.g_proj = param(rngs, linear, (d_model, heads, config.value_head_dim), ("embed", "heads", "head_dim"))
        self.o_proj = param(rngs, linear, (heads, config.value_head_dim, d_model), ("heads", "head_dim", "embed"))
        self.config = config
        self.dtype = dtype
        self.context_parallel = None     # a `k3jax.sharding.context.ContextParallel`, set by parallelize
        self.head_parallel = None        # a `k3jax.sharding.heads.HeadParallel`, set by parallelize

    @scoped
    def __call__(
        self, x: jax.Array, memory: MLAMemory | None = None, segment_ids: jax.Array | None = None
    ) -> tuple[jax.Array, MLAMemory | None]:
        """x ``[B, T, d]`` -> ``(y [B, T, d] in dtype, updated MLAMemory or None)``.

        ``memory`` (latent ``[B, S, kv_lora + r]``, length and document_start ``[B]``; or
        `MLAPages`, see `_attend_paged`) holds earlier tokens; the call writes its T tokens at slots [length, length + T), which must
        fit in S. The call's first segment continues the cached document (slots from
        document_start on); a later segment sees only its own tokens.
        """
        cfg = self.config
        q = self._queries(x)
        latent = adapted_project(self, "kv_a_proj", x, self.dtype)
        c = rms_norm(latent[..., : cfg.kv_lora_rank], self.kv_a_norm[...], cfg.norm_eps)
        latent = jnp.concatenate([c, latent[..., cfg.kv_lora_rank :]], axis=-1)     # [B, T, kv_lora + r]
        if memory is None:
            o, new_memory = self._attend_expanded(q, latent, segment_ids), None
        elif isinstance(memory, MLAPages):
            o, new_memory = self._attend_paged(q, latent, memory)
        else:
            segments = jnp.zeros(x.shape[:2], jnp.int32) if segment_ids is None else segment_ids
            o, new_memory = self._attend_cached(q, latent, memory, segments)
        if cfg.output_gate:
            gate = adapted_project(self, "g_proj", x, self.dtype)
            o = (o.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(self.dtype)
        return adapted_project(self, "o_proj", o, self.dtype, contract=2), new_memory

    def _attend_expanded(self, q, latent, segments):
        """Causal attention among the call's tokens with per-head keys and values expanded from c~
        (segments ``[B, T]`` or None: one document); with ``context_parallel`` the sequence is split
        over its mesh axis and only the compact latent crosses devices; with ``head_parallel`` a
        kernel XLA cannot partition (splash) runs on each device's rows and heads."""
        cfg = self.config
        bank = adapter_bank(self, "kv_b_proj")
        expand = functools.partial(_expand_keys_values, config=cfg, dtype=self.dtype, bank=bank)
        options = dict(scale=cfg.qk_head_dim**-0.5, implementation=cfg.attention_implementation,
                       block_size=cfg.attention_block_size)
        if bank is not None and self.context_parallel is not None:
            raise ValueError("an adapter bank on kv_b_proj does not run context-parallel (a sequence split over devices)")
        if self.context_parallel is not None:
            segments = jnp.zeros(q.shape[:2], jnp.int32) if segments is None else segments
            return self.context_parallel.attention(q, latent, segments, adapted_weight(self, "kv_b_proj", self.dtype),
                                                   expand=expand, **options)
        keys, values = expand(latent, self._kv_b(bank))
        implementation = resolved_implementation(cfg.attention_implementation, True, segments is not None)
        per_device = self.head_parallel is not None and implementation in KERNEL_IMPLEMENTATIONS
        run = self.head_parallel.attention if per_device else attention
        return run(q, keys, values, query_segments=segments, key_segments=segments, **options)

    def _attend_paged(self, q, latent, memory: MLAPages):
        """The absorbed attention over a paged cache (one document per sequence): the call's rows
        are written into this layer's pool (``latent[layer]``) at positions [length, length + T)
        (page tables[t // page], row t % page; ids outside the pool drop), then its queries attend
        over the sequence's pages ``tables [B, P]`` where they lie (`paged_attention`: a key block
        of pages at a time, never the whole cache). A sequence whose tokens do not fit its pages
        gets NaN outputs, as `_attend_cached`'s do."""
        cfg = self.config
        pool, tables, layer = memory.latent, memory.tables, memory.layer
        num_pages, page = pool.shape[1], pool.shape[2] // latent.shape[-1]
        positions = memory.length[:, None] + jnp.arange(q.shape[1])                            # [B, T]
        pages = jnp.take_along_axis(tables, positions // page, axis=1, mode="fill", fill_value=num_pages)
        pool = set_latent_rows(pool, layer, pages, positions % page, latent)
        bank = adapter_bank(self, "kv_b_proj")
        queries, absorb = self._absorbed(q, bank)
        block = tables.shape[1] * page if cfg.attention_implementation == "dense" else cfg.attention_block_size
        mixed = paged_attention(queries, pool, layer, tables, positions, value_width=cfg.kv_lora_rank,
                                scale=cfg.qk_head_dim**-0.5, block_size=block)          # dense: one block
        overflow = memory.length + q.shape[1] > tables.shape[1] * page
        o = jnp.where(overflow[:, None, None, None], jnp.nan, absorb(mixed))
        return o, MLAPages(pool, tables, memory.length + q.shape[1], layer)

    def _attend_cached(self, q, latent, memory: MLAMemory, segments):
        """Write the call's [c~ | k_r] into the cache, attend over it in the absorbed form (blockwise
        over the cache slots unless ``dense`` is configured). Slots before the document start get a
        segment id no query has (int32 min), so they are never seen. A sequence whose tokens do not
        fit the cache (length + T > S) gets NaN outputs, from then on (its length keeps counting):
        an overflowing bank never gives silently wrong results."""
        cfg = self.config
        length = segments.shape[1]
        cache = _write_rows(memory.latent, latent.astype(memory.latent.dtype), memory.length)
        slots = jnp.arange(cache.shape[1])[None]
        key_segments = _write_rows(jnp.broadcast_to(segments[:, :1], cache.shape[:2]), segments, memory.length)
        key_segments = jnp.where(slots >= memory.document_start[:, None], key_segments, jnp.iinfo(jnp.int32).min)
        positions = memory.length[:, None] + jnp.arange(length)

        queries, absorb = self._absorbed(q, adapter_bank(self, "kv_b_proj"))
        keys = cache.astype(self.dtype)[:, :, None, :]                                 # one shared head
        implementation = "dense" if cfg.attention_implementation == "dense" else "xla"
        mixed = attention(queries, keys, keys[..., : cfg.kv_lora_rank], scale=cfg.qk_head_dim**-0.5,
                          query_positions=positions, key_positions=jnp.broadcast_to(slots, key_segments.shape),
                          query_segments=segments, key_segments=key_segments,
                          implementation=implementation, block_size=cfg.attention_block_size)
        overflow = memory.length + length > cache.shape[1]
        o = jnp.where(overflow[:, None, None, None], jnp.nan, absorb(mixed))

        starts = jnp.concatenate([jnp.zeros_like(segments[:, :1], bool), segments[:, 1:] != segments[:, :-1]], axis=1)
        last_start = jnp.max(jnp.where(starts, jnp.arange(length), 0), axis=1)
        document_start = jnp.where(jnp.any(starts, axis=1), memory.length + last_start, memory.document_start)
        return o, MLAMemory(cache, memory.length + length, document_start)

    def _absorbed(self, q, bank: AdapterBank | None):
        """The absorbed form's queries ``[q_lat | q_r] [B, T, H, kv_lora + r]`` and the function
        taking the mixed latents ``[B, T, H, kv_lora]`` to the heads' outputs ``[B, T, H, V]``
        (W_kvb's key and value parts; with ``bank``, each token's adapter terms beside them)."""
        cfg = self.config
        kv_b = self._kv_b(bank)
        key_proj, value_proj = kv_b[..., : cfg.nope_head_dim], kv_b[..., cfg.nope_head_dim :]
        q_nope = q[..., : cfg.nope_head_dim]
        q_latent = jnp.einsum("bthn,chn->bthc", q_nope, key_proj)
        if bank is not None:
            weights = bank.row_weights(q.shape[:2], self.dtype)[:, :, None, :, None]       # [B, T, 1, N, 1]
            low = jnp.einsum("bthn,srhn->bthsr", q_nope, bank.b[...][..., : cfg.nope_head_dim].astype(self.dtype))
            q_latent = q_latent + jnp.einsum("bthsr,csr->bthc", low * weights, bank.a[...].astype(self.dtype))
        queries = jnp.concatenate([q_latent, q[..., cfg.nope_head_dim :]], axis=-1)

        def absorb(mixed):
            o = jnp.einsum("bthc,chv->bthv", mixed, value_proj)
            if bank is not None:
                low = jnp.einsum("bthc,csr->bthsr", mixed, bank.a[...].astype(self.dtype)) * weights
                o = o + jnp.einsum("bthsr,srhv->bthv", low, bank.b[...][..., cfg.nope_head_dim :].astype(self.dtype))
            return o

        return queries, absorb

    def _kv_b(self, bank: AdapterBank | None) -> jax.Array:
        """W_kvb in ``dtype``: with its adapter merged in, or alone beside a ``bank`` (added per token)."""
        return self.kv_b_proj[...].astype(self.dtype) if bank is not None else adapted_weight(self, "kv_b_proj", self.dtype)

    def _queries(self, x: jax.Array) -> jax.Array:
        """``[B, T, H, n + r]``: W_q x, or W_qb RMSNorm(W_qa x) with q-LoRA."""
        if self.config.q_lora_rank is None:
            return adapted_project(self, "q_proj", x, self.dtype)
        q_latent = rms_norm(adapted_project(self, "q_a_proj", x, self.dtype), self.q_a_norm[...], self.config.norm_eps)
        return adapted_project(self, "q_b_proj", q_latent, self.dtype)
