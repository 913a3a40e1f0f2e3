"""Preference tuning on pairs (``train.objective`` dpo | ipo | orpo | simpo, ``data.kind=preferences``,
settings ``preference.*``): DPO (arXiv 2305.18290), IPO (arXiv 2310.12036), ORPO (arXiv 2403.07691),
SimPO (arXiv 2405.14734).

A pair k is two sequences of one row (`k3jax.data.PreferenceDataset`: segments 2k + 1 and 2k + 2),
prompt + chosen reply c and prompt + rejected reply r. With l_t the policy's log-prob of reply token
t, l^ref_t the reference policy's:

    pi_y  = sum_{t in y} l_t         rho_y = sum_{t in y} l^ref_t        |y| = reply tokens of y
    mean_y = pi_y / |y|              log odds_y = mean_y - log(1 - exp(mean_y))

    dpo    h = beta [(pi_c - rho_c) - (pi_r - rho_r)]          loss = -log sigma(h)
    ipo    h = (pi_c - rho_c) - (pi_r - rho_r)                 loss = (h - 1 / (2 beta))^2
    simpo  h = beta mean_c - beta mean_r - gamma               loss = -log sigma(h)
    orpo   loss = -mean_c + lambda (-log sigma(log odds_c - log odds_r))

and the step minimises the mean over the batch's pairs. The implicit rewards logged are
``reward_y`` = beta (pi_y - rho_y) (dpo, ipo), beta mean_y (simpo) and mean_y (orpo); ``margin`` =
reward_c - reward_r and ``accuracy`` the share of pairs with reward_c > reward_r, each a mean over
pairs; ``logprob_accuracy`` is the share with pi_c > pi_r, the policy's own preference, meaningful
before any step too (beta = ``preference.beta``, gamma = ``preference.simpo_margin``, lambda = ``preference.orpo_weight``).

The reference (dpo, ipo) is the policy the run starts from: ``init_from``'s parameters, restored once
more (a full fine-tune holds one more copy of the trained parameters, and computes their log-probs
in one more forward per step), or for LoRA / QLoRA the frozen base itself (the adapters set to zero:
no extra parameter memory). ORPO and SimPO need no reference.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k3jax.config import PREFERENCE_OBJECTIVES, REFERENCE_OBJECTIVES, ConfigError, PreferenceConfig
from k3jax.data import PreferenceDataset
from k3jax.sharding import compiled_together
from k3jax.training.grpo import make_logprob_step, token_logprobs
from k3jax.training.steps import make_train_step
from k3jax.training.trainer import Trainer

PAIR_METRICS = ("reward_chosen", "reward_rejected", "margin", "accuracy", "logprob_accuracy")


def pair_sums(values: jax.Array, batch) -> tuple[jax.Array, jax.Array]:
    """Per-pair sums ``(chosen [B, P], rejected [B, P])`` of ``values [B, T]`` over each pair's reply
    tokens (``loss_mask``), P = (T + 1) // 4 pair slots per row (a sequence has at least two tokens)."""
    segments, mask = batch["segment_ids"], batch["loss_mask"]
    rows, positions = segments.shape
    slots = (positions + 1) // 4
    pair = jnp.where(segments > 0, jnp.arange(rows)[:, None] * slots + (segments - 1) // 2, rows * slots)
    chosen = (segments % 2 == 1).astype(values.dtype)
    masked = values * mask

    def per_pair(x):
        return jax.ops.segment_sum(x.reshape(-1), pair.reshape(-1), rows * slots + 1)[:-1].reshape(rows, slots)

    return per_pair(masked * chosen), per_pair(masked * (1.0 - chosen))


def pair_losses(kind: str, settings: PreferenceConfig, pi, rho, lengths):
    """``(loss, reward_chosen, reward_rejected)`` per pair (module docstring) from the pairs' policy
    log-prob sums ``pi = (pi_c, pi_r)``, reference sums ``rho`` (None without a reference) and reply
    lengths ``lengths = (|c|, |r|)``, each ``[...]``."""
    beta = settings.beta
    if kind in REFERENCE_OBJECTIVES:
        reward_c, reward_r = beta * (pi[0] - rho[0]), beta * (pi[1] - rho[1])
        if kind == "dpo":
            return -jax.nn.log_sigmoid(reward_c - reward_r), reward_c, reward_r
        h = (pi[0] - rho[0]) - (pi[1] - rho[1])
        return (h - 1.0 / (2.0 * beta)) ** 2, reward_c, reward_r
    mean_c, mean_r = pi[0] / jnp.maximum(lengths[0], 1.0), pi[1] / jnp.maximum(lengths[1], 1.0)
    if kind == "simpo":
        reward_c, reward_r = beta * mean_c, beta * mean_r
        return -jax.nn.log_sigmoid(reward_c - reward_r - settings.simpo_margin), reward_c, reward_r
    if kind == "orpo":
        log_odds = lambda mean: mean - jnp.log(-jnp.expm1(mean))  # noqa: E731 - log(p / (1 - p)), p = exp(mean)
        ratio = -jax.nn.log_sigmoid(log_odds(mean_c) - log_odds(mean_r))
        return -mean_c + settings.orpo_weight * ratio, mean_c, mean_r
    raise ValueError(f"unknown preference objective {kind!r}")


def preference_sums(kind: str, settings: PreferenceConfig, logprobs, reference_logprobs, batch):
    """``(loss sum, pairs, metrics)`` over the batch's pairs from token log-probs ``[B, T]`` (policy
    and, for dpo / ipo, reference): metrics are the sums over pairs of `PAIR_METRICS`."""
    pi = pair_sums(logprobs, batch)
    rho = None if reference_logprobs is None else pair_sums(reference_logprobs, batch)
    lengths = pair_sums(jnp.ones_like(logprobs), batch)
    present = (lengths[0] > 0).astype(jnp.float32)
    loss, reward_c, reward_r = pair_losses(kind, settings, pi, rho, lengths)
    total = lambda x: jnp.sum(jnp.where(present > 0, x, 0.0))  # noqa: E731
    margin = jax.lax.stop_gradient(reward_c - reward_r)
    return total(loss), jnp.sum(present), {
        "reward_chosen": total(jax.lax.stop_gradient(reward_c)), "reward_rejected": total(jax.lax.stop_gradient(reward_r)),
        "margin": total(margin), "accuracy": total((margin > 0).astype(jnp.float32)),
        "logprob_accuracy": total((pi[0] > pi[1]).astype(jnp.float32))}


def preference_objective(kind: str, settings: PreferenceConfig):
    """The train step's objective (`k3jax.training.steps.make_train_step`): `preference_sums` of the
    logits' log-probs; dpo / ipo read the batch's ``reference_logprobs``."""

    def objective(logits, batch):
        return preference_sums(kind, settings, token_logprobs(logits, batch["targets"]),
                               batch.get("reference_logprobs"), batch)

    return objective


class PreferenceTrainer(Trainer):
    """`Trainer` of the preference objectives (module docstring): the same loop and checkpoints, the
    reference's log-probs added to each batch (dpo, ipo), the pairs' metrics logged, and held-out
    evaluation of the preference loss, margin and accuracy."""

    objectives = PREFERENCE_OBJECTIVES

    def _check_data(self) -> None:
        if not isinstance(self.data, PreferenceDataset):
            raise ConfigError("data.kind", f"train.objective={self.config.train.objective} needs data.kind=preferences")
        if self.config.train.eval_batches and not self.data.num_rows("heldout"):
            raise ConfigError("train.eval_batches", f"{self.config.train.eval_batches}, but the data's held-out split "
                                                    f"is empty; set train.eval_batches=0 or raise data.heldout_fraction")

    def _build_steps(self) -> None:
        config, kind = self.config, self.config.train.objective
        step = compiled_together(
            make_train_step(self.parts, self.optimizer, accumulation=config.train.grad_accum, schedule=self.schedule,
                            shardings=self.shardings, dropout_seed=config.train.seed,
                            objective=preference_objective(kind, config.preference)), "train step")
        self.logprob_step = make_logprob_step(self.parts, self.shardings)
        self.reference = self._reference_params() if kind in REFERENCE_OBJECTIVES else None
        self.pair_sums = jax.jit(functools.partial(preference_sums, kind, config.preference))
        if kind not in REFERENCE_OBJECTIVES:
            self.train_step = step
            return

        def train_step(state, batch, *frozen):
            return step(state, {**batch, "reference_logprobs": self._reference_logprobs(batch)}, *frozen)

        self.train_step = train_step

    def _loop(self, signals, log, board, progress, *args) -> None:
        if self.position == 0:
            self._periodic_evaluation(log, board, progress)   # the policy before tuning too
        super()._loop(signals, log, board, progress, *args)

    def _record(self, step: int, metrics: dict, *args) -> dict:
        record = super()._record(step, metrics, *args)
        pairs = max(float(metrics["tokens"]), 1.0)
        return {**record, "pairs": int(metrics["tokens"]), **{name: float(metrics[name]) / pairs for name in PAIR_METRICS}}

    def evaluate(self, signals=None) -> dict:
        """The preference loss, rewards, margin and accuracy over the pairs of ``train.eval_batches``
        held-out batches (batch ``i``: held-out batch ``i``, so evaluations of one state are equal;
        a held-out split smaller than that is read again)."""
        sums, pairs = {"loss": 0.0, **{name: 0.0 for name in PAIR_METRICS}}, 0.0
        for index in range(self.config.train.eval_batches):
            if signals is not None and signals.received:
                break
            batch = self._device_batch(self._host_batch(index, split="heldout"))
            logprobs = self.logprob_step(self.state.params, self.state.buffers, batch, *self.frozen_args)
            reference = self._reference_logprobs(batch) if self.reference_needed else None
            loss, count, metrics = jax.device_get(self.pair_sums(logprobs, reference, batch))
            sums["loss"] += float(loss)
            pairs += float(count)
            for name in PAIR_METRICS:
                sums[name] += float(metrics[name])
        if not pairs:
            return {}
        return {**{f"heldout_{name}": value / pairs for name, value in sums.items()}, "heldout_pairs": int(pairs)}

    @property
    def reference_needed(self) -> bool:
        return self.config.train.objective in REFERENCE_OBJECTIVES
