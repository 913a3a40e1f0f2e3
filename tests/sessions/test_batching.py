"""Decode admission (`admit`, with a stand-in for the device's room) and one step's padded inputs
(`decode_batch`, over small pools): no model."""
import numpy as np
import pytest

from k3jax.sessions.batching import Sampling, admit, decode_batch
from k3jax.sessions.tiers import Value
from tests.sessions.test_pools import sequence, small_pools


def room_for(count: int):
    """``make_room`` of a device with room for ``count`` decoding sessions."""
    return lambda sid, admitted: len(admitted) < count


def test_running_sessions_go_first_then_pending_ones_in_order():
    pending = [5, 3, 4]
    assert admit([2, 1], pending, room_for(4)) == [2, 1, 5, 3]
    assert pending == [4]


def test_running_sessions_without_room_go_back_to_the_front_of_pending():
    pending = [4]
    assert admit([1, 2, 3], pending, room_for(2)) == [1, 2]
    assert pending == [3, 4]


def test_admission_stops_at_the_first_session_without_room():
    pending = [1, 2, 3]
    assert admit([], pending, lambda sid, admitted: sid != 2) == [1]     # 3 does not overtake 2
    assert pending == [2, 3]


def test_no_room_for_a_single_session_is_an_error():
    with pytest.raises(ValueError, match="cannot hold one decoding session"):
        admit([], [7], room_for(0))


def test_a_batch_is_padded_to_powers_of_two_with_free_slots_and_empty_tables():
    device = small_pools()
    device.grow(slots=4, pages=8)
    values = []
    for seed, length in enumerate((3, 4, 9)):
        value = Value(list(range(length)), np.full(5, seed, np.float32))
        value.slot, value.pages = device.upload(*sequence(seed, length), length)
        values.append(value)
    samplings = [Sampling(), Sampling(0.7, 5, 0.9, seed=2**32 + 3, stream=11), Sampling(1.0, seed=4)]
    batch = decode_batch([7, 2, 9], values, samplings, device)
    pad = device.pages.capacity
    assert batch.slots.shape == (4,) and batch.tables.shape == (4, 4)      # 3 rows -> 4; 3 pages -> 4
    assert list(batch.slots[:3]) == [v.slot for v in values]
    assert batch.slots[3] not in batch.slots[:3] and device.slots.refs[batch.slots[3]] == 0
    for row, value in zip(batch.tables, values):
        assert list(row) == value.pages + [pad] * (4 - len(value.pages))
    assert list(batch.tables[3]) == [pad] * 4
    assert list(batch.lengths) == [3, 4, 9, 0]
    sampling = batch.sampling                               # stream: the session id unless given
    assert list(sampling.stream) == [7, 11, 9, 0] and list(sampling.seed) == [0, 3, 4, 0]
    np.testing.assert_array_equal(sampling.temperature, np.float32([0, 0.7, 1, 0]))
    assert list(sampling.top_k) == [0, 5, 0, 0]
    np.testing.assert_array_equal(sampling.top_p, np.float32([1, 0.9, 1, 1]))
    np.testing.assert_array_equal(batch.logits, np.repeat(np.arange(4.0)[:, None], 5, axis=1) * [[1], [1], [1], [0]])
    assert batch.slots.dtype == np.int32 and batch.sampling.stream.dtype == np.uint32 and batch.logits.dtype == np.float32
