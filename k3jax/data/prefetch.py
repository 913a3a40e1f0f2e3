"""Batches prepared ahead of the train step on a background thread.

    batches = Prefetcher(read_batch, start, stop, depth)    # read_batch(step) -> host batch
    next(batches)  -> read_batch(start), then read_batch(start + 1), ...;   batches.close()

While the caller runs step s (the device computes, Python waits on it), the thread reads batches
s + 1 … s + depth, so the host-side work (reading, packing, for MQAR generating) overlaps the step
instead of preceding it. The batches and their order are those of calling ``read_batch`` in turn:
prefetching changes when a batch is made, never which. ``depth=0`` reads each batch when asked.
An error reading a batch is raised by the ``next`` that would have returned it.
"""
from __future__ import annotations

import collections
import concurrent.futures
from typing import Callable

from k3jax.data.batching import Batch
from k3jax.data.errors import require_int


class Prefetcher:
    """An iterator over ``read_batch(step)`` for ``step`` in ``[start, stop)``, ``depth`` steps ahead."""

    def __init__(self, read_batch: Callable[[int], Batch], start: int, stop: int, depth: int = 2):
        self.read_batch, self.next_step, self.stop = read_batch, start, stop
        self.depth = require_int("data.prefetch", depth, 0)
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="k3jax-prefetch") if depth else None
        self.pending: collections.deque[concurrent.futures.Future] = collections.deque()
        self.submitted = start
        self._fill()

    def _fill(self) -> None:
        while self.pool and len(self.pending) < self.depth and self.submitted < self.stop:
            self.pending.append(self.pool.submit(self.read_batch, self.submitted))
            self.submitted += 1

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        if self.next_step >= self.stop:
            raise StopIteration
        step, self.next_step = self.next_step, self.next_step + 1
        if not self.pool:
            return self.read_batch(step)
        batch = self.pending.popleft().result()
        self._fill()
        return batch

    def close(self) -> None:
        """Drop the batches not yet taken and stop the thread."""
        if self.pool:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pending.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
