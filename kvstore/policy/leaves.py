"""The leaves of one last-use queue, oldest first, so that a victim search starts at a victim.

A prefix-aware policy never evicts a block with resident children, and never one its owner has
*held* (:meth:`~kvstore.policy.base.EvictionPolicy.hold`: a block being written). Walking a queue
from its front past such blocks made each pop O(n) and an eviction pass O(n²) (docs/soak.md: a
29.7 s drain with a large demotion backlog). Here a queue's candidates are entries ``(tick, item)``,
``tick`` the item's last use (a queue is in tick order, so tick order is the queue's order):

* ``heap``: the entries no search has looked at, a heap. An entry is added when an item gets a new
  tick as a leaf, or turns into a leaf (its last child left, or its owner released it).
* ``parked``: the entries a search looked at and left in place (the caller's ``eligible`` rejected
  them, or another queue's candidate won), sorted. The next search walks them again, merged with
  the heap, in order: a rejected block costs what it cost in the plain walk, not a heap pop and
  push per search.

An entry whose item has moved on (a newer tick, a child, a hold, another band, gone) is stale: it is
dropped when a search reaches it, or by a rebuild once the entries added since the last rebuild
outnumber half the queue (issue 41: a prompt's blocks enter as leaves and all but the last soon
have a child, so most entries of a queue of prompts go stale; this keeps them under half a queue
beyond its candidates, where twice the queue let a tuple of 64 bytes stay for each block). A pop
costs O(log n) amortized, plus the blocks ``eligible`` rejects.

**Bands.** The owner of a policy may sort its candidates into bands (``Banded``,
:mod:`kvstore.policy.base`): the retention hints put a retained block's entries in the band of its
priority (kvstore/store/books/retention.py), so that a search among the unretained blocks never walks
past the retained ones, nor one among the retained past the rest. A queue keeps one ``Leaves`` per
band; an entry is current in its band only while ``bands`` (item -> band, -1 when absent) says so.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from heapq import heappop, heappush
from itertools import filterfalse

from kvstore.policy.base import Eligible, Item
from kvstore.policy.tree import PrefixLinks

Entry = tuple[int, Item]
_ASK = object()  # (Holding._resolved: a parent neither held nor the item before)


def _tick(entry: Entry) -> int:
    return entry[0]


class Leaves:
    __slots__ = ("floor", "heap", "parked")

    def __init__(self) -> None:
        self.heap: list[Entry] = []
        self.parked: list[Entry] = []
        self.floor = 0  # the entries the last rebuild left

    def add(self, tick: int, item: Item, size: int) -> bool:
        """Add a candidate; False when the entries exceed those the last rebuild left by half
        ``size`` (the queue's length) and the owner should :meth:`rebuild` them (a rebuild walks
        the queue: at most one per half a queue of adds)."""
        heap = self.heap
        heappush(heap, (tick, item))
        return len(heap) + len(self.parked) <= self.floor + size // 2 + 64

    def full_at(self, size: int, adds: int) -> int:
        """Which of ``adds`` more :meth:`add` calls (the queue one longer at each, from ``size``)
        would be the first to return False, 1-based; 0 when none would. (The entries only grow,
        the bound by half as fast: the first is found by bisection.)"""
        base = len(self.heap) + len(self.parked) - self.floor - 64

        def over(j: int) -> bool:
            return base + j > (size + j) // 2

        if adds <= 0 or not over(adds):
            return 0
        lo, hi = 1, adds
        while lo < hi:
            mid = (lo + hi) // 2
            if over(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def extend(self, entries: Iterable[Entry]) -> None:
        """:meth:`add` for each of ``entries`` (ticks above every entry's here, rising), none asking
        for a rebuild (:meth:`full_at` says how many may come): a push of a tick above the heap's
        every one leaves it at the end, so the heap is the one the pushes would leave."""
        self.heap.extend(entries)

    def rebuild(self, entries: list[Entry]) -> None:
        """Replace the entries with ``entries``: the current candidates (sorted here by tick, each
        item's own: the policies keep their ticks in plain dicts, in no order)."""
        entries.sort(key=_tick)
        self.heap, self.parked, self.floor = entries, [], len(entries)

    def first(self, ticks: Mapping[Item, int], kids: Container[Item], held: Container[Item], eligible: Eligible | None,
              bands: Mapping[Item, int] | None = None, band: int = -1) -> Entry | None:
        """The oldest current candidate that ``eligible`` accepts (it stays a candidate), dropping
        stale entries on the way; None when there is none. An entry ``(tick, item)`` is current
        while ``ticks`` (the policy's last uses) gives ``item`` that tick, it is in neither
        ``kids`` (items with resident children) nor ``held``, and (``bands`` given) ``bands``
        puts it in ``band``. (The walk is inlined: it is the policies' hot loop.)"""
        heap, parked = self.heap, self.parked
        get = ticks.get
        bget = bands.get if bands is not None else None
        if parked:  # the common case: the first parked entry is the answer
            tick, item = entry = parked[0]
            if (
                (not heap or tick <= heap[0][0])
                and get(item) == tick
                and item not in kids
                and item not in held
                and (bget is None or bget(item, -1) == band)
                and (eligible is None or eligible(item))
            ):
                return entry
        i = 0
        while True:
            while heap:  # stale entries at the heap's top go
                tick, item = heap[0]
                if get(item) == tick and item not in kids and item not in held and (
                    bget is None or bget(item, -1) == band
                ):
                    break
                heappop(heap)
            # The parked entries up to the heap's first, in order (stale ones dropped).
            end = len(parked)
            if heap and end and parked[-1][0] > heap[0][0]:
                end = bisect_right(parked, heap[0][0], i, key=_tick)
            stale: list[int] = []
            found = None
            for k, (tick, item) in enumerate(parked[i:end], i):
                if get(item) != tick or item in kids or item in held or (bget is not None and bget(item, -1) != band):
                    stale.append(k)
                elif eligible is None or eligible(item):
                    found = (tick, item)
                    break
            for k in reversed(stale):
                del parked[k]
            end -= len(stale)
            if found is not None:
                return found
            i = end
            if not heap:
                return None
            entry = heappop(heap)  # current (the loop above): parked after the entries walked
            parked.insert(i, entry)
            if eligible is None or eligible(entry[1]):
                return entry
            i += 1

    def __len__(self) -> int:
        return len(self.heap) + len(self.parked)


class Holding:
    """What both prefix-aware policies do alike with their leaves: :meth:`hold` / :meth:`release`,
    a block that turns into a leaf (its last child left, its hold released) becoming a candidate
    again, and the bands (:class:`~kvstore.policy.base.Banded`: ``band`` says an item's, and
    :meth:`rekey` moves a candidate whose band changed). Each policy says how an item is made a
    candidate (:meth:`_candidate`: with its queue and tick) and what it holds (``__contains__``)."""

    _links: PrefixLinks
    _held: set[Item]
    _bands: dict[Item, int]  # the items whose candidates are in a band >= 0 (the rest: band -1)
    band: Callable[[Item], int] | None  # the owner's rule for an item's band; None: one band

    def _candidate(self, item: Item) -> None:
        raise NotImplementedError

    def __contains__(self, item: object) -> bool:
        raise NotImplementedError

    def _band(self, item: Item) -> int:
        """``item``'s band now (recorded in ``_bands``), as a new candidate entry is filed."""
        band = self.band
        b = band(item) if band is not None else -1
        if b >= 0:
            self._bands[item] = b
        elif self._bands:
            self._bands.pop(item, None)
        return b

    def rekey(self, item: Item) -> None:
        """``item``'s band may have changed (its retention began or ended): a candidate moves to
        its new band, with its tick (the old band's entry goes stale)."""
        band = self.band
        if (
            band is not None
            and item in self
            and item not in self._links.kids
            and item not in self._held
            and band(item) != self._bands.get(item, -1)
        ):
            self._candidate(item)

    def _unlink(self, item: Item) -> None:
        """Take ``item`` out of the prefix links; its parent, if that was its last child, is a
        candidate again (unless held)."""
        if self._bands:
            self._bands.pop(item, None)
        leaf = self._links.unlink(item)
        if leaf is not None and leaf not in self._held:
            self._candidate(leaf)

    def _plain(self, items: Sequence[Item], present: Container[Item]) -> bool:
        """Whether ``items`` may enter by a policy's bulk insert: each new (not in ``present``, not
        twice), none held, each in the common band (``band`` asked, as each insert asks it)."""
        if any(map(present.__contains__, items)) or len(set(items)) != len(items):
            return False
        if self._held and any(map(self._held.__contains__, items)):
            return False
        if self._bands and any(map(self._bands.__contains__, items)):
            return False
        band = self.band
        return band is None or max(map(band, items), default=-1) < 0

    def _resolved(self, items: Sequence[Item], parents: Sequence[Item | None]) -> list[Item | None]:
        """Each of ``items``' parent as one insert after the other would link it: the parent when
        the space holds it at that item's turn (before these, or earlier among them), else None."""
        held, n = self._links.parent, len(items)
        # (a prompt's blocks come root first: a parent is mostly the item before, or held already)
        before = [None, *items[:-1]]
        out = [p if p is None or p is q or p in held else _ASK for p, q in zip(parents, before, strict=True)]
        if _ASK in out:
            at = dict(zip(items, range(n)))
            out = [p if p is not _ASK else parents[i] if at.get(parents[i], n) < i else None for i, p in enumerate(out)]
        return out

    def _candidates(self, ticks: dict[Item, int]) -> list[Entry]:
        """A queue's candidates in the common band as a rebuild of its leaves takes them (``ticks``:
        the queue's last uses): those with no resident child, not held, in no other band."""
        kids, held, get = self._links.kids, self._held, self._bands.get
        if held or self._bands:
            return [(t, x) for x, t in ticks.items() if x not in kids and x not in held and get(x, -1) == -1]
        xs = list(filterfalse(kids.__contains__, ticks))
        return list(zip(map(ticks.__getitem__, xs), xs))

    def hold(self, item: Item) -> None:
        self._held.add(item)

    def release(self, item: Item) -> None:
        if item in self._held:
            self._held.discard(item)
            if item in self and item not in self._links.kids:
                self._candidate(item)
