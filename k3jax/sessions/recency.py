"""Least-recently-used order: a `Clock` stamps an item's ``used`` on each use; `least_recent`
picks the item with the oldest stamp (prefix entries among themselves, values among themselves)."""
from __future__ import annotations

from typing import Iterable, TypeVar

Item = TypeVar("Item")


class Clock:
    """Stamps each use with the next tick."""

    def __init__(self):
        self.tick = 0

    def touch(self, item) -> None:
        self.tick += 1
        item.used = self.tick


def least_recent(items: Iterable[Item]) -> Item | None:
    """The item used longest ago; None when there is none."""
    return min(items, key=lambda item: item.used, default=None)
