"""Batched decode: which sessions step together, and the padded inputs of their step.

All sessions of a `SessionStore.generate` call step together in one jitted decode step
(`k3jax.sessions.paged.decode_step`; batch and page counts in power-of-two buckets); when the
device budget cannot hold them all, those earlier in ``sids`` run first and the others join as
sessions finish (`admit`). A padding row of a batch reads no pages and writes into a free slot of
its own (`decode_batch`).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from k3jax.sessions.paged import next_power_of_two
from k3jax.sessions.pools import DevicePools


def admit(running: list[int], pending: list[int], make_room: Callable[[int, list[int]], bool]) -> list[int]:
    """The sessions of the next step: every running one, then pending ones in order, while
    ``make_room(sid, admitted)`` (room on device for one more token of ``sid`` beside the
    ``admitted``) succeeds. Admitted ones leave ``pending``; running ones that found no room go
    back to its front."""
    admitted = []
    for sid in running + list(pending):
        if not make_room(sid, admitted):
            if not admitted:
                raise ValueError("the device budget cannot hold one decoding session")
            break
        admitted.append(sid)
        if sid in pending:
            pending.remove(sid)
    pending[:0] = [sid for sid in running if sid not in admitted]
    return admitted


class DecodeBatch(NamedTuple):
    """One decode step's inputs, padded to a power-of-two batch of power-of-two page tables."""

    slots: np.ndarray      # [B] int32
    tables: np.ndarray     # [B, P] int32
    lengths: np.ndarray    # [B] int32
    logits: np.ndarray     # [B, vocab] float32
    row_ids: np.ndarray    # [B] uint32: the session ids (0 for padding)


def decode_batch(sids: list[int], values, device: DevicePools) -> DecodeBatch:
    """The step of sessions ``sids`` (their values on device, each with a page for one more
    token); padding rows get free slots of ``device`` (grown if needed) and empty page tables."""
    batch = next_power_of_two(len(values))
    pages = next_power_of_two(max(device.pages_for(v.length + 1) for v in values))
    pad = batch - len(values)
    logits = [np.asarray(v.logits, np.float32) for v in values]
    return DecodeBatch(
        slots=np.asarray([v.slot for v in values] + device.scratch_slots(pad), np.int32),
        tables=np.stack([device.table(v.pages, pages) for v in values] + [device.table([], pages)] * pad),
        lengths=np.asarray([v.length for v in values] + [0] * pad, np.int32),
        logits=np.stack(logits + [np.zeros_like(logits[0])] * pad),
        row_ids=np.asarray(list(sids) + [0] * pad, np.uint32),
    )
