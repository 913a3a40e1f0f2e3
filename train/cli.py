"""``python -m train CONFIG [key=value ...]``: train or fine-tune a K3-family model.

    python -m train configs/tiny.yaml                                  # MQAR on the tiny model
    python -m train configs/tiny.yaml run_dir=runs/a train.steps=2000  # overrides: dotted.key=value
    python -m train configs/tiny.yaml run_dir=runs/ft init_from=runs/a data.kind=text data.path=notes.txt
    python -m train configs/tiny.yaml mesh.data=2 mesh.expert=4 mesh.moe_dispatch=capacity   # 8 devices

Several processes (hosts) train one model when each is started with the same coordinator
(``--coordinator-address host:port --num-processes N --process-id I``, or the environment
variables JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID); the mesh spans all of
their devices.

If ``run_dir`` already holds a checkpoint the run resumes from it. Bad input (config, data,
checkpoints, run directory) ends with one line on stderr and exit status 2; SIGTERM/SIGINT save a
checkpoint and exit 0.
"""
from __future__ import annotations

import argparse
import json
import sys

from k3jax.checkpoint import CheckpointError
from k3jax.config import ConfigError, load_config
from k3jax.host import keep_freed_memory
from k3jax.data import DataError


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m train", description="Train or fine-tune a K3-family model.",
                                     epilog="Overrides are dotted.key=value, e.g. train.steps=500 run_dir=runs/x.")
    parser.add_argument("config", help="YAML config file (e.g. configs/tiny.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value settings applied over the file")
    parser.add_argument("--coordinator-address", help="host:port of process 0, for a multi-process run "
                                                      "(default: $JAX_COORDINATOR_ADDRESS)")
    parser.add_argument("--num-processes", type=int, help="processes in the run (default: $JAX_NUM_PROCESSES)")
    parser.add_argument("--process-id", type=int, help="this process's index (default: $JAX_PROCESS_ID)")
    return parser.parse_intermixed_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    keep_freed_memory()  # before JAX starts its threads
    from k3jax.sharding import initialize_distributed
    from train.run import RunError, Trainer  # after argument parsing: --help stays instant

    try:
        config = load_config(args.config, args.overrides)
        initialize_distributed(args.coordinator_address, args.num_processes, args.process_id)
        summary = Trainer(config).run()
    except (ConfigError, DataError, CheckpointError, RunError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    if "stopped_by" not in summary:
        print(json.dumps(summary), flush=True)
        if "heldout_mqar_recall" in summary:
            print(f"held-out MQAR recall {summary['heldout_mqar_recall']:.3f} after {summary['step']} steps "
                  f"({summary['train_seconds']:.0f} s of training)", flush=True)
    return 0
