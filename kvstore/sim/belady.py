"""Belady's offline optimum with bypass: the bound every policy is reported against.

After each request, the cache keeps the blocks whose next use is nearest: a new block evicts the
resident block whose next use is furthest away, and is not inserted at all (bypass) when its own
next use is later than every resident block's. Next uses are positions in the flattened reference
stream, so among the blocks of one future request the deepest goes first. For block hits this is
the true optimum of the replay's model (the cache after a request is any subset of what it held
plus that request's blocks); for prefix hits it is the reference bound. It needs the future, so
it is not a policy the server can run.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

NEVER = 1 << 62


class HitRates:
    """Hit rates derived from ``prefix_hits``, ``block_hits`` and ``references`` (the replay's
    results and the bound's share them)."""

    __slots__ = ()
    prefix_hits: int
    block_hits: int
    references: int

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.references if self.references else 0.0

    @property
    def block_hit_rate(self) -> float:
        return self.block_hits / self.references if self.references else 0.0


@dataclass(slots=True, frozen=True)
class BeladyResult(HitRates):
    prefix_hits: int
    block_hits: int
    references: int


def next_uses(requests: Sequence[Sequence[int]]) -> list[int]:
    """For every reference in the flattened stream, the position of the next reference to the
    same block, or NEVER."""
    flat = [k for keys in requests for k in keys]
    out = [NEVER] * len(flat)
    last: dict[int, int] = {}
    for p in range(len(flat) - 1, -1, -1):
        k = flat[p]
        out[p] = last.get(k, NEVER)
        last[k] = p
    return out


def belady(requests: Sequence[Sequence[int]], capacity: int) -> BeladyResult:
    """Replay ``requests`` (each a prompt's block ids, root first) through Belady with bypass."""
    nxt = next_uses(requests)
    resident: dict[int, int] = {}  # key -> its next use (the heap's valid entry)
    heap: list[tuple[int, int]] = []  # (-next_use, key), lazily invalidated
    push, pop = heapq.heappush, heapq.heappop
    prefix = hits = 0
    p = 0
    for keys in requests:
        n = len(keys)
        lead = True
        missing: list[int] = []
        for i in range(n):
            k = keys[i]
            if k in resident:
                hits += 1
                if lead:
                    prefix += 1
                nu = nxt[p + i]
                resident[k] = nu
                push(heap, (-nu, k))
            else:
                lead = False
                missing.append(i)
        for i in missing:
            nu = nxt[p + i]
            if nu == NEVER or capacity <= 0:
                continue
            k = keys[i]
            if k in resident:  # repeated inside one request
                continue
            if len(resident) >= capacity:
                while True:
                    neg, v = heap[0]
                    if resident.get(v) == -neg:
                        break
                    pop(heap)
                if -neg <= nu:
                    continue  # bypass: everything resident is needed sooner
                pop(heap)
                del resident[v]
            resident[k] = nu
            push(heap, (-nu, k))
        p += n
        if len(heap) > 4 * capacity + 1024:  # drop stale entries now and then
            heap = [(-nu, k) for k, nu in resident.items()]
            heapq.heapify(heap)
    return BeladyResult(prefix, hits, p)
