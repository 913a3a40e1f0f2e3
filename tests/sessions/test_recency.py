"""Least-recently-used order: each touch is newer than the last; the oldest stamp is picked."""
from types import SimpleNamespace

from k3jax.sessions.recency import Clock, least_recent


def test_the_item_touched_longest_ago_is_least_recent():
    clock = Clock()
    a, b, c = (SimpleNamespace() for _ in range(3))
    for item in (a, b, c, a):
        clock.touch(item)
    assert least_recent([a, b, c]) is b and least_recent([a, c]) is c
    assert least_recent([]) is None
