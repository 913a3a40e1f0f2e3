"""Storage that fails loudly and recovers, and stored responses that are bounded and durable: a
disk tier that cannot be written (simulated: the spill write raises ENOSPC) answers the request
that needed it with a 507 and /health says degraded while the server keeps answering; stored
responses are capped (least recently used evicted) and wait off the device; each is written through before it is answered,
so that a server that never saved (killed) still has it at the next start; interrupted writes,
stale spill files and one damaged file cost only themselves."""
import errno
import json

import pytest

from eval.serve.journal import JOURNAL_DIR
from tests.serve.conftest import KEY
from tests.serve.test_api import post


def server_over(run_dir, *flags):
    """(TestClient context, app) of a server over ``run_dir`` with ``flags``."""
    from fastapi.testclient import TestClient

    from eval.serve.cli import build, parse_args

    app, _, _ = build(parse_args([str(run_dir), "--api-key", KEY, "--max-model-len", "256", *map(str, flags)]))
    return TestClient(app, headers={"Authorization": f"Bearer {KEY}"}), app


def respond(client, text, status=200, **extra):
    response = client.post("/v1/responses", json={"input": text, "max_output_tokens": 4, "temperature": 0, **extra})
    assert response.status_code == status, response.text
    return response.json()


def texts(response) -> list:
    """A response's output items without their ids."""
    return [{key: value for key, value in item.items() if key != "id"} for item in response["output"]]


def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_tier_is_a_507_health_degraded_and_the_server_recovers(chat_run, tmp_path, monkeypatch):
    # room on device for about three stored sessions, on host for about two: the rest spill to disk
    client, app = server_over(chat_run, "--state-dir", tmp_path / "state", "--device-bytes", 60_000,
                              "--host-bytes", 30_000)
    store = app.state.server.engine.store
    with client:
        kept = [respond(client, f"{i} hi")["id"] for i in range(6)]
        assert store.stats()["spills_to_disk"] > 0 and client.get("/health").json() == {"status": "ok"}
        monkeypatch.setattr("k3jax.sessions.tiers.write_npz_atomically", full_disk)
        failed = None
        for i in range(6):
            response = client.post("/v1/responses", json={"input": f"{i} more", "max_output_tokens": 4})
            if response.status_code != 200:
                failed = response
                break
            kept.append(response.json()["id"])
        assert failed is not None and failed.status_code == 507, failed.text if failed else None
        assert "No space left on device" in failed.json()["error"]["message"]
        health = client.get("/health").json()
        assert health["status"] == "degraded" and "cannot take a spilled session" in health["reasons"][0]
        assert store.stats()["sessions"] == len(kept)                  # the failed request left nothing open
        assert client.get(f"/v1/responses/{kept[0]}").status_code == 200       # still answering
        assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code in (200, 507)
        monkeypatch.undo()                                              # room on disk again
        respond(client, "after")
        assert client.get("/health").json() == {"status": "ok"}
        for response_id in kept:                                        # every acknowledged one is still there
            assert client.get(f"/v1/responses/{response_id}").status_code == 200


def test_stored_responses_are_capped_least_recently_used_first(chat_run):
    client, app = server_over(chat_run, "--max-stored-responses", 3)
    with client:
        ids = [respond(client, f"{i} hi")["id"] for i in range(3)]
        client.get(f"/v1/responses/{ids[0]}")                          # used: the least recent is now ids[1]
        ids.append(respond(client, "3 hi")["id"])
        assert client.get(f"/v1/responses/{ids[1]}").status_code == 404
        assert all(client.get(f"/v1/responses/{i}").status_code == 200 for i in (ids[0], ids[2], ids[3]))
        respond(client, "not kept", store=False)
        stats = app.state.server.engine.store.stats()
        assert len(app.state.server.responses.items) == 3 and stats["sessions"] == 3
        assert stats["sessions_on_host"] == 3 and stats["slots_in_use"] == 0     # parked: the device holds none
        assert "k3jax_stored_responses_evicted_total 1" in client.get("/metrics").text
        continued = respond(client, "more", previous_response_id=ids[3])
        stats = app.state.server.engine.store.stats()
        assert stats["sessions_on_host"] == 3 and stats["slots_in_use"] == 0 and stats["loads_from_host"] >= 1
        assert continued["previous_response_id"] == ids[3]


def test_acknowledged_responses_survive_a_server_that_never_saved(chat_run, tmp_path):
    """Write-through: the first server is dropped without its shutdown (as a kill -9 would), after
    a clean save of some responses and not of others; the next start has every one, the unsaved
    ones rebuilt by a prefill, and continues each exactly as the first server did."""
    state = tmp_path / "state"
    client, app = server_over(chat_run, "--state-dir", state)        # no `with`: no shutdown, no save
    saved = respond(client, "3 hi")
    app.state.server.engine.call(lambda store: app.state.server.responses.save(store, state)).result()
    unsaved = respond(client, "4 hi")
    deleted = respond(client, "5 hi")
    assert client.delete(f"/v1/responses/{deleted['id']}").status_code == 200
    expected = {first["id"]: respond(client, "again", previous_response_id=first["id"], store=False)
                for first in (saved, unsaved)}
    files = sorted(path.name for path in (state / JOURNAL_DIR).iterdir())
    assert files == sorted(f"{r['id']}.json" for r in (saved, unsaved))
    app.state.server.engine.shutdown(0)                                # the engine ends; nothing more is saved
    (state / ".sessions-1.0123456789abcdef0123456789abcdef.tmp").mkdir()   # an interrupted save's leftovers
    (state / "tier" / "value-0123abcd.npz").write_bytes(b"stale spill")
    again, _ = server_over(chat_run, "--state-dir", state)
    with again:
        for response_id, reply in expected.items():
            continued = respond(again, "again", previous_response_id=response_id, store=False)
            assert texts(continued) == texts(reply) and continued["usage"] == reply["usage"]
        assert again.get(f"/v1/responses/{deleted['id']}").status_code == 404
    assert not (state / ".sessions-1.0123456789abcdef0123456789abcdef.tmp").exists()
    assert not (state / "tier" / "value-0123abcd.npz").exists()


def test_a_process_other_than_0_loads_the_same_responses_and_changes_nothing_there(chat_run, tmp_path):
    """A mesh over several processes: each loads the shared state directory from the same files (the
    others as ``owner=False``); only process 0 removes leftovers and writes, and both stores hold the
    same sessions (one saved, one rebuilt from the journal) under the same ids."""
    from eval.serve.responses import ResponseStore, read_state_files

    state = tmp_path / "state"
    client, app = server_over(chat_run, "--state-dir", state)
    respond(client, "3 hi")
    app.state.server.engine.call(lambda store: app.state.server.responses.save(store, state)).result()
    respond(client, "4 hi")
    app.state.server.engine.shutdown(0)
    (state / ".sessions-1.0123456789abcdef0123456789abcdef.tmp").mkdir()   # an interrupted save's leftovers
    contents = lambda: {path: path.read_bytes() if path.is_file() else None for path in state.rglob("*")}
    before, files = contents(), read_state_files(state)
    model = app.state.server.served.model
    follower, follower_store, notes = ResponseStore.load(model, state, files=files, owner=False,
                                                         disk_dir=tmp_path / "tier-1")
    assert contents() == before and follower.journal is None and any("rebuilt" in note for note in notes)
    leader, leader_store, _ = ResponseStore.load(model, state, files=files, disk_dir=tmp_path / "tier-0")
    assert contents() == {path: value for path, value in before.items() if ".tmp" not in path.name}
    assert list(follower.items) == list(leader.items) and len(leader.items) == 2
    assert [(item.sid, follower_store.tokens(item.sid).tolist()) for item in follower.items.values()] == \
        [(item.sid, leader_store.tokens(item.sid).tolist()) for item in leader.items.values()]


def test_a_damaged_file_skips_that_response_alone(chat_run, tmp_path, capsys):
    state = tmp_path / "state"
    client, app = server_over(chat_run, "--state-dir", state)
    first, second = respond(client, "3 hi"), respond(client, "4 hi")
    app.state.server.engine.call(lambda store: app.state.server.responses.save(store, state)).result()
    app.state.server.engine.shutdown(0)
    saved = json.loads((state / "state.json").read_text())
    sid = next(item["sid"] for item in saved["responses"] if item["id"] == first["id"])
    (state / saved["sessions"] / f"session-{sid}.npz").write_bytes(b"damaged")    # the first's session file
    (state / JOURNAL_DIR / f"{second['id']}.json").write_text("{damaged")         # one journal file
    again, _ = server_over(chat_run, "--state-dir", state)
    with again:
        statuses = {r["id"]: again.get(f"/v1/responses/{r['id']}").status_code for r in (first, second)}
    notes = capsys.readouterr().err
    assert f"skipped {second['id']}.json: an unreadable journal file" in notes and statuses[second["id"]] == 404
    assert f"rebuilt {first['id']} by a prefill" in notes and statuses[first["id"]] == 200


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, "No space left on device"), ValueError("cannot save")])
def test_a_failed_save_at_shutdown_is_one_line_and_never_saved(chat_run, tmp_path, monkeypatch, capsys, failure):
    client, app = server_over(chat_run, "--state-dir", tmp_path / "state")
    with client:
        respond(client, "3 hi")

        def refuse(*args, **kwargs):
            raise failure
        monkeypatch.setattr("eval.serve.responses.ResponseStore.save", refuse)
    err = capsys.readouterr().err
    assert app.state.server.save_failure is not None and "saved" not in err.replace("could not save", "")
    assert err.count("error: could not save the stored responses") == 1 and "Traceback" not in err


def test_a_max_model_len_no_session_can_fit_is_refused_at_start(chat_run):
    from eval.serve.cli import build, parse_args
    from k3jax.inference import InputError

    with pytest.raises(InputError, match=r"^--max-model-len 1000000000000: a session of 1000000000000 tokens needs"):
        build(parse_args([str(chat_run), "--max-model-len", str(10**12)]))
