"""``python -m eval.plan MODEL [key=value ...] --devices N | --mesh AXIS=N,...``: the memory plan of
running a model before booking the devices (layout only: no weights read, no device created).

    python -m eval.plan configs/kimi-linear-48b.yaml --mesh tensor=8 --batch 64 --context 32768 \\
        --dtype bfloat16 --device-memory 80GiB

MODEL is a run directory (its saved config: a trained, fine-tuned or imported run), a YAML config
or a packaged config's name (``k3``), or a Hugging Face ``config.json`` (read as an import of it
would be: MXFP4 experts stay packed when the file declares them); ``key=value`` overrides use the
trainer's keys. Prints, per device, what `k3jax.inference.plan.plan_running` computes (its
docstring has the arithmetic): the weights (whole replicated arrays and the blocks of the split
ones), the sessions' KDA states, conv tails and MLA pages, estimates of one batched decode step's
and one prefill piece's activations and temporaries, and their total against ``--device-memory``.
A layout that does not fit is refused (the table, then one line on stderr naming the knobs that
would make it fit, status 1). ``--compile`` also compiles the real decode step and prefill piece
for fake CPU devices and prints what XLA:CPU allocates (minutes for big models; an accelerator's
compiler fuses and schedules differently). ``--tpu TOPOLOGY`` (the ``tpu`` extra) compiles them for
that TPU slice instead, with the TPU compiler on compile-only devices (`k3jax.tpu`): the mesh then
spans the slice's devices and ``--device-memory`` defaults to a device's HBM. Bad input is one line
on stderr and status 2.
"""
from __future__ import annotations

import math
import pathlib
import sys

import jax

from k3jax.checkpoint import CheckpointError
from k3jax.config import ConfigError, config_from_dict, load_config, resolve_config, to_dict
from k3jax.convert.errors import ConvertError
from k3jax.convert.importer import hf_run_config
from k3jax.inference import InputError
from k3jax.inference.layout import MeshError, mesh_sizes, parse_mesh
from k3jax.inference.load import locate_checkpoint, saved_meta
from k3jax.inference.plan import (compiled_activations, describe_mesh, model_weights, plan_running,
                                  refusal)
from k3jax.memory import format_bytes
from k3jax.tpu import TargetError, compile_target

from .flags import OneLineParser, byte_count

# What each dimension of a session pool's block is (`k3jax.sessions.paged.Pools`).
POOL_DIMENSIONS = (("sessions", "layers", "heads", "", ""), ("sessions", "layers", "taps", "channels"),
                   ("layers", "pages", "tokens", ""))
MAX_COMPILE_DEVICES = 512     # fake CPU devices --compile creates (each costs host memory and start-up time)


def parse_args(argv):
    parser = OneLineParser(prog="python -m eval.plan", description="Per-device memory of running a model on a "
                           "mesh, from shapes alone: weights, sessions, activations, and whether it fits.")
    parser.add_argument("model", help="a run directory, a YAML config or packaged config name (e.g. k3), or a "
                                      "Hugging Face config.json")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value settings, e.g. model.moe.expert_format=mxfp4")
    parser.add_argument("--devices", type=int, help="device count (default: the product of --mesh's sizes, else 1)")
    parser.add_argument("--mesh", default=None, metavar="AXIS=N,...|auto",
                        help="axes data, fsdp, expert, tensor (data takes the devices left over), or auto "
                             "(default with --devices)")
    parser.add_argument("--batch", type=int, default=1, help="sessions decoded together (default 1)")
    parser.add_argument("--context", type=int, default=32768, help="tokens per session (default 32768)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="the weights' and computation's dtype after loading (default: as stored)")
    parser.add_argument("--device-memory", type=byte_count, default=None, metavar="BYTES",
                        help="memory of one device, e.g. 80GiB (binary units): refuse a layout that does not fit")
    parser.add_argument("--step", type=int, default=None, help="a run directory's checkpoint (default: the newest)")
    parser.add_argument("--compile", action="store_true",
                        help="also compile the decode step and a prefill piece for fake CPU devices")
    parser.add_argument("--tpu", metavar="TOPOLOGY", help="compile them for this TPU slice's compile-only devices "
                        "instead, e.g. v6e:4x4 (needs the tpu extra; implies --compile)")
    return parser.parse_intermixed_args(argv)


def load_model_config(args):
    """``(Config, description)`` of the model argument: a run directory, a config.json or a YAML."""
    path = pathlib.Path(args.model).expanduser()
    if path.is_dir():
        checkpoints, step = locate_checkpoint(str(path), args.step)
        return config_from_dict(to_dict(saved_meta(checkpoints, step)[1]), args.overrides), f"run {path}"
    if args.step is not None:
        raise InputError("--step applies to a run directory only")
    if path.suffix == ".json":
        return hf_run_config(path, path.parent, args.overrides), f"{path} (as imported)"
    return load_config(resolve_config(args.model), args.overrides), str(args.model)


def check_counts(args) -> None:
    """One-line `InputError` for a count below 1 (``--devices``, ``--batch``, ``--context``)."""
    for flag, value in (("--devices", args.devices), ("--batch", args.batch), ("--context", args.context)):
        if value is not None and value < 1:
            raise InputError(f"{flag} must be at least 1, got {value}")


def mesh_of(args, model) -> dict[str, int]:
    """``{axis: size}`` of ``--mesh`` / ``--devices`` (`k3jax.inference.layout.mesh_sizes`)."""
    if args.mesh is None:
        return mesh_sizes(model, "auto" if args.devices else {}, args.devices or 1)
    given = parse_mesh(args.mesh)
    devices = args.devices or (math.prod(given.values()) if given != "auto" else None)
    if devices is None:
        raise InputError("--mesh auto needs --devices")
    return mesh_sizes(model, given, devices)


def compiled_total(plan, compiled) -> float:
    """The plan's total with its larger step as compiled instead of estimated."""
    return plan.total - max(plan.decode, plan.prefill) + max(compiled)


def report(plan, model, description: str, stored: str, compiled=None, compiler: str = "XLA:CPU",
           target_compiled: bool = False) -> str:
    """The plan as a table, with each session pool's arithmetic (one device's block shape x bytes);
    ``target_compiled``: the steps were compiled for the target itself, so the total with them is
    the one checked against the device memory."""
    num_mla = len(model.mla_layer_indices)
    moe = model.moe

    def row(label: str, value: float, note: str = "") -> str:
        return f"  {label:<32}{format_bytes(value)}   {note}".rstrip()

    def arithmetic(block, names) -> str:
        words = (f"{size} {name[:-1] if size == 1 and name else name}".strip() for size, name in zip(block.shape, names))
        return "= " + " x ".join(words) + f" x {block.itemsize} B"

    sessions = plan.sessions
    rows = [
        f"running {description} on {plan.devices} device{'s' * (plan.devices > 1)} "
        f"(--mesh {describe_mesh(plan.sizes)}): {plan.batch} session{'s' * (plan.batch > 1)} x {plan.context} "
        f"tokens, weights {plan.dtype or f'as stored ({stored})'}, compute {plan.compute_dtype}",
        f"model: {model.num_layers} layers ({model.num_layers - num_mla} KDA, {num_mla} MLA), d {model.d_model}, "
        f"{moe.num_experts} experts top-{moe.top_k} ({moe.expert_format}), vocabulary {model.vocab_size}",
        "per device:",
        row("weights, replicated", plan.weights.replicated, "whole arrays"),
        row("weights, sharded", plan.weights.sharded, "this device's blocks of the others"),
        row("KDA states (fp32)", sessions.kda_states.bytes, arithmetic(sessions.kda_states, POOL_DIMENSIONS[0])),
        row("conv tails", sessions.conv_tails.bytes, arithmetic(sessions.conv_tails, POOL_DIMENSIONS[1])),
        row("MLA pages", sessions.mla_pages.bytes, arithmetic(sessions.mla_pages, POOL_DIMENSIONS[2])),
        row("decode step (estimate)", plan.decode, "activations and temporaries"),
        row("prefill piece (estimate)", plan.prefill, f"{model.kda.chunk_size} tokens of one session"),
        *([row(f"decode step ({compiler} compiled)", compiled[0]),
           row(f"prefill piece ({compiler} compiled)", compiled[1])] if compiled else []),
        row("total", plan.total, "weights + sessions + the larger step"),
        *([row(f"total ({compiler} compiled)", compiled_total(plan, compiled),
               "weights + sessions + the larger compiled step")] if target_compiled and compiled else []),
    ]
    total = compiled_total(plan, compiled) if target_compiled and compiled else plan.total
    if plan.device_memory is not None:
        rows.append(row("device memory", plan.device_memory,
                        f"fits, {format_bytes(plan.device_memory - total).strip()} to spare"
                        if total <= plan.device_memory else "does not fit"))
    return "\n".join(rows)


def main(argv=None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        check_counts(args)
        jax.config.update("jax_platforms", "cpu")
        config, description = load_model_config(args)
        target = compile_target(args.tpu) if args.tpu else None
        if target and args.devices not in (None, len(target.devices)):
            raise InputError(f"--devices {args.devices}: --tpu {target.topology} has {len(target.devices)} devices")
        if target:
            args.devices = len(target.devices)
        sizes = mesh_of(args, config.model)
        devices = math.prod(sizes.values())
        if target and devices != len(target.devices):
            raise InputError(f"--mesh {describe_mesh(sizes)} is {devices} devices; --tpu {target.topology} has "
                             f"{len(target.devices)}")
        if args.compile and not target and devices > MAX_COMPILE_DEVICES:
            raise InputError(f"--compile fakes at most {MAX_COMPILE_DEVICES} CPU devices, the mesh has {devices}")
        if args.compile and not target:
            jax.config.update("jax_num_cpu_devices", devices)
        device_memory = args.device_memory if args.device_memory is not None or not target else target.device_hbm
        weights = model_weights(config.model, config.finetune)
        plan = plan_running(config.model, weights, sizes, args.batch, args.context, args.dtype, device_memory)
        compiled, refused = None, None
        try:
            compiled = compiled_activations(config.model, sizes, args.batch, args.context, args.dtype, config.finetune,
                                            target.devices if target else None) if args.compile or target else None
        except jax.errors.JaxRuntimeError as error:   # the TPU compiler's own refusal: it does not fit
            if not (target and str(error).startswith("RESOURCE_EXHAUSTED")):
                raise
            refused = f"the TPU compiler: {str(error).splitlines()[0]}"
    except (InputError, ConfigError, ConvertError, MeshError, CheckpointError, TargetError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    stored = ", ".join(sorted({str(array.dtype) for array in weights if array.castable}))
    compiler = f"TPU {target.chip.name}" if target else "XLA:CPU"
    print(report(plan, config.model, description, stored, compiled, compiler, target_compiled=bool(target)), flush=True)
    if target and compiled and compiled_total(plan, compiled) > device_memory:
        refused = refused or (f"with the steps {compiler} compiled, {format_bytes(compiled_total(plan, compiled)).strip()}"
                              f" per device > {format_bytes(device_memory).strip()}")
    refused = refused or refusal(config.model, weights, plan)
    if refused:
        print(f"refused: {refused}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
