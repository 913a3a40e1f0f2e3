"""Training throughput of the README's main job on this machine's CPU cores, mode against mode.

    python -m bench.cpu_cores [--steps 60] [--trials 3] [--out bench/cpu_cores.json]

Each mode runs ``python -m train configs/tiny.yaml`` for ``--steps`` steps in a fresh subprocess
(its own XLA backend, so each mode can choose its own device count and XLA flags); trials
alternate between the modes (mode A, mode B, mode A, ...), so the slow spells of a shared machine
fall on all of them alike. A trial's figure is the median of its per-step tokens/s after the first
``--warmup`` steps (the first step compiles); the table gives each mode's median over its trials
and the ratio to the first mode, with the load average seen during the measurement. The modes:

    one device    mesh.cpu_devices=1: one XLA:CPU device (the default)
    all cores     mesh.cpu_devices=auto: one device per core, each batch split over them
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile

from bench.common import table, write_json

MODES = {"one device": ["mesh.cpu_devices=1"], "all cores": ["mesh.cpu_devices=auto"]}


def trial(overrides: list[str], steps: int | None, warmup: int, config: str, tree: pathlib.Path | None = None) -> dict:
    """One training run in a subprocess (``steps`` steps, or the config's own with every other
    setting as the config has it when None): its median tokens/s after ``warmup`` logged records,
    its training seconds, its held-out MQAR recall and the device count it used. ``tree``: the
    source tree to run (its directory first on the import path; default: this one)."""
    with tempfile.TemporaryDirectory(prefix="k3jax-cpu-cores-") as run_dir:
        shortened = [] if steps is None else [f"train.steps={steps}", "train.log_every=1", "train.eval_batches=1",
                                              f"checkpoint.every={steps + 1}"]
        command = [sys.executable, "-m", "train", config, f"run_dir={run_dir}", *shortened,
                   "logging.progress=false", *overrides]
        env = None if tree is None else {**os.environ, "PYTHONPATH": str(tree)}
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tree, env=env)
        records = [json.loads(line) for line in (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
        steady = [r["tokens_per_second"] for r in records if "tokens_per_second" in r][warmup:]
        summary = json.loads((pathlib.Path(run_dir) / "summary.json").read_text())
    return {"tokens_per_second": statistics.median(steady), "train_seconds": summary["train_seconds"],
            "devices": summary.get("devices"), "heldout_mqar_recall": summary.get("heldout_mqar_recall")}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--out", default="bench/cpu_cores.json")
    args = parser.parse_args(argv)
    results = {name: [] for name in MODES}
    loads = [os.getloadavg()[0]]
    for index in range(args.trials):
        for name, overrides in MODES.items():
            results[name].append(trial(overrides, args.steps, args.warmup, args.config))
            loads.append(os.getloadavg()[0])
            print(f"trial {index + 1} {name}: {results[name][-1]}", flush=True)
    medians = {name: statistics.median(t["tokens_per_second"] for t in runs) for name, runs in results.items()}
    first = next(iter(medians.values()))
    print(f"{args.config}, {args.steps} steps per trial, {args.trials} trials per mode, {os.cpu_count()} CPUs, "
          f"load average {min(loads):.1f}-{max(loads):.1f}")
    print(table(["mode", "devices", "tokens/s (median)", "vs one device"],
                [[name, results[name][0]["devices"], f"{medians[name]:,.0f}", f"{medians[name] / first:.2f}x"]
                 for name in MODES]))
    write_json(args.out, {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                          "load_average": [min(loads), max(loads)], "steps": args.steps, "trials": results,
                          "median_tokens_per_second": medians})


if __name__ == "__main__":
    main()
