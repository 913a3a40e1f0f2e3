"""``python -m train CONFIG [key=value ...]``: train or fine-tune a K3-family model.

    python -m train configs/tiny.yaml                                  # MQAR on the tiny model
    python -m train configs/tiny.yaml run_dir=runs/a train.steps=2000  # overrides: dotted.key=value
    python -m train configs/tiny.yaml run_dir=runs/ft init_from=runs/a data.kind=text data.path=notes.txt
    python -m train configs/tiny.yaml mesh.data=2 mesh.expert=4 mesh.moe_dispatch=capacity   # 8 devices
    python -m train configs/rl/addition.yaml init_from=runs/sft                   # RL (GRPO) on prompts

Several processes (hosts) train one model when each is started with the same coordinator
(``--coordinator-address host:port --num-processes N --process-id I``, or the environment
variables JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID); the mesh spans all of
their devices.

If ``run_dir`` already holds a checkpoint the run resumes from it. Bad input (config, data,
checkpoints, run directory, a run directory another trainer holds) and failures (a save that
fails, out of memory) end with one line on stderr and exit status 2, at once: the process does
not wait for Orbax's background threads. SIGTERM/SIGINT at any moment exit 0 with one line on
stdout: during training after saving a checkpoint, during the start before writing anything.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from k3jax.host import add_process_flags, process_flags
from k3jax.training.signals import StopRequested, StopSignals   # light: the handlers go in before JAX loads


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m train", description="Train or fine-tune a K3-family model.",
                                     epilog="Overrides are dotted.key=value, e.g. train.steps=500 run_dir=runs/x.")
    parser.add_argument("config", help="YAML config file, or a packaged config's name (e.g. configs/tiny.yaml, tiny)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value settings applied over the file")
    add_process_flags(parser, "a training run")
    args = parser.parse_intermixed_args(argv)
    try:
        process_flags(args)
    except ValueError as error:
        parser.error(str(error))
    return args


def one_line_failure(error: BaseException) -> str | None:
    """The one-line message of a failure the CLI reports without a traceback (None: not one)."""
    from k3jax.checkpoint import CheckpointError
    from k3jax.config import ConfigError
    from k3jax.data import DataError
    from k3jax.training import RunError

    if isinstance(error, (ConfigError, DataError, CheckpointError, RunError)):
        return str(error)
    if "RESOURCE_EXHAUSTED" in str(error) or isinstance(error, MemoryError):
        detail = " ".join(str(error).split())[:200]
        return (f"out of memory ({detail}); lower train.batch_size, raise train.grad_accum, "
                f"set model.remat=full or use more devices (python -m train.plan estimates the memory)")
    return None


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    with StopSignals() as signals:
        try:
            from k3jax.host import keep_freed_memory, use_cpu_cores
            keep_freed_memory()  # before JAX starts its threads
            from k3jax.checkpoint import quiet_checkpoint_io
            quiet_checkpoint_io(logging.CRITICAL)   # failures come as our one line
            from k3jax.config import load_config, resolve_config
            from k3jax.sharding import initialize_distributed
            from k3jax.training import PreferenceTrainer, RLTrainer, Trainer  # after parsing: --help stays instant
            from k3jax.training.metrics import jsonable

            signals.check()
            config = load_config(resolve_config(args.config), args.overrides)
            if not initialize_distributed(args.coordinator_address, args.num_processes, args.process_id,
                                          args.heartbeat_timeout):
                use_cpu_cores(config)   # one process on CPU: a device per core, unless the mesh is set
            trainer = {"lm": Trainer, "grpo": RLTrainer}.get(config.train.objective, PreferenceTrainer)
            summary = trainer(config, signals).run()
        except StopRequested as stop:
            print(f"{stop} received while starting: stopped before training, nothing written; run again to start",
                  flush=True)
            return 0
        except Exception as error:  # noqa: BLE001 - the known failures become one line, the rest a traceback
            message = one_line_failure(error)
            if message is None:
                raise
            print(f"error: {message}", file=sys.stderr, flush=True)
            return 2
    if "stopped_by" not in summary:
        print(json.dumps(jsonable(summary), allow_nan=False), flush=True)
        if "heldout_reward" in summary:
            print(f"held-out greedy reward {summary['heldout_reward']:.3f} ({summary['heldout_pass']:.1%} pass, "
                  f"{summary['heldout_prompts']} prompts) after {summary['step']} steps "
                  f"({summary['train_seconds']:.0f} s of training)", flush=True)
        if "heldout_mqar_recall" in summary:
            print(f"held-out MQAR recall {summary['heldout_mqar_recall']:.3f} after {summary['step']} steps "
                  f"({summary['train_seconds']:.0f} s of training)", flush=True)
    return 0


def entry() -> None:
    """The console script and ``python -m train``: `main`, then exit at once (a failed run does not
    wait for background checkpoint threads, which could hang or print tracebacks at shutdown)."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        os._exit(code)
    sys.exit(code)
