"""Where a session's memory lives when it is off the device, and the bookkeeping of shared pages.

    HostValue   state [N_kda, HV, K, V], conv [N_kda, W-1, C], rows [N_mla, length, L]
                in JAX's ``pinned_host`` memory of the device when the backend has that memory kind
                (`HostTier`), host numpy arrays otherwise
    disk        one ``.npz`` of the same arrays, written under a temporary name and renamed

`RefCounts` hands out integer ids (KDA slots, MLA pages) and counts their holders: an id returns
to the free list when its last holder releases it.
"""
from __future__ import annotations

import os
import pathlib
import uuid
from typing import NamedTuple

import jax
import numpy as np


class HostValue(NamedTuple):
    state: np.ndarray
    conv: np.ndarray
    rows: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.state.nbytes + self.conv.nbytes + self.rows.nbytes


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
    which ("pinned_host" or "numpy")."""

    def __init__(self, device):
        self.device = device
        self.kind = "pinned_host" if pinned_host_available(device) else "numpy"

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
    temporary name in the same directory, then a rename."""
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(temporary, "wb") as file:
        np.savez(file, **{name: np.asarray(array) for name, array in arrays.items()})
    os.replace(temporary, path)


def read_npz(path: pathlib.Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return {name: data[name] for name in data.files}


class RefCounts:
    """Reference-counted ids 0 … capacity-1 with a free list (lowest ids handed out first)."""

    def __init__(self, capacity: int):
        self.refs = [0] * capacity
        self.free = list(range(capacity - 1, -1, -1))

    @property
    def capacity(self) -> int:
        return len(self.refs)

    @property
    def in_use(self) -> int:
        return self.capacity - len(self.free)

    @property
    def shared(self) -> int:
        return sum(count > 1 for count in self.refs)

    def grow(self, capacity: int) -> None:
        self.free = list(range(capacity - 1, self.capacity - 1, -1)) + self.free
        self.refs += [0] * (capacity - self.capacity)

    def allocate(self) -> int:
        index = self.free.pop()
        self.refs[index] = 1
        return index

    def share(self, ids) -> None:
        for index in ids:
            self.refs[index] += 1

    def release(self, ids) -> None:
        for index in ids:
            self.refs[index] -= 1
            if self.refs[index] == 0:
                self.free.append(index)
