"""Where a session's memory lives when it is off the device, and the bookkeeping of shared pages.

    HostValue   state [N_kda, HV, K, V], conv [N_kda, W-1, C], rows [N_mla, length, L]   (numpy)
    disk        one ``.npz`` of the same arrays, written under a temporary name and renamed

`RefCounts` hands out integer ids (KDA slots, MLA pages) and counts their holders: an id returns
to the free list when its last holder releases it.
"""
from __future__ import annotations

import os
import pathlib
import uuid
from typing import NamedTuple

import numpy as np


class HostValue(NamedTuple):
    state: np.ndarray
    conv: np.ndarray
    rows: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.state.nbytes + self.conv.nbytes + self.rows.nbytes


def write_npz_atomically(path: pathlib.Path, **arrays) -> None:
    """``np.savez`` to ``path`` through a temporary name in the same directory, then a rename."""
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(temporary, "wb") as file:
        np.savez(file, **arrays)
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
