"""The pure parts of training: the train state, the loss, the train and eval steps.

The model's NNX state is kept as two flat dicts keyed by parameter path (``"body/layers/0/
mixer/q_proj"``): ``params`` (`nnx.Param`s, trained by the optimizer) and ``buffers`` (the
routers' selection biases, updated by the balancer, and the frozen MXFP4 routed experts). Flat string-keyed dicts make the optimizer
state, the checkpoints and the sharding rules simple; `StateCodec` converts back to NNX.

One train step (jitted, donated):
    loss    = sum(mask * CE(logits, targets)) / sum(mask)     over the global batch; with
              gradient accumulation the batch is split into micro-batches whose gradients add up
    update  optax; skipped (state unchanged) when the loss or the gradient norm is not finite
    balance the routers' selection biases from this step's routing statistics (SPEC §4)
"""
from __future__ import annotations

import functools
import logging
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from k3jax.config import MeshConfig, ModelConfig
from k3jax.layers.lora import LoRA, LoRADropoutSeed, dropout_keys, set_adapter_dropout
from k3jax.layers.moe import ExpertCodes, RouterBias
from k3jax.layers.params import logical_axes
from k3jax.model import K3Model, param_counts
from k3jax.ops.kda.chunk import block_width, chunk_algorithm_flops, effective_chunk_size
from k3jax.ops.moe import MoEStats, load_metrics
from k3jax.sharding import StepShardings, parallelize


# Variables kept beside the trained parameters: the routers' selection biases and MXFP4 experts.
BUFFER_TYPES = (RouterBias, ExpertCodes)


class StateCodec:
    """Converts an NNX state to a flat ``{path: array}`` dict and back (the Variable types and
    metadata come from the template the codec was built with)."""

    def __init__(self, template: nnx.State):
        self._entries = [("/".join(map(str, path)), path, variable) for path, variable in nnx.to_flat_state(template)]

    def flatten(self, state: nnx.State) -> dict[str, jax.Array]:
        return {"/".join(map(str, path)): variable.get_value() for path, variable in nnx.to_flat_state(state)}

    def unflatten(self, flat: dict[str, jax.Array]) -> nnx.State:
        return nnx.from_flat_state([(path, variable.replace(flat[key])) for key, path, variable in self._entries])

    def keys_of(self, variable_types) -> list[str]:
        """The keys of the entries that are instances of ``variable_types`` (a type or a tuple)."""
        return [key for key, _, variable in self._entries if isinstance(variable, variable_types)]

    def axes(self) -> dict[str, tuple[str, ...]]:
        """Logical axis names of every entry."""
        return {key: logical_axes(variable) for key, _, variable in self._entries}

    def shapes(self) -> dict[str, jax.ShapeDtypeStruct]:
        """Shape and dtype of every entry."""
        return {key: jax.ShapeDtypeStruct(variable.shape, variable.dtype) for key, _, variable in self._entries}


class ModelParts(NamedTuple):
    """A model split for functional use: its graph and the codecs of its params (what the optimizer
    trains) and buffers; for LoRA (`k3jax.finetune`) also of the frozen base and of the adapters'
    dropout key slots, and ``balance``: whether the train step updates the routers' biases."""

    graphdef: Any
    params: StateCodec
    buffers: StateCodec
    frozen: StateCodec | None = None
    dropout: StateCodec | None = None
    balance: bool = True

    def merge(self, params: dict, buffers: dict, frozen: dict | None = None, dropout_key: jax.Array | None = None):
        """The model with these parameter, buffer (and frozen) values; a LoRA model's dropout draws
        its masks from ``dropout_key`` (None: the slots hold zeros)."""
        states = [self.params.unflatten(params), self.buffers.unflatten(buffers)]
        if self.frozen is not None:
            states.append(self.frozen.unflatten(frozen))
        if self.dropout is not None:
            states.append(self.dropout.unflatten(dropout_keys(self.dropout.shapes(), dropout_key)))
        return nnx.merge(self.graphdef, *states)


def split_model(model: nnx.Module) -> tuple[ModelParts, dict, dict]:
    """``(parts, params, buffers)`` of a model (concrete or abstract from `nnx.eval_shape`); a
    fine-tuned model's LoRA adapters (and dropout slots) count as params here (LoRA training
    splits with `k3jax.finetune.split_lora_model` instead)."""
    graphdef, params, buffers = nnx.split(model, (nnx.Param, LoRA, LoRADropoutSeed), BUFFER_TYPES)
    parts = ModelParts(graphdef, StateCodec(params), StateCodec(buffers))
    return parts, parts.params.flatten(params), parts.buffers.flatten(buffers)


class TrainState(NamedTuple):
    step: jax.Array           # optimizer steps taken (int32)
    params: dict              # {path: fp32 array}
    buffers: dict             # {path: array}: router selection biases, MXFP4 expert codes and scales
    opt_state: Any
    skipped: jax.Array        # consecutive non-finite steps skipped so far (int32)


def init_train_state(params: dict, buffers: dict, optimizer: optax.GradientTransformation) -> TrainState:
    return TrainState(jnp.zeros((), jnp.int32), params, buffers, optimizer.init(params), jnp.zeros((), jnp.int32))


def abstract_model(config: ModelConfig, mesh: Mesh | None = None,
                   mesh_config: MeshConfig | None = None) -> tuple[ModelParts, dict, dict]:
    """`split_model` of the model ``config`` describes, as ``jax.ShapeDtypeStruct``s (nothing
    allocated); with a ``mesh``, the model is `parallelize`d for it as ``mesh_config`` says."""
    model = nnx.eval_shape(lambda: K3Model(config, rngs=nnx.Rngs(0)))
    return split_model(model if mesh is None else parallelize(model, mesh, mesh_config))


def abstract_train_state(params: dict, buffers: dict, optimizer: optax.GradientTransformation) -> TrainState:
    """The `TrainState` of abstract ``params`` and ``buffers`` (``jax.ShapeDtypeStruct``s)."""
    return jax.eval_shape(functools.partial(init_train_state, optimizer=optimizer), params, buffers)


def sharded_train_state(config: ModelConfig, seed: int, optimizer: optax.GradientTransformation,
                        shardings: TrainState) -> TrainState:
    """A freshly initialised `TrainState` created where ``shardings`` place it: one jitted program
    in which every device computes only its own shards (no full copy on any host, as a K3 needs).
    The values depend on ``seed`` only, not on the mesh (partitionable threefry)."""

    def initialise():
        _, params, buffers = split_model(K3Model(config, rngs=nnx.Rngs(seed)))
        return init_train_state(params, buffers, optimizer)

    return jax.jit(initialise, out_shardings=shardings)()


def sharded_state_from_params(params: dict, buffers: dict, optimizer: optax.GradientTransformation,
                            shardings: TrainState) -> TrainState:
    """A `TrainState` at step 0 around given (e.g. restored) parameters, laid out by ``shardings``."""
    return jax.jit(functools.partial(init_train_state, optimizer=optimizer), out_shardings=shardings)(params, buffers)


def masked_cross_entropy(logits, targets, mask):
    """``(sum of mask * CE, sum of mask)`` with fp32 logits ``[B, T, V]``."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    mask = mask.astype(jnp.float32)
    return jnp.sum(losses * mask), jnp.sum(mask)


def _forward_loss(parts: ModelParts, params, buffers, batch, frozen=None, dropout_key=None):
    """``(loss sum, (mask sum, MoE stats))`` of one micro-batch."""
    model = parts.merge(params, buffers, frozen, dropout_key)
    out = model(batch["tokens"], segment_ids=batch["segment_ids"])
    with jax.named_scope("Loss"):            # names for profiles (`k3jax.layers.scope`)
        loss_sum, count = masked_cross_entropy(out.logits, batch["targets"], batch["loss_mask"])
    return loss_sum, (count, out.moe_stats)


def _merge_micro_batch_stats(stats: MoEStats | None) -> MoEStats | None:
    """Stats stacked ``[A, layers, ...]`` over micro-batches -> one step's ``[layers, ...]``."""
    if stats is None:
        return None
    tokens = lambda x: jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, *x.shape[3:])  # noqa: E731
    summed = lambda x: jnp.sum(x, axis=0)  # noqa: E731
    return MoEStats(summed(stats.expert_load), jax.tree.map(tokens, stats.router_scores), tokens(stats.token_mask),
                    summed(stats.dropped), jax.tree.map(summed, stats.bias_histogram))


def _gradients(parts, params, buffers, batch, accumulation: int, frozen=None, dropout_key=None):
    """Summed loss, mask count, summed gradients and MoE stats over ``accumulation`` micro-batches
    (micro-batch i draws its dropout from ``fold_in(dropout_key, i)``)."""
    grad_fn = jax.value_and_grad(functools.partial(_forward_loss, parts), has_aux=True)
    if accumulation == 1:
        (loss_sum, (count, stats)), grads = grad_fn(params, buffers, batch, frozen, dropout_key)
        return loss_sum, count, grads, stats
    micro = jax.tree.map(lambda x: x.reshape(accumulation, -1, *x.shape[1:]), batch)

    def accumulate(carry, indexed):
        loss_sum, count, grads = carry
        index, micro_batch = indexed
        key = None if dropout_key is None else jax.random.fold_in(dropout_key, index)
        (loss, (n, stats)), g = grad_fn(params, buffers, micro_batch, frozen, key)
        return (loss_sum + loss, count + n, jax.tree.map(jnp.add, grads, g)), stats

    zeros = jax.tree.map(jnp.zeros_like, params)
    (loss_sum, count, grads), stats = jax.lax.scan(accumulate, (0.0, 0.0, zeros), (jnp.arange(accumulation), micro))
    return loss_sum, count, grads, _merge_micro_batch_stats(stats)


def make_train_step(parts: ModelParts, optimizer: optax.GradientTransformation, *, accumulation: int = 1,
                    schedule: optax.Schedule | None = None, shardings: StepShardings | None = None,
                    dropout_seed: int = 0):
    """The jitted ``train_step(state, batch) -> (state, metrics)`` (the state is donated); with
    ``shardings`` the state keeps its layout across steps and the metrics come back replicated.
    What the model computes on the mesh is in ``parts.graphdef`` (`abstract_model` with a mesh).
    A LoRA model's step is ``train_step(state, batch, frozen)`` (the frozen base, not donated); its
    adapters' dropout at step n draws from ``fold_in(key(dropout_seed), n)``."""

    def train_step(state: TrainState, batch, *frozen):
        dropout_key = None if parts.dropout is None else jax.random.fold_in(jax.random.key(dropout_seed), state.step)
        frozen = frozen[0] if frozen else None
        loss_sum, count, grads, stats = _gradients(parts, state.params, state.buffers, batch, accumulation, frozen,
                                                   dropout_key)
        count = jnp.maximum(count, 1.0)
        loss = loss_sum / count
        grads = jax.tree.map(lambda g: g / count, grads)
        grad_norm = optax.global_norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        with jax.named_scope("Optimizer"):
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
        buffers = state.buffers
        if stats is not None and parts.balance:
            model = parts.merge(params, buffers, frozen)
            model.update_router_bias(stats)
            updated = parts.buffers.flatten(nnx.state(model, BUFFER_TYPES))
            buffers = {key: updated[key] for key in buffers}      # a LoRA run's frozen codes stay out
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
        new_state = TrainState(
            step=state.step + finite.astype(jnp.int32),
            params=keep(params, state.params),
            buffers=keep(buffers, state.buffers),
            opt_state=keep(opt_state, state.opt_state),
            skipped=jnp.where(finite, 0, state.skipped + 1),
        )
        metrics = {"loss": loss, "grad_norm": grad_norm, "finite": finite, "tokens": count,
                   "skipped": new_state.skipped}
        if schedule is not None:
            metrics["learning_rate"] = schedule(state.step)
        if stats is not None:
            load = load_metrics(stats.expert_load)
            metrics["expert_load_max_over_mean"] = load.max_over_mean
            metrics["experts_idle_fraction"] = load.zero_fraction
            metrics["moe_dropped_assignments"] = stats.dropped
        return new_state, metrics

    if shardings is None:
        return jax.jit(train_step, donate_argnums=0)
    frozen = () if parts.frozen is None else (shardings.frozen,)
    return jax.jit(train_step, donate_argnums=0, in_shardings=(shardings.state, shardings.batch, *frozen),
                   out_shardings=(shardings.state, shardings.replicated))


def make_eval_step(parts: ModelParts, shardings: StepShardings | None = None):
    """The jitted ``eval_step(params, buffers, batch) -> (loss sum, mask sum, argmax predictions)``
    (predictions laid out like the batch under ``shardings``); a LoRA model's is
    ``eval_step(params, buffers, batch, frozen)``, with the adapters' dropout off."""

    def eval_step(params, buffers, batch, *frozen):
        model = parts.merge(params, buffers, frozen[0] if frozen else None)
        set_adapter_dropout(model, 0.0)
        out = model(batch["tokens"], segment_ids=batch["segment_ids"])
        loss_sum, count = masked_cross_entropy(out.logits, batch["targets"], batch["loss_mask"])
        return loss_sum, count, jnp.argmax(out.logits, axis=-1)

    if shardings is None:
        return jax.jit(eval_step)
    frozen = () if parts.frozen is None else (shardings.frozen,)
    return jax.jit(eval_step, in_shardings=(shardings.state.params, shardings.state.buffers, shardings.batch, *frozen),
                   out_shardings=(shardings.replicated, shardings.replicated, shardings.batch))


@functools.lru_cache(maxsize=16)
def active_parameters(config: ModelConfig) -> int:
    """`k3jax.model.param_counts`' active count, cached per (frozen, hashable) config."""
    return param_counts(config)[1]


def attn_res_mix_sources(config: ModelConfig) -> list[int]:
    """The number of sources of every AttnRes Mix one forward computes (SPEC §3): the attention
    Mix of each layer after the first, the FFN Mix of each layer and the output Mix; each reads
    the closed blocks so far plus the partial sum. Empty for ``attn_res: none``."""
    if config.attn_res.kind != "block":
        return []
    size, mixes, blocks = config.attn_res.block_size, [], 0
    for layer in range(config.num_layers):
        if blocks:
            mixes.append(blocks + 1)        # the mixer's input (layer 0 has no closed block yet)
        blocks += layer % size == 0         # p is appended as a source when a block starts
        mixes.append(blocks + 1)            # the FFN's input
    return mixes + [blocks + 1]             # the head's input


def forward_flops_per_token(config: ModelConfig, seq_len: int) -> dict[str, float]:
    """The model's forward FLOPs per token (2 per multiply-add) over sequences of ``seq_len``, by part:

        weights      2 * active parameters: every projection (KDA, MLA with its LoRA factors,
                     the dense FFN, the shared experts, the router, the latent down / up
                     projections of LatentMoE and the routed experts at top_k / num_experts of
                     their size), the conv taps, the norm gains and the LM head; the input
                     embedding is a lookup (excluded unless tied to the head)
        mla          2 * heads * (qk_head_dim + value_head_dim) * (T + 1) / 2 per MLA layer:
                     scores and the weighted values over the causal context (T + 1) / 2 keys on average
        kda          the chunk algorithm (`chunk_algorithm_flops`) per KDA layer, with the state
                     passed every `block_width` tokens as this implementation does, / T
        attn_res     6 * d * sources per Mix: each source's RMS and score (4 d) and the weighted sum (2 d)

    Not counted: softmax, activations, gates and other elementwise work (a few FLOPs per element),
    the loss. An implementation that computes more (every expert on every token with
    ``expert_matmul: dense``, the full T x T square of dense attention, the masked halves of the
    chunk form's C x C products) executes more than this model count.
    """
    active = active_parameters(config)
    n_mla = len(config.mla_layer_indices)
    mla, kda = config.mla, config.kda
    chunk = block_width(effective_chunk_size(seq_len, kda.chunk_size))
    delta_rule = chunk_algorithm_flops(1, seq_len, kda.num_value_heads, kda.head_dim, kda.head_dim, chunk) / seq_len
    return {"weights": 2.0 * active,
            "mla": n_mla * 2.0 * mla.num_heads * (mla.qk_head_dim + mla.value_head_dim) * (seq_len + 1) / 2,
            "kda": (config.num_layers - n_mla) * delta_rule,
            "attn_res": 6.0 * config.d_model * sum(attn_res_mix_sources(config))}


def training_flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 3 x the forward (`forward_flops_per_token`; the backward takes
    two products per forward product, one for the inputs' gradient and one for the weights')."""
    return 3.0 * sum(forward_flops_per_token(config, seq_len).values())


class RestoredModel(NamedTuple):
    model: nnx.Module
    config: Any               # the run's `k3jax.config.Config`
    meta: dict                # the checkpoint's metadata
    step: int


def _restore_model_at(directory, step: int) -> tuple[nnx.Module, Any, dict]:
    """``(model, config, meta)`` of checkpoint ``step``, its arrays verified."""
    from k3jax.checkpoint import CheckpointError, RunCheckpoints, checkpoint_directory, restore_subtree
    from k3jax.config import config_from_dict

    checkpoints = RunCheckpoints(checkpoint_directory(directory), read_only=True)
    try:
        meta = checkpoints.meta(step)
    finally:
        checkpoints.close()
    if not isinstance(meta.get("config"), dict):
        raise CheckpointError(f"checkpoint {step} in {checkpoints.directory} has no saved config")
    config = config_from_dict(meta["config"])
    if config.finetune.lora:
        from k3jax.finetune import restore_lora_model
        return restore_lora_model(directory, step, config, meta), config, meta
    parts, params, buffers = abstract_model(config.model)
    params, _ = restore_subtree(directory, "params", params, step)
    buffers, _ = restore_subtree(directory, "buffers", buffers, step)
    return parts.merge(params, buffers), config, meta


def restore_model(directory, step: int | None = None, report=None) -> RestoredModel:
    """The model of a trainer checkpoint (a run directory or its ``checkpoints/``), built from the
    config saved with it, on this process's first device (whatever devices wrote it). ``step`` None
    picks the newest checkpoint that restores: each newer one that is corrupted or unreadable is
    reported through ``report`` (default: a logging warning) and skipped. Only parameters and router
    biases are read (not the optimizer state), each verified against its saved checksum; a LoRA
    run's model is its base (from the run it names) with the adapters it trained. Raises
    `k3jax.checkpoint.CheckpointError` when there is none."""
    from k3jax.checkpoint import RunCheckpoints, checkpoint_directory, restore_newest_good

    checkpoints = RunCheckpoints(checkpoint_directory(directory), read_only=True)
    try:
        steps = [checkpoints.require_step(step)] if step is not None else checkpoints.steps()
        checkpoints.require_step(None)
    finally:
        checkpoints.close()
    report = report or logging.getLogger(__name__).warning
    step, (model, config, meta) = restore_newest_good(steps, functools.partial(_restore_model_at, directory), report)
    return RestoredModel(model, config, meta, step)
