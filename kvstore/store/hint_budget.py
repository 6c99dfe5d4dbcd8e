"""What a retention hint may hold: the share of each tier the sidecar lets hints keep.

A hint is a client's guess that it will come back; the cache pays for it with room the policy
would have given to blocks that are being used. On long agentic prompts one turn is a large share
of a small cache, a hundred turns wait on tool calls at once, and a cache that keeps every hinted
turn keeps turns that return after they would have been evicted anyway while the turns and shared
prefixes in use go (docs/eviction.md, "Hints the cache can afford"). So the sidecar judges each
hint against a budget (:class:`HintBudget`), :class:`~kvstore.store.retention.Retention` asking it
before it retains anything:

* in each tier with a capacity, retained blocks together take at most ``retained_fraction`` of it
  (the rest stays in the policy's own order);
* a hint that does not fit is **shortened** to its leading blocks that do (a prefix hit needs the
  leading run, so what lies past a block the cache cannot keep is worth nothing to it), and is
  **refused** when not one fits; blocks it already retains cost nothing more;
* a hint may make room by ending retentions of a **lower priority** than its own: the lowest
  priority first, the earliest end first. Among equal priorities the retentions held are kept
  (first come): a hint the cache accepted is honoured until it ends, runs out, or its block
  leaves the tier. Letting the newest hint push out the oldest would keep only the last few
  turns, which the policy keeps anyway.

The counts are kept as retentions begin, end, run out and as retained blocks are evicted
(:meth:`HintBudget.left`), each step O(log n).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from kvstore.store.index import Block

PRIORITIES = 4  # as kvstore.store.retention (0..3)


@dataclass(slots=True)
class HintBudget:
    """Retained bytes per tier bit within ``fraction`` of each tier's ``capacity`` (bytes)."""

    capacity: Mapping[int, int]  # tier bit -> bytes (a tier without one is not bounded)
    fraction: float
    bound: dict[int, int] = field(init=False)
    held: dict[int, int] = field(init=False)  # tier bit -> retained bytes counted there
    counted: dict[Block, int] = field(init=False, default_factory=dict)  # block -> tier bits it is counted in
    ends: list[list[tuple[float, int, Block]]] = field(init=False)  # per priority: (end, seq, block), a heap
    stale: list[Block] = field(init=False, default_factory=list)  # counted blocks evicted since (recounted)
    shortened: int = 0  # hints cut to the leading blocks that fit
    refused: int = 0  # hints of which not one new block fit
    mask: int = field(init=False, default=0)  # the bounded tiers' bits
    _seq: itertools.count[int] = field(init=False, default_factory=itertools.count)

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"retained_fraction: {self.fraction} is outside 0..1")
        self.bound = {t: int(c * self.fraction) for t, c in self.capacity.items() if c > 0}
        self.held = dict.fromkeys(self.bound, 0)
        self.ends = [[] for _ in range(PRIORITIES)]
        for t in self.bound:
            self.mask |= t

    def admit(self, blocks: Iterable[Block], until: float, priority: int, now: float,
              end: Callable[[Block], None]) -> list[Block]:
        """The leading blocks of ``blocks`` that a hint until ``until`` at ``priority`` may retain,
        counted as retained; ``end`` ends a lower-priority retention that makes room."""
        self.settle(now)
        out: list[Block] = []
        mask, counted, held, bound = self.mask, self.counted, self.held, self.bound
        for b in blocks:
            had = counted.get(b, 0) if b.retain_until > now else 0
            new = b.tiers & mask & ~had
            if new and not self._room(b.size, new, priority, now, end):
                if out or had:
                    self.shortened += 1
                else:
                    self.refused += 1
                break
            for t in bound:
                if new & t:
                    held[t] += b.size
            counted[b] = had | new
            ends, p = (max(b.retain_until, until), max(b.retain_priority, priority)) if b.retain_until > now \
                else (until, priority)
            heapq.heappush(self.ends[p], (ends, next(self._seq), b))
            out.append(b)
        return out

    def release(self, b: Block) -> None:
        """``b``'s retention ended (a hint of 0, or ended to make room)."""
        bits = self.counted.pop(b, 0)
        for t in self.bound:
            if bits & t:
                self.held[t] -= b.size

    def left(self, b: Block) -> None:
        """``b`` was picked as a victim in some space: counted again at the next hint."""
        if b in self.counted:
            self.stale.append(b)

    def settle(self, now: float) -> None:
        """The counts brought up to ``now``: retentions run out, evicted blocks recounted."""
        for heap in self.ends:
            while heap and heap[0][0] <= now:
                _, _, b = heapq.heappop(heap)
                if b.retain_until <= now:
                    self.release(b)
        for b in self.stale:
            if b in self.counted:
                bits = b.tiers & self.counted[b]
                gone = self.counted[b] & ~bits
                self.counted[b] = bits
                for t in self.bound:
                    if gone & t:
                        self.held[t] -= b.size
        self.stale.clear()

    def _room(self, size: int, tiers: int, priority: int, now: float, end: Callable[[Block], None]) -> bool:
        """Whether ``size`` more bytes fit in every tier of ``tiers``, after ending retentions of a
        lower priority than ``priority`` (lowest first, earliest end first) where they do not."""
        short = [t for t in self.bound if tiers & t and self.held[t] + size > self.bound[t]]
        if not short:
            return True
        if any(size > self.bound[t] for t in short):
            return False
        skipped: list[tuple[int, tuple[float, int, Block]]] = []
        try:
            for p in range(priority):
                heap = self.ends[p]
                while short and heap:
                    entry = heapq.heappop(heap)
                    until, _, b = entry
                    if b.retain_until != until or b.retain_priority != p or until <= now or b not in self.counted:
                        continue  # a stale entry: extended, raised, ended
                    if not self.counted[b] & tiers & sum(short):
                        skipped.append((p, entry))
                        continue
                    end(b)
                    short = [t for t in short if self.held[t] + size > self.bound[t]]
                if not short:
                    return True
            return False
        finally:
            for p, entry in skipped:
                heapq.heappush(self.ends[p], entry)

    def snapshot(self) -> dict[str, object]:
        """The budget's part of /stats' ``retained``: bound and bytes counted per tier bit, hints cut."""
        return {"fraction": self.fraction, "shortened": self.shortened, "refused": self.refused}
