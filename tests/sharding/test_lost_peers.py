"""`k3jax.sharding.lost_peers`: JAX's fatal log on losing a peer becomes one line; everything else a
process writes to stderr passes unchanged. The texts are what jaxlib 0.10.2 wrote when a peer of a
two-process run was killed (tests/sharding/test_inference_processes.py kills real ones)."""
import fcntl
import re
import signal
import subprocess
import sys
import textwrap
import time

from k3jax.sharding.lost_peers import PeerLost, lost_peer_line, report_peer_lost_in_one_line

HEARTBEAT_LOST = """\
E1207 05:31:33.677484    5613 coordination_service.cc:1549] [8291124973497416935] Use error polling to propagate the following error to all tasks: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):
1
The tasks have crashed. Check the task logs for an earlier error, or scheduler events (e.g. preemption, eviction) to debug further. [type.googleapis.com/tensorflow.CoordinationServiceError='']
E1207 05:31:33.677968    5624 coordination_service_agent.cc:289] Polled an error from coordination service (this can be an error from this or another task).
F1207 05:31:33.678114    5624 client.h:80] Terminating process because the JAX distributed service detected fatal errors. This most likely indicates that another task died; see the other task logs for more details. Disable Python buffering, i.e. `python -u`, to be sure to see all the previous output. absl::Status: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):
1
The tasks have crashed. Check the task logs for an earlier error, or scheduler events (e.g. preemption, eviction) to debug further.

RPC: /xla.coordination.CoordinationService/PollForError [type.googleapis.com/tensorflow.CoordinationServiceError='']
*** Check failure stack trace: ***
    @     0x7f5b35640634  absl::lts_20260107::log_internal::LogMessage::SendToLog()
    @     0x7f5b356405b6  absl::lts_20260107::log_internal::LogMessage::Flush()
"""
LEADER_LOST = """\
W1207 05:29:15.670922    4277 preemption_sync_manager.cc:147] Failed to retrieve preemption notice from coordination service: UNAVAILABLE: Socket closed
Additional GRPC error information from remote target coordination_service while calling /xla.coordination.CoordinationService/GetKeyValue:
:UNKNOWN:Error received from peer  {grpc_status:14, grpc_message:"Socket closed"}. This is only expected if one of the tasks is unhealthy. Check the logs for the actual root cause.
E1207 05:31:41.791140    5776 coordination_service_agent.cc:289] Polled an error from coordination service (this can be an error from this or another task).
F1207 05:31:41.791217    5776 client.h:80] Terminating process because the JAX distributed service detected fatal errors. This most likely indicates that another task died; see the other task logs for more details. Disable Python buffering, i.e. `python -u`, to be sure to see all the previous output. absl::Status: UNAVAILABLE: Failed to send RPC to coordination service. Either the leader task was preempted/died/restarted unexpectedly or this task is experiencing network issues. Check earlier logs from 1) this task, 2) the leader (usually slice 0 task 0), and 3) cluster scheduler to debug further.
Additional GRPC error information from remote target coordination_service while calling /xla.coordination.CoordinationService/PollForError:
:UNKNOWN:Error received from peer  {grpc_status:14, grpc_message:"Socket closed"}
*** Check failure stack trace: ***
    @     0x7fa4a3e40634  absl::lts_20260107::log_internal::LogMessage::SendToLog()
"""
# A process with the watcher on: it writes ordinary output, then `written` in two pieces (split
# inside a line), then ends by `ending`.
PROGRAM = """\
import fcntl, os, sys, time
from k3jax.sharding.lost_peers import watch_for_lost_peers
lock = open(sys.argv[1], "w"); fcntl.flock(lock, fcntl.LOCK_EX)
watch_for_lost_peers({process}, 2, "10.0.0.2:1234", 7)
print("loading", file=sys.stderr, flush=True)
sys.stderr.write("progress 3/4 "); sys.stderr.flush()
written = sys.stdin.read()
half = len(written) // 2
for piece in (written[:half], written[half:]):
    sys.stderr.write(piece); sys.stderr.flush(); time.sleep(0.2)
{ending}
"""


def run_watched(tmp_path, written: str, ending: str, process: int = 0) -> tuple[subprocess.CompletedProcess, str]:
    """(the finished process, its stderr once the watcher is done with it)."""
    lock = tmp_path / "lock"
    program = PROGRAM.format(process=process, ending=ending)
    done = subprocess.run([sys.executable, "-c", program, str(lock)], input=written, capture_output=True,
                          text=True, timeout=60)
    return done, done.stderr


def test_the_fatal_log_of_a_lost_peer_becomes_one_line_and_a_log_file(tmp_path):
    for process, fatal, reason in ((0, HEARTBEAT_LOST, "process 1 sent no heartbeat for 7 s (died or lost the network)"),
                                   (1, LEADER_LOST, "process 0, the coordinator at 10.0.0.2:1234, is gone")):
        done, stderr = run_watched(tmp_path, fatal, "os.abort()", process)
        assert done.returncode == -signal.SIGABRT
        lines = stderr.splitlines()
        assert lines[0] == "loading" and lines[1] == "progress 3/4 " and len(lines) == 3, stderr
        match = re.fullmatch(rf"error: process {process} of 2 stopped: (.*); every process of the run stops "
                             rf"\(JAX's log: (\S+)\)", lines[2])
        assert match and match.group(1).startswith(reason), lines[2]
        log = match.group(2)
        assert open(log).read() == fatal        # the whole log, not a line of it on stderr
        import os
        os.remove(log)


def test_everything_else_passes_unchanged_and_nothing_of_the_process_is_held(tmp_path):
    warning = HEARTBEAT_LOST.split("\nF1207")[0] + "\n"     # the service's error lines without the fatal one
    text = "a line\n" + warning + "after it\nno newline at the end"
    done, stderr = run_watched(tmp_path, text, "sys.exit(3)")
    assert done.returncode == 3
    assert stderr == "loading\nprogress 3/4 " + text
    with open(tmp_path / "lock", "w") as lock:   # the watcher kept no descriptor of the process: the lock is free
        deadline = time.monotonic() + 5
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.monotonic() < deadline, "the process's lock is still held after it ended"
                time.sleep(0.05)


def test_the_line_names_the_processes_that_stopped_their_heartbeats():
    held = HEARTBEAT_LOST.replace("heartbeats):\n1\n", "heartbeats):\n1\n3\n").encode()
    line = lost_peer_line(held, None, None, "h:1", 100, "/tmp/x.log")
    assert line.startswith("error: this process stopped: processes 1, 3 sent no heartbeat for 100 s")
    other = lost_peer_line(b"F1207 client.h:80] " + b"Terminating process because the JAX distributed service "
                           b"detected fatal errors. absl::Status: INTERNAL: something else\nmore", 2, 4, "h:1", 100, "L")
    assert "process 2 of 4 stopped: JAX's distributed service failed: INTERNAL: something else;" in other


def test_an_uncaught_peer_lost_is_one_line_and_other_errors_keep_their_traceback(monkeypatch, capsys):
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    report_peer_lost_in_one_line(lambda: "process 1 of 2")
    sys.excepthook(PeerLost, PeerLost("process 0 is gone: UNAVAILABLE: Socket closed"), None)
    assert capsys.readouterr().err == ("error: process 1 of 2 stopped: process 0 is gone: UNAVAILABLE: Socket "
                                       "closed; every process of the run stops\n")
    try:
        raise ValueError("another error")
    except ValueError as error:
        sys.excepthook(ValueError, error, error.__traceback__)
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and err.endswith("ValueError: another error\n")
