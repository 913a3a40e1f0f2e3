"""`Tiers` without a model (small random pools, sequences of a few tokens): budget checks, which
value leaves the device or the host (least recently used, pinned ones stay, prefix entries first;
entries give their pages back before the pools grow),
spills to disk and loads back with the memory intact, copies sharing pages, releases."""
import gc
import jax
import numpy as np
import pytest

from k3jax.sessions.prefix import PrefixCache
from k3jax.sessions.recency import Clock
from k3jax.sessions.tiers import HostTier, HostValue, NoRoom, Tiers, Value
from tests.sessions.test_pools import sequence, small_pools


UNIT = 176 + 32          # bytes of one slot and one page of `small_pools` (test_pools checks them)


class Setup:
    """Tiers over small pools and the values it may move (budgets in bytes)."""

    def __init__(self, device_budget=None, host_budget=None, disk_dir=None):
        self.device, self.clock, self.values = small_pools(), Clock(), []
        self.prefix = PrefixCache("model", self.device.pages, self.clock)
        self.tiers = Tiers(self.device, self.prefix, HostTier(jax.devices()[0]), self.clock, lambda: self.values,
                           device_budget, host_budget, disk_dir)

    def value(self, seed: int, length: int = 3) -> Value:
        """A new value on the host (as `SessionStore.load` makes them)."""
        value = Value(list(range(length)), np.zeros(4, np.float32))
        self.tiers.put_on_host(value, HostValue(*sequence(seed, length)))
        self.values.append(value)
        self.clock.touch(value)
        return value

    def cached_page(self) -> int:
        """A page only a prefix entry holds."""
        page = self.device.allocate_pages(1)
        self.prefix.add("boundary", 4, np.zeros(2, np.float32), np.zeros(2, np.float32), page, None)
        self.device.pages.release(page)
        return page[0]


def assert_memory(tiers: Tiers, value: Value, seed: int):
    for got, want in zip(tiers.arrays(value), sequence(seed, value.length)):
        np.testing.assert_array_equal(np.asarray(got), want)


def test_budgets_must_hold_one_session_and_a_session_must_fit_the_device():
    for budgets in ((UNIT - 1, None), (None, UNIT - 1)):
        with pytest.raises(ValueError, match="too small for one session"):
            Setup(*budgets)
    tiers = Setup(device_budget=2 * UNIT).tiers
    tiers.check_fits(24)                            # a slot and 6 pages, and a page to spare
    with pytest.raises(ValueError, match="needs 432 device bytes"):
        tiers.check_fits(25)


def test_the_least_recently_used_unpinned_value_leaves_the_device():
    setup = Setup(device_budget=2 * UNIT)
    tiers = setup.tiers
    a, b, c = (setup.value(seed) for seed in range(3))
    tiers.writable(a, 0)
    tiers.writable(b, 0)
    tiers.writable(c, 0)                            # a was used longest ago
    assert [v.tier for v in (a, b, c)] == ["host", "device", "device"]
    tiers.writable(a, 0, pinned=[b])                # c goes, though b was used before it
    assert [v.tier for v in (a, b, c)] == ["device", "device", "host"]
    assert tiers.counts == {"spills_to_host": 2, "spills_to_disk": 0, "loads_from_host": 4, "loads_from_disk": 0}
    assert setup.device.used_bytes == 2 * UNIT
    for seed, value in enumerate((a, b, c)):
        assert_memory(tiers, value, seed)
    with pytest.raises(NoRoom):
        tiers.writable(c, 0, pinned=[a, b])


def test_prefix_entries_that_free_a_page_leave_before_any_value():
    setup = Setup(device_budget=2 * UNIT)
    a, b = setup.value(0), setup.value(1)
    setup.tiers.writable(a, 0)
    page = setup.cached_page()
    setup.tiers.writable(b, 0)                      # one page short: the entry goes, a stays
    assert (a.tier, b.tier, len(setup.prefix), b.pages) == ("device", "device", 0, [page])   # b got its page
    assert setup.tiers.counts["spills_to_host"] == 0


def test_prefix_entries_give_their_pages_back_before_the_pools_grow():
    setup = Setup()                                 # no budgets: only the pools' size limits the cache
    capacity = setup.device.pages.capacity
    setup.device.allocate_pages(len(setup.device.pages.free) - 1)
    page = setup.cached_page()                      # the last free page, held by the entry alone
    a, b = setup.value(0), setup.value(1)
    setup.tiers.writable(a, 0)                      # the entry goes rather than the pools growing
    assert (len(setup.prefix), a.pages, setup.device.pages.capacity) == (0, [page], capacity)
    setup.tiers.writable(b, 0)                      # nothing left to drop: now they grow
    assert setup.device.pages.capacity == 2 * capacity and b.tier == "device"
    assert_memory(setup.tiers, a, 0)
    assert_memory(setup.tiers, b, 1)


def test_the_host_budget_sends_values_to_disk_and_they_come_back(tmp_path):
    setup = Setup(host_budget=400, disk_dir=tmp_path / "disk")   # room for two values of 200 bytes
    tiers = setup.tiers
    a, b, c = (setup.value(seed) for seed in range(3))
    setup.prefix.add("boundary", 4, np.zeros(2, np.float32), np.zeros(2, np.float32), [], None)
    tiers.fit_host(pinned=[a])                      # the entry goes first, then b, the oldest unpinned
    assert len(setup.prefix) == 0 and [v.tier for v in (a, b, c)] == ["host", "disk", "host"]
    assert tiers.host_bytes == 400 and tiers.disk_bytes == b.disk.stat().st_size > 0
    assert_memory(tiers, b, 1)
    file = b.disk
    tiers.writable(b, 0)
    assert b.tier == "device" and not file.exists() and tiers.disk_bytes == 0
    assert tiers.counts["loads_from_disk"] == 1
    assert_memory(tiers, b, 1)
    setup.value(3)
    tiers.fit_host()                                # a, now the oldest on the host, goes
    assert a.tier == "disk"
    tiers.release(a)                                # and its file with it
    assert list((tmp_path / "disk").iterdir()) == [] and tiers.disk_bytes == 0 and tiers.host_bytes == 400


def test_a_full_host_without_a_disk_tier_is_an_error():
    setup = Setup(host_budget=400)
    for seed in range(3):
        setup.value(seed)
    with pytest.raises(ValueError, match="no disk tier"):
        setup.tiers.fit_host()


def test_copies_share_pages_until_they_write_and_release_frees_them():
    setup = Setup()
    tiers, device = setup.tiers, setup.device
    source = setup.value(0, length=6)               # two pages, the second partial
    tiers.writable(source, 0)                       # on the device
    copy = tiers.copy(source)
    assert copy.slot != source.slot and copy.pages == source.pages and device.pages.shared == 2
    assert_memory(tiers, copy, 0)
    tiers.writable(copy, 3)                         # 9 tokens: the partial page copied, a third added
    assert len(copy.pages) == 3 and copy.pages[0] == source.pages[0] and copy.pages[1] != source.pages[1]
    assert device.pages_copied == 1 and device.pages.shared == 1
    tiers.release(copy)
    tiers.release(source)
    assert device.slots.in_use == device.pages.in_use == 0 and tiers.host_bytes == 0


def test_a_copy_of_a_value_off_the_device_is_uploaded_and_the_value_stays_where_it_was(tmp_path):
    setup = Setup(host_budget=400, disk_dir=tmp_path)
    tiers, device = setup.tiers, setup.device
    on_host, on_disk = setup.value(0, length=6), setup.value(1, length=5)
    tiers._to_disk(on_disk)
    for seed, source, tier in ((0, on_host, "host"), (1, on_disk, "disk")):
        copy = tiers.copy(source)
        assert source.tier == tier and source.slot is None and copy.tier == "device"
        assert_memory(tiers, copy, seed)
        assert_memory(tiers, source, seed)
    assert tiers.counts["loads_from_host"] == tiers.counts["loads_from_disk"] == 1
    assert device.pages.shared == 0 and device.slots.in_use == 2


def test_a_disk_tier_that_cannot_be_written_is_refused_when_made(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(ValueError, match="disk_dir .* cannot be written"):
        Setup(host_budget=400, disk_dir=tmp_path / "file" / "disk")


def test_spill_files_are_removed_when_the_tiers_are_collected(tmp_path):
    setup = Setup(host_budget=400, disk_dir=tmp_path / "disk")
    for seed in range(4):
        setup.value(seed)
    setup.tiers.fit_host()
    assert len(list((tmp_path / "disk").iterdir())) == 2
    del setup
    gc.collect()
    assert list((tmp_path / "disk").iterdir()) == []
