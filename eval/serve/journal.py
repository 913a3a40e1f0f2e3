"""Stored responses written through to disk as they are acknowledged, so that a server killed
without a clean stop (kill -9, a power cut) loses none of them.

    STATE_DIR/responses/resp_<hex>.json   {"id", "messages", "tools", "body", "tokens"}: one file a
                                          response, written under a temporary name, fsynced,
                                          renamed (and the directory fsynced) before it is answered;
                                          removed when the response is deleted or evicted

A file holds the response's token history (small), not its memory-bank state: at the next start
a response whose session was not in the last clean save (`ResponseStore.save`) is rebuilt by one
prefill of those tokens. `remove_interrupted_writes` clears what writes cut short leave behind.
"""
from __future__ import annotations

import json
import pathlib
import re
import shutil

from k3jax.disk import write_atomically

JOURNAL_DIR = "responses"
_ENTRY = re.compile(r"(resp_[0-9a-f]{32})\.json")
_TEMPORARY = re.compile(r"\..+\.[0-9a-f]{32}\.tmp|\.state\.json\.tmp")


def remove_interrupted_writes(directory: pathlib.Path) -> list[str]:
    """Remove the temporary files and directories that writes cut short (a kill during a save)
    left in ``directory`` and its journal -> their names."""
    removed = []
    for folder in (directory, directory / JOURNAL_DIR):
        if not folder.is_dir():
            continue
        for path in folder.iterdir():
            if _TEMPORARY.fullmatch(path.name):
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
                removed.append(path.name)
    return removed


class Journal:
    """The write-through files of stored responses in ``directory / JOURNAL_DIR``."""

    def __init__(self, directory: pathlib.Path):
        self.directory = directory / JOURNAL_DIR
        self.directory.mkdir(parents=True, exist_ok=True)

    def write(self, entry: dict) -> None:
        """Keep ``entry`` (a stored response with its ``tokens``) durably: OSError when it cannot."""
        write_atomically(self.directory / f"{entry['id']}.json", json.dumps(entry), unique=True)

    def remove(self, response_id: str) -> None:
        (self.directory / f"{response_id}.json").unlink(missing_ok=True)


def read_journal(directory: pathlib.Path) -> tuple[dict[str, dict], list[str]]:
    """({id: entry} of every readable file of the journal in ``directory``, the names of files that
    could not be read)."""
    entries, damaged = {}, []
    for path in sorted((directory / JOURNAL_DIR).iterdir()):
        match = _ENTRY.fullmatch(path.name)
        if match is None:
            continue
        try:
            entry = json.loads(path.read_text(encoding="utf-8"))
            if not (isinstance(entry, dict) and entry.get("id") == match.group(1) and _well_formed(entry)):
                raise ValueError("unexpected layout")
        except (OSError, ValueError, RecursionError):
            damaged.append(path.name)
            continue
        entries[entry["id"]] = entry
    return entries, damaged


def _well_formed(entry: dict) -> bool:
    tokens = entry.get("tokens")
    return (isinstance(entry.get("messages"), list) and isinstance(entry.get("body"), dict)
            and (entry.get("tools") is None or isinstance(entry["tools"], list)) and isinstance(tokens, list)
            and len(tokens) > 0 and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens))
