"""``python -m train.plan CONFIG [key=value ...] [--devices N | --tpu TOPOLOGY]``: size a training run
before booking it.

    python -m train.plan configs/k3.yaml --devices 256 mesh.data=1 mesh.fsdp=4 mesh.expert=64 \\
        mesh.moe_dispatch=capacity train.batch_size=256 data.seq_len=4096
    python -m train.plan configs/kimi-linear-48b.yaml --tpu v5e:4x4 mesh.fsdp=16 train.batch_size=16

Compiles one train step ahead of time for N fake CPU devices (nothing is allocated: parameters,
optimizer state and batches are abstract arrays carrying their shardings) and prints, per device,
what `k3jax.training.plan.plan_train_step` measures (its docstring says how): the parameter,
optimizer-state, buffer and frozen-base shards; the compiled program's arguments, outputs,
temporaries and peak; its FLOPs; and its collective bytes, with the expert all-to-all and the
context axis apart. ``--layout-only`` stops before compiling (seconds, even for K3 on 256 devices).

CPU numbers are what XLA:CPU would allocate; an accelerator's compiler fuses and schedules
differently, so treat them as estimates. ``--tpu TOPOLOGY`` (e.g. ``v5p:4x4x4``; needs the ``tpu``
extra) compiles for that TPU slice instead, with the TPU compiler on compile-only devices
(`k3jax.tpu`), and adds each device's total against its HBM, the step's bytes accessed, its roofline
time and the MFU that implies; a step that does not fit is refused after the table (one line on
stderr naming the knobs, status 1). Bad input ends with one line on stderr and status 2.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

from k3jax.memory import format_bytes
from k3jax.tpu import Target, TargetError, compile_target, implied_mfu, roofline_seconds
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
        f"  compute (compiler)              {plan.flops / 1e12:10.3f} TFLOP per step (each loop body counted once)",
        "  collectives per step (result bytes):",
        *(f"    {name:<30}{format_bytes(value)}" for name, value in plan.collectives.items() if value),
        f"expert all-to-all bytes per token (all devices): {plan.all_to_all_bytes_per_token:,.0f}",
        f"context axis bytes per token (all devices): {plan.context_bytes_per_token:,.0f}",
        f"compiled in {plan.compile_seconds:.0f} s",
    ]
    return "\n".join(rows)


def device_total(plan: Plan) -> float:
    """The bytes a device holds at most: the compiled step's peak and its code, or (layout only)
    the resident shards."""
    return plan.resident if math.isnan(plan.temporaries) else plan.peak + plan.generated_code


def model_flops_per_device(plan: Plan, config) -> float:
    """The model's training FLOPs for one step (`k3jax.flops.training_flops`: 3 x the forward) per device."""
    from k3jax.flops import training_flops

    return training_flops(config.model, config.data.seq_len).total * plan.tokens_per_step / plan.devices


def hbm_bytes_at_least(plan: Plan) -> float:
    """A lower bound on the HBM bytes a step moves per device: the compiler's bytes accessed (each
    loop body counted once) or, when larger, its arguments and outputs (each resident byte read and
    each updated byte written once)."""
    return max(plan.bytes_accessed, plan.arguments + plan.outputs)


def tpu_figures(plan: Plan, config, target: Target) -> dict:
    """The TPU side of a plan: the device's HBM and what fits, the roofline and the MFU it implies."""
    figures = {"topology": target.topology, "chip": target.chip.name, "chips": target.chips,
               "device_hbm": target.device_hbm, "device_total": device_total(plan)}
    if not math.isnan(plan.temporaries):
        hbm_bytes = hbm_bytes_at_least(plan)
        seconds = roofline_seconds(plan.matmul_flops, hbm_bytes, target)
        model = model_flops_per_device(plan, config)
        figures.update(hbm_bytes=hbm_bytes, compute_seconds=plan.matmul_flops / target.device_flops,
                       memory_seconds=hbm_bytes / target.device_bandwidth,
                       roofline_seconds=seconds, model_flops=model, mfu=implied_mfu(model, seconds, target))
    return figures


def tpu_report(figures: dict, plan: Plan, target: Target) -> str:
    """`tpu_figures` as lines under the plan's table."""
    total, hbm = figures["device_total"], figures["device_hbm"]
    spare = f"fits, {format_bytes(hbm - total).strip()} to spare" if total <= hbm else "does NOT fit"
    rows = [f"TPU {target.describe()}; per device: {format_bytes(hbm).strip()} HBM, "
            f"{target.device_flops / 1e12:.0f} TFLOP/s bf16, {target.device_bandwidth / 1e9:,.0f} GB/s"]
    if "mfu" not in figures:
        return "\n".join(rows + [f"  resident                        {format_bytes(total)}   {spare}"])
    bound = "compute" if figures["compute_seconds"] >= figures["memory_seconds"] else "memory"
    return "\n".join(rows + [
        f"  generated code                  {format_bytes(plan.generated_code)}",
        f"  total (peak + code)             {format_bytes(total)}   {spare}",
        f"  bytes accessed (compiler)       {format_bytes(plan.bytes_accessed)} per step (loop bodies once)",
        f"  HBM bytes, at least             {format_bytes(figures['hbm_bytes'])} per step (or arguments + outputs)",
        f"  matmul FLOPs (traced)           {plan.matmul_flops / 1e12:10.4g} TFLOP per step (loops x trip counts)",
        f"  roofline step time              {figures['roofline_seconds'] * 1e3:10.3f} ms   = max(matmul FLOPs / peak "
        f"{figures['compute_seconds'] * 1e3:.3f} ms, HBM bytes / bandwidth {figures['memory_seconds'] * 1e3:.3f} ms), "
        f"{bound}-bound",
        f"  model FLOPs (3 x forward)       {figures['model_flops'] / 1e12:10.4g} TFLOP per step -> MFU at the "
        f"roofline {100 * figures['mfu']:.1f}%"])


def fit_knobs(config, plan: Plan, device_memory: float) -> str:
    """The settings that shrink a train step's bytes per device, those not already at their smallest;
    when the resident shards alone overflow ``device_memory``, only those that shrink them."""
    batch_devices = math.prod(plan.mesh[axis] for axis in config.mesh.rules.batch)
    rows = config.train.batch_size // config.train.grad_accum // batch_devices
    knobs = ["a larger --tpu topology (mesh.fsdp / mesh.expert over more devices)"]
    if plan.resident <= device_memory:
        knobs += [*(["train.grad_accum (fewer sequences per micro-batch)"] if rows > 1 else []),
                  f"data.seq_len (now {config.data.seq_len} tokens per sequence, {rows} per device and micro-batch)",
                  *(["model.remat=full"] if config.model.remat != "full" else [])]
    if not config.finetune.lora:
        knobs.append("finetune.lora_rank (a frozen base without optimizer state)")
    if config.model.moe.expert_format != "mxfp4":
        knobs.append("model.moe.expert_format=mxfp4 (frozen experts, 0.53 B/weight)")
    return ", ".join(knobs)


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m train.plan", description="Per-device memory, compute and "
                                     "communication of a train step, compiled for fake CPU devices or a TPU slice.")
    parser.add_argument("config", help="YAML config file, or a packaged config's name (e.g. configs/k3.yaml, k3)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value settings, e.g. mesh.expert=64")
    parser.add_argument("--devices", type=int, help="device count (default: the product of the mesh sizes)")
    parser.add_argument("--tpu", metavar="TOPOLOGY", help="compile for this TPU slice's compile-only devices, "
                        "e.g. v5p:4x4x4, v6e:4x4, tpu7x:4x4x4 (needs the tpu extra)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    parser.add_argument("--layout-only", action="store_true", help="resident shards only, without compiling")
    return parser.parse_intermixed_args(argv)


def cpu_device_count(args, config) -> int:
    """How many fake CPU devices to plan on: ``--devices`` or the product of the mesh sizes."""
    from k3jax.config import ConfigError

    sizes = config.mesh.sizes.values()
    if args.devices is not None and not 1 <= args.devices <= MAX_DEVICES:
        raise ConfigError("--devices", f"must be in 1..{MAX_DEVICES}, got {args.devices}")
    devices = args.devices or (math.prod(sizes) if -1 not in sizes else None)
    if devices is None:
        raise ConfigError("mesh", "a mesh axis is -1: give the device count with --devices")
    if devices > MAX_DEVICES:
        raise ConfigError("mesh", f"{devices} devices; plan at most {MAX_DEVICES} fake CPU devices")
    return devices


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from k3jax.config import ConfigError, load_config, resolve_config

    try:
        config = load_config(resolve_config(args.config), args.overrides)
        if args.tpu and args.devices is not None:
            raise ConfigError("--devices", "--tpu takes its devices from the topology; leave --devices out")
        import jax

        jax.config.update("jax_platforms", "cpu")
        target = compile_target(args.tpu) if args.tpu else None
        jax.config.update("jax_num_cpu_devices", 1 if target else cpu_device_count(args, config))
        devices = target.devices if target else None
        refusal = None
        try:
            plan = plan_train_step(config, compile=not args.layout_only, devices=devices)
        except jax.errors.JaxRuntimeError as error:   # the TPU compiler's own refusal: it does not fit
            if not (target and str(error).startswith("RESOURCE_EXHAUSTED")):
                raise
            refusal = f"the TPU compiler: {str(error).splitlines()[0]}"
            plan = plan_train_step(config, compile=False, devices=devices)
    except (ConfigError, TargetError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    figures = tpu_figures(plan, config, target) if target else {}
    if target and refusal is None and figures["device_total"] > figures["device_hbm"]:
        refusal = (f"{format_bytes(figures['device_total']).strip()} per device > "
                   f"{format_bytes(figures['device_hbm']).strip()} of HBM on {target.topology}")
    if args.json:
        print(json.dumps({**plan._asdict(), "peak": plan.peak, "resident": plan.resident,
                          "all_to_all_bytes_per_token": plan.all_to_all_bytes_per_token if plan.collectives else None,
                          "context_bytes_per_token": plan.context_bytes_per_token if plan.collectives else None,
                          **({"tpu": figures} if target else {})}))
    else:
        print(report(plan, config) + ("\n" + tpu_report(figures, plan, target) if target else ""))
    if refusal:
        print(f"refused: {refusal}; to fit, try {fit_knobs(config, plan, figures['device_hbm'])}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
