"""The README main job's train step under XLA:CPU flag sets, each in a fresh process, rounds interleaved.

    python -m bench.xla_flags [--rounds 3] [--steps 40] [--out bench/xla_flags.json]

XLA reads ``XLA_FLAGS`` once, when it creates its CPU backend, so every flag set runs in its own
subprocess: it builds the main job's trainer (`k3jax.training.Trainer`, tiny config, a scratch run
directory), runs 3 warm-up steps (the first compiles) and reports the median wall time of
``--steps`` more. Each round runs every flag set once, in order, so a slow spell of a shared
machine falls on all of them alike; the table gives each set's median step time over the rounds
and the median over rounds of its ratio to the default set's step time in the same round. The sets:

    default               what k3jax sets (YNN library fusions on, minus jaxlib 0.10's crashing reduce type)
    YNN fusions off       no YNNPACK library fusions: dots go to Eigen
    XNNPACK off           --xla_cpu_use_xnnpack=false
    Eigen one thread      --xla_cpu_multi_thread_eigen=false
    concurrency scheduler --xla_cpu_enable_concurrency_optimized_scheduler=true
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

from bench.common import table, write_json

DEFAULT = "--xla_cpu_experimental_ynn_fusion_type=-LIBRARY_FUSION_TYPE_REDUCE"   # as `k3jax` sets it
FLAG_SETS = {
    "default": DEFAULT,
    "YNN fusions off": "--xla_cpu_experimental_ynn_fusion_type=",
    "XNNPACK off": f"{DEFAULT} --xla_cpu_use_xnnpack=false",
    "Eigen one thread": f"{DEFAULT} --xla_cpu_multi_thread_eigen=false",
    "concurrency scheduler": f"{DEFAULT} --xla_cpu_enable_concurrency_optimized_scheduler=true",
}


def child(config_path: str, steps: int) -> dict:
    """In this process (its XLA_FLAGS already set): the median and minimum train-step ms of the job."""
    from bench.step_profile import scratch_trainer, step_seconds   # imports k3jax before JAX starts

    with scratch_trainer(config_path, []) as trainer:
        state, batch = trainer.state, trainer._device_batch(trainer._host_batch(0))
        state, _ = step_seconds(trainer.train_step, state, batch, 3)
        state, times = step_seconds(trainer.train_step, state, batch, steps)
    return {"step_ms": 1e3 * statistics.median(times), "min_step_ms": 1e3 * min(times)}


def run_flag_set(flags: str, config: str, steps: int) -> dict:
    """`child` in a subprocess whose XLA_FLAGS are ``flags``."""
    command = [sys.executable, "-m", "bench.xla_flags", "--child", "--config", config, "--steps", str(steps)]
    done = subprocess.run(command, check=True, capture_output=True, text=True, env={**os.environ, "XLA_FLAGS": flags})
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default="bench/xla_flags.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.config, args.steps)))
        return
    rounds = []
    loads = [os.getloadavg()[0]]
    for index in range(args.rounds):
        rounds.append({name: run_flag_set(flags, args.config, args.steps) for name, flags in FLAG_SETS.items()})
        loads.append(os.getloadavg()[0])
        print(f"round {index + 1}: " + ", ".join(f"{name} {r['step_ms']:.1f} ms" for name, r in rounds[-1].items()),
              flush=True)
    rows = {}
    for name in FLAG_SETS:
        ratios = [r[name]["step_ms"] / r["default"]["step_ms"] for r in rounds]
        rows[name] = {"median_step_ms": statistics.median(r[name]["step_ms"] for r in rounds),
                      "median_ratio_to_default": statistics.median(ratios), "ratios": ratios}
    print(f"{args.config}: train step, {args.steps} steps per run, {args.rounds} rounds, {os.cpu_count()} CPUs, "
          f"load average {min(loads):.1f}-{max(loads):.1f}")
    print(table(["flag set", "step ms (median)", "step time vs default (median ratio)", "per-round ratios"],
                [[name, f"{row['median_step_ms']:.1f}", f"{row['median_ratio_to_default']:.2f}x",
                  " ".join(f"{x:.2f}" for x in row["ratios"])] for name, row in rows.items()]))
    write_json(args.out, {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                          "load_average": [min(loads), max(loads)], "config": args.config, "steps": args.steps,
                          "flag_sets": FLAG_SETS, "rounds": rounds, "summary": rows})


if __name__ == "__main__":
    main()
