"""Who holds which slot and page of the device pools (`k3jax.sessions.paged`).

A session's memory on device is its KDA states and conv tails (a slot of the pools) and its MLA
latent rows (pages of the paged cache). Forks, snapshots and prefix-cache entries share pages; a
page is copied before a write when someone else holds it (copy-on-write: only a session's last,
partial page is ever written). `RefCounts` counts the holders of each slot and page id; the
pools double when more are needed than are free.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from k3jax.sessions import paged
from k3jax.sharding.mesh import to_host
from k3jax.sessions.paged import Pools


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


class DevicePools:
    """The device pools ``arrays`` (programs that donate them assign their result back) of pages of
    ``page_size`` tokens, the holders of their slots and pages, and the bytes those take.
    ``shardings`` (`paged.pool_shardings`; None on one device) is where the pools live on a mesh;
    they keep it when they grow."""

    def __init__(self, arrays: Pools, page_size: int, shardings: Pools | None = None):
        self.arrays, self.shardings = arrays, shardings
        self.slots, self.pages = RefCounts(arrays.state.shape[0]), RefCounts(arrays.latent.shape[1])
        self.page_size, self.latent_width = page_size, arrays.latent.shape[2] // page_size
        self.slot_bytes = sum(a.nbytes // a.shape[0] for a in (arrays.state, arrays.conv))   # a KDA slot
        self.page_bytes = arrays.latent.nbytes // arrays.latent.shape[1]          # an MLA page of every layer
        self.pages_copied = 0

    @property
    def used_bytes(self) -> int:
        """Bytes of the slots and pages someone holds (whole arrays: on a mesh, summed over devices)."""
        return self.slots.in_use * self.slot_bytes + self.pages.in_use * self.page_bytes

    @property
    def pool_bytes(self) -> int:
        """Bytes of the pools, free entries included."""
        return sum(a.nbytes for a in self.arrays)

    def pages_for(self, length: int) -> int:
        """Pages that hold ``length`` tokens."""
        return math.ceil(length / self.page_size)

    def table(self, pages: list[int], bucket: int) -> np.ndarray:
        """A page table padded to ``bucket`` entries with the out-of-range page id."""
        table = np.full((bucket,), self.pages.capacity, np.int32)
        table[: len(pages)] = pages
        return table

    def grow(self, slots: int, pages: int) -> None:
        """Grow the pools (doubling) until ``slots`` slots and ``pages`` pages are free."""
        slot_capacity, page_capacity = self.slots.capacity, self.pages.capacity
        while len(self.slots.free) + (slot_capacity - self.slots.capacity) < slots:
            slot_capacity *= 2
        while len(self.pages.free) + (page_capacity - self.pages.capacity) < pages:
            page_capacity *= 2
        if (slot_capacity, page_capacity) != (self.slots.capacity, self.pages.capacity):
            self.arrays = paged.grown(self.arrays, slot_capacity, page_capacity, self.shardings)
            self.slots.grow(slot_capacity)
            self.pages.grow(page_capacity)

    def scratch_slots(self, count: int) -> list[int]:
        """``count`` distinct free slots (not allocated) for a batch's padding rows to write into;
        the pools grow when fewer are free (scratch does not count against the device budget)."""
        self.grow(count, 0)
        return self.slots.free[len(self.slots.free) - count:]

    def allocate_pages(self, count: int) -> list[int]:
        return [self.pages.allocate() for _ in range(count)]

    def release(self, slot: int, pages: list[int]) -> None:
        self.slots.release([slot])
        self.pages.release(pages)

    def start_slot(self, state, conv) -> int:
        """A new slot holding ``state`` and ``conv`` tails (no rows written)."""
        slot = self.slots.allocate()
        latent = self.arrays.latent
        self.arrays = paged.write_value(self.arrays, slot, state, conv, jnp.zeros((0,), jnp.int32),
                                        jnp.zeros((latent.shape[0], 0, self.latent_width), latent.dtype))
        return slot

    def zero_state(self) -> tuple[np.ndarray, np.ndarray]:
        """The state and conv tails of a sequence before its first token."""
        return tuple(np.zeros(a.shape[1:], a.dtype) for a in (self.arrays.state, self.arrays.conv))

    def copy_slot(self, source: int) -> int:
        """A new slot holding slot ``source``'s state and conv tails."""
        slot = self.slots.allocate()
        self.arrays = paged.copy_slot(self.arrays, np.int32(source), np.int32(slot))
        return slot

    def read_slot(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """The state and conv tails of ``slot``, on the host."""
        return tuple(to_host(a) for a in paged.read_slot(self.arrays, np.int32(slot)))

    def shared_partial_page(self, pages: list[int], length: int) -> int | None:
        """The index in ``pages`` of the sequence's last, partial page when someone else holds it
        too (it must be copied before the sequence writes); None when there is no such page."""
        index = length // self.page_size
        if length % self.page_size == 0 or self.pages.refs[pages[index]] == 1:
            return None
        return index

    def copy_on_write(self, pages: list[int], length: int) -> None:
        """Give the sequence of ``pages`` and ``length`` its own copy of its shared partial page
        (a free page must be there: reserved by the caller)."""
        index = self.shared_partial_page(pages, length)
        if index is None:
            return
        page = self.pages.allocate()
        self.arrays = paged.copy_page(self.arrays, np.int32(pages[index]), np.int32(page))
        self.pages.release([pages[index]])
        pages[index] = page
        self.pages_copied += 1

    def upload(self, state, conv, rows, length: int) -> tuple[int, list[int]]:
        """Write one sequence (its state, conv tails and latent rows ``[N_mla, length, L]``) into a
        new slot and new pages -> (slot, pages); room must be there."""
        count = self.pages_for(length)
        bucket = paged.next_power_of_two(count) if count else 0
        padded = np.zeros((rows.shape[0], bucket * self.page_size, rows.shape[-1]), rows.dtype)
        padded[:, :length] = np.asarray(rows)
        slot, pages = self.slots.allocate(), self.allocate_pages(count)
        self.arrays = paged.write_value(self.arrays, np.int32(slot), state, conv,
                                        self.table(pages, bucket), padded)
        return slot, pages

    def download(self, slot: int, pages: list[int], length: int):
        """-> (state, conv tails, latent rows ``[N_mla, length, L]`` on the host) of one sequence:
        state and conv as device arrays."""
        bucket = paged.next_power_of_two(len(pages)) if pages else 0
        state, conv, rows = paged.read_value(self.arrays, np.int32(slot), self.table(pages, bucket), self.latent_width)
        return state, conv, to_host(rows)[:, :length]
