"""Prefix-aware LRU with frequency credit and a frequency ghost (LRU when ``boost`` is 0).

A block's priority is ``last use + boost × (uses - 1) × capacity``, with ``uses`` capped at
``classes``: every reuse buys a block ``boost`` more cache lifetimes, up to
``boost × (classes - 1)``. The lowest priority goes first. A partial tail block (``size`` below the
largest size seen) is placed one capacity below its last use: a tail is re-keyed by the next turn,
so it is the first to go.

* **Queues, not one heap.** Blocks with the same credit sit in one LRU queue (a dict of their
  last-use ticks: the ticks are the order), so each queue's oldest leaf is its lowest priority. A
  victim is the lowest of the ``classes + 1`` queues' oldest eligible leaves (one queue per use
  count, one for partial tails). A use moves a block to the end of its queue (a new tick) or to
  the next queue's end. Each queue's leaves that are not held are also kept oldest first
  (:class:`~kvstore.policy.leaves.Leaves`), so a pop does not walk past blocks with children or
  blocks being written: O(log n) amortized.
* **Bounded credit.** Uncapped credit (the heap version this replaced allowed 64 uses, i.e. up to
  31 lifetimes) keeps old, often-used steps of an agent loop while the next step needs the newest
  blocks: it lost to LRU on the held-out agentic shape (0.93x at 5%). With 4 classes and boost
  0.75 a block keeps at most 2.25 lifetimes of credit, and the policy is never below LRU on the
  shared or held-out traces at 1-25% (docs/eviction.md; boost 1 scores higher on the shared
  traces but falls 0.0001 below LRU on one held-out cell).
* **Ghost frequencies.** Evicted keys keep their use count on a bounded ghost list (``ghost`` × the
  space's capacity). A block that comes back resumes its count, so a block that was evicted and
  then needed again is kept longer the second time. In a cluster the count also outlives the node:
  a node that lets a block go tells the directory its count (:meth:`uses`), and the next node to
  store it resumes that count (:meth:`resume`; kvstore/cluster/publisher.py).
* **Prefix-aware.** A block with resident children is never the victim (its children go first).
  Owners access a request's blocks deepest first, so an ancestor is at least as recent and at
  least as often used as its descendants.
* **Two plain dict entries a block** (issue 41, the compact index): its queue holds its last-use
  tick (a move between queues always takes a new tick, so an entry of queue ``q``'s leaves is
  current while queue ``q`` gives its item that tick), and one dict holds its queue and its use
  count packed in one small int (:meth:`CreditLRUPolicy._pack`).

The owner's commit inserts new blocks root first and then calls ``access_many`` on them deepest
first to order them (kvstore/store/block_store.py); that first ``access`` after an ``insert`` only orders, it
is not counted as a use (otherwise every new block would start with two uses).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Sequence
from itertools import accumulate, compress, filterfalse, repeat
from operator import lt, not_
from typing import ClassVar

from kvstore.policy.base import Eligible, Item
from kvstore.policy.leaves import Holding, Leaves
from kvstore.policy.tree import PrefixLinks

TAILS = 0  # queue index of partial tail blocks; queue 1 + c holds blocks with c earlier uses


def ghost_key(item: Item) -> object:
    """What a ghost entry remembers: the block key (Blocks are re-created after eviction)."""
    return getattr(item, "key", item)


class CreditLRUPolicy(Holding):
    name: ClassVar[str] = "credit"

    def __init__(self, boost: float = 0.75, classes: int = 4, ghost: float = 4.0) -> None:
        if classes < 1:
            raise ValueError("credit: classes must be at least 1")
        self.boost = boost
        self.classes = classes
        self.ghost_share = ghost
        self._links = PrefixLinks()
        # Each queue: item -> tick of its last use (or of the commit's ordering; unique: the order).
        self._queues: list[dict[Item, int]] = [{} for _ in range(classes + 1)]
        self._unit = classes + 1
        self._queue: dict[Item, int] = {}  # item -> its queue, its uses (capped at ``classes``), fresh: packed
        self._leaves = [Leaves() for _ in range(classes + 1)]  # each queue's candidates
        self._held: set[Item] = set()  # not victims until released (blocks being written)
        self._ghost: OrderedDict[object, int] = OrderedDict()
        self._tick = 0
        self._cap = 0  # the space's capacity, learned: the most blocks held when asked for a victim
        self._full = 0  # the largest block size seen
        # Inserted, not yet ordered by the owner's commit access: ``_fresh_at`` added to its packed
        # int while it is. ``_batch_items`` lists this batch's inserts, whose mark the next batch
        # clears (a list, not a set of them: 8 bytes a block, issue 41); ``_fresh`` counts the marked.
        self._fresh_at = self._unit * self._unit  # added to the packed int of a fresh item
        self._batch_items: list[Item] = []
        self._fresh = 0
        self._batch = False
        self.band: Callable[[Item], int] | None = None  # the owner's bands (Banded); None: one
        self._bands: dict[Item, int] = {}
        self._banded: dict[int, list[Leaves]] = {}  # band >= 0 -> each queue's leaves in it

    def _pack(self, q: int, f: int) -> int:
        """Queue ``q`` and ``f`` uses as one int (a small one, shared, for the default classes)."""
        return q * self._unit + f

    def _clear_fresh(self) -> None:
        """A new batch of inserts: the last one's blocks are fresh no more."""
        queue, at = self._queue, self._fresh_at
        if self._fresh:
            for item in self._batch_items:
                packed = queue.get(item)
                if packed is not None and packed >= at:
                    queue[item] = packed - at
        self._batch_items = []
        self._fresh = 0

    def insert(self, item: Item, parent: Item | None, depth: int, size: int) -> None:
        if item in self._queue:
            self.access(item)
            return
        if not self._batch:
            self._clear_fresh()
            self._batch = True
        self._batch_items.append(item)
        self._fresh += 1
        links = self._links
        links.link(item, parent if parent is not None and parent in links else None)
        self._full = max(self._full, size)
        f = min(self._ghost.pop(ghost_key(item), 0) + 1, self.classes)
        q = TAILS if size < self._full else f
        self._tick += 1
        self._queue[item] = self._pack(q, f) + self._fresh_at
        self._queues[q][item] = self._tick
        if item not in self._held:
            self._leaf(q, self._tick, item)

    def insert_many(
        self, items: Sequence[Item], parents: Sequence[Item | None], depths: Sequence[int], sizes: Sequence[int]
    ) -> None:
        """:meth:`insert` for each of ``items`` in order (a restart's batch). New blocks, none held,
        in the common band, with no ghost to resume (a restart's is empty) enter with dict updates
        in C: each one use, its queue the tails' when its size is below the largest seen so far,
        each queue's leaf entries appended up to each point where an insert would rebuild that
        queue's leaves, which is done there, as it would be (the same ticks, queues, links, leaves
        and rebuilds: the state one insert after the other leaves)."""
        queue = self._queue
        if len(items) < 2 or self._ghost or not self._plain(items, queue):
            for item, parent, depth, size in zip(items, parents, depths, sizes, strict=True):
                self.insert(item, parent, depth, size)
            return
        resolved = self._resolved(items, parents)
        n, f = len(items), min(1, self.classes)  # (no ghost: one use each)
        tops = list(accumulate(sizes, max, initial=self._full))[1:]
        self._full = tops[-1]
        tails = list(map(lt, sizes, tops))
        if not self._batch:  # (before the new marks: the last batch's are cleared)
            self._clear_fresh()
            self._batch = True
        self._batch_items.extend(items)
        self._fresh += n
        whole = self._pack(f, f) + self._fresh_at  # (each fresh)
        at: dict[int, Sequence[int]]  # per queue: its items' places in ``items``
        if any(tails):
            tail = self._pack(TAILS, f) + self._fresh_at
            queue.update(zip(items, [tail if t else whole for t in tails], strict=True))
            at = {TAILS: list(compress(range(n), tails)), f: list(compress(range(n), map(not_, tails)))}
        else:
            queue.update(zip(items, repeat(whole)))
            at = {f: range(n)}
        done = dict.fromkeys(at, 0)  # per queue: its items entered so far
        links, t0 = self._links, self._tick
        a = 0
        while a < n:
            e, full_q = n, -1  # the first insert that would rebuild a queue's leaves, and that queue
            for q, idx in at.items():
                j = self._leaves[q].full_at(len(self._queues[q]), len(idx) - done[q])
                if j and idx[done[q] + j - 1] < e:
                    e, full_q = idx[done[q] + j - 1] + 1, q
            for q, idx in at.items():
                b = bisect_left(idx, e, done[q])
                took = idx[done[q] : b]
                ticks: Sequence[int]
                if isinstance(took, range):
                    run, ticks = items[took.start : took.stop], range(t0 + 1 + took.start, t0 + 1 + took.stop)
                else:
                    run, ticks = [items[i] for i in took], [t0 + 1 + i for i in took]
                self._queues[q].update(zip(run, ticks))
                self._leaves[q].extend(zip(ticks, run))
                done[q] = b
            links.link_many(items[a:e], resolved[a:e])
            self._tick = t0 + e
            if full_q >= 0:
                self._leaves[full_q].rebuild(self._candidates(self._queues[full_q]))
            a = e

    def access(self, item: Item) -> None:
        self._batch = False
        packed = self._queue.get(item)
        if packed is None:
            return
        self._tick += 1
        if packed >= self._fresh_at:  # the owner's commit ordering a block it just inserted: not a use
            self._fresh -= 1
            q, uses = divmod(packed - self._fresh_at, self._unit)
            f = q
        else:
            q, uses = divmod(packed, self._unit)
            f = uses = min(uses + 1, self.classes)
        if f == q:
            self._queues[q][item] = self._tick
        else:
            del self._queues[q][item]
            self._queues[f][item] = self._tick
        self._queue[item] = self._pack(f, uses)
        if item not in self._links.kids and item not in self._held:
            self._leaf(f, self._tick, item)

    def access_many(self, items: Sequence[Item]) -> None:
        top = self.classes
        n = len(items)
        if n > 1 and not self._fresh and list(map(self._queue.get, items)).count(self._pack(top, top)) == n:
            # Hits on blocks that already have full credit (a hot prefix): reorder in C.
            self._batch = False
            last = self._queues[top]
            t = self._tick
            last.update(zip(items, range(t + 1, t + n + 1), strict=True))
            self._tick = t + n
            held = self._held
            for item in filterfalse(self._links.kids.__contains__, items):  # (a run: one leaf, its deepest)
                if item not in held:
                    self._leaf(top, last[item], item)
            return
        access = self.access
        for item in items:
            access(item)

    def remove(self, item: Item) -> None:
        packed = self._queue.pop(item, None)
        if packed is None:
            return
        if packed >= self._fresh_at:
            self._fresh -= 1
            packed -= self._fresh_at
        del self._queues[packed // self._unit][item]
        self._unlink(item)

    def _candidate(self, item: Item) -> None:
        q = self._queue[item] % self._fresh_at // self._unit
        self._leaf(q, self._queues[q][item], item)

    def _leaf(self, q: int, tick: int, item: Item) -> None:
        """``item`` is a candidate of queue ``q`` as of ``tick`` (its last use), in its band's leaves."""
        b = -1 if self.band is None else self._band(item)
        if b < 0:
            leaves = self._leaves[q]
        else:
            banded = self._banded.get(b)
            if banded is None:
                banded = self._banded[b] = [Leaves() for _ in self._leaves]
            leaves = banded[q]
        if not leaves.add(tick, item, len(self._queues[q])):
            kids, held, get = self._links.kids, self._held, self._bands.get
            leaves.rebuild(
                [(t, x) for x, t in self._queues[q].items() if x not in kids and x not in held and get(x, -1) == b]
            )

    def pop_victim(self, eligible: Eligible | None = None, band: int | None = None) -> Item | None:
        self._batch = False
        n = len(self._queue)
        self._cap = max(self._cap, n)
        unit = self.boost * self._cap
        queues, kids, held, bands = self._queues, self._links.kids, self._held, self._bands or None
        # Each queue's leaves to search: one band's (``band``), or every band's.
        searched: list[tuple[int, list[Leaves]]]
        if bands is None:
            searched = [(-1, self._leaves)] if band is None or band < 0 else []
        elif band is None:
            searched = [(-1, self._leaves), *self._banded.items()]
        else:
            banded = self._leaves if band < 0 else self._banded.get(band)
            searched = [(band, banded)] if banded is not None else []
        victim, best = None, 0.0
        for q in range(len(self._leaves)):  # queue by queue: a tie goes to the first queue, as ever
            for b, per_queue in searched:
                first = per_queue[q].first(queues[q], kids, held, eligible, bands, b)  # its lowest priority
                if first is None:
                    continue
                tick, item = first
                pri = tick + ((q - 1) * unit if q != TAILS else -self._cap)
                if victim is None or pri < best:
                    victim, best = item, pri
        if victim is None:
            return None
        ghost = self._ghost
        ghost[ghost_key(victim)] = self._queue[victim] % self._unit
        if len(ghost) > self.ghost_share * self._cap:
            ghost.popitem(last=False)
        self.remove(victim)
        return victim

    def uses(self, item: Item) -> int:
        packed = self._queue.get(item)
        return packed % self._unit if packed is not None else self._ghost.get(ghost_key(item), 0)

    def ghost_size(self) -> int:
        return int(self.ghost_share * self._cap)

    def resume(self, item: Item, uses: int) -> None:
        packed = self._queue.get(item)
        if packed is None:
            return
        fresh = packed - packed % self._fresh_at  # (kept: a resumed count is no access)
        q, had = divmod(packed - fresh, self._unit)
        f = min(uses + 1, self.classes)  # as its own ghost would: the count remembered, plus this store
        if f <= had:
            return
        if q == TAILS:  # a partial tail keeps its place: the next turn re-keys it
            self._queue[item] = self._pack(q, f) + fresh
            return
        # A new tick, as a move between queues must have: the old queue's leaf entry goes stale
        # (kvstore.policy.leaves). It was stored moments ago, so this barely moves its recency.
        self._tick += 1
        del self._queues[q][item]
        self._queues[f][item] = self._tick
        self._queue[item] = self._pack(f, f) + fresh
        if item not in self._links.kids and item not in self._held:
            self._leaf(f, self._tick, item)

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, item: object) -> bool:
        return item in self._queue
