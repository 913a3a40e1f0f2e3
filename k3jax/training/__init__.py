"""The library of training: everything a run is made of, importable by the launcher (``python -m
train``), tests, benchmarks and users' own scripts.

    state      the train state: a model split into flat param / buffer dicts (`split_model`,
               `StateCodec`, `ModelParts`), `TrainState`, its abstract and sharded creation
    steps      the masked loss, the train step (accumulation, non-finite skip, router balance)
               and the eval step
    optim      learning-rate schedules, AdamW and per-head Muon
    finetune   LoRA / QLoRA: the adapted model's split, the adapters' first values, the frozen base
    layout     a run's mesh, parts, optimizer and state shapes before any array exists (`lay_out_run`)
    trainer    `Trainer`: set up, the train loop, checkpoints, held-out evaluation
    resume     where a run starts: resumed from its checkpoints (checked against the config) or initialised
    evaluation held-out scores (loss, bits per byte, MQAR recall) and the evaluation's log lines
    rl         `RLTrainer` (``train.objective=grpo``): rollouts and policy updates, rollouts.jsonl
    preference `PreferenceTrainer` (``train.objective`` dpo | ipo | orpo | simpo): the pair losses
    rollout    groups of completions on forked sessions, with the policy's log-probs; tool episodes
    grpo       group-relative advantages, the update's rows, the clipped policy-gradient objective
    rewards    built-in rewards and ``module:function`` ones
    environments  multi-turn tool environments (`Calculator`), `ToolCallError`
    run_dir    the run directory: creation, the lock, atomic writes, `RunError`
    metrics    metrics.jsonl (written and read), TensorBoard, the progress line
    signals    SIGTERM / SIGINT recorded for a clean stop (no JAX: the CLI installs it first)
    plan       a train step's per-device memory, FLOPs and collectives, compiled ahead of time

FLOP counts live in `k3jax.flops`; a trained model is loaded to run it by `k3jax.inference`. The names below are importable from the package itself
(``from k3jax.training import Trainer``); each submodule loads on first use, so that importing
one light module (`signals`, `metrics`) does not start JAX.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "state": ("BUFFER_TYPES", "ModelParts", "StateCodec", "TrainState", "abstract_model", "abstract_train_state",
              "init_train_state", "sharded_state_from_params", "sharded_train_state", "split_model"),
    "steps": ("make_eval_step", "make_train_step", "masked_cross_entropy"),
    "optim": ("build_optimizer", "learning_rate_schedule"),
    "layout": ("RunLayout", "lay_out_run"),
    "trainer": ("Trainer",),
    "rl": ("RLTrainer",),
    "preference": ("PreferenceTrainer",),
    "rollout": ("Completion", "Rollout"),
    "grpo": ("group_advantages", "policy_objective"),
    "rewards": ("RewardError",),
    "environments": ("ToolCallError", "Turn"),
    "run_dir": ("RunError",),
    "metrics": ("read_metrics",),
    "signals": ("StopRequested", "StopSignals"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
