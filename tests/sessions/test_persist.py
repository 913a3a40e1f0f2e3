"""The saved-store directory without a model: a round trip of sessions and snapshots, atomic writes,
and a ValueError for each way a directory can be damaged or foreign."""
import json
import shutil

import numpy as np
import pytest

from k3jax.sessions import persist
from k3jax.sessions.persist import FORMAT_VERSION, SavedValue
from k3jax.sessions.tiers import HostValue
from tests.sessions.test_pools import sequence


def saved_value(seed: int, length: int) -> SavedValue:
    return SavedValue(np.arange(length, dtype=np.int32) + seed, np.full(5, seed, np.float32),
                      HostValue(*sequence(seed, length)))


SESSIONS, SNAPSHOTS = {0: saved_value(0, 3), 2: saved_value(2, 6)}, {(0, 1): saved_value(1, 2)}


def save(directory) -> None:
    persist.save(directory, fingerprint="model", sessions=SESSIONS, snapshots=SNAPSHOTS, next_session=3,
                 next_serial=2, saved=lambda value: value)


def test_a_saved_store_reads_back_as_it_was(tmp_path):
    save(tmp_path / "saved")
    manifest = persist.read_manifest(tmp_path / "saved")
    assert manifest == {"format": FORMAT_VERSION, "fingerprint": "model", "sessions": [0, 2], "snapshots": [[0, 1]],
                        "next_session": 3, "next_serial": 2}
    read = persist.read_values(tmp_path / "saved", manifest, "model")
    assert read.sessions.keys() == SESSIONS.keys() and read.snapshots.keys() == SNAPSHOTS.keys()
    for got, want in [*zip(read.sessions.values(), SESSIONS.values()), *zip(read.snapshots.values(), SNAPSHOTS.values())]:
        for a, b in zip([got.tokens, got.logits, *got.memory], [want.tokens, want.logits, *want.memory]):
            np.testing.assert_array_equal(a, b)
    assert sorted(p.name for p in (tmp_path / "saved").iterdir()) == [
        "manifest.json", "session-0.npz", "session-2.npz", "snapshot-0-1.npz"]


def test_save_writes_a_new_directory_or_nothing(tmp_path):
    save(tmp_path / "saved")
    with pytest.raises(ValueError, match="already exists"):
        save(tmp_path / "saved")
    with pytest.raises(ValueError, match="is not a directory"):
        save(tmp_path / "missing" / "saved")

    def failing(value):
        if value is SNAPSHOTS[(0, 1)]:
            raise RuntimeError("the device went away")
        return value
    with pytest.raises(RuntimeError, match="went away"):
        persist.save(tmp_path / "partial", fingerprint="model", sessions=SESSIONS, snapshots=SNAPSHOTS,
                     next_session=3, next_serial=2, saved=failing)
    assert [p.name for p in tmp_path.iterdir()] == ["saved"]          # no partial or temporary directory


def test_a_process_that_does_not_write_reads_every_value_in_the_same_order_and_writes_nothing(tmp_path):
    for write in (True, False):
        read = []
        persist.save(tmp_path / f"write-{write}", fingerprint="model", sessions=SESSIONS, snapshots=SNAPSHOTS,
                     next_session=3, next_serial=2, saved=lambda value: read.append(value) or value, write=write)
        assert read == [*SESSIONS.values(), *SNAPSHOTS.values()]        # the same reads, each once
    assert [p.name for p in tmp_path.iterdir()] == ["write-True"]


def rewrite_manifest(directory, **changes):
    manifest = json.loads((directory / "manifest.json").read_text())
    (directory / "manifest.json").write_text(json.dumps({**manifest, **changes}))


DAMAGE = {
    "no manifest": (lambda d: (d / "manifest.json").unlink(), "not a saved session store"),
    "manifest not JSON": (lambda d: (d / "manifest.json").write_text("{"), "not a saved session store"),
    "manifest without snapshots": (lambda d: (d / "manifest.json").write_text('{"sessions": []}'),
                                   "not a saved session store"),
    "another format": (lambda d: rewrite_manifest(d, format=FORMAT_VERSION + 1), "has format 2"),
    "another model": (lambda d: rewrite_manifest(d, fingerprint="other"), "different model"),
    "a session file missing": (lambda d: (d / "session-2.npz").unlink(), "unreadable session file"),
    "a snapshot file not an npz": (lambda d: (d / "snapshot-0-1.npz").write_bytes(b"not arrays"),
                                   "unreadable session file"),
    "a truncated snapshot file": (lambda d: (d / "snapshot-0-1.npz").write_bytes((d / "snapshot-0-1.npz").read_bytes()[:60]),
                                  "unreadable session file"),
    "a session file without its tokens": (lambda d: np.savez(d / "session-2.npz", logits=np.zeros(5)),
                                          "unreadable session file"),
    "session ids that are not numbers": (lambda d: rewrite_manifest(d, sessions=["x"]), "damaged manifest"),
    "a manifest without its counters": (lambda d: (d / "manifest.json").write_text(
        json.dumps({"format": FORMAT_VERSION, "sessions": [], "snapshots": []})), "damaged manifest"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_or_foreign_directory_is_a_value_error(tmp_path, damage):
    save(tmp_path / "saved")
    damaged = tmp_path / "damaged"
    shutil.copytree(tmp_path / "saved", damaged)
    change, message = DAMAGE[damage]
    change(damaged)
    with pytest.raises(ValueError, match=message):
        persist.read_values(damaged, persist.read_manifest(damaged), "model")


def test_a_save_that_fails_on_the_disk_is_a_value_error_and_leaves_nothing(tmp_path, monkeypatch):
    def full_disk(path, **arrays):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(persist, "write_npz_atomically", full_disk)
    with pytest.raises(ValueError, match="cannot save sessions to .*: No space left on device"):
        save(tmp_path / "saved")
    assert list(tmp_path.iterdir()) == []
