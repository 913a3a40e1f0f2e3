"""``python -m train.plan CONFIG [key=value ...] [--devices N]``: size a training run before booking it.

    python -m train.plan configs/k3.yaml --devices 256 mesh.data=1 mesh.fsdp=4 mesh.expert=64 \\
        mesh.moe_dispatch=capacity train.batch_size=256 data.seq_len=4096

Compiles one train step ahead of time for N fake CPU devices (nothing is allocated: parameters,
optimizer state and batches are abstract arrays carrying their shardings) and prints, per device,
what `k3jax.training.plan.plan_train_step` measures (its docstring says how): the parameter,
optimizer-state, buffer and frozen-base shards; the compiled program's arguments, outputs,
temporaries and peak; its FLOPs; and its collective bytes, with the expert all-to-all and the
context axis apart. ``--layout-only`` stops before compiling (seconds, even for K3 on 256 devices).

CPU numbers are what XLA:CPU would allocate; an accelerator's compiler fuses and schedules
differently, so treat them as estimates. Bad input ends with one line on stderr and status 2.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

from k3jax.memory import format_bytes
from k3jax.training.plan import Plan, plan_train_step


MAX_DEVICES = 16384   # fake CPU devices the planner creates (each costs host memory and start-up time)


def report(plan: Plan, config) -> str:
    """The plan as a table."""
    moe = config.model.moe
    mesh = " ".join(f"{name}={size}" for name, size in plan.mesh.items())
    finetune = config.finetune
    tuning = (f"LoRA rank {finetune.lora_rank} on a frozen base ({plan.trainable_count:,} trainable, "
              f"{plan.frozen_count:,} frozen parameters)" if finetune.lora else
              f"full training ({plan.trainable_count:,} parameters)")
    rows = [
        f"train step on {plan.devices} devices ({mesh}), batch {config.train.batch_size} x {config.data.seq_len} "
        f"tokens, grad_accum {config.train.grad_accum}, moe_dispatch {config.mesh.moe_dispatch}"
        + (f" (capacity_factor {config.mesh.capacity_factor})" if config.mesh.moe_dispatch == "capacity" else "")
        + (f", context attention {config.mesh.context_attention}" if plan.mesh.get("context", 1) > 1 else ""),
        f"model: {config.model.num_layers} layers, d {config.model.d_model}, {moe.num_experts} experts "
        f"top-{moe.top_k} ({moe.expert_format}), latent {moe.latent_dim or 'none (plain MoE)'}, "
        f"{config.model.compute_dtype} compute, {config.optimizer.name}; {tuning}",
        "per device:",
        f"  {'parameters (adapters)' if finetune.lora else 'parameters':<32}{format_bytes(plan.parameters)}",
        *([f"  {'frozen base (MXFP4 packed)' if moe.expert_format == 'mxfp4' else 'frozen base parameters':<32}"
            f"{format_bytes(plan.frozen_parameters)}"] if finetune.lora else []),
        f"  optimizer state                 {format_bytes(plan.optimizer_state)}",
        f"  buffers (biases, MXFP4 experts) {format_bytes(plan.buffers)}",
        f"  resident (params + state)       {format_bytes(plan.resident)}",
    ]
    if math.isnan(plan.temporaries):
        return "\n".join(rows + ["(layout only: not compiled)"])
    rows += [
        f"  arguments (state + batch)       {format_bytes(plan.arguments)}",
        f"  outputs (new state, donated)    {format_bytes(plan.outputs)}",
        f"  temporaries (activations, work) {format_bytes(plan.temporaries)}",
        f"  peak (args + outputs - aliased + temporaries) {format_bytes(plan.peak).strip()}",
        f"  compute                         {plan.flops / 1e12:10.3f} TFLOP per step",
        "  collectives per step (result bytes):",
        *(f"    {name:<30}{format_bytes(value)}" for name, value in plan.collectives.items() if value),
        f"expert all-to-all bytes per token (all devices): {plan.all_to_all_bytes_per_token:,.0f}",
        f"context axis bytes per token (all devices): {plan.context_bytes_per_token:,.0f}",
        f"compiled in {plan.compile_seconds:.0f} s",
    ]
    return "\n".join(rows)


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m train.plan", description="Per-device memory, compute and "
                                     "communication of a train step, compiled for fake CPU devices.")
    parser.add_argument("config", help="YAML config file, or a packaged config's name (e.g. configs/k3.yaml, k3)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value settings, e.g. mesh.expert=64")
    parser.add_argument("--devices", type=int, help="device count (default: the product of the mesh sizes)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    parser.add_argument("--layout-only", action="store_true", help="resident shards only, without compiling")
    return parser.parse_intermixed_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from k3jax.config import ConfigError, load_config, resolve_config

    try:
        config = load_config(resolve_config(args.config), args.overrides)
        sizes = config.mesh.sizes.values()
        if args.devices is not None and not 1 <= args.devices <= MAX_DEVICES:
            raise ConfigError("--devices", f"must be in 1..{MAX_DEVICES}, got {args.devices}")
        devices = args.devices or (math.prod(sizes) if -1 not in sizes else None)
        if devices is None:
            raise ConfigError("mesh", "a mesh axis is -1: give the device count with --devices")
        if devices > MAX_DEVICES:
            raise ConfigError("mesh", f"{devices} devices; plan at most {MAX_DEVICES} fake CPU devices")
        import jax

        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", devices)
        plan = plan_train_step(config, compile=not args.layout_only)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    if args.json:
        print(json.dumps({**plan._asdict(), "peak": plan.peak, "resident": plan.resident,
                          "all_to_all_bytes_per_token": plan.all_to_all_bytes_per_token if plan.collectives else None,
                          "context_bytes_per_token": plan.context_bytes_per_token if plan.collectives else None}))
    else:
        print(report(plan, config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
