"""Prefix links shared by the prefix-aware policies: parent of each item, count of resident kids.

A block with resident children is never a victim (its children go first), so a prefix is
trimmed from its tail, never cut at its root. Counts, not sets: no per-block object churn.
"""

from __future__ import annotations

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
