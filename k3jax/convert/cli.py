"""``python -m k3jax.convert`` / ``k3jax-convert``: Hugging Face checkpoints in and out of k3jax.

    python -m k3jax.convert import HF_DIR OUT_DIR [key=value ...]     HF -> a k3jax run directory
        [--num-processes N --process-id I]     run once per process, each writing every N-th tensor
    python -m k3jax.convert export RUN_DIR HF_DIR [--mxfp4] [--float32]   a k3jax run -> HF safetensors
                                                                      (a LoRA run: adapters merged)
    python -m k3jax.convert config CONFIG_JSON OUT_YAML [key=value ...]  the run config an import would use

Bad input (a missing or truncated shard, a missing or unexpected tensor, a shape or dtype
mismatch, an unsupported config field, an existing output directory, a full disk) prints one
line and exits with status 1; nothing that looks complete is left behind.
"""
from __future__ import annotations

import argparse
import sys

from k3jax.checkpoint import CheckpointError, quiet_checkpoint_io
from k3jax.convert.errors import ConvertError
from k3jax.data.errors import DataError

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
    importing.add_argument("--num-processes", type=int, default=1, help="processes sharing the import (default 1)")
    importing.add_argument("--process-id", type=int, default=0, help="this process, 0 … N-1 (0 finalises)")
    exporting = commands.add_parser("export", help="a k3jax run directory -> a HF checkpoint directory")
    exporting.add_argument("run_dir")
    exporting.add_argument("hf_dir")
    exporting.add_argument("--mxfp4", action="store_true", help="pack the routed experts as MXFP4")
    exporting.add_argument("--float32", action="store_true", help="write every tensor not packed as MXFP4 in fp32")
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
    try:
        if args.command == "import":
            from k3jax.convert.importer import import_checkpoint
            if args.num_processes < 1:
                raise ConvertError(f"--num-processes must be at least 1, got {args.num_processes}")
            import_checkpoint(args.hf_dir, args.out_dir, args.overrides, log=log, process=args.process_id,
                              num_processes=args.num_processes)
        elif args.command == "config":
            from k3jax.convert.importer import write_run_config
            write_run_config(args.config_json, args.out_yaml, args.overrides)
        else:
            from k3jax.convert.exporter import export_checkpoint
            if args.shard_gb <= 0:
                raise ConvertError(f"--shard-gb must be positive, got {args.shard_gb}")
            export_checkpoint(args.run_dir, args.hf_dir, mxfp4=args.mxfp4, float32=args.float32,
                              shard_bytes=int(args.shard_gb * 2**30), log=log)
    except EXPECTED_ERRORS as error:
        print(f"k3jax-convert: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("k3jax-convert: interrupted; no output was left behind", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
