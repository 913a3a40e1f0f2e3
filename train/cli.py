"""``python -m train CONFIG [key=value ...]``: train or fine-tune a K3-family model.

    python -m train configs/tiny.yaml                                  # MQAR on the tiny model
    python -m train configs/tiny.yaml run_dir=runs/a train.steps=2000  # overrides: dotted.key=value
    python -m train configs/tiny.yaml run_dir=runs/ft init_from=runs/a data.kind=text data.path=notes.txt

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
from k3jax.data import DataError


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m train", description="Train or fine-tune a K3-family model.",
                                     epilog="Overrides are dotted.key=value, e.g. train.steps=500 run_dir=runs/x.")
    parser.add_argument("config", help="YAML config file (e.g. configs/tiny.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value settings applied over the file")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from train.run import RunError, Trainer  # after argument parsing: --help stays instant

    try:
        summary = Trainer(load_config(args.config, args.overrides)).run()
    except (ConfigError, DataError, CheckpointError, RunError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    if "stopped_by" not in summary:
        print(json.dumps(summary), flush=True)
        if "heldout_mqar_recall" in summary:
            print(f"held-out MQAR recall {summary['heldout_mqar_recall']:.3f} after {summary['step']} steps "
                  f"({summary['train_seconds']:.0f} s of training)", flush=True)
    return 0
