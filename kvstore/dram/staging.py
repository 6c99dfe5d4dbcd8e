"""Page-aligned, reusable buffers for blocks in flight between tiers.

A demotion copies a block out of its DRAM slot so the slot can be reused at once. Fresh numpy
arrays would page-fault on every copy and are not page-aligned, so the SSD tier would copy them
again for O_DIRECT; these buffers are anonymous mmaps, kept and reused, and aligned.

Kept, not hoarded: a buffer that sat in the pool through a whole trim period (``trim_every``
takes) was not needed in it, and is let go (unmapped once no view of it is left). Before, the
pool kept every buffer it ever made, so the sidecar's memory stayed at the worst backlog of
demotions it had seen (MAP_SHARED anonymous pages: ``RssShmem``, not ``RssAnon``): the soak's
``client_kill`` left 2,300 more 16 KiB buffers (+36 MiB) for the rest of the process's life. A
pool that sees no takes (no demotions) keeps what it has until the next ones.
"""

from __future__ import annotations

import mmap

import numpy as np

PAGE = mmap.PAGESIZE
TRIM_EVERY = 4096  # takes per trim period


class StagingPool:
    def __init__(self, limit_bytes: int, trim_every: int = TRIM_EVERY) -> None:
        self.limit = limit_bytes
        self.trim_every = max(1, trim_every)
        self.used = 0  # bytes taken and not given back
        self.taken = 0  # buffers taken and not given back
        self.pooled = 0  # bytes of free buffers kept for reuse
        self._free: dict[int, list[mmap.mmap]] = {}
        self._idle: dict[int, int] = {}  # buffer size -> fewest free ones of it since the last trim
        self._takes = 0

    def take(self, size: int) -> tuple[np.ndarray, mmap.mmap] | None:
        """A buffer of ``size`` bytes, or None when ``limit_bytes`` are in flight already."""
        cap = -(-size // PAGE) * PAGE
        if self.used + cap > self.limit:
            return None
        free = self._free.get(cap)
        if free:
            buf = free.pop()
            self.pooled -= cap
            self._idle[cap] = min(self._idle.get(cap, 0), len(free))
        else:
            buf = mmap.mmap(-1, cap)
            self._idle[cap] = 0
        self.used += cap
        self.taken += 1
        self._takes += 1
        if self._takes >= self.trim_every:
            self.trim()
        return np.frombuffer(buf, dtype=np.uint8, count=size), buf

    def give(self, buf: mmap.mmap) -> None:
        self.used -= len(buf)
        self.taken -= 1
        self._free.setdefault(len(buf), []).append(buf)
        self.pooled += len(buf)

    def trim(self) -> None:
        """End a trim period: let go of the free buffers no take needed in it (of each size, the
        fewest its free list held meanwhile; the longest-kept ones)."""
        self._takes = 0
        for cap, free in self._free.items():
            n = min(self._idle.get(cap, 0), len(free))
            if n:
                del free[:n]
                self.pooled -= n * cap
            self._idle[cap] = len(free)
