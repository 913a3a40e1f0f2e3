"""`PrefixCache` without a model: longest-prefix lookup, keys, hit/miss counts, page references,
host bytes, and the order entries leave in (least recently used; for device room, only those
holding the last reference to a page)."""
import numpy as np

from k3jax.sessions.pools import RefCounts
from k3jax.sessions.prefix import PrefixCache
from k3jax.sessions.recency import Clock

TOKENS = list(range(10, 30))


def cache(max_entries: int = 8) -> PrefixCache:
    return PrefixCache("model-a", RefCounts(8), Clock(), max_entries)


def add(prefix: PrefixCache, tokens, pages) -> None:
    state, conv = np.full((2, 3), len(tokens), np.float32), np.zeros((1, 2), np.float32)
    prefix.add(prefix.key(tokens), len(tokens), state, conv, pages, np.zeros(4, np.float32))


def test_the_longest_cached_prefix_wins():
    prefix = cache()
    add(prefix, TOKENS[:4], [0])
    add(prefix, TOKENS[:8], [0, 1])
    add(prefix, [5, 6], [2])
    assert prefix.longest_prefix(TOKENS).length == 8
    assert prefix.longest_prefix(TOKENS[:7]).length == 4            # 8 is longer than the prompt
    assert prefix.longest_prefix(TOKENS[:6] + [0, 0, 0]).length == 4
    assert prefix.longest_prefix([5, 6, 7]).state[0, 0] == 2
    assert prefix.longest_prefix([1, 2, 3, 4, 5]) is None
    assert prefix.counts == {"prefix_hits": 4, "prefix_misses": 1, "prefix_tokens_reused": 8 + 4 + 4 + 2}


def test_keys_name_the_model_and_the_tokens():
    a, b = cache(), PrefixCache("model-b", RefCounts(1), Clock())
    assert a.key([1, 2]) == a.key(np.array([1, 2])) != a.key([2, 1])
    assert a.key([1, 2]) != b.key([1, 2])


def test_entries_hold_their_pages_and_host_bytes():
    prefix = cache()
    pages = [prefix.pages.allocate(), prefix.pages.allocate()]     # a session's
    add(prefix, TOKENS[:4], pages[:1])
    add(prefix, TOKENS[:8], pages)
    assert [prefix.pages.refs[p] for p in pages] == [3, 2] and prefix.nbytes == 2 * (24 + 8) and len(prefix) == 2
    assert prefix.touch(prefix.key(TOKENS[:4])) and not prefix.touch(prefix.key(TOKENS[:5]))
    prefix.drop(prefix.entries[prefix.key(TOKENS[:8])])
    assert [prefix.pages.refs[p] for p in pages] == [2, 1] and prefix.nbytes == 24 + 8
    assert prefix.longest_prefix(TOKENS).length == 4                # its length is no longer looked up
    assert prefix.lengths == {4: 1}


def test_the_least_recently_used_entry_leaves_first():
    prefix = cache(max_entries=2)
    add(prefix, TOKENS[:1], [])
    add(prefix, TOKENS[:2], [])
    prefix.longest_prefix(TOKENS[:1])                               # the first is now the more recent
    add(prefix, TOKENS[:3], [])                                     # one too many: the second goes
    assert sorted(e.length for e in prefix.entries.values()) == [1, 3]
    assert prefix.evict() and [e.length for e in prefix.entries.values()] == [3]
    assert prefix.evict() and not prefix.evict()


def test_for_device_room_only_entries_holding_a_last_page_reference_leave():
    prefix = cache()
    held_elsewhere = prefix.pages.allocate()                        # a session holds this page too
    add(prefix, TOKENS[:4], [held_elsewhere])                       # older, but frees nothing
    own = prefix.pages.allocate()
    add(prefix, TOKENS[:8], [own])
    prefix.pages.release([own])                                     # the cache is its last holder
    assert prefix.evict(freeing_pages=True)
    assert [e.length for e in prefix.entries.values()] == [4] and prefix.pages.refs[own] == 0
    assert not prefix.evict(freeing_pages=True) and len(prefix) == 1
