"""SIGTERM / SIGINT for the life of a run, recorded rather than fatal (a light module: no JAX).

A signal handler only records the signal; the run looks at it where stopping is clean: between
the phases of its start (`StopSignals.check` raises `StopRequested` there, before anything is
written) and between training steps (the loop finishes its step, saves and exits). Raising from the
handler itself is unsafe: it can fire inside a garbage-collection callback or an import, where the
exception is swallowed or leaves a half-built module. The exception is a user's callable (a
reward, an environment), which may never return: `bounded_call` runs it so that a signal raises
`StopRequested` inside it, and so that it raises `CallTimedOut` past its time.
"""
from __future__ import annotations

import contextlib
import signal
import threading


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


class CallTimedOut(BaseException):
    """A `bounded_call` ran past its seconds (a `BaseException`: a user's ``except Exception``
    inside the call cannot swallow it)."""


@contextlib.contextmanager
def bounded_call(seconds: float | None):
    """Around a user's callable (a reward, an environment), which may hang: past ``seconds`` (None:
    no bound) SIGALRM raises `CallTimedOut` inside it, and a SIGTERM / SIGINT arriving meanwhile is
    handed to the handler installed before (the run's `StopSignals` records it) and then raises
    `StopRequested` inside it, so that a stop never waits for the call. Handlers and the timer are
    restored after. Signal handlers run on the main thread: elsewhere the body runs unbounded."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM)}

    def stop(number, frame):
        handler = previous[number]
        if callable(handler):
            handler(number, frame)
        raise StopRequested(signal.Signals(number).name)

    def timed_out(number, frame):
        raise CallTimedOut(seconds)
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, stop)
    if seconds is not None:
        signal.signal(signal.SIGALRM, timed_out)
        signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        if seconds is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
        for number, handler in previous.items():
            signal.signal(number, handler)
