"""``python -m k3jax.convert`` / ``k3jax-convert``: Hugging Face checkpoints in and out of k3jax.

    python -m k3jax.convert import HF_DIR OUT_DIR [key=value ...]     HF -> a k3jax run directory
        [--coordinator-address HOST:PORT --num-processes N --process-id I]   the same command on every
                        host (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID, as the
                        trainer): the processes of one jax.distributed run, each writing every N-th tensor
    python -m k3jax.convert export RUN_DIR HF_DIR [--mxfp4] [--float32]   a k3jax run -> HF safetensors
                                                                      (a LoRA run: adapters merged)
    python -m k3jax.convert export RUN_DIR OUT_DIR --adapter          a LoRA run's adapters alone, as a PEFT
                        LoRA adapter (adapter_config.json, adapter_model.safetensors; no base weight)
    python -m k3jax.convert import-adapter PEFT_DIR RUN_DIR OUT_DIR   a PEFT LoRA adapter for the model of
                        RUN_DIR (a plain run) -> OUT_DIR, a LoRA run on RUN_DIR (eval / generate load it)

Routed experts (``finetune.lora_routed_experts``: one A shared by a layer's experts, one B per
expert) export as one PEFT pair per expert module ``experts.{e}.w1|w3|w2``, lora_A the shared A
repeated; import-adapter takes routed experts only when the experts of a weight carry the same
lora_A (`k3jax.convert.peft`).
    python -m k3jax.convert config CONFIG_JSON OUT_YAML [key=value ...]  the run config an import would use

Bad input (a missing or truncated shard, a missing or unexpected tensor, a shape or dtype
mismatch, an unsupported config field, an existing output directory, a full disk) prints one
line and exits with status 1; nothing that looks complete is left behind. In a multi-process
import an error in one process stops all of them (each prints its line and exits 1 at once).
"""
from __future__ import annotations

import argparse
import os
import sys

from k3jax.checkpoint import CheckpointError, quiet_checkpoint_io
from k3jax.convert.errors import ConvertError
from k3jax.data.errors import DataError
from k3jax.host import add_process_flags, process_flags

EXPECTED_ERRORS = (ConvertError, CheckpointError, DataError)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="k3jax-convert", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    importing = commands.add_parser("import", help="a HF checkpoint directory -> a k3jax run directory")
    importing.add_argument("hf_dir")
    importing.add_argument("out_dir")
    importing.add_argument("overrides", nargs="*", metavar="key=value", help="trainer config overrides, e.g. "
                           "model.moe.expert_format=dense (decode MXFP4 experts) data.path=notes.txt mesh.fsdp=8 "
                           "(chunks follow the mesh's shards)")
    add_process_flags(importing, "an import (process 0 finalises it)")
    exporting = commands.add_parser("export", help="a k3jax run directory -> a HF checkpoint directory")
    exporting.add_argument("run_dir")
    exporting.add_argument("hf_dir")
    exporting.add_argument("--mxfp4", action="store_true", help="pack the routed experts as MXFP4")
    exporting.add_argument("--float32", action="store_true", help="write every tensor not packed as MXFP4 in fp32")
    exporting.add_argument("--adapter", action="store_true", help="a LoRA run's adapters only, as a PEFT adapter")
    adapter = commands.add_parser("import-adapter", help="a PEFT LoRA adapter + its base run -> a k3jax LoRA run")
    adapter.add_argument("peft_dir")
    adapter.add_argument("run_dir", help="the k3jax run holding the adapter's base model")
    adapter.add_argument("out_dir")
    configuring = commands.add_parser("config", help="a HF config.json -> the k3jax run config (YAML)")
    configuring.add_argument("config_json")
    configuring.add_argument("out_yaml")
    configuring.add_argument("overrides", nargs="*", metavar="key=value")
    exporting.add_argument("--shard-gb", type=float, default=5.0, help="largest shard in GiB (default 5)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    quiet_checkpoint_io()   # Orbax warns through absl on every read-only open
    log = lambda line: print(line, file=sys.stderr)  # noqa: E731
    group = None
    try:
        if args.command == "import":
            from k3jax.convert.importer import import_checkpoint
            group = _join_import_processes(args)
            import_checkpoint(args.hf_dir, args.out_dir, args.overrides, log=log, group=group)
        elif args.command == "config":
            from k3jax.convert.importer import write_run_config
            write_run_config(args.config_json, args.out_yaml, args.overrides)
        elif args.command == "import-adapter":
            from k3jax.convert.peft import import_adapter
            import_adapter(args.peft_dir, args.run_dir, args.out_dir, log=log)
        elif args.adapter:
            from k3jax.convert.peft import export_adapter
            if args.mxfp4 or args.float32:
                raise ConvertError("--adapter writes the adapters alone (fp32): --mxfp4 and --float32 do not apply")
            export_adapter(args.run_dir, args.hf_dir, log=log)
        else:
            from k3jax.convert.exporter import export_checkpoint
            if args.shard_gb <= 0:
                raise ConvertError(f"--shard-gb must be positive, got {args.shard_gb}")
            export_checkpoint(args.run_dir, args.hf_dir, mxfp4=args.mxfp4, float32=args.float32,
                              shard_bytes=int(args.shard_gb * 2**30), log=log)
    except EXPECTED_ERRORS as error:
        print(f"k3jax-convert: error: {error}", file=sys.stderr)
        return _exit(1, group)
    except KeyboardInterrupt:
        print("k3jax-convert: interrupted; no output was left behind", file=sys.stderr)
        return _exit(130, group)
    if group is not None:
        import jax
        jax.distributed.shutdown()     # every process is here: the import is complete
    return 0


def _join_import_processes(args):
    """The `ImportGroup` of this process when the import is shared (a coordinator address from
    the flags or the environment, as the trainer takes it), else None."""
    from k3jax.convert.processes import ImportGroup
    from k3jax.sharding import initialize_distributed

    try:
        address, count = process_flags(args)
    except ValueError as error:
        raise ConvertError(str(error)) from None
    if address is None:
        if count is not None and count > 1:
            raise ConvertError(f"--num-processes {count} needs --coordinator-address HOST:PORT (process 0's; or "
                               f"JAX_COORDINATOR_ADDRESS): run the same command on every process")
        return None
    try:
        initialize_distributed(address, args.num_processes, args.process_id, args.heartbeat_timeout)
    except Exception as error:  # noqa: BLE001 - JAX raises its own runtime errors
        raise ConvertError(f"cannot join the import's processes at {address}: {' '.join(str(error).split())[:300]}") from None
    return ImportGroup.joined()


def _exit(code: int, group) -> int:
    """``code``; a process of a shared import leaves at once instead (`os._exit`): waiting at
    jax.distributed's shutdown barrier for processes that stopped would hang."""
    if group is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
