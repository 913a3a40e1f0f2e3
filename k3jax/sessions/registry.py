"""Which sessions and snapshots a `SessionStore` holds: their ids, the snapshot handles (a snapshot
is released when its handle is garbage or its session closes), and the copies `snapshot`,
`rollback` and `fork` make and `close` drops (through `k3jax.sessions.tiers.Tiers`, which keeps
them within the byte budgets).
"""
from __future__ import annotations

import dataclasses
import weakref

import numpy as np

from k3jax.sessions.persist import SavedValues
from k3jax.sessions.recency import Clock
from k3jax.sessions.tiers import Tiers, Value


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A handle to a saved point of one session (plain, picklable; valid after `SessionStore.load`)."""

    session: int
    serial: int


class Registry:
    """The values of a store's sessions ({id: `Value`}) and snapshots ({(session, serial): `Value`})."""

    def __init__(self, tiers: Tiers):
        self.tiers = tiers
        self.sessions: dict[int, Value] = {}
        self.snapshots: dict[tuple[int, int], Value] = {}
        self.next_session = self.next_serial = 0
        self._released_handles: list[tuple[int, int]] = []

    def values(self) -> tuple[Value, ...]:
        """Every session and snapshot."""
        return (*self.sessions.values(), *self.snapshots.values())

    def session(self, sid) -> Value:
        """The value of session ``sid``; ValueError for an id that is unknown or closed."""
        if isinstance(sid, bool) or not isinstance(sid, (int, np.integer)) or int(sid) not in self.sessions:
            raise ValueError(f"unknown or closed session id {sid!r}")
        return self.sessions[int(sid)]

    def collect(self) -> None:
        """Release the snapshots whose handles were garbage-collected since the last call."""
        while self._released_handles:
            value = self.snapshots.pop(self._released_handles.pop(), None)
            if value is not None:
                self.tiers.release(value)

    def add(self, value: Value) -> int:
        """A new session holding ``value`` -> its id."""
        sid = self.next_session
        self.next_session += 1
        self.sessions[sid] = value
        return sid

    def snapshot(self, sid) -> Snapshot:
        copy = self.tiers.copy(self.session(sid))
        handle = Snapshot(sid, self.next_serial)
        self.next_serial += 1
        self.snapshots[(handle.session, handle.serial)] = copy
        weakref.finalize(handle, self._released_handles.append, (handle.session, handle.serial))
        return handle

    def rollback(self, sid, handle: Snapshot) -> None:
        value = self.session(sid)
        if not isinstance(handle, Snapshot) or handle.session != sid:
            raise ValueError(f"{handle!r} is not a snapshot of session {sid}")
        if (handle.session, handle.serial) not in self.snapshots:
            raise ValueError(f"{handle!r} was released")
        copy = self.tiers.copy(self.snapshots[(handle.session, handle.serial)], pinned=(value,))
        self.tiers.release(value)
        self.sessions[sid] = copy

    def fork(self, sid) -> int:
        return self.add(self.tiers.copy(self.session(sid)))

    def close(self, sid) -> None:
        self.tiers.release(self.session(sid))
        del self.sessions[sid]
        for key in [key for key in self.snapshots if key[0] == sid]:
            self.tiers.release(self.snapshots.pop(key))

    def restore(self, saved: SavedValues, next_session: int, next_serial: int, clock: Clock) -> None:
        """Hold the sessions and snapshots of a saved store (`k3jax.sessions.persist.read_values`),
        on host, and go on numbering from where it stopped."""
        for held, values in ((self.sessions, saved.sessions), (self.snapshots, saved.snapshots)):
            for key, item in values.items():
                value = Value([int(t) for t in item.tokens], item.logits, item.adapter)
                self.tiers.put_on_host(value, item.memory)
                held[key] = value
                clock.touch(value)
        self.next_session, self.next_serial = next_session, next_serial
