"""Where this engine's blocks lie in the sidecar's DRAM, so a lookup needs no round trip.

The scheduler side learns where blocks lie from the sidecar's answers (``Acquire``), the worker
side from its own saves (``Allocate`` + ``Commit``). The sidecar's slab carries a *free epoch*
(:func:`kvstore.dram.slab.free_epoch`) that moves whenever any slot is freed, so a block learned at
epoch *e* is still in its slot, byte for byte, while its segment's epoch reads *e* (a committed
block's bytes change only after its slot was freed). :meth:`BlockDirectory.find` answers a
request whose blocks are all known at the current epoch; the worker then copies from those slots
without a lease, checks their checksums, and checks that the epoch did not move while it copied
(a slot freed mid-copy may have been rewritten: then every block of the load is reported for
recompute). The sidecar hears about the hit afterwards, off the request's path, so its eviction
policy sees it. Any eviction, delete or restart moves the epoch and the next lookup asks the
sidecar again -- the directory is a shortcut, never the authority.

One directory per sidecar URL per process, shared by the scheduler and worker sides of an engine
that run in one process (vLLM's in-process engine core); bounded (LRU).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.client import SlotRef
from kvstore.dram.slab import free_epoch

CAPACITY = 1 << 16  # blocks remembered per sidecar


@dataclass(slots=True, frozen=True)
class Place:
    slot: SlotRef
    checksum: int  # non-zero: a block is only remembered with its checksum
    epoch: int  # the slab's free epoch when the place was known to hold the block


def epoch_of(segment: str) -> int | None:
    """The free epoch of ``segment`` now; None when it cannot be mapped (gone, another host)."""
    try:
        return int(free_epoch(segment)[0])
    except (OSError, ValueError):
        return None


class BlockDirectory:
    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._places: OrderedDict[bytes, Place] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._places)

    def learn(self, keys: Sequence[bytes], slots: Sequence[SlotRef], checksums: Sequence[int], epoch: int) -> None:
        """``keys[i]`` lies at ``slots[i]`` with ``checksums[i]``, as of free epoch ``epoch`` (read
        while the blocks were committed and pinned: under a lease, or before their commit)."""
        with self._lock:
            for key, slot, c in zip(keys, slots, checksums):
                if c:
                    self._places[key] = Place(slot, c, epoch)
                    self._places.move_to_end(key)
            while len(self._places) > self.capacity:
                self._places.popitem(last=False)

    def find(self, keys: Sequence[bytes]) -> list[Place] | None:
        """Places of all of ``keys``, when every one is known and still valid; else None."""
        if not keys:
            return None
        places: list[Place] = []
        with self._lock:
            for k in keys:
                p = self._places.get(k)
                if p is None:
                    return None
                places.append(p)
            for k in keys:
                self._places.move_to_end(k)
        now: dict[str, int | None] = {}
        for p in places:
            seg = p.slot.segment
            if seg not in now:
                now[seg] = epoch_of(seg)
            if now[seg] != p.epoch:
                return None
        return places

    def forget(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for k in keys:
                self._places.pop(k, None)


_directories: dict[str, BlockDirectory] = {}
_directories_lock = threading.Lock()


def directory_for(url: str) -> BlockDirectory:
    """The process's directory for the sidecar at ``url``."""
    with _directories_lock:
        d = _directories.get(url)
        if d is None:
            d = _directories[url] = BlockDirectory()
        return d
