"""Segmented LRU with a ghost list and size-aware admission, leaves first.

New blocks enter a small *probation* segment; a hit promotes a block to the *protected* segment,
and a block whose key is still on the *ghost* list (recently evicted) enters protected directly:
it has proven reuse. Victims come from probation while it is over its share, so one-shot blocks
(most blocks in real traces) pass through probation without flushing reused ones. A partial tail
block (size below the largest size seen) rarely recurs — the next turn re-keys it — so it enters
at probation's cold end. Capacity is learned from the owner (the size of the space when it first
asks for a victim), so the policy needs no configuration.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import ClassVar

from kvstore.policy.base import Eligible, Item, PolicyBase
from kvstore.policy.tree import PrefixLinks


def ghost_key(item: Item) -> object:
    """What a ghost entry remembers: the block key (Blocks are re-created after eviction)."""
    return getattr(item, "key", item)


class SegmentedLRUPolicy(PolicyBase):
    name: ClassVar[str] = "slru"

    def __init__(self, probation: float = 0.1, ghost: float = 2.0) -> None:
        self.probation_share = probation
        self.ghost_share = ghost
        self._prob: OrderedDict[Item, None] = OrderedDict()  # oldest first
        self._prot: OrderedDict[Item, None] = OrderedDict()
        self._ghost: OrderedDict[object, None] = OrderedDict()
        self._links = PrefixLinks()
        self._cap = 0
        self._full = 0  # largest block size seen

    def admit(self, item: Item, parent: Item | None, depth: int, size: int) -> bool:
        return True

    def insert(self, item: Item, parent: Item | None, depth: int, size: int) -> None:
        if item in self._links:
            self.access(item)
            return
        links = self._links
        links.link(item, parent if parent is not None and parent in links else None)
        if size > self._full:
            self._full = size
        g = ghost_key(item)
        if g in self._ghost:
            del self._ghost[g]
            self._prot[item] = None
        else:
            self._prob[item] = None
            if size < self._full:
                self._prob.move_to_end(item, last=False)

    def access(self, item: Item) -> None:
        prot = self._prot
        if item in prot:
            prot.move_to_end(item)
        elif item in self._prob:
            del self._prob[item]
            prot[item] = None

    def remove(self, item: Item) -> None:
        if item not in self._links:
            return
        self._prob.pop(item, None)
        self._prot.pop(item, None)
        self._links.unlink(item)

    def _scan(self, seg: OrderedDict[Item, None], eligible: Eligible | None) -> Item | None:
        kids = self._links.kids
        for item in seg:
            if item in kids:
                continue
            if eligible is not None and not eligible(item):
                continue
            return item
        return None

    def pop_victim(self, eligible: Eligible | None = None) -> Item | None:
        n = len(self._links.parent)
        if n > self._cap:
            self._cap = n
        first, second = self._prob, self._prot
        if len(first) <= self.probation_share * self._cap and second:
            first, second = second, first
        victim = self._scan(first, eligible)
        if victim is None:
            victim = self._scan(second, eligible)
            if victim is None:
                return None
        self.remove(victim)
        ghost = self._ghost
        ghost[ghost_key(victim)] = None
        if len(ghost) > self.ghost_share * self._cap:
            ghost.popitem(last=False)
        return victim

    def __len__(self) -> int:
        return len(self._links.parent)

    def __contains__(self, item: object) -> bool:
        return item in self._links.parent
