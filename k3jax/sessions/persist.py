"""A saved session store: one directory, written atomically (a temporary directory renamed at the
end), read back by a store of the same model.

    manifest.json              {"format": FORMAT_VERSION, "fingerprint": the model's, "sessions": [sid, ...],
                                "snapshots": [[sid, serial], ...], "next_session": .., "next_serial": ..}
    session-{sid}.npz          tokens, logits, state, conv, rows   (see `k3jax.sessions.tiers`),
                               adapter (the LoRA adapter serving it; absent: the base)
    snapshot-{sid}-{serial}.npz
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import uuid
from typing import Callable, Mapping, NamedTuple, TypeVar

import numpy as np

from k3jax.sessions.tiers import HostValue, read_npz, write_npz_atomically

FORMAT_VERSION = 1
Item = TypeVar("Item")


class SavedValue(NamedTuple):
    """One session or snapshot as saved: its token ids, last logits, memory and adapter tag
    (`k3jax.sessions.tiers.Value.adapter`)."""

    tokens: np.ndarray
    logits: np.ndarray
    memory: HostValue
    adapter: str = ""


class SavedValues(NamedTuple):
    sessions: dict[int, SavedValue]
    snapshots: dict[tuple[int, int], SavedValue]


def _session_file(sid) -> str:
    return f"session-{sid}.npz"


def _snapshot_file(sid, serial) -> str:
    return f"snapshot-{sid}-{serial}.npz"


def save(directory, *, fingerprint: str, sessions: Mapping[int, Item], snapshots: Mapping[tuple[int, int], Item],
         next_session: int, next_serial: int, saved: Callable[[Item], SavedValue], write: bool = True) -> None:
    """Write ``sessions`` and ``snapshots`` (each value as ``saved`` gives it, one at a time) and
    the manifest into the new directory ``directory``. ``write`` False: only read the values as
    ``saved`` gives them, in the same order (a process other than 0 of a store spread over several:
    its reads are collectives made together with process 0, which writes)."""
    items = [(_session_file(sid), v) for sid, v in sessions.items()] + \
            [(_snapshot_file(s, n), v) for (s, n), v in snapshots.items()]
    if not write:
        for _, value in items:
            saved(value)
        return
    target = pathlib.Path(directory)
    if target.exists():
        raise ValueError(f"{target} already exists; save writes a new directory")
    if not target.parent.is_dir():
        raise ValueError(f"{target.parent} is not a directory")
    temporary = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
    try:
        temporary.mkdir()
        for name, value in items:
            item = saved(value)
            tagged = {"adapter": np.asarray(item.adapter)} if item.adapter else {}
            write_npz_atomically(temporary / name, **item.memory._asdict(), tokens=item.tokens, logits=item.logits,
                                 **tagged)
        manifest = {"format": FORMAT_VERSION, "fingerprint": fingerprint, "sessions": sorted(sessions),
                    "snapshots": sorted(map(list, snapshots)), "next_session": next_session,
                    "next_serial": next_serial}
        with open(temporary / "manifest.json", "w", encoding="utf-8") as file:
            file.write(json.dumps(manifest))
            file.flush()
            os.fsync(file.fileno())
        os.rename(temporary, target)
        _fsync_directory(target.parent)
    except OSError as error:
        shutil.rmtree(temporary, ignore_errors=True)
        raise ValueError(f"cannot save sessions to {target}: {error.strerror or error}") from None
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def _fsync_directory(directory: pathlib.Path) -> None:
    """Make a rename inside ``directory`` durable."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def read_manifest(directory: pathlib.Path) -> dict:
    """The manifest of a saved store in ``directory`` (ValueError when there is none or it has
    another format)."""
    try:
        manifest = json.loads((directory / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as error:
        raise ValueError(f"{directory} is not a saved session store ({type(error).__name__}: "
                         f"{' '.join(str(error).split())[:120]})") from None
    if not isinstance(manifest, dict) or "format" not in manifest:
        raise ValueError(f"{directory} is not a saved session store (its manifest names no format)")
    if manifest["format"] != FORMAT_VERSION:
        raise ValueError(f"{directory} has format {manifest['format']!r}, this version reads {FORMAT_VERSION}")
    if not _well_formed(manifest):
        raise ValueError(f"{directory}: a damaged manifest (session ids, snapshot pairs or counters)")
    return manifest


def _well_formed(manifest: dict) -> bool:
    """Session ids, ``[session, serial]`` snapshot pairs and the two counters: whole numbers >= 0."""
    whole = lambda item: isinstance(item, int) and not isinstance(item, bool) and item >= 0  # noqa: E731
    sessions, snapshots = manifest.get("sessions"), manifest.get("snapshots")
    return (isinstance(sessions, list) and all(map(whole, sessions)) and isinstance(snapshots, list)
            and all(isinstance(pair, list) and len(pair) == 2 and all(map(whole, pair)) for pair in snapshots)
            and whole(manifest.get("next_session")) and whole(manifest.get("next_serial")))


def read_values(directory: pathlib.Path, manifest: dict, fingerprint: str,
                damaged: list | None = None) -> SavedValues:
    """The sessions and snapshots the ``manifest`` of ``directory`` lists, for the model of
    ``fingerprint`` (ValueError when another model saved them). An unreadable file is a ValueError,
    or, given a ``damaged`` list, skipped: its session's id is appended there (and the session's
    snapshots skipped; a damaged snapshot file alone skips that snapshot)."""
    if manifest.get("fingerprint") != fingerprint:
        raise ValueError(f"{directory} was saved by a different model (config or weights differ)")

    def read(name: str) -> SavedValue | None:
        try:
            return _saved_value(read_npz(directory / name))
        except (ValueError, KeyError) as error:
            if damaged is None:
                raise ValueError(f"{directory}: unreadable session file ({error})") from None
            return None
    sessions = {sid: read(_session_file(sid)) for sid in manifest["sessions"]}
    if damaged is not None:
        damaged += [sid for sid, value in sessions.items() if value is None]
    sessions = {sid: value for sid, value in sessions.items() if value is not None}
    snapshots = {(s, n): read(_snapshot_file(s, n)) for s, n in manifest["snapshots"] if s in sessions}
    return SavedValues(sessions, {key: value for key, value in snapshots.items() if value is not None})


def _saved_value(arrays: dict[str, np.ndarray]) -> SavedValue:
    return SavedValue(arrays["tokens"], arrays["logits"], HostValue.among(arrays), str(arrays.get("adapter", "")))
