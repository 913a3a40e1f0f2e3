"""`k3jax.inference.mirror` in one process: a leader's mirrored session store and a follower's own
store (a thread), over an in-memory stand-in for jax.distributed's key-value store, end with the same
sessions, tokens, logits and snapshots after prefills, steps, snapshots (one dropped), rollback,
fork, a failing call and tier spills; the channel deletes what every follower has read and the
leader waits for a follower that is too far behind."""
import gc
import threading
import time

import numpy as np
import pytest

from k3jax.inference import mirror
from k3jax.inference.mirror import Channel, Leader, Mirrored, follow, follow_lines
from k3jax.sessions import Sampling, SessionStore, Snapshot
from tests.sessions.conftest import random_tokens


class KeyValueStore:
    """The calls of jax.distributed's client that `Channel` makes, over a dict."""

    def __init__(self):
        self.values: dict[str, object] = {}
        self.changed = threading.Condition()

    def key_value_set_bytes(self, key, value, allow_overwrite=False):
        with self.changed:
            assert allow_overwrite or key not in self.values, key
            self.values[key] = value
            self.changed.notify_all()

    key_value_set = key_value_set_bytes

    def blocking_key_value_get_bytes(self, key, timeout_in_ms):
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.values, timeout_in_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")
            return self.values[key]

    blocking_key_value_get = blocking_key_value_get_bytes

    def key_value_dir_get(self, prefix):
        with self.changed:
            return [(key, value) for key, value in self.values.items() if key.startswith(prefix)]

    def key_value_delete(self, key):
        with self.changed:
            del self.values[key]

    def messages(self) -> int:
        return sum("/read/" not in key for key in self.values)


def following(channel, targets):
    """A thread running `follow`; its result lands in ``result['calls']``."""
    result = {}
    thread = threading.Thread(target=lambda: result.update(calls=follow(channel, targets)))
    thread.start()
    return thread, result


def store_contents(store):
    """What the store holds; its snapshots read first: a follower's handles are dropped when
    `follow` returns, and the next call of the store releases them."""
    registry = store._registry
    snapshots = sorted(registry.snapshots)
    return {"snapshots": snapshots, "next": (registry.next_session, registry.next_serial),
            "tiers": {sid: registry.sessions[sid].tier for sid in store.sessions()},
            "stats": {key: value for key, value in store.stats().items() if key != "host_memory"},
            "sessions": {sid: (store.tokens(sid).tolist(), store.logits(sid)) for sid in store.sessions()}}


def test_a_follower_store_ends_as_the_leaders(model):
    budget = 3 * SessionStore(model).slot_bytes + 12 * SessionStore(model).page_bytes   # a few sessions: spills
    client = KeyValueStore()
    ours, theirs = SessionStore(model, device_bytes=budget), SessionStore(model, device_bytes=budget)
    thread, result = following(Channel(client, 1, 2), {"store": theirs})
    leader = Leader(Channel(client, 0, 2))
    store = Mirrored(ours, "store", leader, handles=(Snapshot,))

    first = store.open(random_tokens(0, 20))
    kept = store.snapshot(first)
    dropped = store.snapshot(first)
    second = store.open(random_tokens(1, 35))
    for _ in range(3):
        store.step({first: Sampling(), second: Sampling(temperature=1.0, seed=7)})
    del dropped
    gc.collect()
    third = store.fork(second)
    store.append(third, random_tokens(2, 5))
    store.rollback(first, kept)
    with pytest.raises(ValueError, match="unknown or closed session"):
        store.append(99, [1])
    store.generate([first, third], 4, temperature=0.8, seed=3)
    store.close(second)
    leader.stop()
    thread.join(timeout=300)

    assert result["calls"] == 13
    ours_now, theirs_now = store_contents(ours), store_contents(theirs)
    assert ours_now["snapshots"] == theirs_now["snapshots"] == [(first, kept.serial)]
    for key in ("next", "tiers", "stats"):
        assert ours_now[key] == theirs_now[key], key
    assert ours_now["stats"]["spills_to_host"] > 0, "the budget was meant to spill sessions"
    for sid, (tokens, logits) in ours_now["sessions"].items():
        assert theirs_now["sessions"][sid][0] == tokens
        np.testing.assert_array_equal(theirs_now["sessions"][sid][1], logits)


def test_lines_reach_followers_in_order_and_end_with_the_stream():
    client = KeyValueStore()
    received = []
    thread = threading.Thread(target=lambda: received.extend(follow_lines(Channel(client, 1, 2))))
    thread.start()
    assert list(Leader(Channel(client, 0, 2)).lines(iter(["a\n", "", "b c\n"]))) == ["a\n", "", "b c\n"]
    thread.join(timeout=30)
    assert received == ["a\n", "", "b c\n"]


def test_the_leader_deletes_what_followers_read_and_waits_for_the_slowest(monkeypatch):
    monkeypatch.setattr(mirror, "ACK_EVERY", 4)
    monkeypatch.setattr(mirror, "WINDOW", 8)
    client = KeyValueStore()
    leader, followers = Channel(client, 0, 3), [Channel(client, p, 3) for p in (1, 2)]
    for number in range(40):
        leader.send(b"%d" % number)
        assert [channel.receive() for channel in followers] == [b"%d" % number] * 2
    assert client.messages() <= mirror.ACK_EVERY

    sent = []
    sender = threading.Thread(target=lambda: [sent.append(leader.send(b"x")) for _ in range(20)])
    sender.start()                 # the followers read nothing: the leader stops WINDOW ahead of them
    time.sleep(1.0)
    assert mirror.WINDOW <= len(sent) < mirror.WINDOW + mirror.ACK_EVERY
    for _ in range(20):
        for channel in followers:
            assert channel.receive() == b"x"
    sender.join(timeout=30)
    assert len(sent) == 20


def test_a_follower_says_in_one_line_that_process_zero_is_gone(monkeypatch):
    class Gone(KeyValueStore):
        def blocking_key_value_get_bytes(self, key, timeout_in_ms):
            raise RuntimeError("UNAVAILABLE: Failed to send RPC to coordination service.\nmore lines")

    monkeypatch.setattr(mirror, "SERVICE_STOP_GRACE_S", 0.5)
    started = time.monotonic()
    with pytest.raises(mirror.PeerLost, match=r"^process 0 is gone: UNAVAILABLE: Failed to send RPC[^\n]*$"):
        Channel(Gone(), 1, 2).receive()
    assert time.monotonic() - started >= 0.5     # JAX's coordination service had its chance to stop it


def test_every_process_hears_what_each_said_whenever_it_arrives():
    client, heard = KeyValueStore(), {}

    def say(process, delay):
        time.sleep(delay)
        heard[process] = Channel(client, process, 3).said_by_every_process("read", f"read {process % 2}")
    threads = [threading.Thread(target=say, args=(process, delay)) for process, delay in ((0, 0.5), (1, 0), (2, 0.2))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert heard == {process: ["read 0", "read 1", "read 0"] for process in range(3)}
