"""Conversion errors, and the atomic output directory every conversion writes into."""
from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
from typing import Iterator

from k3jax.disk import disk_full


class ConvertError(ValueError):
    """Bad conversion input or a failed write: a one-line message naming the file or tensor."""


def require_new(path: pathlib.Path) -> None:
    if path.exists():
        raise ConvertError(f"{path} already exists; choose a new output directory")


@contextlib.contextmanager
def atomic_directory(final: pathlib.Path) -> Iterator[pathlib.Path]:
    """Yield a fresh temporary directory beside ``final``; rename it to ``final`` when the block
    succeeds, delete it when it fails (a full disk or another write error becomes `ConvertError`)."""
    require_new(final)
    temporary = final.parent / f".{final.name}.partial-{os.getpid()}"
    try:
        temporary.mkdir(parents=True)
        yield temporary
        temporary.rename(final)
    except BaseException as error:
        shutil.rmtree(temporary, ignore_errors=True)
        converted = conversion_error(final, error)
        if converted is None:
            raise
        raise converted from None


def conversion_error(final: pathlib.Path, error: BaseException) -> ConvertError | None:
    """The one-line `ConvertError` of a failed write of ``final`` (a full disk, another OSError),
    after its partial output was removed; None for any other error (raised as it is)."""
    if disk_full(error):
        return ConvertError(f"disk full while writing {final} (nothing was left behind)")
    if isinstance(error, OSError):
        return ConvertError(f"cannot write {final}: {error.strerror or error}")
    return None
