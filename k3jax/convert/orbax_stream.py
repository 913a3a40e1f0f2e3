"""Orbax checkpoints written and read one tensor region at a time (tensorstore, no full arrays).

A trainer checkpoint step ``<run>/checkpoints/<step>/`` holds the pytree item ``state`` (zarr
arrays named ``<top>.<leaf key>`` in an OCDBT key-value store, plus Orbax's ``_METADATA`` and
``_sharding``) and the JSON item ``meta``. `StreamedStateWriter` creates every array of that
layout up front and fills it region by region — e.g. one expert of one scanned layer at a time —
so converting a model never holds more than one tensor; `k3jax.checkpoint.RunCheckpoints`,
`restore_subtree` and `k3jax.inference.restore_model` read the result like any trainer checkpoint.
`StateReader` reads regions of the arrays of any such checkpoint (the trainer's included).

Several processes can write one checkpoint (each a share of the regions) the way Orbax writes
multi-host checkpoints: process i writes into its own OCDBT store ``state/ocdbt.process_i/``
(process 0 creates every array's zarr metadata, the others write chunks only), and after all
have finished the primary merges the stores into the root one (`merge_process_stores`, Orbax's
merge: the root store references the per-process data files, which stay).
"""
from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import json
import pathlib
import time
from typing import Any, NamedTuple

import jax
import numpy as np
import tensorstore as ts
from etils import epath
from orbax.checkpoint._src.serialization import ocdbt_utils
from orbax.checkpoint._src.serialization import tensorstore_utils

from k3jax.checkpoint import region_checksum, sealed_with_checksums
from k3jax.convert.errors import ConvertError

STATE, META = "state", "meta"
_CHECKSUM_PIECE = 2**22      # elements per checksum call (16 MiB of fp32)
_HANDLERS = {META: "orbax.checkpoint._src.handlers.json_checkpoint_handler.JsonCheckpointHandler",
             STATE: "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler"}


class LeafSpec(NamedTuple):
    shape: tuple[int, ...]
    dtype: np.dtype
    chunks: tuple[int, ...]   # one region written at a time spans whole chunks


def _kvstore(state_dir: pathlib.Path) -> dict:
    return {"driver": "ocdbt", "base": f"file://{state_dir.resolve()}/"}


def _array_name(top: str, key: str) -> str:
    return f"{top}.{key}"


class StreamedStateWriter:
    """The ``state`` and ``meta`` items of one checkpoint step, written region by region.

    ``leaves``: ``{top-level name: {leaf key: LeafSpec}}`` (e.g. ``{"params": {...}, "buffers": {...}}``).
    Writes run in the background while the caller prepares the next region; at most
    ``pending_bytes`` (at least one region) are in flight, which bounds the memory they hold.
    Each region's part of its array's checksum (`k3jax.checkpoint.region_checksum`) is added up
    as it is written, and `finish` seals ``meta`` with the sums, so restores verify the arrays
    like a trainer checkpoint's (every element must have been written exactly once).
    """

    def __init__(self, step_dir: pathlib.Path, leaves: dict[str, dict[str, LeafSpec]], pending_bytes: int = 2**26,
                 process: int = 0, num_processes: int = 1):
        self.step_dir = step_dir
        self.state_dir = step_dir / STATE
        self.state_dir.mkdir(parents=True, exist_ok=num_processes > 1)
        store_dir = self.state_dir if num_processes == 1 else self.state_dir / f"ocdbt.process_{process}"
        self.leaves = leaves
        self._context = ts.Context()
        self._pending: collections.deque = collections.deque()
        self._pending_bytes, self._budget = 0, pending_bytes
        opening = {}
        for top, specs in leaves.items():
            for key, spec in specs.items():
                metadata = {"shape": list(spec.shape), "chunks": list(spec.chunks), "dtype": np.dtype(spec.dtype).str,
                            "compressor": {"id": "zstd", "level": 1}}
                opening[top, key] = ts.open(
                    {"driver": "zarr", "kvstore": {**_kvstore(store_dir), "path": _array_name(top, key)},
                     "metadata": metadata, "assume_metadata": process > 0}, create=True, context=self._context)
        self._arrays: dict[tuple[str, str], Any] = {name: future.result() for name, future in opening.items()}
        self._checksums = dict.fromkeys(self._arrays, 0)

    def write(self, top: str, key: str, index: tuple[int, ...], value: np.ndarray) -> None:
        """Start ``array[index] = value`` for the leaf ``top/key`` (``value`` is cast to the leaf dtype)."""
        spec = self.leaves[top][key]
        expected = spec.shape[len(index):]
        if tuple(value.shape) != expected:
            raise ConvertError(f"{top}/{key}{list(index)}: got shape {list(value.shape)}, expected {list(expected)}")
        value = np.asarray(value, spec.dtype)
        self._add_checksum(top, key, index, value)
        while self._pending and self._pending_bytes + value.nbytes > self._budget:
            self._wait_oldest()
        self._pending.append((self._arrays[top, key][index].write(value), value.nbytes))
        self._pending_bytes += value.nbytes

    def _add_checksum(self, top: str, key: str, index: tuple[int, ...], value: np.ndarray) -> None:
        """Add the checksum part of ``array[index] = value`` (a block of whole trailing rows)."""
        part = block_checksum(self.leaves[top][key].shape, index, value)
        self._checksums[top, key] = (self._checksums[top, key] + part) % 2**32

    def checksums(self) -> dict[str, int]:
        """``{path: checksum}`` of the arrays so far, named as `k3jax.checkpoint.tree_checksums`
        names the restored ``{top: {key: array}}``."""
        return {checksum_name(top, key): total for (top, key), total in self._checksums.items()}

    def _wait_oldest(self) -> None:
        future, nbytes = self._pending.popleft()
        self._pending_bytes -= nbytes
        future.result()

    def flush(self) -> None:
        """Wait for every write started so far."""
        while self._pending:
            self._wait_oldest()

    def settle(self) -> None:
        """Wait for every write in flight to end, ignoring their errors: what a failed import calls
        before its partial directory is removed (a write still landing would recreate files there)."""
        while self._pending:
            with contextlib.suppress(Exception):
                self._wait_oldest()

    def finish(self, meta: dict, checksums: dict[str, int]) -> None:
        """Finish the writes, then write Orbax's metadata for the state item, the meta item (``meta``
        sealed with ``checksums``: this writer's `checksums`, or every process's summed) and the
        step's commit markers."""
        self.flush()
        device = jax.devices()[0]
        sharding = json.dumps({"sharding_type": "SingleDeviceSharding", "device_str": f"{device.platform}:{device.id}"})
        tree, shardings = {}, {}
        for top, specs in self.leaves.items():
            for key, spec in specs.items():
                tree[str((top, key))] = {
                    "key_metadata": [{"key": top, "key_type": 2}, {"key": key, "key_type": 2}],
                    "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False, "write_shape": list(spec.chunks)},
                }
                shardings[base64.b64encode(_array_name(top, key).encode()).decode()] = sharding
        (self.state_dir / "_METADATA").write_text(json.dumps({
            "tree_metadata": tree, "use_ocdbt": True, "use_zarr3": False,
            "store_array_data_equal_to_fill_value": True, "custom_metadata": None}))
        (self.state_dir / "_sharding").write_text(json.dumps(shardings))
        (self.step_dir / META).mkdir()
        (self.step_dir / META / "metadata").write_text(json.dumps(sealed_with_checksums(meta, checksums)))
        now = time.time_ns()
        (self.step_dir / "_CHECKPOINT_METADATA").write_text(json.dumps({
            "item_handlers": _HANDLERS, "metrics": {}, "performance_metrics": {},
            "init_timestamp_nsecs": now, "commit_timestamp_nsecs": now, "custom_metadata": {}}))


def merge_process_stores(state_dir: pathlib.Path) -> None:
    """Merge the per-process OCDBT stores ``state_dir/ocdbt.process_*`` into the root store
    (Orbax's multi-host merge, one atomic transaction; it checks every array has data)."""
    context = tensorstore_utils.get_ts_context(use_ocdbt=True)
    try:
        asyncio.run(ocdbt_utils.merge_ocdbt_per_process_files(epath.Path(state_dir), ts_context=context, use_zarr3=False))
    except ValueError as error:
        raise ConvertError(f"{state_dir}: merging the processes' stores failed ({' '.join(str(error).split())[:200]})") from None


def checksum_name(top: str, key: str) -> str:
    """The path `k3jax.checkpoint.tree_checksums` gives array ``key`` of state item ``top``."""
    return jax.tree_util.keystr((jax.tree_util.DictKey(top), jax.tree_util.DictKey(key)))


def block_checksum(shape: tuple[int, ...], index: tuple[int, ...], value: np.ndarray) -> int:
    """The part of the checksum of an array of ``shape`` that its block ``array[index] = value`` (whole
    trailing rows: a contiguous region) contributes (`k3jax.checkpoint.region_checksum`)."""
    offset = int(np.ravel_multi_index(index, shape[: len(index)])) * value.size if index else 0
    flat, total = value.reshape(-1), 0
    for start in range(0, flat.size, _CHECKSUM_PIECE):   # bounded pieces: bounded transient memory
        total = (total + region_checksum(flat[start : start + _CHECKSUM_PIECE], offset + start)) % 2**32
    return total


def summed_checksums(parts: list[dict[str, int]]) -> dict[str, int]:
    """Per-array checksums from the parts several writers summed (the sums add mod 2^32)."""
    return {name: sum(part.get(name, 0) for part in parts) % 2**32 for name in parts[0]}


class StateReader:
    """Regions of the arrays in a checkpoint step's ``state`` item. Each distinct region read adds
    its part to its array's checksum; `verify` compares every array read whole with the checksum
    saved with the checkpoint (``saved``: the meta's ``{path: checksum}``), as every restore does."""

    def __init__(self, step_dir: pathlib.Path, saved: dict[str, int] | None = None):
        self.state_dir = step_dir / STATE
        self.saved = saved
        self._context = ts.Context()
        self._arrays: dict[tuple[str, str], Any] = {}
        self._parts: dict[tuple[str, str], dict[tuple[int, ...], tuple[int, int]]] = collections.defaultdict(dict)

    def array(self, top: str, key: str):
        if (top, key) not in self._arrays:
            try:
                self._arrays[top, key] = ts.open(
                    {"driver": "zarr", "kvstore": {**_kvstore(self.state_dir), "path": _array_name(top, key)}},
                    open=True, read=True, context=self._context).result()
            except ValueError as error:
                raise ConvertError(f"{self.state_dir}: no array {top}/{key} ({' '.join(str(error).split())[:200]})") from None
        return self._arrays[top, key]

    def has(self, top: str, key: str) -> bool:
        try:
            self.array(top, key)
        except ConvertError:
            return False
        return True

    def read(self, top: str, key: str, index: tuple[int, ...] = ()) -> np.ndarray:
        array = self.array(top, key)
        value = np.asarray(array[index].read().result())
        if self.saved is not None and index not in self._parts[top, key]:
            self._parts[top, key][index] = (block_checksum(tuple(array.shape), index, value), value.size)
        return value

    def verify(self) -> None:
        """Raise `ConvertError` naming the first array read whole whose checksum is not the saved one."""
        for (top, key), parts in self._parts.items():
            if sum(size for _, size in parts.values()) != int(np.prod(self.array(top, key).shape, dtype=np.int64)):
                continue   # read in part (an adapter's shared factor, say): nothing to compare
            found = sum(part for part, _ in parts.values()) % 2**32
            saved = self.saved.get(checksum_name(top, key))
            if found != saved:
                raise ConvertError(f"{self.state_dir}: array {top}/{key} is corrupted (checksum {found:#010x}, "
                                   f"saved {saved if saved is None else f'{saved:#010x}'})")
