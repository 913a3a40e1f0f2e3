"""Orbax checkpoints of a training run.

A run directory holds ``checkpoints/<step>/`` with two items: ``state`` (a pytree of arrays:
parameters, optimizer state, router biases, step) and ``meta`` (JSON: the resolved config, the
data position, the model config, what wrote it). Orbax writes each step into a temporary
directory and renames it when complete, so a killed save never becomes the latest checkpoint;
leftover temporaries are removed on the next start.

    checkpoints = RunCheckpoints(run_dir / "checkpoints", keep=3, every=100)
    checkpoints.save(step, state, meta)            # asynchronous unless async_save=False
    state, meta = checkpoints.restore(step, abstract_state)   # onto abstract_state's shardings
    params = restore_subtree(other_run / "checkpoints", "params", abstract_params)

Integrity: every save records in ``meta`` a checksum of each array of the state and a SHA-256 of
the rest of the metadata; every restore recomputes them and refuses a checkpoint that differs. An
array's checksum mixes each 32-bit word w_i (16- and 8-bit values widened) with its row-major
index i and adds the results:

    checksum(x) = sum_i fmix32(w_i xor (i * 0x9E3779B9))   mod 2^32

fmix32 is MurmurHash3's finaliser, a bijection of 32-bit words. Integer addition modulo 2^32 is
exact in any order, so the sum is the same for any sharding of the array and any device count;
changing any one word (any bit flip) changes exactly one term and so always changes the sum, and
changes to several words collide with probability about 2^-32.
`restore_newest_good` walks back from the newest checkpoint to the newest one that restores.

Every failure (missing or corrupted checkpoint, full disk, unwritable directory) surfaces as a
`CheckpointError` with a one-line message.
"""
from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import pathlib
import shutil
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from k3jax.disk import disk_full, free_space

STATE, META = "state", "meta"
CHECKSUMS, META_DIGEST = "checksums", "meta_sha256"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, found or read."""


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) < 300 else text[:297] + "..."


def checkpoint_directory(path: str | pathlib.Path) -> pathlib.Path:
    """The checkpoint directory of a run directory (``<run>/checkpoints``), or ``path`` itself when it
    already is one."""
    path = pathlib.Path(path).expanduser().resolve()
    return path / "checkpoints" if (path / "checkpoints").is_dir() else path


def _words(x: jax.Array) -> jax.Array:
    """The bits of every element of ``x`` as uint32 (16/8-bit values zero-extended, 64-bit folded)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    words = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
    if x.dtype.itemsize == 8:      # [..., 2] halves: the high half weighted by an odd constant
        words = words[..., 0] + words[..., 1] * jnp.uint32(0x9E3779B1)
    return words


def _fmix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's finaliser: a bijection of uint32 words that spreads every bit over all of them."""
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _array_checksum(x: jax.Array, offset=0) -> jax.Array:
    """``sum_i fmix32(w_i xor (i * 0x9E3779B9)) mod 2^32`` over the words w of ``x`` (row-major index
    i, counted from ``offset``: a region of a larger array starting at its flat index ``offset``)."""
    words = _words(x)
    index = jnp.full(words.shape, offset, jnp.uint32)
    stride = 1
    for axis in reversed(range(words.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis) * jnp.uint32(stride % 2**32)
        stride *= words.shape[axis]
    return jnp.sum(_fmix32(words ^ (index * jnp.uint32(0x9E3779B9))), dtype=jnp.uint32)


_tree_checksums = jax.jit(lambda tree: jax.tree.map(_array_checksum, tree))
_region_checksum = jax.jit(_array_checksum)


def region_checksum(region, offset: int) -> int:
    """The part of an array's checksum that its region ``region`` contributes, the region holding
    the elements at flat (row-major) indices ``offset, offset + 1, ...`` of the array. The array's
    checksum is the sum mod 2^32 of its disjoint regions' parts (so it can be streamed)."""
    return int(_region_checksum(region, np.uint32(offset % 2**32)))


def tree_checksums(tree: Any) -> dict[str, int]:
    """``{path: checksum}`` of every array in ``tree`` (a dict of pytrees; paths as `jax.tree_util.keystr`)."""
    sums = jax.device_get(_tree_checksums(tree))
    return {jax.tree_util.keystr(path): int(value) for path, value in jax.tree_util.tree_leaves_with_path(sums)}


def _named(state: Any) -> dict:
    """The state as a dict of its fields, so that its paths match a restored subtree's ``{field: ...}``."""
    return state._asdict() if hasattr(state, "_asdict") else dict(state)


def _meta_digest(meta: dict) -> str:
    body = {key: value for key, value in meta.items() if key != META_DIGEST}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def sealed_meta(meta: dict, state: Any) -> dict:
    """``meta`` with the checksums of ``state``'s arrays and the digest of the whole."""
    return sealed_with_checksums(meta, tree_checksums(_named(state)))


def sealed_with_checksums(meta: dict, checksums: dict[str, int]) -> dict:
    """``meta`` with ``{path: checksum}`` (paths as `tree_checksums` names them) and the digest."""
    sealed = {**meta, CHECKSUMS: checksums}
    return {**sealed, META_DIGEST: _meta_digest(sealed)}


def verify_meta(meta: dict, where: str) -> dict:
    """``meta`` if its digest matches (or it predates digests), else a `CheckpointError`."""
    if META_DIGEST in meta and meta[META_DIGEST] != _meta_digest(meta):
        raise CheckpointError(f"{where}: metadata is corrupted (its SHA-256 does not match)")
    return meta


def verify_arrays(tree: dict, meta: dict, where: str) -> None:
    """Raise `CheckpointError` naming the first array of ``tree`` (``{field: subtree}``) whose
    checksum differs from the one saved in ``meta`` (checkpoints without checksums pass)."""
    saved = meta.get(CHECKSUMS)
    if saved is None:
        return
    for name, value in tree_checksums(tree).items():
        if saved.get(name) != value:
            raise CheckpointError(f"{where}: array {name} is corrupted (checksum {value:#010x}, "
                                  f"saved {saved.get(name, 0):#010x})" if name in saved else
                                  f"{where}: array {name} has no saved checksum")


def _is_late_io_callback(report) -> bool:
    """A late result posted to a closed loop, or an Orbax coroutine closed mid-read that raised on
    its way out (both `sys.unraisablehook` reports of I/O abandoned after a failure)."""
    if report.object is None:
        return isinstance(report.exc_value, RuntimeError) and str(report.exc_value) == "Event loop is closed"
    code = getattr(report.object, "cr_code", None)
    return inspect.iscoroutine(report.object) and code is not None and "/orbax/checkpoint/" in code.co_filename


def _is_abandoned_orbax_task(record: logging.LogRecord) -> bool:
    message = str(record.msg)
    return message.startswith("Task exception was never retrieved") and "/orbax/checkpoint/" in message


class _DropAbandonedOrbaxTasks(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" report for an Orbax coroutine."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not _is_abandoned_orbax_task(record)


def quiet_checkpoint_io(absl_level: int = logging.ERROR) -> None:
    """For the command lines: Orbax's absl notices down to ``absl_level``, and no tracebacks from
    I/O that outlives a failed save or restore.

    When one array of an Orbax save or restore fails, the others are abandoned mid-flight, which
    Python reports after the failure itself has been reported, one traceback per array:
    - TensorStore finishes each read and write on its own threads and posts the result to the
      asyncio loop that awaited it; Orbax closes that loop, and each late result reports
      ``RuntimeError: Event loop is closed`` through `sys.unraisablehook` (no object);
    - Orbax gathers the arrays' coroutines without collecting the exceptions after the first; when
      the other failed tasks are collected, asyncio logs "Task exception was never retrieved" for
      each (logger ``asyncio``, an Orbax coroutine named in the message);
    - an array read still suspended when its coroutine is collected is closed, and Orbax's read
      raises its own error on the way out: "Exception ignored in: <coroutine object
      _read_array_index_and_device_put>" through `sys.unraisablehook` (the coroutine as object).
    Those reports are dropped; every other one reaches the hook and the handlers installed before."""
    logging.getLogger("absl").setLevel(absl_level)
    asyncio_logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _DropAbandonedOrbaxTasks) for f in asyncio_logger.filters):
        asyncio_logger.addFilter(_DropAbandonedOrbaxTasks())
    previous = sys.unraisablehook
    if getattr(previous, "drops_late_io_callbacks", False):
        return

    def hook(report) -> None:
        if not _is_late_io_callback(report):
            previous(report)

    hook.drops_late_io_callbacks = True
    sys.unraisablehook = hook


@contextlib.contextmanager
def _quiet_orbax_notices():
    """Orbax logs notices (through absl) on every read-only open; errors still come through."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(max(level, logging.ERROR))
    try:
        yield
    finally:
        logger.setLevel(level)


class RunCheckpoints:
    """The checkpoints of one run: saves every ``every`` steps (or when forced), keeps the last ``keep``."""

    def __init__(self, directory: str | pathlib.Path, *, keep: int = 3, every: int = 1,
                 async_save: bool = True, read_only: bool = False):
        self.directory = pathlib.Path(directory).expanduser().resolve()
        writing = {"save_interval_steps": 0} if read_only else {"max_to_keep": keep, "save_interval_steps": every}
        options = ocp.CheckpointManagerOptions(
            **writing,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=not read_only,
            read_only=read_only,
            create=not read_only,
        )
        try:
            with _quiet_orbax_notices():
                self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=(STATE, META))
        except Exception as error:  # noqa: BLE001 - any failure to open is reported the same way
            raise CheckpointError(f"cannot open checkpoints at {self.directory}: {_one_line(error)}") from error

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def due(self, step: int) -> bool:
        """Whether `save` at ``step`` would save without ``force`` (every ``every`` steps)."""
        return self._manager.should_save(step)

    def save(self, step: int, state: Any, meta: dict, *, force: bool = False) -> bool:
        """Start saving ``state`` and ``meta`` at ``step`` (when due, or ``force``); True if started.

        The metadata saved is sealed: it carries the checksum of every array of ``state`` and the
        digest of itself (`sealed_meta`). A failure of an earlier asynchronous save is raised here or
        by `wait`."""
        self.check()
        try:
            if not (force or self._manager.should_save(step)):
                return False
            return self._manager.save(
                step, args=ocp.args.Composite(**{STATE: ocp.args.StandardSave(state),
                                                  META: ocp.args.JsonSave(sealed_meta(meta, state))}),
                force=force,
            )
        except Exception as error:  # noqa: BLE001
            raise CheckpointError(f"saving checkpoint {step} in {self.directory} failed: {self._write_failure(error)}") from error

    def check(self) -> None:
        """Raise `CheckpointError` if an asynchronous save that has ended failed (cheap: no waiting)."""
        try:
            self._manager.check_for_errors()
        except Exception as error:  # noqa: BLE001
            raise CheckpointError(f"saving a checkpoint in {self.directory} failed: {self._write_failure(error)}") from error

    def wait(self) -> None:
        """Block until pending saves are on disk."""
        try:
            self._manager.wait_until_finished()
        except Exception as error:  # noqa: BLE001
            raise CheckpointError(f"saving a checkpoint in {self.directory} failed: {self._write_failure(error)}") from error

    def _write_failure(self, error: BaseException) -> str:
        """What a failed save says: a full disk named as one, with the space left once the failed
        save's temporary directories are removed, else the error's first 300 characters."""
        if disk_full(error):
            for partial in self.directory.glob("*.orbax-checkpoint-tmp*"):
                shutil.rmtree(partial, ignore_errors=True)
            return (f"no space left on device ({free_space(self.directory)} free); free some space or "
                    "point run_dir elsewhere, then run again to resume from the last checkpoint")
        return _one_line(error)

    def meta(self, step: int | None = None) -> dict:
        """The JSON metadata of ``step`` (default: the latest)."""
        step = self.require_step(step)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))
        except Exception as error:  # noqa: BLE001
            raise CheckpointError(f"checkpoint {step} in {self.directory} is unreadable: {_one_line(error)}") from error
        return verify_meta(dict(restored[META]), f"checkpoint {step} in {self.directory}")

    def restore(self, step: int | None, abstract_state: Any) -> tuple[Any, dict]:
        """The state and metadata of ``step`` (default: the latest), placed like ``abstract_state``
        (a pytree of `jax.ShapeDtypeStruct`, with shardings), verified against the saved checksums."""
        step = self.require_step(step)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(
                **{STATE: ocp.args.StandardRestore(abstract_state), META: ocp.args.JsonRestore()}))
        except Exception as error:  # noqa: BLE001
            raise CheckpointError(f"checkpoint {step} in {self.directory} does not match this model or is "
                                  f"corrupted: {_one_line(error)}") from error
        where = f"checkpoint {step} in {self.directory}"
        meta = verify_meta(dict(restored[META]), where)
        verify_arrays(_named(restored[STATE]), meta, where)
        return restored[STATE], meta

    def read_state(self, step: int | None = None) -> Any:
        """The state of ``step`` (default: the latest) as saved, without a target structure (host
        arrays; not verified: the structure differs from the one the checksums were taken of)."""
        step = self.require_step(step)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**{STATE: ocp.args.StandardRestore()}))
        except Exception as error:  # noqa: BLE001
            raise CheckpointError(f"checkpoint {step} in {self.directory} is unreadable: {_one_line(error)}") from error
        return restored[STATE]

    def close(self) -> None:
        self._manager.close()

    def reload(self) -> None:
        """Re-read the list of steps from disk (after step directories were moved)."""
        self._manager.reload()

    def require_step(self, step: int | None) -> int:
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointError(f"no checkpoint in {self.directory}")
        elif step not in self._manager.all_steps():
            raise CheckpointError(f"no checkpoint for step {step} in {self.directory} (have {self.steps()})")
        return step


def latest_meta(directory: str | pathlib.Path, step: int | None = None) -> tuple[int, dict]:
    """``(step, metadata)`` of a run's checkpoint ``step`` (None: the latest), read only."""
    checkpoints = RunCheckpoints(checkpoint_directory(directory), read_only=True)
    try:
        step = checkpoints.require_step(step)
        return step, checkpoints.meta(step)
    finally:
        checkpoints.close()


def _restore_sharding(abstract: Any) -> jax.sharding.Sharding:
    """Where an array is restored: its own sharding, or this process's first device."""
    sharding = getattr(abstract, "sharding", None)
    return sharding if sharding is not None else jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


# The most bytes (of this process's shards) one Orbax restore reads: Orbax holds what it read
# until the restore returns, so a model restored in one call peaked at twice its shards; in groups
# the peak is the shards plus about one group (measured by bench/loading_memory.py).
RESTORE_GROUP_BYTES = 256 * 2**20


def local_bytes(abstract: Any) -> int:
    """Bytes of this process's shards of the array ``abstract`` (a ShapeDtypeStruct or array;
    without a sharding: all of it)."""
    sharding = getattr(abstract, "sharding", None)
    itemsize = np.dtype(abstract.dtype).itemsize
    if sharding is None:
        return int(np.prod(abstract.shape)) * itemsize
    distinct = {tuple((part.start, part.stop) for part in index)
                for index in sharding.addressable_devices_indices_map(abstract.shape).values()}
    return int(np.prod(sharding.shard_shape(abstract.shape))) * itemsize * len(distinct)


def restore_groups(leaves: list[tuple[Any, Any]], limit: int) -> list[list[tuple[Any, Any]]]:
    """``leaves`` ((path, abstract array) in tree order) cut into consecutive groups of at most
    ``limit`` bytes of this process's shards (`local_bytes`); an array larger than ``limit`` is a
    group of its own."""
    groups, size = [[]], 0
    for path, leaf in leaves:
        nbytes = local_bytes(leaf)
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append((path, leaf))
        size += nbytes
    return [group for group in groups if group]


def _keys(path) -> tuple:
    """A tree path's keys (dict keys, attribute names, sequence indices) as plain values."""
    return tuple(getattr(entry, "key", getattr(entry, "name", getattr(entry, "idx", None))) for entry in path)


def _nested(leaves: list[tuple[Any, Any]]) -> dict:
    """The nested dicts holding ``leaves`` ((path, value)) at their paths' `_keys`: a partial
    tree that Orbax restores as is, and whose checksum names are those of the full tree."""
    tree: dict = {}
    for path, leaf in leaves:
        keys = _keys(path)
        node = tree
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = leaf
    return tree


def restore_subtree(directory: str | pathlib.Path, key: str, abstract: Any, step: int | None = None,
                    group_bytes: int | None = None) -> tuple[Any, dict]:
    """Restore only ``state[key]`` (e.g. the parameters, for fine-tuning) of a run's checkpoint,
    placed like ``abstract`` (arrays without a sharding go to this process's first device, whatever
    devices wrote the checkpoint), verified against the saved checksums; returns ``(subtree, meta)``.
    The arrays are read in groups of at most ``group_bytes`` (None: `RESTORE_GROUP_BYTES`) of this
    process's shards (`restore_groups`), so the memory a restore holds beyond the restored arrays is
    about one group."""
    checkpoints = RunCheckpoints(checkpoint_directory(directory), read_only=True)
    try:
        step = checkpoints.require_step(step)
    except CheckpointError:
        checkpoints.close()
        raise
    where = f"checkpoint {step} in {checkpoints.directory}"
    placed = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=_restore_sharding(a)), abstract)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(placed)
    restored, meta = {}, None
    try:
        for group in restore_groups(leaves, group_bytes or RESTORE_GROUP_BYTES) or [[]]:
            part, meta = _restore_part(checkpoints, step, key, _nested(group), where)
            restored.update((_keys(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(part)[0])
    finally:
        checkpoints.close()
    return jax.tree_util.tree_unflatten(treedef, [restored[_keys(path)] for path, _ in leaves]), meta


def _restore_part(checkpoints: RunCheckpoints, step: int, key: str, part: dict, where: str) -> tuple[dict, dict]:
    """``(state[key] restored where ``part``'s arrays say, meta)``, each array verified."""
    restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding), part)
    try:
        restored = checkpoints._manager.restore(step, args=ocp.args.Composite(**{
            STATE: ocp.args.PyTreeRestore(item={key: part}, restore_args={key: restore_args}, partial_restore=True),
            META: ocp.args.JsonRestore(),
        }))
    except Exception as error:  # noqa: BLE001
        raise CheckpointError(f"cannot restore '{key}' from {where}: {_one_line(error)}") from error
    meta = verify_meta(dict(restored[META]), where)
    verify_arrays({key: restored[STATE][key]}, meta, where)
    return restored[STATE][key], meta


def restore_newest_good(steps: list[int], restore_step: Callable[[int], Any],
                        report: Callable[[str], None]) -> tuple[int, Any]:
    """``(step, restore_step(step))`` for the newest of ``steps`` that restores. The steps that raise
    `CheckpointError` on the way are skipped; once an older one restores, each is reported in one
    line (``report``), then the fallback. When none restores: one `CheckpointError` with the reason
    of the newest."""
    failures = []
    for step in sorted(steps, reverse=True):
        try:
            result = restore_step(step)
        except CheckpointError as error:
            failures.append((step, error))
            continue
        for _, error in failures:
            report(f"warning: {error}")
        if failures:
            report(f"falling back to checkpoint {step} (unusable: {', '.join(str(s) for s, _ in failures)})")
        return step, result
    if not failures:
        raise CheckpointError("no checkpoint")
    older = f" (and {len(failures) - 1} older checkpoints)" if len(failures) > 1 else ""
    raise CheckpointError(f"{failures[0][1]}{older}")
