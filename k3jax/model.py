"""The K3 stack (SPEC §0, §3, §5): embedding, L decoder layers, final mix, norm and head.

    model = K3Model(config.model, rngs=nnx.Rngs(0))
    out = model(tokens)                                        # training forward: out.logits, out.moe_stats
    out = model(prompt, memory=init_memory(cfg, B, S))         # prefill; out.memory continues the sequence
    out = model(next_token[:, None], memory=out.memory)        # one decode step

Layer l: a token mixer (MLA on ``config.mla_layer_indices``, KDA elsewhere) and a feed-forward
(dense GLU for l < ``dense_layers``, MoE after), each reading the residual stream through
RMSNorm (SPEC §3's procedure; `k3jax.layers.attnres`). Layer 0's attention-res pair exists (as in
the released checkpoint) but is never read: at layer 0 there are no sources to mix.

Depth is scanned: the layers split into an unrolled prefix, a body of identical periods of
``config.pattern_period`` layers (lcm of the KDA/MLA period and the AttnRes block size) whose
parameters are stacked on a leading "layers" axis and run by one `lax.scan`, and an unrolled
suffix — so compile time does not grow with depth. The memory bank and the MoE statistics are
stacked per layer kind in layer order (`k3jax.memory`); they are sliced and rejoined around the
scan.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.layers.attnres import AttnRes, ResidualStream
from k3jax.layers.axes import ActivationLayout, with_logical_constraint
from k3jax.layers.ffn import DenseGLU
from k3jax.layers.kda import KDALayer
from k3jax.layers.linear import project
from k3jax.layers.mla import MLALayer
from k3jax.layers.moe import ExpertCodes, MoE
from k3jax.layers.params import logical_axes, param, truncated_normal
from k3jax.layers.scope import scoped
from k3jax.memory import Memory, SharedPools, check_memory, join_pools, split_pools, updated_pools
from k3jax.ops.moe import MoEStats, updated_router_bias
from k3jax.ops.norms import rms_norm

# The residual stream [B, T, d] splits over the batch and the sequence, never the model width
# (`k3jax.sharding.parallelize` maps the names).
ACTIVATION_AXES = ("batch", "sequence", None)
# What the backward pass keeps of each scanned period (`ModelConfig.remat`); the rest is recomputed.
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class ModelOutput(NamedTuple):
    """logits ``[B, T, vocab]`` fp32; memory: the updated bank (None for a training forward);
    moe_stats: `MoEStats` with a leading axis over the MoE layers in layer order (None without MoE)."""

    logits: jax.Array
    memory: Memory | None
    moe_stats: MoEStats | None


class DecoderLayer(nnx.Module):
    """One layer: the mixer and the feed-forward, each behind an RMSNorm and (block AttnRes) a Mix."""

    def __init__(self, config: ModelConfig, index: int, *, rngs: nnx.Rngs):
        d, dtype, eps = config.d_model, jnp.dtype(config.compute_dtype), config.norm_eps
        ones = nnx.initializers.ones
        self.block_res = config.attn_res.kind == "block"
        self.reads_sources = self.block_res and index > 0
        self.starts_block = self.block_res and index % config.attn_res.block_size == 0
        self.uses_mla = config.is_mla(index)
        self.uses_moe = not config.is_dense(index)
        self.norm_eps = eps
        self.activation_layout: ActivationLayout | None = None   # set by `k3jax.sharding.parallelize`
        if self.block_res:
            self.attention_res = AttnRes(d, norm_eps=eps, rngs=rngs)
            self.ffn_res = AttnRes(d, norm_eps=eps, rngs=rngs)
        self.input_norm = param(rngs, ones, (d,), ("embed",))
        if self.uses_mla:
            self.mixer = MLALayer(d, config.mla, init_std=config.init_std, dtype=dtype, rngs=rngs)
        else:
            self.mixer = KDALayer(d, config.kda, init_std=config.init_std, dtype=dtype, rngs=rngs)
        self.post_attention_norm = param(rngs, ones, (d,), ("embed",))
        if self.uses_moe:
            self.ffn = MoE(d, config.moe, activation=config.activation, situ_beta=config.situ_beta,
                           situ_beta_linear=config.situ_linear_beta, norm_eps=eps, init_std=config.init_std,
                           dtype=dtype, rngs=rngs)
        else:
            self.ffn = DenseGLU(d, config.dense_width, activation=config.activation, situ_beta=config.situ_beta,
                                situ_beta_linear=config.situ_linear_beta, init_std=config.init_std, dtype=dtype,
                                rngs=rngs)

    def __call__(self, stream: ResidualStream, memory, segment_ids):
        """-> (stream, the mixer's updated memory, MoEStats or None)."""
        h = self.attention_res(stream) if self.reads_sources else stream.partial
        if self.starts_block:
            stream = stream.close_block()
        a, memory = self.mixer(rms_norm(h, self.input_norm[...], self.norm_eps), memory, segment_ids)
        a = a.astype(jnp.float32)
        stream = stream._replace(partial=a if self.starts_block else stream.partial + a)
        f_in = self.ffn_res(stream) if self.block_res else stream.partial
        f_in = rms_norm(f_in, self.post_attention_norm[...], self.norm_eps)
        if self.uses_moe:   # padding (segment id 0) is routed but left out of the balancing statistics
            f, stats = self.ffn(f_in, None if segment_ids is None else segment_ids != 0)
        else:
            f, stats = self.ffn(f_in), None
        partial = with_logical_constraint(stream.partial + f.astype(jnp.float32), ACTIVATION_AXES,
                                          self.activation_layout)
        return stream._replace(partial=partial), memory, stats


def check_token_range(tokens, vocab_size: int) -> None:
    """Raise ValueError unless ``tokens`` are integers in ``[0, vocab_size)`` (the range is checked
    when they are concrete: outside jit, or constants closed over by a jitted function; read on the
    host so that no traced op is recorded)."""
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be integer ids, got dtype {tokens.dtype}")
    if tokens.size and not isinstance(tokens, jax.core.Tracer) and getattr(tokens, "is_fully_addressable", True):
        ids = np.asarray(tokens)
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab_size:
            raise ValueError(f"token ids must be in [0, {vocab_size}) (model.vocab_size), got ids from {low} to {high}")


def _stack_trees(trees, empty):
    """Stack per-layer pytrees on a new leading axis (``empty`` when there are none)."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees) if trees else empty


class LayerStack(nnx.Module):
    """Consecutive decoder layers applied in order; their memory comes stacked per kind."""

    def __init__(self, config: ModelConfig, indices: tuple[int, ...], *, rngs: nnx.Rngs):
        self.layers = nnx.List([DecoderLayer(config, index, rngs=rngs) for index in indices])

    def __call__(self, stream: ResidualStream, memory: Memory | None, pools: SharedPools, segment_ids):
        """memory: this stack's slice of the bank (``[n_kda, ...]``, ``[n_mla, ...]``) or None,
        without its shared pools, which each layer reads and updates in turn (`k3jax.memory`).
        -> (stream, updated slice or None, updated pools, stacked MoEStats or None)."""
        new = {True: [], False: []}  # uses_mla -> per-layer memories
        stats = []
        for layer in self.layers:
            if memory is None:
                layer_memory = None
            else:
                bank = memory.mla if layer.uses_mla else memory.kda
                layer_memory = join_pools(jax.tree.map(lambda a, i=len(new[layer.uses_mla]): a[i], bank), pools)
            stream, layer_memory, layer_stats = layer(stream, layer_memory, segment_ids)
            pools = updated_pools(pools, layer_memory)
            new[layer.uses_mla].append(split_pools(layer_memory)[0])
            if layer_stats is not None:
                stats.append(layer_stats)
        if memory is not None:
            memory = Memory(kda=_stack_trees(new[False], memory.kda), mla=_stack_trees(new[True], memory.mla))
        return stream, memory, pools, _stack_trees(stats, None)


class LayerGroups(NamedTuple):
    """The depth split: unrolled ``prefix``, one ``body`` period repeated ``repeats`` times, unrolled ``suffix``."""

    prefix: tuple[int, ...]
    body: tuple[int, ...]
    repeats: int
    suffix: tuple[int, ...]


def layer_groups(config: ModelConfig) -> LayerGroups:
    """Split the layers so the longest run of identical periods (the latest on a tie) is scanned.

    Periods of ``config.pattern_period`` layers start at layer 0; two are identical when every
    layer in them has the same mixer, feed-forward kind and AttnRes role.
    """
    period, block = config.pattern_period, config.attn_res
    def signature(layer):
        return (config.is_mla(layer), config.is_dense(layer), layer == 0,
                block.kind == "block" and layer % block.block_size == 0)
    periods = [tuple(signature(l) for l in range(k * period, (k + 1) * period)) for k in range(config.num_layers // period)]
    best_start, best_repeats, start = 0, 0, 0
    while start < len(periods):
        end = start + 1
        while end < len(periods) and periods[end] == periods[start]:
            end += 1
        if end - start >= best_repeats:
            best_start, best_repeats = start, end - start
        start = end
    body_start, body_stop = best_start * period, (best_start + best_repeats) * period
    return LayerGroups(
        prefix=tuple(range(body_start)),
        body=tuple(range(body_start, body_start + period)) if best_repeats else (),
        repeats=best_repeats,
        suffix=tuple(range(body_stop, config.num_layers)),
    )


def _stacked_module(make, repeats: int, key: jax.Array) -> nnx.Module:
    """``repeats`` copies of ``make(rngs)`` with independent initialisations, parameters stacked on a
    leading axis whose logical name is "layers"."""
    stacked = nnx.vmap(lambda k: make(nnx.Rngs(params=k)), in_axes=0, out_axes=0)(jax.random.split(key, repeats))
    for _, variable in nnx.to_flat_state(nnx.state(stacked)):
        variable.set_metadata(logical_axes=("layers", *logical_axes(variable)))
    return stacked


class _Split(NamedTuple):
    """Per-kind layer counts of the three groups (the body count is per period)."""

    prefix: int
    body: int
    suffix: int


class K3Model(nnx.Module):
    """The K3 / Kimi Linear language model (SPEC §§0-6).

    Parameters: ``embedding`` [vocab, d]; ``prefix`` / ``suffix`` (`LayerStack`s) and ``body``
    (a `LayerStack` with every parameter stacked over ``groups.repeats``); ``output_res`` (block
    AttnRes); ``final_norm`` [d]; ``lm_head`` [d, vocab], absent with ``tie_embeddings`` (the
    head is then the transposed embedding: logits = h E^T). Activation layouts and the MoE
    expert dispatch are unset (experts computed where the tokens are) until
    `k3jax.sharding.parallelize` sets them for a mesh.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        d, vocab = config.d_model, config.vocab_size
        self.config = config
        self.groups = layer_groups(config)
        self.embedding = param(rngs, nnx.initializers.normal(config.embed_init_std), (vocab, d), ("vocab", "embed"))
        self.prefix = LayerStack(config, self.groups.prefix, rngs=rngs)
        self.body = _stacked_module(lambda r: LayerStack(config, self.groups.body, rngs=r),
                                    self.groups.repeats, rngs.params()) if self.groups.repeats else None
        self.suffix = LayerStack(config, self.groups.suffix, rngs=rngs)
        if config.attn_res.kind == "block":
            self.output_res = AttnRes(d, norm_eps=config.norm_eps, rngs=rngs)
        self.final_norm = param(rngs, nnx.initializers.ones, (d,), ("embed",))
        if not config.tie_embeddings:
            self.lm_head = param(rngs, truncated_normal(config.init_std), (d, vocab), ("embed", "vocab"))
        self.activation_layout: ActivationLayout | None = None   # set by `k3jax.sharding.parallelize`

    @scoped
    def __call__(self, tokens: jax.Array, memory: Memory | None = None, segment_ids: jax.Array | None = None) -> ModelOutput:
        """tokens ``[B, T]`` int; memory from `k3jax.memory.init_memory` (or a previous call) to
        continue sequences, None for a training forward; segment_ids ``[B, T]`` for packed
        documents (state, conv window and attention restart where the id changes; id 0 marks
        padding, which the MoE balancing statistics leave out)."""
        cfg = self.config
        if tokens.ndim != 2 or (segment_ids is not None and segment_ids.shape != tokens.shape):
            raise ValueError(f"tokens must be [B, T] and segment_ids None or the same shape; got "
                             f"{tokens.shape} and {None if segment_ids is None else segment_ids.shape}")
        if memory is not None:
            check_memory(cfg, memory, tokens.shape[0], tokens.shape[1])
        check_token_range(tokens, cfg.vocab_size)
        num_sources = -(-cfg.num_layers // cfg.attn_res.block_size) if cfg.attn_res.kind == "block" else None
        # Ids outside [0, vocab) (only possible under jit, where they cannot be checked) embed as NaN.
        embedded = jnp.take(self.embedding[...], tokens, axis=0, mode="fill", fill_value=jnp.nan)
        embedded = with_logical_constraint(embedded, ACTIVATION_AXES, self.activation_layout)
        stream = ResidualStream.start(embedded, num_sources)

        kda_split, mla_split, moe_split = (self._split(kind) for kind in ("kda", "mla", "moe"))
        prefix_memory = body_memory = suffix_memory = None
        pools = SharedPools()
        if memory is not None:
            memory, pools = split_pools(memory)
            kda_parts = _split_layers(memory.kda, kda_split, self.groups.repeats)
            mla_parts = _split_layers(memory.mla, mla_split, self.groups.repeats)
            prefix_memory, body_memory, suffix_memory = (Memory(k, m) for k, m in zip(kda_parts, mla_parts))

        stream, prefix_memory, pools, prefix_stats = self.prefix(stream, prefix_memory, pools, segment_ids)
        body_stats = None
        if self.body is not None:
            stream, body_memory, pools, body_stats = self._scan_body(stream, body_memory, pools, segment_ids)
        stream, suffix_memory, pools, suffix_stats = self.suffix(stream, suffix_memory, pools, segment_ids)

        out = self.output_res(stream) if cfg.attn_res.kind == "block" else stream.partial
        out = rms_norm(out, self.final_norm[...], cfg.norm_eps)
        head = self.embedding[...].T if cfg.tie_embeddings else self.lm_head[...]
        logits = project(out, head, jnp.dtype(cfg.compute_dtype)).astype(jnp.float32)
        if memory is not None:
            memory = join_pools(Memory(
                kda=_join_layers(*(m.kda for m in (prefix_memory, body_memory, suffix_memory))),
                mla=_join_layers(*(m.mla for m in (prefix_memory, body_memory, suffix_memory))),
            ), pools)
        return ModelOutput(logits, memory, _join_layers(prefix_stats, body_stats, suffix_stats))

    def _scan_body(self, stream, memory, pools, segment_ids):
        """Run the stacked body period ``repeats`` times with `lax.scan`, each period checkpointed
        as ``config.remat`` says; shared pools travel in the carry (updated in place)."""
        graphdef, state = nnx.split(self.body)

        def period(carry, per_period):
            stream, pools = carry
            state, memory = per_period
            stream, memory, pools, stats = nnx.merge(graphdef, state)(stream, memory, pools, segment_ids)
            return (stream, pools), (memory, stats)

        if self.config.remat != "none":
            period = jax.checkpoint(period, policy=REMAT_POLICIES[self.config.remat], prevent_cse=False)
        # A single period is unrolled: a one-trip loop only adds copies of the carried stream.
        (stream, pools), (memory, stats) = jax.lax.scan(period, (stream, pools), (state, memory),
                                                        unroll=self.groups.repeats == 1)
        return stream, memory, pools, stats

    def _split(self, kind: str) -> _Split:
        """How many layers of ``kind`` ("kda", "mla" or "moe") each group holds."""
        cfg = self.config
        is_kind = {"kda": lambda l: not cfg.is_mla(l), "mla": cfg.is_mla, "moe": lambda l: not cfg.is_dense(l)}[kind]
        count = lambda layers: sum(map(is_kind, layers))  # noqa: E731
        return _Split(count(self.groups.prefix), count(self.groups.body), count(self.groups.suffix))

    def _moe_layers(self, stack: LayerStack | None) -> list[MoE]:
        return [] if stack is None else [layer.ffn for layer in stack.layers if layer.uses_moe]

    def router_bias(self) -> jax.Array:
        """The routers' selection biases ``[n_moe_layers, E]`` in layer order (as `moe_stats`)."""
        parts = [jnp.stack([m.router.e_score_correction_bias[...] for m in self._moe_layers(stack)], axis=-2)
                 if self._moe_layers(stack) else None for stack in (self.prefix, self.body, self.suffix)]
        return _join_layers(*parts)

    def set_router_bias(self, bias: jax.Array) -> None:
        """Overwrite the selection biases from ``[n_moe_layers, E]`` in layer order."""
        parts = _split_layers(bias, self._split("moe"), self.groups.repeats)
        for stack, part in zip((self.prefix, self.body, self.suffix), parts):
            for i, moe in enumerate(self._moe_layers(stack)):
                moe.router.e_score_correction_bias[...] = part[..., i, :]

    def update_router_bias(self, moe_stats: MoEStats) -> None:
        """The configured balancing (SPEC §4, ``config.moe.balancing``) of every router from one
        optimizer step's `ModelOutput.moe_stats`; call after the optimizer update."""
        moe = self.config.moe
        update = functools.partial(updated_router_bias, method=moe.balancing, top_k=moe.top_k,
                                   rate=moe.bias_update_rate, expert_groups=moe.expert_groups,
                                   topk_groups=moe.topk_groups)
        self.set_router_bias(jax.vmap(update)(self.router_bias(), moe_stats))


def _split_layers(tree, split: _Split, repeats: int):
    """Slice arrays stacked over all layers of one kind into (prefix, body [repeats, per period, ...], suffix)."""
    body_stop = split.prefix + split.body * repeats
    prefix = jax.tree.map(lambda a: a[: split.prefix], tree)
    body = jax.tree.map(lambda a: a[split.prefix : body_stop].reshape(repeats, split.body, *a.shape[1:]), tree)
    suffix = jax.tree.map(lambda a: a[body_stop:], tree)
    return prefix, body, suffix


def _join_layers(prefix, body, suffix):
    """Inverse of `_split_layers`; groups given as None or holding no layer of the kind are
    skipped (an empty group returns its input, whose shapes a `KDAPositions` call changes)."""
    if body is not None:
        body = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), body)
    parts = [part for part in (prefix, body, suffix) if part is not None]
    parts = [part for part in parts if jax.tree.leaves(part)[0].shape[0]] or parts[:1]
    return jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts) if parts else None


def param_counts(config: ModelConfig) -> tuple[int, int]:
    """``(total, active)`` parameter counts from shapes alone (nothing is allocated).

    Active counts routed experts at top_k / num_experts of their size and excludes the input
    embedding (SPEC §6) unless it is also the (tied) head; the router's selection bias is not a
    parameter, MXFP4 experts count as the weights they encode.
    """
    model = nnx.eval_shape(lambda: K3Model(config, rngs=nnx.Rngs(0)))
    total = active = 0.0
    for path, variable in nnx.to_flat_state(nnx.state(model, (nnx.Param, ExpertCodes))):
        size = variable.size
        if isinstance(variable, ExpertCodes):   # MXFP4: two weights per code byte; scales are not parameters
            size = 2 * size if str(path[-1]).endswith("_packed") else 0
        total += size
        if path == ("embedding",) and not config.tie_embeddings:
            continue
        routed = "expert_mlp" in logical_axes(variable)
        active += size * config.moe.top_k / config.moe.num_experts if routed else size
    return int(total), int(round(active))
