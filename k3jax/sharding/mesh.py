"""Device meshes and the placement of parameters, optimizer state and batches on them.

    mesh = make_mesh(config.mesh)                    # axes data, fsdp, expert, context, tensor (Auto)
    check_run_fits(config, mesh)                     # one-line ConfigErrors
    parts, params, buffers = abstract_model(config.model, mesh, config.mesh)   # k3jax.training:
                                                     # shapes only, the model parallelized
    shapes = abstract_train_state(params, buffers, optimizer)
    shardings = step_shardings(shapes, parts.params.axes(), parts.buffers.axes(), mesh, config.mesh)
    state = sharded_train_state(config.model, seed, optimizer, shardings.state)   # shard by shard
    step = make_train_step(parts, optimizer, shardings=shardings)
    index, count = process_rows(shardings.batch, B)  # this process's block of each global batch
    state, metrics = step(state, global_batch(dataset.batch(i, B, process_index=index, process_count=count),
                                              shardings.batch, B))

Every parameter carries logical axis names (`k3jax.layers.params`); the rules table
(`k3jax.config.AxisRules`) maps each name to mesh axes. An array dimension takes, in order, the
rule's axes that are not used by an earlier dimension of the same array and whose sizes divide
it -- so any mesh runs any model, a dimension that does not divide staying replicated. The
optimizer state follows its parameter; batches ``[B, T]`` split their rows over ``rules.batch``
and their sequence over ``rules.sequence`` (the context axis).
What the model computes on the mesh (activation layouts, the expert dispatch) is set by
`k3jax.sharding.parallelize`.
"""
from __future__ import annotations

import math
import os
from typing import Any, Mapping, NamedTuple, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec as P

from k3jax.config import MESH_AXIS_NAMES, AxisRules, Config, ConfigError, MeshConfig
from k3jax.ops.kda.blocks import chunk_length
from k3jax.sharding.lost_peers import report_peer_lost_in_one_line, watch_for_lost_peers

MESH_AXES = MESH_AXIS_NAMES
AnyMesh = Mesh | AbstractMesh   # shardings are computed alike for concrete and abstract meshes


# --- the mesh ----------------------------------------------------------------------------------


def mesh_shape(config: MeshConfig, device_count: int) -> dict[str, int]:
    """The axis sizes with the -1 axis (if any) filled so that they multiply to ``device_count``."""
    sizes = config.sizes
    known = math.prod(size for size in sizes.values() if size != -1)
    described = " x ".join(f"{name}={size}" for name, size in sizes.items())
    if -1 in sizes.values():
        if device_count % known:
            raise ConfigError("mesh", f"{device_count} devices do not split over {described}")
        return {name: device_count // known if size == -1 else size for name, size in sizes.items()}
    if known != device_count:
        raise ConfigError("mesh", f"{described} is {known} devices, but there are {device_count}")
    return sizes


def make_mesh(config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The mesh over ``devices`` (default: all devices of all processes) with GSPMD (Auto) axes."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(config, len(devices))
    return jax.make_mesh(tuple(shape.values()), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                         devices=devices)


def axes_size(mesh: AnyMesh, axes: Sequence[str]) -> int:
    """How many devices the mesh ``axes`` span together."""
    return math.prod(mesh.shape[axis] for axis in axes)


def check_run_fits(config: Config, mesh: Mesh) -> None:
    """One-line ConfigErrors for a run the mesh cannot execute: experts that do not split over the
    expert axes, batches that do not split over the batch axes, sequences that do not split into
    whole KDA chunks on every context shard, a dispatch the platform lacks."""
    rules, dispatch = config.mesh.rules, config.mesh.moe_dispatch
    experts = axes_size(mesh, rules.experts)
    if dispatch != "local" and config.model.moe.num_experts % experts:
        raise ConfigError("mesh.rules.experts", f"model.moe.num_experts = {config.model.moe.num_experts} does "
                                                f"not split over {experts} devices ({', '.join(rules.experts)})")
    if dispatch == "ragged" and mesh.devices.flat[0].platform == "cpu":
        raise ConfigError("mesh.moe_dispatch", "'ragged' needs ragged_all_to_all, which XLA:CPU does not "
                                               "implement; use 'capacity' on CPU")
    micro_batch = config.train.batch_size // config.train.grad_accum
    shards = axes_size(mesh, rules.batch)
    if micro_batch % shards:
        raise ConfigError("train.batch_size", f"micro-batches of {micro_batch} sequences (batch_size / grad_accum) "
                                              f"do not split over the {shards} devices of mesh.rules.batch")
    context, length = axes_size(mesh, rules.sequence), config.data.seq_len
    chunk = chunk_length(max(length // context, 1), config.model.kda.chunk_size)
    if context > 1 and (length % (context * chunk) or length // context < config.model.kda.conv_size - 1):
        raise ConfigError("data.seq_len", f"{length} does not split into whole KDA chunks of {chunk} tokens on "
                                          f"each of the {context} devices of mesh.rules.sequence (needs a "
                                          f"multiple of {context * chunk}, or model.kda.chunk_size smaller)")


# --- logical axes -> shardings -------------------------------------------------------------------


def partition_spec(logical_axes: Sequence[str | None], shape: Sequence[int], rules: AxisRules,
                   mesh: AnyMesh) -> P:
    """The PartitionSpec of an array whose dimensions have these logical names (None: unsharded).

    Dimension i takes the mesh axes of its rule in order, skipping axes of size 1, axes an earlier
    dimension took, and axes whose size would not divide the dimension.
    """
    if len(logical_axes) != len(shape):
        raise ValueError(f"logical axes {tuple(logical_axes)} do not match shape {tuple(shape)}")
    used: set[str] = set()
    entries = []
    for name, size in zip(logical_axes, shape):
        if name is not None and not hasattr(rules, name):
            raise ValueError(f"no sharding rule for the logical axis {name!r}")
        taken: list[str] = []
        for axis in (getattr(rules, name) if name else ()):
            split = axes_size(mesh, taken) * mesh.shape[axis]
            if mesh.shape[axis] > 1 and axis not in used and size % split == 0:
                taken.append(axis)
                used.add(axis)
        entries.append(tuple(taken) if len(taken) > 1 else (taken[0] if taken else None))
    return P(*entries)


def named_shardings(axes: Mapping[str, Sequence[str]], arrays: Mapping[str, Any], rules: AxisRules,
                    mesh: AnyMesh) -> dict[str, NamedSharding]:
    """``{path: NamedSharding}`` of flat ``{path: array}`` parameters (or buffers) from their logical axes."""
    return {path: NamedSharding(mesh, partition_spec(axes[path], array.shape, rules, mesh))
            for path, array in arrays.items()}


def optimizer_shardings(opt_state: Any, param_shardings: Mapping[str, NamedSharding],
                        params: Mapping[str, Any], mesh: AnyMesh) -> Any:
    """Shardings of an optax state over flat ``{path: param}`` parameters: a leaf found under a
    parameter's path key with that parameter's shape (moments, momenta) follows the parameter;
    everything else (step counts, coefficients) is replicated."""
    replicated = NamedSharding(mesh, P())

    def leaf_sharding(path, leaf):
        for key in reversed(path):
            name = getattr(key, "key", None)
            if name in params and tuple(params[name].shape) == tuple(leaf.shape):
                return param_shardings[name]
        return replicated

    return jax.tree_util.tree_map_with_path(leaf_sharding, opt_state)


def state_shardings(state, param_axes: Mapping[str, Sequence[str]], buffer_axes: Mapping[str, Sequence[str]],
                    rules: AxisRules, mesh: AnyMesh):
    """The shardings of a `k3jax.training.TrainState` (the same NamedTuple, a NamedSharding per leaf)."""
    params = named_shardings(param_axes, state.params, rules, mesh)
    replicated = NamedSharding(mesh, P())
    return state._replace(
        step=replicated,
        params=params,
        buffers=named_shardings(buffer_axes, state.buffers, rules, mesh),
        opt_state=optimizer_shardings(state.opt_state, params, state.params, mesh),
        skipped=replicated,
    )


def batch_sharding(mesh: Mesh, rules: AxisRules) -> NamedSharding:
    """Batches ``[B, T]`` split their rows over the rules' batch axes and, with a context axis, their
    sequence over the sequence axes."""
    rows = tuple(axis for axis in rules.batch if mesh.shape[axis] > 1)
    sequence = tuple(axis for axis in rules.sequence if mesh.shape[axis] > 1 and axis not in rows)
    return NamedSharding(mesh, P(rows or None, *([sequence] if sequence else [])))


class StepShardings(NamedTuple):
    """How a train or eval step (`k3jax.training.make_train_step`) lays out its arrays on a mesh:
    ``state`` a TrainState of NamedShardings, ``batch`` every batch array's, ``replicated`` the
    metrics'."""

    state: Any
    batch: NamedSharding
    replicated: NamedSharding
    frozen: Any = None        # a LoRA run's frozen base parameters: {path: NamedSharding}


def step_shardings(state, param_axes: Mapping[str, Sequence[str]], buffer_axes: Mapping[str, Sequence[str]],
                   mesh: Mesh, config: MeshConfig) -> StepShardings:
    """The `StepShardings` of training ``state`` on ``mesh``."""
    return StepShardings(state_shardings(state, param_axes, buffer_axes, config.rules, mesh),
                         batch_sharding(mesh, config.rules), NamedSharding(mesh, P()))


def abstract(tree: Any, shardings: Any) -> Any:
    """``jax.ShapeDtypeStruct``s of ``tree`` carrying ``shardings`` (for AOT lowering and restores)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


# --- data movement -------------------------------------------------------------------------------


def _spec_entry_size(mesh: AnyMesh, entry) -> int:
    """How many devices a PartitionSpec entry (None, an axis name or a tuple of them) splits over."""
    return axes_size(mesh, (entry,) if isinstance(entry, str) else entry or ())


def process_rows(sharding: NamedSharding, global_rows: int) -> tuple[int, int]:
    """This process's rows of a batch laid out by ``sharding``, as ``(index, count)``: the rows
    are block ``index`` of ``count`` equal blocks (the ``process_index`` / ``process_count`` the
    datasets take). Processes whose devices hold the same rows read the same block."""
    # the later dimensions (the sequence) stand in at the size that splits exactly as the spec says
    shape = (global_rows, *(_spec_entry_size(sharding.mesh, entry) for entry in sharding.spec[1:]))
    blocks = sorted({index[0].indices(global_rows)[:2] for index in
                     sharding.addressable_devices_indices_map(shape).values()})
    start, stop = blocks[0][0], blocks[-1][1]
    size = stop - start
    contiguous = all(end == next_start for (_, end), (next_start, _) in zip(blocks, blocks[1:]))
    if not contiguous or start % size or global_rows % size:
        raise ValueError(f"this process's batch rows {blocks} are not one block of {global_rows} rows split evenly; "
                         f"order the mesh's devices by process")
    return start // size, global_rows // size


def global_batch(local: Mapping[str, np.ndarray], sharding: NamedSharding, global_rows: int) -> dict[str, jax.Array]:
    """The global batch arrays assembled from every process's rows (``process_rows``)."""
    return {name: jax.make_array_from_process_local_data(sharding, rows, (global_rows, *rows.shape[1:]))
            for name, rows in local.items()}


def to_host(x: jax.Array) -> np.ndarray:
    """The full value of a (possibly multi-process) array on this host."""
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


# --- several processes ---------------------------------------------------------------------------

# Seconds without a peer's heartbeat before the others end (JAX's default).
HEARTBEAT_TIMEOUT_S = 100


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, heartbeat_timeout_s: int | None = None) -> bool:
    """Join a multi-process run (call before anything touches a device); True if one was joined.

    Arguments left None come from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID;
    without a coordinator address (and outside clusters JAX detects by itself) this is one process.
    CPU processes exchange data over gloo. A peer that dies ends this process (at once if it was
    the coordinator, else after ``heartbeat_timeout_s`` without its heartbeat; default JAX's 100 s)
    with one line on stderr instead of JAX's fatal log (`k3jax.sharding.lost_peers`).
    """
    coordinator_address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if num_processes is None and "JAX_NUM_PROCESSES" in os.environ:
        num_processes = int(os.environ["JAX_NUM_PROCESSES"])
    if process_id is None and "JAX_PROCESS_ID" in os.environ:
        process_id = int(os.environ["JAX_PROCESS_ID"])
    if coordinator_address is None:
        return False
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    heartbeat_timeout_s = HEARTBEAT_TIMEOUT_S if heartbeat_timeout_s is None else heartbeat_timeout_s
    watch_for_lost_peers(process_id, num_processes, coordinator_address, heartbeat_timeout_s)
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, heartbeat_timeout_seconds=heartbeat_timeout_s)
    report_peer_lost_in_one_line(lambda: f"process {jax.process_index()} of {jax.process_count()}")
    return True


# How long a process waits at a barrier for the others: on a loaded host one process can finish
# compiling a large program many minutes after another.
BARRIER_TIMEOUT_S = 3600


def wait_for_all_processes(name: str, timeout_s: float = BARRIER_TIMEOUT_S) -> None:
    """Block until every process of the run has reached the barrier ``name`` (unique per barrier;
    a no-op in one process). It waits in the coordination service of `jax.distributed`, not in a
    device collective: CPU collectives (gloo) give up when a peer is more than 30 s late (a fixed
    rendezvous deadline), which is why a program's first run must start on all processes together."""
    if jax.process_count() > 1:
        from orbax.checkpoint import multihost
        multihost.get_barrier_sync_fn()(key=f"k3jax/{name}", timeout_ms=int(timeout_s * 1000))


def compiled_together(jitted, name: str):
    """``jitted``, except that in a multi-process run its first call compiles the program for its
    arguments (``jitted.lower(*args).compile()`` fills the cache that call then uses) and waits for
    every process to have compiled it (`wait_for_all_processes`) before running it. Compilation
    times differ between hosts by far more than the collectives' 30 s rendezvous deadline allows."""
    if jax.process_count() == 1:
        return jitted
    pending = [True]

    def call(*args):
        if pending:
            jitted.lower(*args).compile()
            wait_for_all_processes(f"{name} compiled")
            pending.clear()
        return jitted(*args)

    return call
