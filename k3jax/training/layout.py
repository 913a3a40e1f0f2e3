"""A run's layout before any array exists: the mesh, the model's parts, the optimizer, the shapes."""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from k3jax.config import Config
from k3jax.sharding import StepShardings, abstract, check_run_fits, make_mesh, named_shardings, step_shardings
from k3jax.training.finetune import abstract_lora_model
from k3jax.training.optim import build_optimizer, learning_rate_schedule
from k3jax.training.state import TrainState, abstract_model, abstract_train_state


def run_optimizer(config: Config, axes: dict):
    """``(schedule, optimizer)`` of a run, for parameters with these logical axes."""
    opt = config.optimizer
    schedule = learning_rate_schedule(opt.schedule, opt.learning_rate, opt.schedule_steps or config.train.steps,
                                      opt.warmup_steps, opt.min_lr_ratio, opt.decay_fraction)
    optimizer = build_optimizer(name=opt.name, schedule=schedule, axes=axes, weight_decay=opt.weight_decay,
                                beta1=opt.beta1, beta2=opt.beta2, eps=opt.eps, grad_clip=opt.grad_clip)
    return schedule, optimizer


class RunLayout(NamedTuple):
    """What a run's train step is built from, before any array exists: the device mesh, the
    model's parts, the schedule and optimizer, and the train state as `jax.ShapeDtypeStruct`s
    carrying the shardings it lives with on the mesh (``shardings`` also lays out the batches).
    A LoRA run (`k3jax.training.finetune`) trains only its adapters; ``frozen`` is its base, laid out the
    same way (None otherwise)."""

    mesh: Any
    parts: Any
    schedule: Any
    optimizer: Any
    state: TrainState
    shardings: StepShardings
    frozen: Any = None


def lay_out_run(config: Config, devices: Sequence[Any] | None = None) -> RunLayout:
    """The `RunLayout` of ``config`` on ``devices`` (default: all devices; e.g. the compile-only TPU
    devices of `k3jax.tpu.compile_target`), from shapes only: nothing is allocated."""
    mesh = make_mesh(config.mesh, devices)
    check_run_fits(config, mesh)
    frozen = None
    if config.finetune.lora:
        lora = abstract_lora_model(config.model, config.finetune, config.train.seed, mesh, config.mesh)
        parts, params, buffers, frozen = lora
    else:
        parts, params, buffers = abstract_model(config.model, mesh, config.mesh)
    schedule, optimizer = run_optimizer(config, parts.params.axes())
    shapes = abstract_train_state(params, buffers, optimizer)
    shardings = step_shardings(shapes, parts.params.axes(), parts.buffers.axes(), mesh, config.mesh)
    if frozen is not None:
        shardings = shardings._replace(frozen=named_shardings(parts.frozen.axes(), frozen, config.mesh.rules, mesh))
        frozen = abstract(frozen, shardings.frozen)
    return RunLayout(mesh, parts, schedule, optimizer, abstract(shapes, shardings.state), shardings, frozen)
