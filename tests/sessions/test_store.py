"""SessionStore equalities (fp32, CPU): paged cache = contiguous bank, greedy generate = generate,
rollback replay, forks, prefix hits = cold prefill, save/load, bad input, memory accounting."""
import pickle

import numpy as np
import pytest

from k3jax.inference.generation import generate
from k3jax.sessions import SessionStore, Snapshot
from tests.sessions.conftest import contiguous_bank, contiguous_logits, random_tokens, tiny_model

TOL = dict(rtol=1e-5, atol=1e-5)
PROMPT, TURN = random_tokens(0, 20), random_tokens(1, 4)


@pytest.mark.slow   # 15-60 s of the default set's CPU: in .ci/run's slow set
def test_paged_cache_equals_contiguous_bank(model):
    store = SessionStore(model)
    sid = store.open(PROMPT)
    np.testing.assert_allclose(store.logits(sid), contiguous_logits(model, PROMPT)[-1], **TOL)
    whole = np.concatenate([PROMPT, TURN])
    np.testing.assert_allclose(store.append(sid, TURN), contiguous_logits(model, whole)[20:], **TOL)
    bank, value = contiguous_bank(model, whole), store._arrays(store._sessions[sid])
    np.testing.assert_allclose(value.state, np.asarray(bank.kda.state[:, 0]), **TOL)
    np.testing.assert_allclose(value.conv, np.asarray(bank.kda.conv[:, 0]), **TOL)
    np.testing.assert_allclose(value.rows, np.asarray(bank.mla.latent[:, 0, :24]), **TOL)
    assert np.all(np.any(value.rows != 0, axis=-1))          # every row written (the check is not vacuous)
    store.generate([sid], 2)                                   # the batched decode step over the pages
    np.testing.assert_allclose(store.logits(sid), contiguous_logits(model, store.tokens(sid))[-1], **TOL)


@pytest.mark.slow     # two compiles of k3jax.generate's loop
def test_greedy_generate_equals_generate_for_a_batch_of_different_lengths(model):
    store = SessionStore(model)
    short = store.open(PROMPT)
    long = store.fork(short)
    store.append(long, TURN)
    new = store.generate([short, long], max_new_tokens=3)
    for sid, tokens in zip((short, long), new):
        history = store.tokens(sid)
        expected = generate(model, history[: len(history) - 3], max_new_tokens=3).tokens
        np.testing.assert_array_equal(tokens, expected)
        np.testing.assert_array_equal(history[-3:], tokens)
    np.testing.assert_allclose(store.logits(long), contiguous_logits(model, store.tokens(long))[-1], **TOL)


def test_rollback_then_replay_gives_the_original_logits_bitwise(model):
    store = SessionStore(model)
    sid = store.open(PROMPT)
    handle = store.snapshot(sid)
    at_snapshot = store.logits(sid)
    first = store.append(sid, TURN)
    first_tokens = store.generate([sid], 2)[0]
    store.rollback(sid, handle)
    np.testing.assert_array_equal(store.logits(sid), at_snapshot)
    np.testing.assert_array_equal(store.tokens(sid), PROMPT)
    np.testing.assert_array_equal(store.append(sid, TURN), first)
    np.testing.assert_array_equal(store.generate([sid], 2)[0], first_tokens)
    store.rollback(sid, handle)                        # a snapshot stays valid after use
    np.testing.assert_array_equal(store.append(sid, TURN), first)


def test_forks_diverge_independently_and_leave_the_parent_unchanged(model):
    store = SessionStore(model)
    parent = store.open(PROMPT)
    before = store.logits(parent)
    left, right = store.fork(parent), store.fork(parent)
    assert store.stats()["pages_shared"] == 2        # both pages of the prompt, shared by three
    other = random_tokens(2, 4)
    left_logits, right_logits = store.append(left, TURN), store.append(right, other)
    assert store.stats()["pages_copied"] == 2        # each fork copied the shared partial page
    np.testing.assert_allclose(left_logits, contiguous_logits(model, np.concatenate([PROMPT, TURN]))[20:], **TOL)
    np.testing.assert_allclose(right_logits, contiguous_logits(model, np.concatenate([PROMPT, other]))[20:], **TOL)
    np.testing.assert_array_equal(store.logits(parent), before)
    np.testing.assert_array_equal(store.append(parent, TURN), left_logits)   # same program, same state


@pytest.mark.parametrize("first_turn", [pytest.param(15, marks=pytest.mark.slow), 16,
                                        pytest.param(17, marks=pytest.mark.slow)])
def test_prefix_cache_hit_equals_cold_prefill(model, first_turn):
    """The cached prefix ends before, on and after the chunk boundary at 16."""
    prompt = random_tokens(3, 24)
    warm = SessionStore(model)
    warm.open(prompt[:first_turn])
    sid = warm.open(prompt)
    stats = warm.stats()
    assert (stats["prefix_hits"], stats["prefix_tokens_reused"]) == (1, first_turn)
    cold = SessionStore(model)
    cold_sid = cold.open(prompt)
    assert cold.stats()["prefix_hits"] == 0
    same_program = first_turn % 16 == 0           # the hit resumes at a piece boundary of the cold run
    compare = np.testing.assert_array_equal if same_program else lambda a, b: np.testing.assert_allclose(a, b, **TOL)
    compare(warm.logits(sid), cold.logits(cold_sid))
    compare(warm.append(sid, TURN), cold.append(cold_sid, TURN))


def test_whole_prompt_hit_needs_no_prefill(model):
    store = SessionStore(model)
    first = store.open(PROMPT)
    prefilled = store.stats()["prefill_tokens"]
    second = store.open(PROMPT)
    assert store.stats()["prefill_tokens"] == prefilled
    np.testing.assert_array_equal(store.logits(second), store.logits(first))
    np.testing.assert_array_equal(store.append(second, TURN), store.append(first, TURN))


def test_without_the_prefix_cache_every_open_prefills_its_prompt_to_the_same_values(model):
    store = SessionStore(model, prefix_cache=False)
    first = store.open(PROMPT)
    second = store.open(PROMPT)
    assert store.stats()["prefill_tokens"] == 2 * len(PROMPT) and store.stats()["prefix_entries"] == 0
    np.testing.assert_array_equal(store.logits(second), store.logits(first))
    np.testing.assert_array_equal(store.append(second, TURN), store.append(first, TURN))


def test_save_load_continue_equals_never_stopping(model, tmp_path):
    store = SessionStore(model)
    sid = store.open(PROMPT)
    handle = store.snapshot(sid)
    store.append(sid, TURN)
    store.save(tmp_path / "saved")
    loaded = SessionStore.load(model, tmp_path / "saved")
    assert loaded.sessions() == [sid] and loaded.stats()["sessions_on_host"] == 1
    np.testing.assert_array_equal(loaded.logits(sid), store.logits(sid))
    np.testing.assert_array_equal(loaded.append(sid, TURN), store.append(sid, TURN))
    revived = pickle.loads(pickle.dumps(handle))
    loaded.rollback(sid, revived)
    store.rollback(sid, handle)
    np.testing.assert_array_equal(loaded.append(sid, TURN), store.append(sid, TURN))


def test_bad_input_is_a_value_error_and_leaves_the_store_unchanged(model, tmp_path):
    store = SessionStore(model, device_bytes=10**6)
    a, b = store.open(PROMPT), store.open(PROMPT[:16])
    handle_b = store.snapshot(b)
    store.close(b)
    before = (store.stats(), store.logits(a), store.tokens(a))
    bad_calls = [
        (lambda: store.logits(99), "unknown or closed session"),
        (lambda: store.append(b, TURN), "unknown or closed session"),
        (lambda: store.rollback(a, handle_b), "not a snapshot of session"),
        (lambda: store.rollback(a, "h"), "not a snapshot of session"),
        (lambda: store.append(a, [1, 64]), "must lie in"),
        (lambda: store.append(a, []), "non-empty 1-D"),
        (lambda: store.append(a, np.zeros(10**6, np.int32)), "device bytes"),
        (lambda: store.generate([a, a], 2), "once"),
        (lambda: store.generate([a], 0), "max_new_tokens"),
        (lambda: store.save(tmp_path), "already exists"),
    ]
    for call, message in bad_calls:
        with pytest.raises(ValueError, match=message):
            call()
    after = (store.stats(), store.logits(a), store.tokens(a))
    assert before[0] == after[0]
    np.testing.assert_array_equal(before[1], after[1])
    np.testing.assert_array_equal(before[2], after[2])
    with pytest.raises(ValueError, match="too small for one session"):
        SessionStore(model, device_bytes=1000)
    store.save(tmp_path / "saved")
    with pytest.raises(ValueError, match="different model"):
        SessionStore.load(tiny_model(seed=1), tmp_path / "saved")
    with pytest.raises(ValueError, match="not a saved session store"):
        SessionStore.load(model, tmp_path)


def test_snapshots_are_released_when_their_handles_are_garbage(model):
    store = SessionStore(model)
    sid = store.open(PROMPT)
    handle = store.snapshot(sid)
    assert isinstance(handle, Snapshot) and store.stats()["snapshots"] == 1
    slots = store.stats()["slots_in_use"]
    del handle
    store.stats()
    store.logits(sid)                                  # any call collects released handles
    assert store.stats()["snapshots"] == 0 and store.stats()["slots_in_use"] == slots - 1


@pytest.mark.slow
def test_tiers_under_pressure_equal_unlimited_memory(model, tmp_path):
    """Device room for 2 sessions, host room for 3: random appends/forks/rollbacks on 6 sessions
    spill to host and disk and give what an unlimited store gives."""
    probe = SessionStore(model)
    per_session = probe.slot_bytes + 3 * probe.page_bytes
    tight = SessionStore(model, device_bytes=2 * per_session, host_bytes=3 * per_session, disk_dir=tmp_path / "disk")
    roomy = SessionStore(model)
    compare_random_workload(tight, roomy, sessions=6, operations=14, seed=0)
    stats = tight.stats()
    assert stats["spills_to_host"] > 0 and stats["spills_to_disk"] > 0 and stats["loads_from_disk"] > 0
    assert stats["device_bytes"] <= 2 * per_session and stats["host_bytes"] <= 3 * per_session
    assert stats["device_bytes"] == stats["slots_in_use"] * stats["slot_bytes"] + stats["pages_in_use"] * stats["page_bytes"]


def compare_random_workload(tight: SessionStore, roomy: SessionStore, *, sessions: int, operations: int, seed: int):
    """Run the same random operations on both stores and require equal logits and tokens."""
    rng = np.random.default_rng(seed)
    ids = {}
    for index in range(sessions):
        prompt = rng.integers(0, 64, 4).astype(np.int32)
        ids[index] = (tight.open(prompt), roomy.open(prompt))
    handles = {}
    for _ in range(operations):
        index = int(rng.integers(len(ids)))
        a, b = ids[index]
        kind = rng.choice(["append", "fork", "snapshot", "rollback", "generate"])
        if kind == "append":
            turn = rng.integers(0, 64, 4).astype(np.int32)
            np.testing.assert_allclose(tight.append(a, turn), roomy.append(b, turn), **TOL)
        elif kind == "fork":
            ids[len(ids)] = (tight.fork(a), roomy.fork(b))
        elif kind == "snapshot":
            handles[index] = (tight.snapshot(a), roomy.snapshot(b))
        elif kind == "rollback" and index in handles:
            tight.rollback(a, handles[index][0])
            roomy.rollback(b, handles[index][1])
        elif kind == "generate":
            pair = [ids[int(rng.integers(len(ids)))] for _ in range(2)]
            pair = list(dict.fromkeys(pair))
            for x, y in zip(tight.generate([p[0] for p in pair], 2), roomy.generate([p[1] for p in pair], 2)):
                np.testing.assert_array_equal(x, y)
    for a, b in ids.values():
        np.testing.assert_array_equal(tight.tokens(a), roomy.tokens(b))
        np.testing.assert_allclose(tight.logits(a), roomy.logits(b), **TOL)


def test_a_parked_session_frees_the_device_and_continues_bitwise(model):
    store, never_parked = SessionStore(model), SessionStore(model)
    parked, kept = store.open(PROMPT), never_parked.open(PROMPT)
    capacity = store.stats()["slot_capacity"]
    store.park(parked)
    store.park(parked)                                  # already off the device: stays there
    stats = store.stats()
    assert stats["sessions_on_host"] == 1 and stats["values_on_device"] == stats["slots_in_use"] == 0
    fork = store.fork(parked)                           # an uploaded copy; the parked session stays on host
    assert store.stats()["sessions_on_host"] == 1
    np.testing.assert_array_equal(store.append(fork, TURN), never_parked.append(never_parked.fork(kept), TURN))
    np.testing.assert_array_equal(store.append(parked, TURN), never_parked.append(kept, TURN))   # brought back
    np.testing.assert_array_equal(store.generate([parked], 2)[0], never_parked.generate([kept], 2)[0])
    for _ in range(3 * capacity):                       # sessions that wait parked never grow the pools
        store.park(store.open(TURN))
    assert store.stats()["slot_capacity"] == capacity
