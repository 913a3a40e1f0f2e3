"""One line, not JAX's fatal log, when a process of a multi-process run loses a peer.

When a process of a `jax.distributed` run dies (killed, out of memory, its host gone), JAX's
coordination service ends every other process: at once when the coordinator (process 0) is gone,
after the heartbeat timeout when another is. It does so from a native thread, with ``LOG(FATAL)``:
twenty-odd lines of glog messages and a native stack trace, then ``abort()``. Nothing in Python
runs, and jaxlib 0.10's hook for it (``missed_heartbeat_callback``) aborts converting its status.

`watch_for_lost_peers` keeps the process as it is and forks a small watcher that becomes the reader
of its standard error (file descriptor 2 now points at a pipe to the watcher). The watcher passes
every line through as it comes, except the coordination service's own error lines and whatever
follows them, which it holds. When the process ends with JAX's fatal message among them, the
watcher writes the held text to a log file and prints one line in its place:

    error: process 1 of 2 stopped: process 0, the coordinator at 10.0.0.2:1234, is gone (... log: /tmp/...)

If the process ends otherwise, or the held lines are not followed by the fatal message within
`HOLD_SECONDS`, they are passed on unchanged: nothing written to standard error is lost. The watcher
ignores the signals a terminal or a scheduler sends (they are the process's to handle, and the
process keeps its pid) and ends when the process's standard error closes, that is when it ends.

Python code can see the loss first (a follower's read from process 0, `k3jax.inference.mirror`); it
then waits for the service to stop the process, and raises `PeerLost` only if it does not.
`report_peer_lost_in_one_line` makes an uncaught `PeerLost` one line too.
"""
from __future__ import annotations

import os
import re
import select
import signal
import sys
import tempfile
import time

# How long held coordination lines wait for JAX's fatal message before they are passed on.
HOLD_SECONDS = 10.0

# A glog line from the coordination service's client and service (`E1207 05:29:06.120 4120 file.cc:12] ...`).
COORDINATION_LINE = re.compile(rb"[WEF]\d{4} [\d:.]+\s+\d+ (coordination_service\w*|preemption_\w+|client)\.(cc|h):\d+\]")
# What may still become such a line: an incomplete line is held only while it could be one.
GLOG_PREFIX = re.compile(rb"^[IWEF](\d{0,4}( [\d:.]*(\s+\d*)?)?)?$")
FATAL = b"Terminating process because the JAX distributed service detected fatal errors"
UNHEALTHY = re.compile(rb"stopped sending heartbeats\):\s*\n([\d\s,]+)")
LEADER_GONE = (b"leader task was preempted/died", b"Failed to send RPC to coordination service")
STATUS = re.compile(rb"absl::Status: (.*)")


class PeerLost(RuntimeError):
    """Another process of the run is gone; the message is one line."""


def report_peer_lost_in_one_line(this_process) -> None:
    """An uncaught `PeerLost` ends this process with one line, naming it ``this_process()``
    (e.g. ``"process 1 of 2"``), instead of a traceback; other errors as before."""
    previous = sys.excepthook

    def hook(kind, error, trace):
        if not issubclass(kind, PeerLost):
            return previous(kind, error, trace)
        print(f"error: {this_process()} stopped: {error}; every process of the run stops",
              file=sys.stderr, flush=True)
    sys.excepthook = hook


def lost_peer_line(held: bytes, process_id: int | None, process_count: int | None, address: str,
                   heartbeat_s: int, log_path: str) -> str:
    """The one line that stands for JAX's fatal log ``held`` (which contains `FATAL`)."""
    unhealthy = UNHEALTHY.search(held)
    if unhealthy:
        peers = sorted({int(task) for task in re.findall(rb"\d+", unhealthy.group(1))})
        names = ", ".join(map(str, peers))
        reason = (f"process{'es' if len(peers) > 1 else ''} {names} sent no heartbeat for {heartbeat_s} s "
                  f"(died or lost the network)")
    elif any(sign in held for sign in LEADER_GONE):
        reason = f"process 0, the coordinator at {address}, is gone (died or lost the network)"
    else:
        status = STATUS.search(held)
        reason = "JAX's distributed service failed: " + (status.group(1).decode(errors="replace").strip()[:200]
                                                          if status else "see the log")
    this = "this process" if process_id is None else f"process {process_id}" + (
        "" if process_count is None else f" of {process_count}")
    return f"error: {this} stopped: {reason}; every process of the run stops (JAX's log: {log_path})"


def watch_for_lost_peers(process_id: int | None, process_count: int | None, address: str, heartbeat_s: int) -> bool:
    """Put a watcher (module docstring) on this process's standard error; call just before
    `jax.distributed.initialize`. False, and nothing changed, where it cannot fork (not POSIX)."""
    if not hasattr(os, "fork"):
        return False
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    if os.fork() != 0:                       # this process goes on, writing its stderr to the watcher
        os.close(read_end)
        os.dup2(write_end, 2)
        os.close(write_end)
        return True
    os.close(write_end)
    try:
        _watch(read_end, lambda held, path: lost_peer_line(held, process_id, process_count, address,
                                                            heartbeat_s, path))
    finally:
        os._exit(0)


def _watch(read_end: int, line_for) -> None:
    """The watcher's loop: read the process's stderr from ``read_end`` until it closes. The one line
    goes out as soon as JAX's fatal message is read, while the process is still writing its stack
    trace (so before it ends); the rest of the trace goes to the log file."""
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGTSTP):
        signal.signal(number, signal.SIG_IGN)
    for low, high in ((0, 2), (3, read_end), (read_end + 1, os.sysconf("SC_OPEN_MAX"))):
        os.closerange(low, high)             # hold nothing of the process's open (a lock, a socket) but its stderr
    out = _Output()
    pending = b""                            # an incomplete line that may become a coordination line
    held = b""
    held_since = None
    log = None
    while True:
        ready, _, _ = select.select([read_end], [], [], 1.0)
        chunk = os.read(read_end, 1 << 16) if ready else None
        if chunk == b"":
            break
        if log is not None:
            log.write(chunk)
            continue
        if chunk:
            lines = (pending + chunk).split(b"\n")
            pending = lines.pop()
            for line in lines:
                start = COORDINATION_LINE.search(line) if held_since is None else None
                if start:                    # (after a partial line of the process's, it starts mid-line)
                    out.write(line[:start.start()])
                    line, held_since = line[start.start():], time.monotonic()
                if held_since is not None:
                    held += line + b"\n"
                else:
                    out.write(line + b"\n")
            if pending and held_since is None and not GLOG_PREFIX.match(pending[:40]):
                out.write(pending)
                pending = b""
        if FATAL in held:
            log = tempfile.NamedTemporaryFile("wb", prefix="k3jax-lost-peer-", suffix=".log", delete=False)
            log.write(held + pending)
            log.flush()
            out.line(line_for(held, log.name))
        elif held_since is not None and time.monotonic() - held_since > HOLD_SECONDS:
            out.write(held)
            held, held_since = b"", None
    if log is not None:
        log.close()
    else:
        out.write(held + pending)


class _Output:
    """The original standard error, remembering whether the last write ended its line."""

    def __init__(self):
        self.at_line_start = True

    def write(self, data: bytes) -> None:
        if data:
            self.at_line_start = data.endswith(b"\n")
        while data:
            data = data[os.write(2, data):]

    def line(self, text: str) -> None:
        self.write((b"" if self.at_line_start else b"\n") + text.encode() + b"\n")
