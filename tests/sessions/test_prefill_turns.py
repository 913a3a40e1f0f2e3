"""A prompt prefilled in turns (`prefill_in_turns`, a server's chunked prefill) is the prompt
prefilled in one go: the same pieces, so the same state, logits and continuation, bit for bit."""
import numpy as np
import pytest

from k3jax.sessions import SessionStore, prefill_in_turns
from k3jax.sessions.paged import piece_lengths, turn_stop
from tests.sessions.conftest import random_tokens


def run(turns):
    """Drive a `prefill_in_turns` generator to its end -> (its return value, turns it yielded)."""
    count = 0
    while True:
        try:
            next(turns)
            count += 1
        except StopIteration as done:
            return done.value, count


@pytest.mark.parametrize("start, stop, turn", [(0, 100, 20), (5, 100, 20), (7, 40, 3), (0, 16, 512), (33, 34, 1)])
def test_turns_cut_only_where_pieces_cut(start, stop, turn):
    cuts, position = [], start
    while position < stop:
        position = turn_stop(position, stop, turn, 16)
        cuts.append(position)
    assert cuts[-1] == stop and all(b > a for a, b in zip([start] + cuts, cuts))
    pieces = [size for a, b in zip([start] + cuts, cuts) for size in piece_lengths(a, b, 16)]
    assert pieces == piece_lengths(start, stop, 16)


def test_a_prompt_in_turns_equals_one_prefill(model):
    prompt = random_tokens(3, 100)
    whole = SessionStore(model, prefix_cache=False)
    reference = whole.open(prompt)
    store = SessionStore(model, prefix_cache=False)
    sid, turns = run(prefill_in_turns(store, prompt, 20))
    assert turns == 6                # open feeds 16 tokens, each turn 16 more (whole chunks) up to 96, the last 4
    assert store.tokens(sid).tolist() == prompt.tolist()
    np.testing.assert_array_equal(store.logits(sid), whole.logits(reference))
    assert store.feeder.counts["prefill_tokens"] == len(prompt)
    ours, theirs = store.generate([sid], 6)[0], whole.generate([reference], 6)[0]
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(store.logits(sid), whole.logits(reference))


def test_a_turn_fed_to_an_open_session_equals_append(model):
    history, turn = random_tokens(4, 21), random_tokens(5, 60)
    whole = SessionStore(model, prefix_cache=False)
    reference = whole.open(history)
    expected = whole.append(reference, turn)
    store = SessionStore(model, prefix_cache=False)
    sid = store.open(history)
    logits = []
    assert run(prefill_in_turns(store, turn, 16, sid=sid, logits=logits))[0] == sid
    np.testing.assert_array_equal(np.concatenate(logits), expected)
    quiet = store.fork(store.open(history))
    run(prefill_in_turns(store, turn, 16, sid=quiet))      # `extend`: no logits read back
    np.testing.assert_array_equal(store.logits(quiet), expected[-1])
    with pytest.raises(ValueError, match="give sid"):
        run(prefill_in_turns(store, turn, 16, logits=[]))
    with pytest.raises(ValueError, match="limit must be a positive integer"):
        store.open(history, limit=0)
