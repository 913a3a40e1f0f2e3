"""Writing files so that a failure loses nothing, and full disks recognised wherever a write fails.

    write_atomically   a file replaced whole or not at all (temporary file, fsync, rename)
    disk_full          an OSError with ENOSPC, or a library's error whose text carries the system's
                       message (Orbax and TensorStore report one as RESOURCE_EXHAUSTED with
                       "No space left on device" deep in a long message)
    free_space         what is left, for the one line that reports it
"""
from __future__ import annotations

import errno
import os
import pathlib
import re
import uuid
from typing import BinaryIO, Callable


def write_atomically(path: str | os.PathLike, data: str | bytes | Callable[[BinaryIO], None], *,
                     unique: bool = False) -> None:
    """Replace ``path`` by ``data`` (text as UTF-8, bytes, or a function writing into the open
    binary file) whole or not at all: a temporary file beside it (``.<name>.tmp``; ``unique``: with
    a random part, for writers that may overlap), fsynced, renamed over ``path``, the directory
    fsynced. A failure (a full disk) leaves no temporary file and ``path`` as it was."""
    path = pathlib.Path(path)
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp" if unique else f".{path.name}.tmp")
    try:
        with open(temporary, "wb") as file:
            if callable(data):
                data(file)
            else:
                file.write(data.encode("utf-8") if isinstance(data, str) else data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


_SHORT_WRITE = re.compile(r"\d+ requested and \d+ written")   # NumPy's `tofile` on a full disk: no errno


def disk_full(error: BaseException) -> bool:
    """Whether ``error`` (or one it was raised from) is a full disk."""
    while error is not None:
        if ((isinstance(error, OSError) and (error.errno == errno.ENOSPC or _SHORT_WRITE.search(str(error))))
                or "No space left on device" in str(error)):
            return True
        error = error.__cause__ or error.__context__
    return False


def free_space(path: str | os.PathLike) -> str:
    """The free space of the file system holding ``path`` (its nearest existing ancestor), e.g. '340 KiB'."""
    path = pathlib.Path(path).expanduser().resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    free = os.statvfs(path).f_bavail * os.statvfs(path).f_frsize
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if free < 1024 or unit == "GiB":
            return f"{free:.0f} {unit}" if unit == "bytes" else f"{free:.1f} {unit}"
        free /= 1024
    return ""
