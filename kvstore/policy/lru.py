"""Least-recently-used, leaves first: the baseline every other policy is judged against."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import ClassVar

from kvstore.policy.base import Eligible, Item


class LRUPolicy:
    """Evicts the least recently used block that has no child in the space.

    A block with resident children is skipped (its children go first), so a prefix is trimmed
    from its tail, never cut at its root.
    """

    name: ClassVar[str] = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Item, None] = OrderedDict()  # oldest first
        self._parent: dict[Item, Item | None] = {}
        self._kids: dict[Item, set[Item]] = {}  # resident children of resident blocks

    def insert(self, item: Item, parent: Item | None, depth: int, size: int) -> None:
        if item in self._order:
            self._order.move_to_end(item)
            return
        self._order[item] = None
        if parent is not None and parent not in self._order:
            parent = None
        self._parent[item] = parent
        if parent is not None:
            self._kids.setdefault(parent, set()).add(item)

    def access(self, item: Item) -> None:
        if item in self._order:
            self._order.move_to_end(item)

    def access_many(self, items: Sequence[Item]) -> None:
        try:
            deque(map(self._order.move_to_end, items), maxlen=0)  # the loop runs in C
        except KeyError:  # one of them is not in this space: take the careful path
            for item in items:
                self.access(item)

    def remove(self, item: Item) -> None:
        if item not in self._order:
            return
        del self._order[item]
        parent = self._parent.pop(item)
        if parent is not None:
            kids = self._kids[parent]
            kids.discard(item)
            if not kids:
                del self._kids[parent]
        # Children of a removed block stay; they become roots of what is left.
        for kid in self._kids.pop(item, ()):
            self._parent[kid] = None

    def pop_victim(self, eligible: Eligible | None = None) -> Item | None:
        kids = self._kids
        for item in self._order:
            if item in kids:
                continue
            if eligible is not None and not eligible(item):
                continue
            self.remove(item)
            return item
        return None

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, item: object) -> bool:
        return item in self._order
