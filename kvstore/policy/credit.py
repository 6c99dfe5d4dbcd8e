"""Prefix-aware LRU with frequency credit and a frequency ghost (LRU when ``boost`` is 0).

Priority = ``now + boost × (freq - 1) × capacity × size/full`` where ``now`` counts the calls the
policy has seen (one per reference), so every reuse buys a block ``boost`` more cache lifetimes;
a partial tail block is inserted at ``now - capacity`` (first to go). The rest of this note is
the greedy-dual variant it was derived from (removed: it was slower and no better):

Prefix-aware Greedy-Dual-Size-Frequency with a frequency ghost.

Each block's priority is ``H = L + freq × size / full_size (× depth_cost)`` where ``L`` is the
inflation clock: the priority of the last victim. The lowest ``H`` goes first (ties: oldest
first). A block hit again is re-valued against the current clock, so ``L`` ages out blocks that
were popular long ago (LFU with dynamic aging), and every reuse buys a block about one more cache
lifetime.

* **Admission by value.** A new block starts at ``L + 1`` and a partial tail (``size`` below the
  largest size seen) at ``L + size/full``: a tail is re-keyed by the next turn, so it is the first
  to go. One-shot blocks therefore leave before anything that has been reused.
* **Ghost frequencies.** Evicted keys keep their count on a bounded ghost list (``ghost`` × the
  space's capacity). A block that comes back resumes its count, so a block that was evicted and
  then needed again is kept longer the second time.
* **Prefix-aware.** Owners access a request's blocks deepest-first, and an ancestor's count is at
  least its descendants', so priorities fall along a prefix; a block with resident children is
  never the victim (its children go first).
* ``depth_cost`` > 0 weighs blocks by recompute cost (``1 + depth_cost × depth``), for owners who
  value saved prefill time rather than hit count.

The owner's commit inserts new blocks root first and then calls ``access_many`` on them deepest
first to order them (kvstore/store.py); that first ``access`` after an ``insert`` only orders, it
is not counted as a use (otherwise every new block would start with two uses).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import ClassVar

from kvstore.policy.base import Eligible, Item, PolicyBase
from kvstore.policy.tree import PrefixLinks


def ghost_key(item: Item) -> object:
    """What a ghost entry remembers: the block key (Blocks are re-created after eviction)."""
    return getattr(item, "key", item)


class CreditLRUPolicy(PolicyBase):
    name: ClassVar[str] = "credit"

    def __init__(self, ghost: float = 4.0, depth_cost: float = 0.0, max_freq: int = 64, boost: float = 0.5) -> None:
        self.ghost_share = ghost
        self.boost = boost
        self.depth_cost = depth_cost
        self.max_freq = max_freq
        self._links = PrefixLinks()
        self._h: dict[Item, float] = {}  # item -> priority (the heap entry that is current)
        self._freq: dict[Item, int] = {}
        self._weight: dict[Item, float] = {}  # size / full × cost
        self._depth: dict[Item, int] = {}
        self._heap: list[tuple[float, int, int, Item]] = []  # (H, -depth, seq, item)
        self._seq = 0
        self._clock = 0.0  # L
        self._ghost: OrderedDict[object, int] = OrderedDict()
        self._cap = 0
        self._full = 0
        self._fresh: set[Item] = set()  # inserted, not yet ordered by the owner's commit access
        self._batch = False

    def admit(self, item: Item, parent: Item | None, depth: int, size: int) -> bool:
        return True

    def insert(self, item: Item, parent: Item | None, depth: int, size: int) -> None:
        if item in self._h:
            self.access(item)
            return
        if not self._batch:
            self._fresh.clear()
            self._batch = True
        self._fresh.add(item)
        links = self._links
        links.link(item, parent if parent is not None and parent in links else None)
        if size > self._full:
            self._full = size
        w = size / self._full
        if self.depth_cost:
            w *= 1.0 + self.depth_cost * depth
        f = self._ghost.pop(ghost_key(item), 0) + 1
        self._freq[item] = f
        self._weight[item] = w
        self._depth[item] = depth
        self._clock += 1
        h = self._clock + (self.boost * (f - 1) * w - (1.0 - w)) * max(self._cap, 1)
        if parent is not None:
            hp = self._h.get(parent)
            if hp is not None and hp < h:
                h = hp  # never above its parent: leaves stay first
        self._h[item] = h
        self._seq += 1
        heapq.heappush(self._heap, (h, -depth, self._seq, item))

    def access(self, item: Item) -> None:
        self._batch = False
        freq = self._freq
        f = freq.get(item)
        if f is None:
            return
        if item in self._fresh:  # the owner's commit ordering a block it just inserted: not a use
            self._fresh.discard(item)
            return
        if f < self.max_freq:
            f += 1
            freq[item] = f
        self._clock += 1
        h = self._clock + self.boost * (f - 1) * self._weight[item] * max(self._cap, 1)
        self._h[item] = h
        self._seq += 1
        heapq.heappush(self._heap, (h, -self._depth[item], self._seq, item))

    def remove(self, item: Item) -> None:
        if self._h.pop(item, None) is None:
            return
        self._freq.pop(item)
        self._weight.pop(item)
        self._depth.pop(item)
        self._fresh.discard(item)
        self._links.unlink(item)  # its heap entries go stale and are skipped

    def pop_victim(self, eligible: Eligible | None = None) -> Item | None:
        self._batch = False
        n = len(self._h)
        if n > self._cap:
            self._cap = n
        heap, cur, kids = self._heap, self._h, self._links.kids
        skipped: list[tuple[float, int, int, Item]] = []
        victim = None
        while heap:
            entry = heapq.heappop(heap)
            h, _, _, item = entry
            if cur.get(item) != h:
                continue  # stale
            if item in kids or (eligible is not None and not eligible(item)):
                skipped.append(entry)
                continue
            victim = item
            break
        for entry in skipped:
            heapq.heappush(heap, entry)
        if victim is None:
            return None
        ghost = self._ghost
        ghost[ghost_key(victim)] = self._freq[victim]
        if len(ghost) > self.ghost_share * self._cap:
            ghost.popitem(last=False)
        self.remove(victim)
        if len(heap) > 4 * n + 1024:
            self._compact()
        return victim

    def _compact(self) -> None:
        cur = self._h
        self._heap = [e for e in self._heap if cur.get(e[3]) == e[0]]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._h)

    def __contains__(self, item: object) -> bool:
        return item in self._h
