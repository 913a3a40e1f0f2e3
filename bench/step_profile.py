"""Where the README main job's train step spends its time on XLA:CPU, from a profiler trace.

    python -m bench.step_profile [--config configs/tiny.yaml] [--calls 5] [--out bench/step_profile.json]
                                 [key=value ...]

It builds the job's trainer (`k3jax.training.Trainer`, in a scratch run directory) and times its train
step (median wall time of 20 steps after 3), then traces ``--calls`` steps with `jax.profiler`
and reads the trace back (`jax.profiler.ProfileData`). Per step it reports

    wall ms          the step's wall time while traced
    busy ms          the time XLA:CPU's worker threads spent inside operations (summed over threads)
    busy / wall      how many cores the step keeps busy on average
    operations       the compiled operations (thunks) executed, counting every trip of every loop
    mean us / op     busy time per operation

then the busy time by component -- the model's layers (`k3jax.layers.scope`: each layer's
operations carry its class name), the loss and the optimizer, forward and backward apart (an
operation traced under ``transpose(...)`` is the backward's), the rest of the step (gradient
scaling and norm, the skipped-step guard, the router-bias update) and operations XLA created
without a name -- and the operation kinds with the most busy time (fusion names without their
numbers). Busy / wall well under the core count means the step's operations are too small to
keep the cores busy. Eigen's threads also spin while they wait for work, so a process monitor
shows more CPU than the busy time here. The program is compiled afresh (the persistent XLA cache
is off for this run): a cached one may predate the names.
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
NOT_OPERATIONS = ("ThunkExecutor", "end: ", "Wait", "Rendezvous", "SlinkyThreadPool", "ThreadpoolListener")
UNNAMED = "(no name)"          # operations XLA created without an op_name (or not in the program text)
REST = "rest of the step"      # named, but in none of k3jax's scopes


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
    """The job's `k3jax.training.Trainer` for ``config_path`` with ``overrides``, in a scratch run
    directory removed afterwards, on the CPU devices the config asks for (`use_cpu_cores`)."""
    from k3jax.config import load_config
    from k3jax.host import keep_freed_memory, use_cpu_cores
    from k3jax.training import Trainer

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


def _unwrapped(segment: str) -> str:
    """An op_name path segment without JAX's transformation wrappers: ``transpose(jvp(K3Model))``
    -> ``K3Model``."""
    while (match := re.fullmatch(r"[\w-]+\((.*)\)", segment)):
        segment = match.group(1)
    return segment


def component(op_name: str) -> str:
    """The innermost k3jax scope of an HLO op_name (CamelCase: `k3jax.layers.scope`'s module class
    names, ``Loss``, ``Optimizer``; JAX's own segments are lower case), with `` backward`` for an
    operation of the backward pass; `REST` where there is none."""
    scopes = [name for name in map(_unwrapped, op_name.split("/")) if re.fullmatch(r"[A-Z]\w*", name)]
    direction = " backward" if "transpose(" in op_name else ""
    return scopes[-1] + direction if scopes else REST


def instruction_op_names(hlo_text: str) -> dict[str, str]:
    """``{instruction name: op_name}`` of a compiled module's text. A fusion without its own
    op_name takes the most frequent one inside its fused computation; an instruction still
    without one (a layout copy or reduction XLA made up) takes its first named operand's (the
    text lists each computation's instructions after their operands)."""
    named, calls, operands, inside = {}, {}, {}, collections.defaultdict(collections.Counter)
    computation = None
    for line in hlo_text.splitlines():
        if not line.startswith(" ") and line.rstrip().endswith("{"):
            computation = line.split()[0].lstrip("%")
            continue
        instruction = re.match(r"\s*(?:ROOT )?%?([\w.-]+) = ", line)
        if instruction is None:
            continue
        name = instruction.group(1)
        if (op_name := re.search(r'op_name="([^"]+)"', line)):
            named[name] = op_name.group(1)
            inside[computation][op_name.group(1)] += 1
        if (called := re.search(r"calls=%?([\w.-]+)", line)):
            calls[name] = called.group(1)
        operands[name] = re.findall(r"%([\w.-]+)", line.split(" = ", 1)[1].split("), ")[0])
    for name, computation in calls.items():
        if name not in named and inside[computation]:
            named[name] = inside[computation].most_common(1)[0][0]
    for name, inputs in operands.items():      # in text order: an instruction's operands come before it
        if name not in named and (found := next((named[o] for o in inputs if o in named), None)):
            named[name] = found
    return named


def step_inputs(trainer) -> tuple[object, object]:
    """``(state, batch)``: ``trainer``'s train state and its first batch, on the devices."""
    return trainer.state, trainer._device_batch(trainer._host_batch(0))


def profile(trainer, calls: int) -> dict:
    """Timings and the operation profile of ``trainer``'s train step (see the module doc)."""
    state, batch = step_inputs(trainer)
    op_names = instruction_op_names(trainer.train_step.lower(state, batch).compile().as_text())
    state, times = step_seconds(trainer.train_step, state, batch, 23)
    with tempfile.TemporaryDirectory(prefix="k3jax-step-profile-") as trace_dir:
        jax.profiler.start_trace(trace_dir)
        state, traced = step_seconds(trainer.train_step, state, batch, calls)
        jax.profiler.stop_trace()
        busy, counts = operation_times(trace_dir)
    kinds, kind_counts = collections.Counter(), collections.Counter()
    components, component_counts = collections.Counter(), collections.Counter()
    for name, nanoseconds in busy.items():
        kind = re.sub(r"[.\d]+$", "", name)
        kinds[kind] += nanoseconds
        kind_counts[kind] += counts[name]
        part = component(op_names[name]) if name in op_names else UNNAMED
        components[part] += nanoseconds
        component_counts[part] += counts[name]
    wall_ms = 1e3 * sum(traced) / calls
    busy_ms = sum(busy.values()) / 1e6 / calls
    operations = sum(counts.values()) / calls
    return {"devices": len(jax.devices()), "step_ms": 1e3 * statistics.median(times[3:]),
            "traced_step_ms": wall_ms, "busy_ms": busy_ms, "busy_over_wall": busy_ms / wall_ms,
            "operations": operations, "mean_us_per_operation": 1e3 * busy_ms / operations,
            "components": [{"component": part, "ms": nanoseconds / 1e6 / calls, "count": component_counts[part] / calls}
                           for part, nanoseconds in components.most_common()],
            "top_kinds": [{"kind": kind, "ms": nanoseconds / 1e6 / calls, "count": kind_counts[kind] / calls}
                          for kind, nanoseconds in kinds.most_common(8)]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--out", default="bench/step_profile.json")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides (e.g. mesh.cpu_devices=2)")
    args = parser.parse_args(argv)
    with scratch_trainer(args.config, ["train.compilation_cache=null", *args.overrides]) as trainer:
        result = profile(trainer, args.calls)
    print(f"{args.config} {' '.join(args.overrides)}: {result['devices']} device(s), {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(table(["step ms", "traced ms", "busy ms", "busy / wall", "operations", "mean us / op"],
                [[f"{result['step_ms']:.1f}", f"{result['traced_step_ms']:.1f}", f"{result['busy_ms']:.1f}",
                  f"{result['busy_over_wall']:.2f}", f"{result['operations']:,.0f}",
                  f"{result['mean_us_per_operation']:.1f}"]]))
    print(table(["component", "busy ms / step", "share", "operations / step"],
                [[row["component"], f"{row['ms']:.2f}", f"{row['ms'] / result['busy_ms']:.0%}", f"{row['count']:.0f}"]
                 for row in result["components"]]))
    print(table(["operation kind", "busy ms / step", "count / step"],
                [[row["kind"], f"{row['ms']:.2f}", f"{row['count']:.0f}"] for row in result["top_kinds"]]))
    write_json(args.out, {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                          "config": args.config, "overrides": args.overrides, **result})


if __name__ == "__main__":
    main()
