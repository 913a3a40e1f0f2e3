"""Slow session tests: 1,000 sessions under tight device/host budgets, and save -> new process ->
load -> continue."""
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from k3jax.sessions import SessionStore
from tests.sessions.conftest import random_tokens
from tests.sessions.test_store import PROMPT, TURN, compare_random_workload

pytestmark = pytest.mark.slow


def test_a_thousand_sessions_with_room_for_16_on_device_and_64_on_host(model, tmp_path):
    probe = SessionStore(model)
    per_session = probe.slot_bytes + 2 * probe.page_bytes
    tight = SessionStore(model, device_bytes=16 * per_session, host_bytes=64 * per_session,
                         disk_dir=tmp_path / "disk")
    roomy = SessionStore(model)
    compare_random_workload(tight, roomy, sessions=1000, operations=300, seed=1)
    stats = tight.stats()
    assert stats["sessions"] == roomy.stats()["sessions"] > 1000
    assert stats["sessions_on_disk"] > 800 and stats["loads_from_disk"] > 100
    assert stats["device_bytes"] <= 16 * per_session and stats["host_bytes"] <= 64 * per_session
    assert roomy.stats()["spills_to_host"] == 0


CHILD = textwrap.dedent("""
    import pickle, sys
    import numpy as np
    from k3jax.sessions import SessionStore
    from tests.sessions.conftest import tiny_model
    from tests.sessions.test_store import TURN
    saved, handle_file, out = sys.argv[1:]
    store = SessionStore.load(tiny_model(), saved)
    sid, handle = pickle.load(open(handle_file, "rb"))
    continued = store.append(sid, TURN)
    store.rollback(sid, handle)
    replayed = store.append(sid, TURN)
    generated = store.generate([sid], 3)[0]
    np.savez(out, continued=continued, replayed=replayed, generated=generated, logits=store.logits(sid))
""")


def test_save_then_load_in_a_new_process_continues_as_if_never_stopped(model, tmp_path):
    store = SessionStore(model)
    sid = store.open(PROMPT)
    handle = store.snapshot(sid)
    store.append(sid, random_tokens(5, 4))
    store.save(tmp_path / "saved")
    (tmp_path / "handle.pkl").write_bytes(pickle.dumps((sid, handle)))
    subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "saved"), str(tmp_path / "handle.pkl"),
                    str(tmp_path / "out.npz")], check=True, timeout=600)   # compiles like this process (tests/conftest.py)
    child = np.load(tmp_path / "out.npz")
    np.testing.assert_array_equal(child["continued"], store.append(sid, TURN))
    store.rollback(sid, handle)
    np.testing.assert_array_equal(child["replayed"], store.append(sid, TURN))
    np.testing.assert_array_equal(child["generated"], store.generate([sid], 3)[0])
    np.testing.assert_array_equal(child["logits"], store.logits(sid))
