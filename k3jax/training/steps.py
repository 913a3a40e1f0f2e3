"""The train and eval steps: the masked loss, gradients (with accumulation), the update.

One train step (jitted, donated):
    loss    = sum(mask * CE(logits, targets)) / sum(mask)     over the global batch; with
              gradient accumulation the batch is split into micro-batches whose gradients add up
              (another ``objective``, e.g. GRPO's policy loss, gives its own sum and count)
    update  optax; skipped (state unchanged) when the loss, the gradient norm or any updated
            parameter is not finite
    balance the routers' selection biases from this step's routing statistics (SPEC §4)
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from k3jax.layers.lora import set_adapter_dropout
from k3jax.ops.moe import MoEStats, load_metrics
from k3jax.sharding import StepShardings
from k3jax.training.state import BUFFER_TYPES, ModelParts, TrainState


def all_finite(tree) -> jax.Array:
    """True when every element of every leaf of ``tree`` is finite (a bool scalar)."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(tree)]))


def masked_cross_entropy(logits, targets, mask):
    """``(sum of mask * CE, sum of mask)`` with fp32 logits ``[B, T, V]``."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    mask = mask.astype(jnp.float32)
    return jnp.sum(losses * mask), jnp.sum(mask)


def language_model_objective(logits, batch):
    """The objective of ``train.objective=lm``: ``(sum of mask * CE, sum of mask, {})``.

    An objective maps a micro-batch's logits ``[B, T, V]`` and the batch to ``(loss sum, count,
    metrics)``: the step minimises sum / count over the whole batch; ``metrics`` are scalars summed
    over micro-batches (those named ``*_max``: their maximum)."""
    loss_sum, count = masked_cross_entropy(logits, batch["targets"], batch["loss_mask"])
    return loss_sum, count, {}


def _forward_loss(parts: ModelParts, objective, params, buffers, batch, frozen=None, dropout_key=None):
    """``(loss sum, (count, MoE stats, objective metrics))`` of one micro-batch."""
    model = parts.merge(params, buffers, frozen, dropout_key)
    out = model(batch["tokens"], segment_ids=batch["segment_ids"])
    with jax.named_scope("Loss"):            # names for profiles (`k3jax.layers.scope`)
        loss_sum, count, metrics = objective(out.logits, batch)
    return loss_sum, (count, out.moe_stats, metrics)


def _merge_micro_batch_metrics(metrics: dict) -> dict:
    """Objective metrics stacked ``[A]`` over micro-batches -> summed (``*_max``: the maximum)."""
    return {name: jnp.max(value, axis=0) if name.endswith("_max") else jnp.sum(value, axis=0)
            for name, value in metrics.items()}


def _merge_micro_batch_stats(stats: MoEStats | None) -> MoEStats | None:
    """Stats stacked ``[A, layers, ...]`` over micro-batches -> one step's ``[layers, ...]``."""
    if stats is None:
        return None
    tokens = lambda x: jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, *x.shape[3:])  # noqa: E731
    summed = lambda x: jnp.sum(x, axis=0)  # noqa: E731
    return MoEStats(summed(stats.expert_load), jax.tree.map(tokens, stats.router_scores), tokens(stats.token_mask),
                    summed(stats.dropped), jax.tree.map(summed, stats.bias_histogram))


def _gradients(parts, objective, params, buffers, batch, accumulation: int, frozen=None, dropout_key=None):
    """Summed loss, count, summed gradients, MoE stats and objective metrics over ``accumulation``
    micro-batches (micro-batch i draws its dropout from ``fold_in(dropout_key, i)``)."""
    grad_fn = jax.value_and_grad(functools.partial(_forward_loss, parts, objective), has_aux=True)
    if accumulation == 1:
        (loss_sum, (count, stats, metrics)), grads = grad_fn(params, buffers, batch, frozen, dropout_key)
        return loss_sum, count, grads, stats, metrics
    micro = jax.tree.map(lambda x: x.reshape(accumulation, -1, *x.shape[1:]), batch)

    def accumulate(carry, indexed):
        loss_sum, count, grads = carry
        index, micro_batch = indexed
        key = None if dropout_key is None else jax.random.fold_in(dropout_key, index)
        (loss, (n, stats, metrics)), g = grad_fn(params, buffers, micro_batch, frozen, key)
        return (loss_sum + loss, count + n, jax.tree.map(jnp.add, grads, g)), (stats, metrics)

    zeros = jax.tree.map(jnp.zeros_like, params)
    (loss_sum, count, grads), (stats, metrics) = jax.lax.scan(accumulate, (0.0, 0.0, zeros),
                                                              (jnp.arange(accumulation), micro))
    return loss_sum, count, grads, _merge_micro_batch_stats(stats), _merge_micro_batch_metrics(metrics)


def _balanced_buffers(parts: ModelParts, params, buffers, frozen, stats: MoEStats | None):
    """``buffers`` with the routers' selection biases moved by the step's routing ``stats``
    (`update_router_bias`, under the updated ``params``); unchanged without stats or balancing."""
    if stats is None or not parts.balance:
        return buffers
    model = parts.merge(params, buffers, frozen)
    model.update_router_bias(stats)
    updated = parts.buffers.flatten(nnx.state(model, BUFFER_TYPES))
    return {key: updated[key] for key in buffers}      # a LoRA run's frozen codes stay out


def _moe_metrics(stats: MoEStats | None) -> dict:
    """The step's expert balance: max over mean load, the idle experts' fraction, dropped assignments."""
    if stats is None:
        return {}
    load = load_metrics(stats.expert_load)
    return {"expert_load_max_over_mean": load.max_over_mean, "experts_idle_fraction": load.zero_fraction,
            "moe_dropped_assignments": stats.dropped}


def make_train_step(parts: ModelParts, optimizer: optax.GradientTransformation, *, accumulation: int = 1,
                    schedule: optax.Schedule | None = None, shardings: StepShardings | None = None,
                    dropout_seed: int = 0, objective=language_model_objective):
    """The jitted ``train_step(state, batch) -> (state, metrics)`` (the state is donated) minimising
    ``objective`` (`language_model_objective`; its metrics join the step's); with
    ``shardings`` the state keeps its layout across steps and the metrics come back replicated.
    What the model computes on the mesh is in ``parts.graphdef`` (`abstract_model` with a mesh).
    A LoRA model's step is ``train_step(state, batch, frozen)`` (the frozen base, not donated); its
    adapters' dropout at step n draws from ``fold_in(key(dropout_seed), n)``."""

    def train_step(state: TrainState, batch, *frozen):
        dropout_key = None if parts.dropout is None else jax.random.fold_in(jax.random.key(dropout_seed), state.step)
        frozen = frozen[0] if frozen else None
        loss_sum, count, grads, stats, objective_metrics = _gradients(
            parts, objective, state.params, state.buffers, batch, accumulation, frozen, dropout_key)
        count = jnp.maximum(count, 1.0)
        loss = loss_sum / count
        grads = jax.tree.map(lambda g: g / count, grads)
        grad_norm = optax.global_norm(grads)
        with jax.named_scope("Optimizer"):
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & all_finite(params)
        buffers = _balanced_buffers(parts, params, state.buffers, frozen, stats)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
        new_state = TrainState(
            step=state.step + finite.astype(jnp.int32),
            params=keep(params, state.params),
            buffers=keep(buffers, state.buffers),
            opt_state=keep(opt_state, state.opt_state),
            skipped=jnp.where(finite, 0, state.skipped + 1),
        )
        metrics = {"loss": loss, "grad_norm": grad_norm, "finite": finite, "tokens": count,
                   "skipped": new_state.skipped, **objective_metrics}
        if schedule is not None:
            metrics["learning_rate"] = schedule(state.step)
        return new_state, {**metrics, **_moe_metrics(stats)}

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
