"""Prefix links shared by the prefix-aware policies: parent of each item, count of resident kids.

A block with resident children is never a victim (its children go first), so a prefix is
trimmed from its tail, never cut at its root. Counts, not sets: no per-block object churn.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat

from kvstore.policy.base import Item


class PrefixLinks:
    __slots__ = ("kids", "parent")

    def __init__(self) -> None:
        self.parent: dict[Item, Item | None] = {}
        self.kids: dict[Item, int] = {}  # only items with at least one resident child

    def link(self, item: Item, parent: Item | None) -> None:
        """``parent`` must already be resident (the caller checks membership)."""
        self.parent[item] = parent
        if parent is not None:
            kids = self.kids
            kids[parent] = kids.get(parent, 0) + 1

    def link_many(self, items: Sequence[Item], parents: Sequence[Item | None]) -> None:
        """:meth:`link` for each of ``items`` with its parent (resident, or None), in order: the
        same dicts, the counts added in C when no parent is counted twice or already."""
        self.parent.update(zip(items, parents, strict=True))
        ps = [p for p in parents if p is not None]
        kids = self.kids
        if len(set(ps)) == len(ps) and not any(map(kids.__contains__, ps)):
            kids.update(zip(ps, repeat(1)))
            return
        for p in ps:
            kids[p] = kids.get(p, 0) + 1

    def unlink(self, item: Item) -> Item | None:
        """Forget ``item``; returns its parent when that has no resident child left (a leaf now)."""
        parent = self.parent.pop(item)
        kids = self.kids
        leaf = None
        if parent is not None:
            n = kids[parent] - 1
            if n:
                kids[parent] = n
            else:
                del kids[parent]
                leaf = parent
        if item in kids:
            # Children of a removed block stay; they become roots of what is left.
            del kids[item]
            par = self.parent
            for k, p in par.items():  # rare: only when a block leaves before its children
                if p == item:  # (items are hashables: equal, not only the same object)
                    par[k] = None
        return leaf

    def __contains__(self, item: object) -> bool:
        return item in self.parent
