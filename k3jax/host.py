"""Process-level settings: how a process runs XLA on a CPU host, where it keeps compiled programs.

XLA:CPU allocates a program's buffers on every call. With glibc's default malloc, blocks above
the mmap threshold come from freshly mapped pages and memory freed at the top of a heap is
returned to the OS, so every call faults its buffers in again. `keep_freed_memory` makes the next
call reuse the pages of the last one. Measured on 2 cores: the tiny training job (configs/tiny.yaml,
300 steps, two alternating pairs of runs) 14.0K -> 19.1K tokens/s; a KDA prototype whose
temporaries were sequence-sized went from ~20,000 minor page faults and ~45 ms of kernel time per
call to ~1,300 and ~5 ms.

XLA:CPU runs most of a small model's many small operations on one thread. `use_cpu_cores` gives a
one-process run one XLA:CPU device per core, so the trainer's default data axis splits each batch
over all of them (see its docstring for what it measured).

`enable_compilation_cache` keeps compiled programs on disk (JAX's persistent cache), for the
trainer and the server alike.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import pathlib

# mallopt(3) parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_NEVER_TRIM = -1  # mallopt(3): -1 turns trimming off


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory for reuse: one arena, no mmap'd blocks, no trimming.

    Call it at the start of a process, before JAX starts its threads (the arena limit applies to
    threads created afterwards). The process then keeps its peak heap until it exits, which is
    what a training or evaluation process wants. Returns False (and changes nothing) where the C
    library is not glibc.
    """
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _NEVER_TRIM))
    return all(mallopt(parameter, value) == 1 for parameter, value in settings)


HOST_DEVICE_COUNT_FLAG = "xla_force_host_platform_device_count"


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_device_count(requested: str | int, micro_batch: int, cores: int) -> int:
    """XLA:CPU devices for a run whose default data axis splits micro-batches of ``micro_batch``
    rows: ``requested`` when it is a count, for "auto" the largest count <= ``cores`` that divides
    ``micro_batch`` (1 when only 1 does)."""
    if requested != "auto":
        return int(requested)
    return max(count for count in range(1, max(cores, 1) + 1) if micro_batch % count == 0)


def use_cpu_cores(config) -> int | None:
    """Give XLA:CPU ``cpu_device_count(config.mesh.cpu_devices, ...)`` devices for a one-process run
    of ``config`` (a `k3jax.config.Config`) whose mesh is the default one; returns the count, or
    None when it changed nothing: a mesh the user sized, a device count already chosen (XLA_FLAGS,
    JAX_NUM_CPU_DEVICES or ``jax_num_cpu_devices``), a JAX backend already started. Call it before anything touches a device. It sets ``jax_num_cpu_devices``,
    which only the CPU backend reads, so a GPU or TPU run is unaffected.
    """
    import jax
    from jax._src import xla_bridge
    from k3jax.config import MeshConfig

    chosen = HOST_DEVICE_COUNT_FLAG in os.environ.get("XLA_FLAGS", "") or jax.config.jax_num_cpu_devices != -1
    if config.mesh.sizes != MeshConfig().sizes or chosen or xla_bridge.backends_are_initialized():
        return None
    count = cpu_device_count(config.mesh.cpu_devices, config.train.batch_size // config.train.grad_accum,
                             usable_cores())
    jax.config.update("jax_num_cpu_devices", count)
    return count


def enable_compilation_cache(directory: str | None) -> None:
    """Keep compiled programs on disk so a resumed or repeated run starts in seconds."""
    if directory:
        import jax

        jax.config.update("jax_compilation_cache_dir", str(pathlib.Path(directory).expanduser()))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def add_process_flags(parser, joined: str) -> None:
    """``--coordinator-address``, ``--num-processes`` and ``--process-id`` on ``parser`` (an
    argparse parser or group): several processes (hosts) that form one JAX system
    (`k3jax.sharding.initialize_distributed`), each started with the same flags but its own id.
    ``joined``: what the processes share, for the help ("a training run", "an import", ...)."""
    parser.add_argument("--coordinator-address", help=f"host:port of process 0, for {joined} shared by several "
                                                      "processes / hosts (default: $JAX_COORDINATOR_ADDRESS)")
    parser.add_argument("--num-processes", type=int, help="processes in all (default: $JAX_NUM_PROCESSES)")
    parser.add_argument("--process-id", type=int, help="this process, 0 … N-1 (default: $JAX_PROCESS_ID)")
    parser.add_argument("--heartbeat-timeout", type=int, default=None, metavar="SECONDS",
                        help="seconds without a process's heartbeat before the others stop, each with one line "
                             "(default: 100; a lost coordinator stops them at once)")


def process_flags(args) -> tuple[str | None, int | None]:
    """``(coordinator address, process count)`` of `add_process_flags`'s flags in ``args``, each
    falling back to $JAX_COORDINATOR_ADDRESS / $JAX_NUM_PROCESSES (None: not given); ValueError
    (one line) for a count below 1 or a ``--process-id`` outside [0, count)."""
    count = args.num_processes if args.num_processes is not None else os.environ.get("JAX_NUM_PROCESSES")
    count = None if count is None else int(count)
    if count is not None and count < 1:
        raise ValueError(f"--num-processes must be at least 1, got {count}")
    if args.process_id is not None and count is not None and not 0 <= args.process_id < count:
        raise ValueError(f"--process-id must be in [0, {count}), got {args.process_id}")
    if args.heartbeat_timeout is not None and args.heartbeat_timeout < 1:
        raise ValueError(f"--heartbeat-timeout must be at least 1 second, got {args.heartbeat_timeout}")
    return args.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS"), count
