"""The slots of the SSD's segment files: which are free, and the capacity they count against.

A block takes one slot of its *size class*: its bytes rounded up to 4 KiB pages (a 16 KiB block
takes exactly 16 KiB, no header). A class's slots are numbered from 0 (slot ``g`` lies in segment
``g // per_segment``, at ``(g % per_segment) * class bytes``); segment files grow as slots are
first used.

A deleted block's slot is *pending* until its tombstone is durable in the index log, then *ready*:
the next put of the same class overwrites it (no new extents). Handing a slot out earlier could let
a crash resurrect the old record over someone else's bytes (the checksum verified on every read
would still make that a miss, never wrong bytes). Ready and pending slots are on disk, so they
count against the capacity with the live ones; when a put of another class needs their room, ready
slots are punched out (``FALLOC_FL_PUNCH_HOLE``) and kept as *hollow*: free, taking no disk, reused
like fresh ones.

Thread-safe: the SSD tier's writer threads take slots while deletes free them.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterable

import numpy as np

from kvstore.errors import ResourceExhausted

PAGE = 4096
SEGMENT_BYTES = 1 << 30


def pages(size: int) -> int:
    """The size class of a block of ``size`` bytes, in pages."""
    return max(1, -(-size // PAGE))


class Slots:
    """Slot books of every size class, within ``capacity`` bytes."""

    def __init__(
        self,
        capacity: int,
        punch: Callable[[int, int], bool],
        sync: Callable[[], None],
        segment_bytes: int = SEGMENT_BYTES,
    ) -> None:
        """``punch(cls, g)`` gives a free slot's disk back (False: it could not); ``sync()``
        makes every tombstone written so far durable."""
        self.capacity = capacity
        self.segment_bytes = segment_bytes
        self.used = 0  # bytes of live blocks' slots
        self.free_bytes = 0  # bytes of ready and pending slots (on disk)
        self._punch = punch
        self._sync = sync
        self._ready: dict[int, list[int]] = defaultdict(list)
        self._hollow: dict[int, list[int]] = defaultdict(list)
        self._pending: list[tuple[int, int]] = []
        self._settled = 0  # pending slots made ready so far (a mark counts from the first ever)
        self._high: dict[int, int] = defaultdict(int)  # slots of the class ever handed out
        self._lock = threading.Lock()

    def per_segment(self, cls: int) -> int:
        return max(1, self.segment_bytes // (cls * PAGE))

    def place(self, cls: int, g: int) -> tuple[int, int]:
        """(segment, byte offset in it) of slot ``g`` of class ``cls``."""
        per = self.per_segment(cls)
        return g // per, (g % per) * cls * PAGE

    def high(self, cls: int) -> int:
        return self._high[cls]

    def restore(self, live: dict[int, np.ndarray]) -> None:
        """At start: ``live[cls]`` are the slots the log names; every other slot below the
        highest is free (ready: on disk, or counted as if)."""
        for cls, gs in live.items():
            high = int(gs.max()) + 1 if len(gs) else 0
            taken = np.zeros(high, dtype=bool)
            taken[gs] = True
            free = np.flatnonzero(~taken)[::-1].tolist()  # the lowest handed out first
            self._high[cls] = high
            self._ready[cls] = free
            self.used += len(gs) * cls * PAGE
            self.free_bytes += len(free) * cls * PAGE

    def take(self, cls: int) -> int:
        """A slot for a block of class ``cls``: a ready one, else new room (punching other
        classes' ready slots when the capacity is short). :class:`ResourceExhausted` if none."""
        with self._lock:
            mark = self._settled + len(self._pending) if not self._ready[cls] and self._pending else 0
        if mark:  # tombstones waiting for a sync: make them durable, and their slots ready
            self._sync()
            self.settle(mark)
        nbytes = cls * PAGE
        with self._lock:
            if self._ready[cls]:
                self.free_bytes -= nbytes
                self.used += nbytes
                return self._ready[cls].pop()
            short = self.used + self.free_bytes + nbytes - self.capacity
            if short > 0:
                self._hollow_out(short, cls)
            if self.used + self.free_bytes + nbytes > self.capacity:
                raise ResourceExhausted(
                    f"ssd tier full: {self.used} bytes of blocks + {self.free_bytes} of free slots"
                    f" + {nbytes} bytes > capacity {self.capacity}"
                )
            self.used += nbytes
            if self._hollow[cls]:
                return self._hollow[cls].pop()
            g = self._high[cls]
            self._high[cls] = g + 1
            return g

    def _hollow_out(self, short: int, keep: int) -> None:
        """Punch ready slots of classes other than ``keep`` until ``short`` bytes are given back."""
        for cls, ready in self._ready.items():
            while cls != keep and ready and short > 0:
                g = ready.pop()
                if not self._punch(cls, g):
                    ready.append(g)
                    return
                self._hollow[cls].append(g)
                self.free_bytes -= cls * PAGE
                short -= cls * PAGE

    def untake(self, cls: int, g: int) -> None:
        """A slot taken for a write that failed: free again at once (no record names it)."""
        with self._lock:
            self.used -= cls * PAGE
            self.free_bytes += cls * PAGE
            self._ready[cls].append(g)

    def free(self, slots: Iterable[tuple[int, int]], durable: bool) -> None:
        """Slots whose blocks are gone: ready at once if their tombstones are ``durable``, else
        pending until :meth:`settle`."""
        with self._lock:
            for cls, g in slots:
                self.used -= cls * PAGE
                self.free_bytes += cls * PAGE
                if durable:
                    self._ready[cls].append(g)
                else:
                    self._pending.append((cls, g))

    def mark(self) -> int:
        """Where the pending slots end now (for :meth:`settle` after a sync)."""
        with self._lock:
            return self._settled + len(self._pending)

    def settle(self, mark: int | None = None) -> None:
        """Pending slots freed before ``mark`` (all: None) are ready: a log sync made their
        tombstones durable."""
        with self._lock:
            n = len(self._pending) if mark is None else max(0, mark - self._settled)
            for cls, g in self._pending[:n]:
                self._ready[cls].append(g)
            del self._pending[:n]
            self._settled += n
