"""Full disks, recognised wherever a write fails: an OSError with ENOSPC, or a library's error whose
text carries the system's message (Orbax and TensorStore report one as RESOURCE_EXHAUSTED with
"No space left on device" deep in a long message)."""
from __future__ import annotations

import errno
import os
import pathlib


def disk_full(error: BaseException) -> bool:
    """Whether ``error`` (or one it was raised from) is a full disk."""
    while error is not None:
        if (isinstance(error, OSError) and error.errno == errno.ENOSPC) or "No space left on device" in str(error):
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
