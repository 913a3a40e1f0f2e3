"""The facade's published surface: the names `k3jax.sessions` exports and the keys (in order) of
`SessionStore.stats`, which callers (bench.sessions, eval) read. No prefill: nothing compiles."""
import pytest

import k3jax.sessions
from k3jax.sessions import SessionStore
from k3jax.sessions.tiers import Value

STATS_KEYS = [
    "prefix_hits", "prefix_misses", "prefix_tokens_reused", "prefill_tokens", "spills_to_host", "spills_to_disk",
    "loads_from_host", "loads_from_disk", "pages_copied", "decode_steps", "decode_tokens", "sessions", "snapshots",
    "prefix_entries", "sessions_on_device", "sessions_on_host", "sessions_on_disk", "values_on_device",
    "slots_in_use", "pages_in_use", "slot_capacity", "page_capacity", "pages_shared", "device_bytes", "host_bytes", "disk_bytes", "device_pool_bytes",
    "slot_bytes", "page_bytes", "page_size", "host_memory",
]


def test_the_package_exports_the_store_its_handles_sampling_the_fingerprint_and_turns():
    assert k3jax.sessions.__all__ == ["DiskTierError", "DraftModel", "PromptLookup", "RoundResult", "Sampling", "SessionStore", "Snapshot",
                                      "Speculator", "model_fingerprint", "prefill_in_turns"]


def test_stats_has_the_published_keys_in_order(model):
    stats = SessionStore(model, device_bytes=10**6).stats()
    assert list(stats) == STATS_KEYS
    assert stats["device_bytes"] == stats["host_bytes"] == stats["disk_bytes"] == stats["sessions"] == 0
    assert stats["device_pool_bytes"] == 8 * stats["slot_bytes"] + 32 * stats["page_bytes"]   # the initial pools
    assert (stats["slot_capacity"], stats["page_capacity"]) == (8, 32)


def test_reserve_grows_the_pools_by_doubling_to_the_free_room_asked(model):
    store = SessionStore(model)
    store.reserve(20, 33)
    stats = store.stats()
    assert (stats["slot_capacity"], stats["page_capacity"]) == (32, 64)
    assert stats["device_pool_bytes"] == 32 * stats["slot_bytes"] + 64 * stats["page_bytes"]
    assert stats["slots_in_use"] == stats["pages_in_use"] == 0
    store.reserve(4, 4)                                            # room enough: nothing changes
    assert store.stats()["device_pool_bytes"] == stats["device_pool_bytes"]
    for bad in ((-1, 0), (1.5, 0), (0, True)):
        with pytest.raises(ValueError, match="must be a non-negative integer"):
            store.reserve(*bad)


@pytest.mark.parametrize("arguments, message", [
    (dict(max_new_tokens=2.5), "max_new_tokens must be an integer"),     # looped forever before
    (dict(max_new_tokens=2, temperature=float("nan")), "finite temperature"),
    (dict(max_new_tokens=2, seed="x"), "seed must be an integer"),
    (dict(max_new_tokens=2**50), "needs .* device bytes, the device holds"),   # no budget: the device's memory
])
def test_generate_refuses_bad_arguments_before_anything_runs(model, arguments, message):
    with pytest.raises(ValueError, match=message):
        store = SessionStore(model)
        store._sessions[0] = Value([1, 2, 3], None)     # a session's history, without prefilling it
        store.generate([0], **arguments)
