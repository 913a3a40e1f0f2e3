"""The processes of one import (hosts of a jax.distributed run) and the partial directory they fill.

A multi-host import is the same command on every host, launched like the trainer: with
``--coordinator-address HOST:PORT --num-processes N --process-id I`` or JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES and JAX_PROCESS_ID (`k3jax.sharding.initialize_distributed`); this process is
``jax.process_index()`` of ``jax.process_count()``. The processes talk through the coordination
service's key-value store (`ImportGroup`), under ``k3jax-convert-import/``:

    ready        process 0 owns a clean partial directory; the value: its fingerprint of the
                 inputs (config.json, tensor manifest, OUT_DIR and overrides), which every
                 other process compares with its own before writing
    done/<i>     process i has written its share: its checksum sums (JSON)
    finished     process 0 has renamed the partial directory to OUT_DIR
    failed/<i>   process i stopped: its one-line error, or that it saw another's

Every process looks at ``failed/`` between tensors and while it waits, so an error in one stops
all of them within about a second; process 0 then waits (up to ``STOP_SECONDS``) for every other
process to report that it stopped and removes the partial directory. A process killed outright
reports nothing: JAX's coordination service ends the others after ``--heartbeat-timeout`` seconds
(at once if it was process 0), each with one line (`k3jax.sharding.lost_peers`), and the next import of the same OUT_DIR removes what was left (`PartialDirectory`).

`PartialDirectory` is ``.<name>.partial-import`` beside OUT_DIR, owned by the import holding an
exclusive ``flock`` on ``.<name>.partial-import.lock`` (which records its host, pid and start).
The kernel drops the lock when its holder ends however it ends, so a partial directory whose
lock can be taken is stale and is removed; one whose lock is held belongs to a live import and
is left alone.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import pathlib
import shutil
import socket
import time
from typing import Callable, Iterator

from k3jax.convert.errors import ConvertError, conversion_error, require_new

NAMESPACE = "k3jax-convert-import/"
POLL_SECONDS, STOP_SECONDS = 0.2, 30.0


def one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


class ImportGroup:
    """This process (``process`` of ``count``) among the processes of one import, exchanging
    short values through ``client`` (jax.distributed's key-value store client)."""

    def __init__(self, client, process: int, count: int):
        self.client, self.process, self.count = client, process, count
        self._next_check = 0.0

    @classmethod
    def joined(cls) -> ImportGroup | None:
        """The group of the jax.distributed run this process joined; None outside one (or alone)."""
        import jax
        from jax._src import distributed      # the coordination service client (no public handle)

        client = distributed.global_state.client
        if client is None or jax.process_count() == 1:
            return None
        return cls(client, jax.process_index(), jax.process_count())

    @property
    def primary(self) -> bool:
        return self.process == 0

    def publish(self, key: str, value: str = "") -> None:
        self.client.key_value_set(NAMESPACE + key, value)

    def _values(self) -> dict[str, str]:
        return {key.removeprefix(NAMESPACE): value for key, value in self.client.key_value_dir_get(NAMESPACE)}

    def _raise_if_another_failed(self, values: dict[str, str]) -> None:
        failed = sorted((int(key.split("/")[1]), value) for key, value in values.items() if key.startswith("failed/"))
        for process, message in failed:
            if process != self.process:
                raise ConvertError(f"import process {process} failed: {message}")

    def check(self) -> None:
        """Raise `ConvertError` if another process has failed (asks at most every POLL_SECONDS)."""
        if time.monotonic() >= self._next_check:
            self._raise_if_another_failed(self._values())
            self._next_check = time.monotonic() + POLL_SECONDS

    def wait(self, keys: list[str]) -> list[str]:
        """The values of ``keys`` once all are published; `ConvertError` as soon as another fails."""
        while True:
            values = self._values()
            self._raise_if_another_failed(values)
            if all(key in values for key in keys):
                return [values[key] for key in keys]
            time.sleep(POLL_SECONDS)

    def fail(self, message: str) -> None:
        """Tell the others this process stopped (best effort: the service may be gone)."""
        with contextlib.suppress(Exception):
            self.publish(f"failed/{self.process}", message)

    def wait_stopped(self, seconds: float = STOP_SECONDS) -> list[int]:
        """Wait until every other process has reported that it stopped; those that did not in time."""
        deadline = time.monotonic() + seconds
        silent = [i for i in range(self.count) if i != self.process]
        while True:
            with contextlib.suppress(Exception):
                values = self._values()
                silent = [i for i in silent if f"failed/{i}" not in values]
            if not silent or time.monotonic() > deadline:
                return silent
            time.sleep(POLL_SECONDS)


class PartialDirectory:
    """``.<name>.partial-import`` beside ``out_dir``, claimed by this import (see the module doc)."""

    def __init__(self, out_dir: pathlib.Path):
        self.out_dir = out_dir
        self.path = out_dir.parent / f".{out_dir.name}.partial-import"
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self._lock: int | None = None

    def claim(self, log: Callable[[str], None]) -> pathlib.Path:
        """Own the partial directory: take its lock (`ConvertError` when a live import holds it),
        remove a stale one, record this import as the owner and create it empty."""
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        self._lock = self._take_lock()
        stale = self._lock_record()
        if self.path.exists():
            shutil.rmtree(self.path)
            log(f"removed {self.path}, left by an import that is no longer running ({stale or 'no owner record'})")
        record = f"pid {os.getpid()} on host {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}"
        os.ftruncate(self._lock, 0)
        os.pwrite(self._lock, record.encode(), 0)
        self.path.mkdir()
        return self.path

    def _take_lock(self) -> int:
        while True:
            descriptor = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                owner = os.pread(descriptor, 4096, 0).decode(errors="replace").strip()
                os.close(descriptor)
                if error.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                raise ConvertError(f"another import ({owner or 'owner unknown'}) is writing {self.path}; "
                                   f"wait for it to end or stop it") from None
            try:            # the lock file may have been removed (or replaced) while we waited for it
                if os.stat(self.lock_path).st_ino == os.fstat(descriptor).st_ino:
                    return descriptor
            except FileNotFoundError:
                pass
            os.close(descriptor)

    def _lock_record(self) -> str:
        return os.pread(self._lock, 4096, 0).decode(errors="replace").strip()

    def publish(self) -> None:
        """Rename the finished directory to OUT_DIR and give up the lock."""
        require_new(self.out_dir)
        self.path.rename(self.out_dir)
        self._release()

    def remove(self) -> None:
        """Delete the directory (this import failed) and give up the lock."""
        shutil.rmtree(self.path, ignore_errors=True)
        self._release()

    def _release(self) -> None:
        if self._lock is not None:
            with contextlib.suppress(FileNotFoundError):
                self.lock_path.unlink()
            os.close(self._lock)
            self._lock = None

    @property
    def claimed(self) -> bool:
        return self._lock is not None


@contextlib.contextmanager
def partial_directory(out_dir: pathlib.Path, log: Callable[[str], None]) -> Iterator[pathlib.Path]:
    """A one-process import's partial directory: claimed, renamed to ``out_dir`` when the block
    succeeds, removed when it fails (a full disk or other write error becomes `ConvertError`)."""
    require_new(out_dir)
    partial = PartialDirectory(out_dir)
    try:
        yield partial.claim(log)
        partial.publish()
    except BaseException as error:
        if partial.claimed:
            partial.remove()
        converted = conversion_error(out_dir, error)
        if converted is None:
            raise
        raise converted from None


def inputs_fingerprint(config_text: bytes, manifest: dict, out_dir: pathlib.Path, overrides) -> str:
    """What every process of one import must agree on, as JSON: digests of config.json, of the
    tensor manifest (names, shards, dtypes, shapes) and of OUT_DIR with the overrides."""
    digest = lambda text: hashlib.sha256(text if isinstance(text, bytes) else text.encode()).hexdigest()  # noqa: E731
    tensors = json.dumps(sorted((name, info.shard, info.dtype, list(info.shape)) for name, info in manifest.items()))
    return json.dumps({"config.json": digest(config_text), "tensor manifest (HF_DIR)": digest(tensors),
                       "OUT_DIR and key=value overrides": digest(json.dumps([str(out_dir), list(overrides)]))})


def check_same_inputs(mine: str, primary: str, process: int) -> None:
    """`ConvertError` naming the first input where this process's fingerprint differs from process 0's."""
    ours, theirs = json.loads(mine), json.loads(primary)
    for part, value in ours.items():
        if theirs.get(part) != value:
            raise ConvertError(f"process {process}: not the same {part} as process 0; every process must import "
                               f"the same checkpoint into the same OUT_DIR")
