"""Page-aligned, reusable buffers for blocks in flight between tiers.

A demotion copies a block out of its DRAM slot so the slot can be reused at once. Fresh numpy
arrays would page-fault on every copy and are not page-aligned, so the SSD tier would copy them
again for O_DIRECT; these buffers are anonymous mmaps, kept and reused, and aligned.
"""

from __future__ import annotations

import mmap

import numpy as np

PAGE = mmap.PAGESIZE


class StagingPool:
    def __init__(self, limit_bytes: int) -> None:
        self.limit = limit_bytes
        self.used = 0
        self._free: dict[int, list[mmap.mmap]] = {}

    def take(self, size: int) -> tuple[np.ndarray, mmap.mmap] | None:
        """A buffer of ``size`` bytes, or None when ``limit_bytes`` are in flight already."""
        cap = -(-size // PAGE) * PAGE
        if self.used + cap > self.limit:
            return None
        free = self._free.get(cap)
        buf = free.pop() if free else mmap.mmap(-1, cap)
        self.used += cap
        return np.frombuffer(buf, dtype=np.uint8, count=size), buf

    def give(self, buf: mmap.mmap) -> None:
        self.used -= len(buf)
        self._free.setdefault(len(buf), []).append(buf)
