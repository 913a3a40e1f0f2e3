"""Where the README main job's train step spends its time on XLA:CPU, from a profiler trace.

    python -m bench.step_profile [--config configs/tiny.yaml] [--calls 5] [--out bench/step_profile.json]
                                 [key=value ...]

It builds the job's trainer (`train.run.Trainer`, in a scratch run directory) and times its train
step (median wall time of 20 steps after 3), then traces ``--calls`` steps with `jax.profiler`
and reads the trace back (`jax.profiler.ProfileData`). Per step it reports

    wall ms          the step's wall time while traced
    busy ms          the time XLA:CPU's worker threads spent inside operations (summed over threads)
    busy / wall      how many cores the step keeps busy on average
    operations       the compiled operations (thunks) executed, counting every trip of every loop
    mean us / op     busy time per operation

and the operation kinds with the most busy time (fusion names without their numbers). Many
operations of a few microseconds each and busy / wall well under the core count mean the step
is bound by the latency of its small operations, which splitting the batch over more XLA:CPU
devices (`mesh.cpu_devices`) cannot shorten. Eigen's threads also spin while they wait for work,
so a process monitor shows more CPU than the busy time here.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import os
import platform
import re
import statistics
import tempfile
import time

import k3jax  # noqa: F401  (XLA:CPU workaround before JAX starts)
import jax

from bench.common import table, write_json

WORKER_THREADS = "tf_XLAEigen"          # XLA:CPU's intra-op pool threads, as the trace names them
# Spans that are not operations: the executor's own (they enclose the operations), its end
# markers, and a thread waiting for others (collectives' rendezvous, the pool's joins).
NOT_OPERATIONS = ("ThunkExecutor", "end: ", "Wait", "Rendezvous", "SlinkyThreadPool")


def step_seconds(step, state, batch, steps: int) -> tuple[object, list[float]]:
    """``(state after the steps, seconds of each)`` of ``state = step(state, batch)``."""
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - started)
    return state, times


@contextlib.contextmanager
def scratch_trainer(config_path: str, overrides: list[str]):
    """The job's `train.run.Trainer` for ``config_path`` with ``overrides``, in a scratch run
    directory removed afterwards, on the CPU devices the config asks for (`use_cpu_cores`)."""
    from k3jax.config import load_config
    from k3jax.host import keep_freed_memory, use_cpu_cores
    from train.run import Trainer

    keep_freed_memory()
    with tempfile.TemporaryDirectory(prefix="k3jax-bench-run-") as run_dir:
        config = load_config(config_path, [*overrides, f"run_dir={run_dir}/run", "logging.progress=false"])
        use_cpu_cores(config)
        trainer = Trainer(config)
        try:
            yield trainer
        finally:
            trainer.close()


def operation_times(trace_dir: str) -> tuple[collections.Counter, collections.Counter]:
    """``({operation name: nanoseconds}, {operation name: count})`` over the worker threads of the
    trace in ``trace_dir``."""
    from jax.profiler import ProfileData

    (path,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    busy, counts = collections.Counter(), collections.Counter()
    for plane in ProfileData.from_file(path).planes:
        for line in plane.lines:
            if not line.name.startswith(WORKER_THREADS):
                continue
            for event in line.events:
                if not event.name.startswith(NOT_OPERATIONS):
                    busy[event.name] += event.duration_ns
                    counts[event.name] += 1
    return busy, counts


def profile(trainer, calls: int) -> dict:
    """Timings and the operation profile of ``trainer``'s train step (see the module doc)."""
    state, batch = trainer.state, trainer._device_batch(trainer._host_batch(0))
    state, times = step_seconds(trainer.train_step, state, batch, 23)
    with tempfile.TemporaryDirectory(prefix="k3jax-step-profile-") as trace_dir:
        jax.profiler.start_trace(trace_dir)
        state, traced = step_seconds(trainer.train_step, state, batch, calls)
        jax.profiler.stop_trace()
        busy, counts = operation_times(trace_dir)
    kinds, kind_counts = collections.Counter(), collections.Counter()
    for name, nanoseconds in busy.items():
        kind = re.sub(r"[.\d]+$", "", name)
        kinds[kind] += nanoseconds
        kind_counts[kind] += counts[name]
    wall_ms = 1e3 * sum(traced) / calls
    busy_ms = sum(busy.values()) / 1e6 / calls
    operations = sum(counts.values()) / calls
    return {"devices": len(jax.devices()), "step_ms": 1e3 * statistics.median(times[3:]),
            "traced_step_ms": wall_ms, "busy_ms": busy_ms, "busy_over_wall": busy_ms / wall_ms,
            "operations": operations, "mean_us_per_operation": 1e3 * busy_ms / operations,
            "top_kinds": [{"kind": kind, "ms": nanoseconds / 1e6 / calls, "count": kind_counts[kind] / calls}
                          for kind, nanoseconds in kinds.most_common(8)]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--out", default="bench/step_profile.json")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides (e.g. mesh.cpu_devices=2)")
    args = parser.parse_args(argv)
    with scratch_trainer(args.config, args.overrides) as trainer:
        result = profile(trainer, args.calls)
    print(f"{args.config} {' '.join(args.overrides)}: {result['devices']} device(s), {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(table(["step ms", "traced ms", "busy ms", "busy / wall", "operations", "mean us / op"],
                [[f"{result['step_ms']:.1f}", f"{result['traced_step_ms']:.1f}", f"{result['busy_ms']:.1f}",
                  f"{result['busy_over_wall']:.2f}", f"{result['operations']:,.0f}",
                  f"{result['mean_us_per_operation']:.1f}"]]))
    print(table(["operation kind", "busy ms / step", "count / step"],
                [[row["kind"], f"{row['ms']:.2f}", f"{row['count']:.0f}"] for row in result["top_kinds"]]))
    write_json(args.out, {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                          "config": args.config, "overrides": args.overrides, **result})


if __name__ == "__main__":
    main()
