"""SIGTERM / SIGINT for the life of a run, recorded rather than fatal (a light module: no JAX).

A signal handler only records the signal; the run looks at it where stopping is clean: between
the phases of its start (`StopSignals.check` raises `StopRequested` there, before anything is
written) and between training steps (the loop finishes its step, saves and exits). Raising from the
handler itself is unsafe: it can fire inside a garbage-collection callback or an import, where the
exception is swallowed or leaves a half-built module.
"""
from __future__ import annotations

import signal


class StopRequested(BaseException):
    """SIGTERM or SIGINT arrived while the run was starting (a `BaseException`, like
    `KeyboardInterrupt`, so that no ``except Exception`` on the way turns it into an error)."""


class StopSignals:
    """Records SIGTERM / SIGINT in ``received`` while installed (a context manager)."""

    def __init__(self):
        self.received: str | None = None
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.received = signal.Signals(signum).name

    def check(self) -> None:
        """Raise `StopRequested` if a signal has arrived."""
        if self.received:
            raise StopRequested(self.received)

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
