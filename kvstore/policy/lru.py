"""Least-recently-used, leaves first: the baseline every other policy is judged against."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import filterfalse
from operator import eq
from typing import ClassVar

from kvstore.policy.base import Eligible, Item
from kvstore.policy.leaves import Holding, Leaves
from kvstore.policy.tree import PrefixLinks


class LRUPolicy(Holding):
    """Evicts the least recently used block that has no child in the space.

    A block with resident children is skipped (its children go first), so a prefix is trimmed
    from its tail, never cut at its root. The leaves that are not held are also kept oldest first
    (:class:`~kvstore.policy.leaves.Leaves`), so a pop does not walk past the others. Each block's
    last-use tick is one plain dict entry (issue 41, the compact index): the ticks are the order,
    and only a rebuild of the leaves needs them sorted.
    """

    name: ClassVar[str] = "lru"

    def __init__(self) -> None:
        self._order: dict[Item, int] = {}  # item -> tick of its last use (unique: the order)
        self._links = PrefixLinks()
        self._leaves = Leaves()
        self._held: set[Item] = set()  # not victims until released (blocks being written)
        self._tick = 0
        self.band: Callable[[Item], int] | None = None  # the owner's bands (Banded); None: one
        self._bands: dict[Item, int] = {}
        self._banded: dict[int, Leaves] = {}  # band >= 0 -> its leaves (band -1: ``_leaves``)

    def insert(self, item: Item, parent: Item | None, depth: int, size: int) -> None:
        if item in self._order:
            self.access(item)
            return
        self._tick += 1
        self._order[item] = self._tick
        self._links.link(item, parent if parent is not None and parent in self._order else None)
        if item not in self._held:
            self._leaf(self._tick, item)

    def insert_many(
        self, items: Sequence[Item], parents: Sequence[Item | None], depths: Sequence[int], sizes: Sequence[int]
    ) -> None:
        """:meth:`insert` for each of ``items`` in order (a restart's batch): new blocks, none held,
        in the common band, enter with dict updates in C, their leaf entries appended up to each
        point where an insert would rebuild the leaves, which is done there, as it would be (the
        same ticks, links, leaves and rebuilds: the state one insert after the other leaves)."""
        order = self._order
        # (an item its own parent: :meth:`insert` links it to itself, which the bulk path does not)
        if len(items) < 2 or not self._plain(items, order) or any(map(eq, items, parents)):
            for item, parent, depth, size in zip(items, parents, depths, sizes, strict=True):
                self.insert(item, parent, depth, size)
            return
        resolved = self._resolved(items, parents)
        leaves, links, n = self._leaves, self._links, len(items)
        a, t = 0, self._tick
        while a < n:
            full = leaves.full_at(len(order), n - a)  # the insert that would rebuild the leaves
            e = a + full if full else n
            run, ticks = items[a:e], range(t + 1, t + 1 + e - a)
            order.update(zip(run, ticks))
            links.link_many(run, resolved[a:e])
            leaves.extend(zip(ticks, run))
            t = self._tick = t + e - a
            if full:
                leaves.rebuild(self._candidates(order))
            a = e

    def access(self, item: Item) -> None:
        order = self._order
        if item in order:
            self._tick += 1
            order[item] = self._tick
            if item not in self._links.kids and item not in self._held:
                self._leaf(self._tick, item)

    def access_many(self, items: Sequence[Item]) -> None:
        order = self._order
        if not all(map(order.__contains__, items)):  # one of them is not in this space: the careful path
            for item in items:
                self.access(item)
            return
        t = self._tick
        order.update(zip(items, range(t + 1, t + len(items) + 1), strict=True))
        self._tick = t + len(items)
        held = self._held
        for item in filterfalse(self._links.kids.__contains__, items):  # (a run: one leaf, its deepest)
            if item not in held:
                self._leaf(order[item], item)

    def remove(self, item: Item) -> None:
        if item not in self._order:
            return
        del self._order[item]
        self._unlink(item)

    def _candidate(self, item: Item) -> None:
        self._leaf(self._order[item], item)

    def _leaf(self, tick: int, item: Item) -> None:
        """``item`` is a candidate as of ``tick`` (its last use), in its band's leaves."""
        b = -1 if self.band is None else self._band(item)
        leaves = self._leaves if b < 0 else self._banded.setdefault(b, Leaves())
        if not leaves.add(tick, item, len(self._order)):
            kids, held, get = self._links.kids, self._held, self._bands.get
            leaves.rebuild(
                [(t, x) for x, t in self._order.items() if x not in kids and x not in held and get(x, -1) == b]
            )

    def pop_victim(self, eligible: Eligible | None = None, band: int | None = None) -> Item | None:
        order, kids, held, bands = self._order, self._links.kids, self._held, self._bands or None
        if bands is None:  # one band: every candidate is in ``_leaves``
            first = self._leaves.first(order, kids, held, eligible) if band is None or band < 0 else None
        elif band is not None:
            leaves = self._leaves if band < 0 else self._banded.get(band)
            first = leaves.first(order, kids, held, eligible, bands, band) if leaves is not None else None
        else:  # every band: the oldest of their firsts
            first = self._leaves.first(order, kids, held, eligible, bands, -1)
            for b, leaves in self._banded.items():
                f = leaves.first(order, kids, held, eligible, bands, b)
                if f is not None and (first is None or f[0] < first[0]):
                    first = f
        if first is None:
            return None
        self.remove(first[1])
        return first[1]

    def uses(self, item: Item) -> int:
        return 0  # recency only: no count to share

    def ghost_size(self) -> int:
        return 0

    def resume(self, item: Item, uses: int) -> None:
        return None

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, item: object) -> bool:
        return item in self._order
