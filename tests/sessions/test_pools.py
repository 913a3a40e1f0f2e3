"""`DevicePools` without a model (small random pools): byte accounting, growth, upload/download,
scratch slots, and copy-on-write of a shared partial page with its reference counts."""
import jax.numpy as jnp
import numpy as np

from k3jax.sessions.paged import Pools
from k3jax.sessions.pools import DevicePools

SLOTS, PAGES, PAGE = 2, 4, 4     # state [slot, 2, 1, 2, 2] fp32, conv [slot, 2, 3, 6], latent [1, page id, 4 * 2]


def small_pools(seed: int = 0) -> DevicePools:
    rng = np.random.default_rng(seed)
    return DevicePools(Pools(jnp.asarray(rng.normal(size=(SLOTS, 2, 1, 2, 2)), jnp.float32),
                             jnp.asarray(rng.normal(size=(SLOTS, 2, 3, 6)), jnp.float32),
                             jnp.asarray(rng.normal(size=(1, PAGES, PAGE * 2)), jnp.float32)), PAGE)


def sequence(seed: int, length: int):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(2, 1, 2, 2)).astype(np.float32), rng.normal(size=(2, 3, 6)).astype(np.float32),
            rng.normal(size=(1, length, 2)).astype(np.float32))


def test_bytes_count_the_slots_and_pages_held():
    device = small_pools()
    assert (device.slot_bytes, device.page_bytes, device.page_size) == ((8 + 36) * 4, 8 * 4, PAGE)
    assert device.pool_bytes == SLOTS * device.slot_bytes + PAGES * device.page_bytes
    slot, pages = device.upload(*sequence(0, 6), length=6)
    assert device.used_bytes == device.slot_bytes + 2 * device.page_bytes and len(pages) == 2
    device.release(slot, pages)
    assert device.used_bytes == 0 and device.slots.in_use == device.pages.in_use == 0


def test_upload_then_download_gives_the_sequence_back():
    device = small_pools()
    state, conv, rows = sequence(1, 6)
    other = device.upload(*sequence(2, 3), length=3)              # another sequence's slot and page
    slot, pages = device.upload(state, conv, rows, 6)
    assert slot not in (other[0],) and not set(pages) & set(other[1])
    got = device.download(slot, pages, 6)
    for a, b in zip(got, (state, conv, rows)):
        np.testing.assert_array_equal(np.asarray(a), b)
    np.testing.assert_array_equal(device.read_slot(slot)[0], state)


def test_grow_doubles_and_keeps_what_is_held():
    device = small_pools()
    slot, pages = device.upload(*sequence(3, 8), length=8)
    before = device.download(slot, pages, 8)
    device.grow(slots=3, pages=5)                  # 1 slot and 2 pages free: slots 2 -> 4, pages 4 -> 8
    assert (device.slots.capacity, device.pages.capacity) == (4, 8)
    assert (len(device.slots.free), len(device.pages.free)) == (3, 6)
    assert device.arrays.state.shape[0] == 4 and device.arrays.latent.shape[1] == 8
    for a, b in zip(device.download(slot, pages, 8), before):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(device.arrays.state[SLOTS:], 0)
    device.grow(slots=8, pages=6)                  # slots 4 -> 8 -> 16; 6 pages are free already
    assert (device.slots.capacity, device.pages.capacity) == (16, 8)


def test_scratch_slots_are_distinct_free_slots_not_allocated():
    device = small_pools()
    slot = device.start_slot(*device.zero_state())
    scratch = device.scratch_slots(3)              # one free slot: the pools grow to 4
    assert len(set(scratch)) == 3 and slot not in scratch and device.slots.in_use == 1
    assert all(device.slots.refs[s] == 0 for s in scratch)


def test_copy_on_write_copies_a_shared_partial_page_once():
    device = small_pools()
    state, conv, rows = sequence(4, 6)
    slot, pages = device.upload(state, conv, rows, 6)    # page 0 full, page 1 partial (2 of 4 rows)
    fork = list(pages)
    device.pages.share(fork)
    fork_slot = device.copy_slot(slot)
    np.testing.assert_array_equal(device.read_slot(fork_slot)[1], conv)
    assert device.shared_partial_page(fork, 6) == 1
    assert device.shared_partial_page(fork, 8) is None     # a write at 8 starts a new page
    assert device.shared_partial_page(fork, 4) is None     # and so does one at 4
    device.copy_on_write(fork, 6)
    assert fork[0] == pages[0] and fork[1] != pages[1] and device.pages_copied == 1
    assert [device.pages.refs[p] for p in (pages[0], pages[1], fork[1])] == [2, 1, 1]
    np.testing.assert_array_equal(device.download(fork_slot, fork, 6)[2], rows)
    device.copy_on_write(pages, 6)                        # the original is the only holder now
    assert device.pages_copied == 1 and device.pages.shared == 1
