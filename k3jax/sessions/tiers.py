"""Where a session's memory lives, and the moves that keep it within the byte budgets.

    device      a slot and pages of the device pools (`k3jax.sessions.pools`)
    HostValue   state [N_kda, HV, K, V], conv [N_kda, W-1, C], rows [N_mla, length, L]
                in JAX's ``pinned_host`` memory of the device when the backend has that memory kind
                (`HostTier`), host numpy arrays otherwise
    disk        one ``.npz`` of the same arrays, written under a temporary name and renamed

Under a device byte budget the least-recently-used values (prefix entries holding the last
reference to a page first, then sessions and snapshots) leave the device for the host tier; under
a host budget (prefix entries first, then values) they go on to atomic files in ``disk_dir``. Each
comes back on use (`Tiers.writable`).
"""
from __future__ import annotations

import os
import pathlib
import re
import tempfile
import uuid
import weakref
import zipfile
from typing import Callable, Iterable, Mapping, NamedTuple

import jax
import numpy as np

from k3jax.memory import memory_limit
from k3jax.sessions.pools import DevicePools
from k3jax.sessions.prefix import PrefixCache
from k3jax.sessions.recency import Clock, least_recent


class HostValue(NamedTuple):
    state: np.ndarray
    conv: np.ndarray
    rows: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.state.nbytes + self.conv.nbytes + self.rows.nbytes

    @classmethod
    def among(cls, arrays: Mapping[str, np.ndarray]) -> HostValue:
        """The value held in named arrays (those of an ``.npz`` file)."""
        return cls(*(arrays[name] for name in cls._fields))


def pinned_host_available(device) -> bool:
    """Whether ``device`` addresses a ``pinned_host`` memory (JAX memory kinds; backends without
    memory-kind support, or without that kind, say no)."""
    try:
        return any(memory.kind == "pinned_host" for memory in device.addressable_memories())
    except (AttributeError, NotImplementedError, jax.errors.JaxRuntimeError):
        return False


class HostTier:
    """Puts host values into the device's ``pinned_host`` memory when it has one (transfers to
    and from the device are then direct copies), into host numpy arrays otherwise; ``kind`` says
    which ("pinned_host" or "numpy"). ``devices``: those the pools live on; pools split over
    several devices (a mesh) keep host values as numpy arrays."""

    def __init__(self, devices):
        devices = list(devices) if isinstance(devices, (set, frozenset, list, tuple)) else [devices]
        self.device = devices[0]
        self.kind = "pinned_host" if len(devices) == 1 and pinned_host_available(self.device) else "numpy"

    def put(self, value: HostValue) -> HostValue:
        """``value`` (device, pinned or numpy arrays) held in this tier."""
        if self.kind == "numpy":
            return HostValue(*(np.asarray(a) for a in value))
        sharding = jax.sharding.SingleDeviceSharding(self.device, memory_kind="pinned_host")
        return HostValue(*jax.device_put(tuple(value), sharding))

    def to_device(self, array):
        """One array of a held value ready for the device: a pinned array copied to the device's
        default memory (numpy arrays are uploaded by the program that takes them)."""
        if self.kind == "numpy":
            return array
        return jax.device_put(array, jax.sharding.SingleDeviceSharding(self.device))


def write_npz_atomically(path: pathlib.Path, **arrays) -> None:
    """``np.savez`` of ``arrays`` (numpy or JAX arrays, copied to the host) to ``path`` through a
    temporary name in the same directory, fsynced, then a rename; a failed write (a full disk)
    leaves no temporary file behind."""
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(temporary, "wb") as file:
            np.savez(file, **{name: np.asarray(array) for name, array in arrays.items()})
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def read_npz(path: pathlib.Path) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` file; ValueError (naming the file) when it is missing or damaged."""
    try:
        with np.load(path, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as error:
        raise ValueError(f"{path}: unreadable ({type(error).__name__}: {' '.join(str(error).split())[:120]})") from None


class Value:
    """One sequence's memory and history: on device (slot + pages), on host, or in a file; and the
    tag of the LoRA adapter that serves it ("" the base model; `SessionStore.serve_adapters`)."""

    def __init__(self, tokens: list[int], logits, adapter: str = ""):
        self.tokens = tokens
        self.logits = logits            # [vocab] of the last position
        self.adapter = adapter
        self.slot: int | None = None
        self.pages: list[int] = []
        self.host: HostValue | None = None
        self.disk: pathlib.Path | None = None
        self.used = 0

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def tier(self) -> str:
        return "device" if self.slot is not None else "host" if self.host is not None else "disk"


def _held_off_device(value: Value) -> HostValue:
    """The memory of a value that is not on device: its host-tier arrays or its file's."""
    return value.host if value.host is not None else HostValue.among(read_npz(value.disk))


class NoRoom(Exception):
    """The device budget has no room left without moving a pinned value."""


class DiskTierError(OSError):
    """The disk tier could not take a value (a full or unwritable disk): the value stays where it
    was and the operation that needed the room fails; the store keeps serving what fits."""


def _check_writable(directory: pathlib.Path) -> None:
    """Create ``directory`` and prove a file can be written there (ValueError otherwise), so that a
    disk tier that cannot be used is refused when the store is made, not at its first spill."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-test-"):
            pass
    except OSError as error:
        raise ValueError(f"disk_dir {directory} cannot be written: {error.strerror or error}") from None


SPILL_PREFIX = "value-"        # a spill file's name: value-{hex}.npz (being written: .value-{hex}.npz.{hex}.tmp)


def remove_spill_files(directory: pathlib.Path) -> list[pathlib.Path]:
    """Remove the spill files (and half-written ones) that a store which ended without cleaning up
    (killed) left in its disk tier ``directory`` -> the paths removed. Only for a directory no
    running store uses: spill files are nobody's state once their store is gone."""
    if not directory.is_dir():
        return []
    stale = [path for path in directory.iterdir()
             if re.fullmatch(rf"\.?{SPILL_PREFIX}[0-9a-f]+\.npz(\.[0-9a-f]+\.tmp)?", path.name)]
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def _remove_files(paths: set[pathlib.Path]) -> None:
    for path in list(paths):
        path.unlink(missing_ok=True)
    paths.clear()


class Tiers:
    """Moves the values that ``values()`` lists (and drops entries of ``prefix``) between the
    ``device`` pools, the ``host`` tier and files in ``disk_dir`` to keep within ``device_budget``
    and ``host_budget`` bytes (None: unlimited; prefix entries count on the host), least recently
    used (``clock``) first; ``pinned`` values stay where they are."""

    def __init__(self, device: DevicePools, prefix: PrefixCache, host: HostTier, clock: Clock,
                 values: Callable[[], Iterable[Value]], device_budget: int | None, host_budget: int | None,
                 disk_dir: pathlib.Path | None):
        smallest = device.slot_bytes + device.page_bytes
        for name, budget in (("device_bytes", device_budget), ("host_bytes", host_budget)):
            if budget is not None and budget < smallest:
                raise ValueError(f"{name}={budget} is too small for one session "
                                 f"(one KDA slot + one MLA page = {smallest} bytes)")
        if disk_dir is not None:
            _check_writable(disk_dir)
        self.device, self.prefix, self.host, self.clock, self.values = device, prefix, host, clock, values
        self.device_budget, self.host_budget, self.disk_dir = device_budget, host_budget, disk_dir
        self.value_host_bytes = self.disk_bytes = 0
        self.counts = dict.fromkeys(("spills_to_host", "spills_to_disk", "loads_from_host", "loads_from_disk"), 0)
        self.disk_failure: str | None = None      # why the latest spill to disk failed (None: it did not)
        # The spill files in use, removed when the tiers are collected or the process exits.
        self.spill_files: set[pathlib.Path] = set()
        weakref.finalize(self, _remove_files, self.spill_files)

    @property
    def host_bytes(self) -> int:
        return self.prefix.nbytes + self.value_host_bytes

    def check_fits(self, length: int) -> None:
        """A session of ``length`` tokens must fit the device budget on its own (without a budget:
        the device's memory, `k3jax.memory.memory_limit`)."""
        need = self.device.slot_bytes + (self.device.pages_for(length) + 1) * self.device.page_bytes
        budget = memory_limit() if self.device_budget is None else self.device_budget
        if need > budget:
            raise ValueError(f"a session of {length} tokens needs {need} device bytes, the "
                             f"{'device holds' if self.device_budget is None else 'budget is'} {budget}")

    def reserve(self, slots: int, pages: int, pinned) -> None:
        """Free device room for ``slots`` slots and ``pages`` pages (evicting the least recently
        used values not in ``pinned``), drop prefix entries while the pools lack free pages, and
        only then grow the pools so they can be allocated."""
        need = slots * self.device.slot_bytes + pages * self.device.page_bytes
        pinned_ids = {id(v) for v in pinned}
        while self.device_budget is not None and self.device.used_bytes + need > self.device_budget:
            if self.prefix.evict(freeing_pages=True):    # prefix entries that are the last holder of a page go first
                continue
            value = least_recent(v for v in self.values() if v.slot is not None and id(v) not in pinned_ids)
            if value is None:
                raise NoRoom()
            self.to_host(value, pinned)
        while len(self.device.pages.free) < pages and self.prefix.evict(freeing_pages=True):
            pass                                         # the prefix cache lives in spare pages: it never grows the pools
        self.device.grow(slots, pages)

    def writable(self, value: Value, new_tokens: int, pinned=()) -> None:
        """Put ``value`` on device with pages for ``new_tokens`` more tokens, the page written
        first copied if shared."""
        self.clock.touch(value)
        pinned = (*pinned, value)
        if value.slot is None:
            self._to_device(value, pinned)
        copy = new_tokens > 0 and self.device.shared_partial_page(value.pages, value.length) is not None
        grow = self.device.pages_for(value.length + new_tokens) - len(value.pages)
        self.reserve(0, grow + copy, pinned)
        if copy:
            self.device.copy_on_write(value.pages, value.length)
        value.pages += self.device.allocate_pages(grow)

    def copy(self, source: Value, pinned=()) -> Value:
        """A new device value equal to ``source``: its slot copied and its pages shared when it is
        on the device; uploaded from its host arrays or file otherwise (``source`` stays there)."""
        if source.slot is None:
            self.clock.touch(source)
            copy = Value(list(source.tokens), np.array(source.logits), source.adapter)
            self._upload(copy, source, (*pinned, source))
            self.clock.touch(copy)
            return copy
        self.writable(source, 0, pinned)
        self.reserve(1, 0, (*pinned, source))
        copy = Value(list(source.tokens), np.array(source.logits), source.adapter)
        copy.slot = self.device.copy_slot(source.slot)
        copy.pages = list(source.pages)
        self.device.pages.share(copy.pages)
        self.clock.touch(copy)
        return copy

    def release(self, value: Value) -> None:
        """Free everything the value holds on device, host and disk."""
        if value.slot is not None:
            self.device.release(value.slot, value.pages)
            value.slot, value.pages = None, []
        self._clear_off_device(value)

    def arrays(self, value: Value) -> HostValue:
        """The value's memory (rows cut to its length, on the host), wherever it is: state and conv
        tails as device arrays when it is on the device, else its host-tier arrays or its file's."""
        if value.slot is None:
            return _held_off_device(value)
        return HostValue(*self.device.download(value.slot, value.pages, value.length))

    def put_on_host(self, value: Value, arrays: HostValue) -> None:
        """Hold ``arrays`` in the host tier as the memory of ``value`` (not on device)."""
        value.host = self.host.put(arrays)
        self.value_host_bytes += value.host.nbytes

    def fit_host(self, pinned=()) -> None:
        """Within the host budget: drop prefix entries, then move host values not in ``pinned`` to
        disk, least recently used first."""
        pinned_ids = {id(v) for v in pinned}
        while self.host_budget is not None and self.host_bytes > self.host_budget:
            if self.prefix.evict():
                continue
            value = least_recent(v for v in self.values() if v.host is not None and id(v) not in pinned_ids)
            if value is None:
                return
            if self.disk_dir is None:
                raise ValueError(f"the host budget of {self.host_budget} bytes is full and there is no disk tier "
                                 f"(give disk_dir)")
            self._to_disk(value)

    def _to_device(self, value: Value, pinned) -> None:
        """Move a host or disk value into a fresh slot and pages."""
        self._upload(value, value, pinned)
        self._clear_off_device(value)

    def _upload(self, value: Value, source: Value, pinned) -> None:
        """Write the memory of ``source`` (a host or disk value of ``value.length`` tokens) into a
        fresh slot and pages of ``value``."""
        host = _held_off_device(source)
        self.reserve(1, self.device.pages_for(value.length), (*pinned, value))
        value.slot, value.pages = self.device.upload(self.host.to_device(host.state), self.host.to_device(host.conv),
                                                     host.rows, value.length)
        self.counts["loads_from_host" if source.host is not None else "loads_from_disk"] += 1

    def to_host(self, value: Value, pinned=()) -> None:
        """Move a device value to the host tier (then keep the host budget, ``pinned`` staying)."""
        arrays = self.arrays(value)
        self.device.release(value.slot, value.pages)
        value.slot, value.pages = None, []
        self.put_on_host(value, arrays)
        self.counts["spills_to_host"] += 1
        self.fit_host(pinned)

    def _to_disk(self, value: Value) -> None:
        """Move a host value to a new spill file; `DiskTierError` (the value still on host, the
        failure kept in ``disk_failure`` until a spill succeeds) when the file cannot be written."""
        path = self.disk_dir / f"{SPILL_PREFIX}{uuid.uuid4().hex}.npz"
        try:
            write_npz_atomically(path, **value.host._asdict())
        except OSError as error:
            self.disk_failure = f"the disk tier {self.disk_dir} cannot take a spilled session: {error.strerror or error}"
            raise DiskTierError(self.disk_failure) from None
        self.disk_failure = None
        self.spill_files.add(path)
        self.disk_bytes += path.stat().st_size
        self.value_host_bytes -= value.host.nbytes
        value.host, value.disk = None, path
        self.counts["spills_to_disk"] += 1

    def _clear_off_device(self, value: Value) -> None:
        """Forget the value's host arrays and file (it is now elsewhere or gone)."""
        if value.host is not None:
            self.value_host_bytes -= value.host.nbytes
            value.host = None
        if value.disk is not None:
            self.disk_bytes -= value.disk.stat().st_size
            value.disk.unlink()
            self.spill_files.discard(value.disk)
            value.disk = None
