"""The DRAM tier's shared-memory slab: fixed-size slots in size classes.

The sidecar owns one POSIX shared-memory segment (mode 0600, pre-faulted at start, unlinked on
clean shutdown). It is cut into pages of ``page_bytes``; a page is given on first need to one
size class (powers of two from ``min_slot_bytes`` to ``page_bytes``) and split into slots of
that size, as memcached's slab allocator does. Workers attach to the segment once per process
(:func:`attach`) and copy straight into and out of slots; the bytes never cross gRPC.

Pages move between classes (memcached's slab rebalancing): a page whose last slot is freed goes
back to the free-page pool at once, and an owner that needs a page of another class frees every
slot of one (:meth:`Slab.pages`, :attr:`Slot.holder` say what is in them). A page cut again for
the class it last served gets back the same slot objects, ids included; cut for another class it
gets new ones. A slot id therefore names one offset and capacity for the slab's life, and a slot
is only ever handed out when no slot of another cut of its page is taken.

A header page after the last slab page (the segment's last 4 KiB) holds the slab's page size (a
u64 at byte 8, :func:`page_bytes_of`: a worker pins the slab in registrations cut at page
boundaries), its smallest slot (a u64 at byte 16: whether every slot is whole OS pages, which a
client's read-only mapping needs, :mod:`kvstore.dram.protect`) and the **free epoch** (a u64 at
its start, :func:`free_epoch`): the sidecar adds one every time it frees a slot (eviction, delete,
abort, shutdown). A client that read the epoch
before learning where committed blocks lie may read them there without a lease as long as the
epoch has not moved: a committed block's bytes only change after its slot was freed
(:mod:`connector.roles.block_directory`).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import mmap
import os
import threading
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from multiprocessing import resource_tracker, shared_memory
from typing import Protocol

import numpy as np

from kvstore.dram.protect import ReadOnlyMapping, pages_whole
from kvstore.errors import InvalidArgument


class Holder(Protocol):
    """What a slot's holder is to those who find it through the slot: a block of the index
    (:class:`kvstore.store.books.index.Block`, which imports this module; this one imports nothing of the
    store): the slot it is bound to, its placement bits, whether it may leave."""

    @property
    def slot(self) -> Slot | None: ...

    @property
    def tiers(self) -> int: ...

    @property
    def pinned(self) -> bool: ...


@dataclass(slots=True, eq=False)
class Slot:
    slot_id: int
    offset: int
    cls: int  # size-class index
    capacity: int
    page: int  # index of the page it is cut from
    # the block written into it (set by its owner, kvstore.store.books.dram_space); None once freed
    holder: Holder | None = None
    # Times it was freed (Slab.free): a block holding it now and as many frees as when it was read has
    # held it without a break since (slot objects are reused: ``holder is b`` alone does not say so).
    frees: int = 0


@dataclass(slots=True, eq=False)
class Page:
    index: int
    cls: int = -1  # the size class it is cut for; -1 while in the free-page pool
    used: int = 0  # its slots handed out and not freed
    slots: list[Slot] = field(default_factory=list)  # its slots, as last cut
    free: list[Slot] = field(default_factory=list)  # its free slots while cut (taken from the end)


@dataclass(slots=True)
class _SizeClass:
    size: int
    per_page: int
    pages: dict[Page, None] = field(default_factory=dict)  # the pages cut for it
    open: dict[Page, None] = field(default_factory=dict)  # those with a free slot; the last is used first
    used: int = 0


class Slab:
    def __init__(
        self,
        capacity_bytes: int,
        page_bytes: int = 4 << 20,
        min_slot_bytes: int = 4096,
        *,
        prefault: bool = True,
        name_prefix: str = "kvstore",
    ) -> None:
        if capacity_bytes < page_bytes:
            raise InvalidArgument(f"dram.capacity_bytes: {capacity_bytes} is smaller than one page ({page_bytes})")
        self.page_bytes = page_bytes
        self.num_pages = capacity_bytes // page_bytes
        self.capacity_bytes = self.num_pages * page_bytes
        self.name = f"{name_prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        _retry_closing()  # an earlier slab's views may have gone since
        self._shm = shared_memory.SharedMemory(name=self.name, create=True, size=self.capacity_bytes + HEADER_BYTES)
        _owned[self.name] = self._shm
        mapped = _mapping(self._shm)
        self.buf = np.frombuffer(mapped, dtype=np.uint8, count=self.capacity_bytes)
        self._epoch = epoch_view(mapped, self.capacity_bytes)
        epoch_view(mapped, self.capacity_bytes + PAGE_BYTES_AT)[0] = page_bytes  # for clients: page_bytes_of()
        epoch_view(mapped, self.capacity_bytes + MIN_SLOT_BYTES_AT)[0] = min_slot_bytes  # for clients: attach()
        self._reclaimed = epoch_view(mapped, self.capacity_bytes + RECLAIMED_AT)  # for clients: reclaimed_in()
        if prefault:
            self.buf[:: 4096] = 0
        self.classes: list[_SizeClass] = []
        size = min_slot_bytes
        while size <= page_bytes:
            self.classes.append(_SizeClass(size, page_bytes // size))
            size *= 2
        self._pages = [Page(i) for i in range(self.num_pages)]
        self._free_pages = self._pages[::-1]  # the pool, taken from the end
        self._next_id = 0
        self.page_moves = 0  # pages cut for another class than the one they last served

    # --- size classes -------------------------------------------------------------------

    @property
    def max_slot_bytes(self) -> int:
        return self.classes[-1].size

    def holds(self, size: int) -> bool:
        """Whether a block of ``size`` bytes fits a slot of this slab."""
        return 0 < size <= self.max_slot_bytes

    def class_of(self, size: int) -> int:
        if size <= 0:
            raise InvalidArgument(f"size: must be positive, got {size}")
        if size > self.max_slot_bytes:
            raise InvalidArgument(
                f"size: {size} bytes exceeds the largest slot ({self.max_slot_bytes}); raise dram.page_bytes"
            )
        idx = max(0, (size - 1).bit_length() - self.classes[0].size.bit_length() + 1)
        return idx

    # --- allocation ---------------------------------------------------------------------

    def try_alloc(self, cls: int, grow: bool = True) -> Slot | None:
        """A free slot of class ``cls``, cutting a page from the pool if needed (and ``grow``);
        None when there is neither."""
        sc = self.classes[cls]
        if not sc.open and not (grow and self.grow(cls)):
            return None
        page, _ = sc.open.popitem()
        slot = page.free.pop()
        if page.free:
            sc.open[page] = None
        page.used += 1
        sc.used += 1
        return slot

    def take(self, cls: int, n: int) -> list[Slot]:
        """Up to ``n`` free slots of class ``cls`` at once, cutting pages from the pool as needed
        (all ``n`` when :meth:`fits` says so)."""
        sc = self.classes[cls]
        out: list[Slot] = []
        while n > 0 and (sc.open or self.grow(cls)):
            page, _ = sc.open.popitem()
            free = page.free
            k = min(n, len(free))
            out += free[: -k - 1 : -1]  # as try_alloc would hand them out
            del free[-k:]
            if free:
                sc.open[page] = None
            page.used += k
            sc.used += k
            n -= k
        return out

    def grow(self, cls: int) -> bool:
        """Cut a page from the free-page pool into free slots of class ``cls``; False when the
        pool is empty."""
        if not self._free_pages:
            return False
        page = self._free_pages.pop()
        sc = self.classes[cls]
        if not page.slots or page.slots[0].cls != cls:
            if page.slots:
                self.page_moves += 1
            base, first = page.index * self.page_bytes, self._next_id
            page.slots = [Slot(first + i, base + i * sc.size, cls, sc.size, page.index) for i in range(sc.per_page)]
            self._next_id += sc.per_page
        page.cls = cls
        page.free = page.slots[::-1]
        sc.pages[page] = None
        sc.open[page] = None
        return True

    def free(self, slot: Slot) -> None:
        """Give a slot back; the last one of its page takes the page back to the pool."""
        self._epoch[0] += 1  # before the slot can be handed out again
        slot.holder = None
        slot.frees += 1
        page = self._pages[slot.page]
        sc = self.classes[slot.cls]
        sc.used -= 1
        page.used -= 1
        if not page.used:
            sc.open.pop(page, None)
            page.free = []
            page.cls = -1
            del sc.pages[page]
            self._free_pages.append(page)
            return
        page.free.append(slot)
        if len(page.free) == 1:
            sc.open[page] = None

    # --- pages ----------------------------------------------------------------------------

    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    def pool_pages(self) -> list[Page]:
        """The pages of the free-page pool (a copy: what an audit reads)."""
        return list(self._free_pages)

    def per_page(self, cls: int) -> int:
        return self.classes[cls].per_page

    def free_slots(self, cls: int) -> int:
        """Free slots of class ``cls`` in its pages (the pool's pages not counted)."""
        sc = self.classes[cls]
        return len(sc.pages) * sc.per_page - sc.used

    def fits(self, needs: Mapping[int, int]) -> bool:
        """Whether ``needs`` (class -> slots) can be taken from free slots and the pool alone."""
        pages = 0
        for cls, n in needs.items():
            short = n - self.free_slots(cls)
            if short > 0:
                pages += -(-short // self.classes[cls].per_page)
        return pages <= len(self._free_pages)

    def pages(self, cls: int) -> Iterator[Page]:
        """The pages cut for class ``cls`` (free no slot while iterating: a page may leave)."""
        return iter(self.classes[cls].pages)

    def page_of(self, slot: Slot) -> Page:
        return self._pages[slot.page]

    def view(self, slot: Slot, length: int) -> np.ndarray:
        return self.buf[slot.offset : slot.offset + length]

    # --- accounting ---------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return sum(c.used * c.size for c in self.classes)

    def occupancy(self) -> dict[str, object]:
        return {
            "capacity_bytes": self.capacity_bytes,
            "used_bytes": self.used_bytes,
            "free_pages": len(self._free_pages),
            "page_moves": self.page_moves,
            "classes": {
                str(c.size): {"pages": len(c.pages), "used_slots": c.used, "free_slots": self.free_slots(i)}
                for i, c in enumerate(self.classes)
                if c.pages
            },
        }

    def note_reclaimed(self) -> None:
        """An allocation was reclaimed unfinished (its writer may write its slots late):
        :func:`reclaimed_in` tells the clients, whose loads from this slab then hash."""
        self._reclaimed[0] += 1

    def close(self, unlink: bool = True) -> None:
        self._epoch[0] += 1  # nothing a client learned about this slab holds any more
        del self.buf, self._epoch, self._reclaimed
        _arrays.pop(self.name, None)
        _close_when_unexported(self._shm)
        _owned.pop(self.name, None)
        _attached.pop(self.name, None)
        _read_only.pop(self.name, None)
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                self._shm.unlink()


# --- worker side ----------------------------------------------------------------------------

HEADER_BYTES = 4096  # after the slab pages: the free epoch, then the page size, then the smallest slot
PAGE_BYTES_AT = 8  # the slab's page_bytes (u64) in the header page
MIN_SLOT_BYTES_AT = 16  # the slab's min_slot_bytes (u64) in the header page (0: a sidecar that did not record it)
# Allocations the sidecar reclaimed unfinished (u64): their writers may still hold their slots' pages
# writable and write them late, into slots handed out again, so a slab with any loads with hashing
# (connector.roles.guard): the read-only guard keeps only this process's own stray writes out.
RECLAIMED_AT = 24


def epoch_view(buf: memoryview | np.ndarray, offset: int) -> np.ndarray:
    """The slab's free epoch (one u64, see the module docstring) in a mapping of the segment."""
    return np.ndarray((1,), dtype=np.uint64, buffer=buf, offset=offset)


def free_epoch(segment: str) -> np.ndarray:
    """The free epoch of the sidecar slab ``segment`` as this process maps it (read ``[0]``)."""
    mem = attach(segment)
    return epoch_view(mem, len(mem) - HEADER_BYTES)


def reclaimed_in(segment: str) -> int:
    """How many allocations the sidecar of slab ``segment`` reclaimed unfinished (:data:`RECLAIMED_AT`)."""
    mem = attach(segment)
    return int(epoch_view(mem, len(mem) - HEADER_BYTES + RECLAIMED_AT)[0])


def page_bytes_of(segment: str) -> int:
    """The page size of the sidecar slab ``segment`` (a slot never straddles a page); 0 from a
    sidecar that did not record it."""
    mem = attach(segment)
    return int(epoch_view(mem, len(mem) - HEADER_BYTES + PAGE_BYTES_AT)[0])


_attached: dict[str, shared_memory.SharedMemory] = {}
_owned: dict[str, shared_memory.SharedMemory] = {}  # slabs this process created (an in-process sidecar)
_arrays: dict[str, np.ndarray] = {}  # each mapping as one uint8 array: clients slice a view per block
_read_only: dict[str, ReadOnlyMapping] = {}  # the attached mappings kept read-only (kvstore.dram.protect)
_attach_lock = threading.Lock()


_closing: dict[str, shared_memory.SharedMemory] = {}  # closed slabs whose mapping a live view still exports
_closing_lock = threading.Lock()


@atexit.register
def _release_arrays() -> None:
    """Drop the cached arrays before the mappings are finalized: a mapping with a live export
    cannot close ("BufferError: cannot close exported pointers exist" at exit)."""
    _arrays.clear()
    _retry_closing()


def _close_when_unexported(shm: shared_memory.SharedMemory) -> None:
    """Close ``shm`` now, or, while a view of its mapping is still alive, as soon as none is.

    A view can outlive the slab's close legitimately: a caller's lease or allocation, or the frames
    of a traceback someone keeps (a test's ``pytest.raises``, a logged exception) hold slot views
    until they are dropped or, in a reference cycle, collected. ``SharedMemory.close`` then raises
    BufferError, and a SharedMemory dropped in that state raises it again from its ``__del__``
    (an unraisable "cannot close exported pointers exist", and its fd stays open). So it is kept
    here, and closed again after every garbage collection (which is what frees views held in
    cycles), at the next slab's start or close, and at exit: an entry lives only while its views do."""
    _closing[shm.name] = shm
    _retry_closing()


def _retry_closing(*_: object) -> None:
    """Close the segments :func:`_close_when_unexported` keeps whose views are gone (also a
    :data:`gc.callbacks` entry). Skipped when another thread, or a collection inside this one,
    is already at it: that one closes what can be closed."""
    if not _closing or not _closing_lock.acquire(blocking=False):
        return
    try:
        for name, shm in list(_closing.items()):
            with contextlib.suppress(BufferError):  # a view is still alive: the next try
                shm.close()  # after a failed close, closes the mapping and fd still open
                del _closing[name]
    finally:
        _closing_lock.release()


gc.callbacks.append(_retry_closing)


def attach(segment: str) -> np.ndarray:
    """Map the sidecar's slab into this process, once per process.

    A slab another process owns is mapped read-only when every slot of it is whole OS pages
    (:func:`read_only`): only the slots of this process's allocations are made writable, while
    they are written (:mod:`kvstore.dram.protect`).

    Python 3.11's SharedMemory registers every segment it opens with the resource tracker, which
    unlinks it when this process exits; a worker must never destroy the sidecar's slab, so we
    unregister it again.
    """
    mem = _arrays.get(segment)
    if mem is not None:
        return mem
    with _attach_lock:
        shm = _attached.get(segment) or _owned.get(segment)
        if shm is None:
            shm = shared_memory.SharedMemory(name=segment, create=False)
            _untrack(shm)
            _prefault(shm)
            _attached[segment] = shm
            _protect(segment, np.frombuffer(_mapping(shm), dtype=np.uint8))
        mem = _arrays[segment] = np.frombuffer(_mapping(shm), dtype=np.uint8)
        return mem


def _protect(segment: str, mem: np.ndarray) -> None:
    """Map a slab another process owns read-only here (:mod:`kvstore.dram.protect`) when every
    slot of it is whole OS pages; else leave it read-write (loads from it keep hashing)."""
    header = len(mem) - HEADER_BYTES
    if header < 0 or not pages_whole(int(epoch_view(mem, header + PAGE_BYTES_AT)[0]),
                                     int(epoch_view(mem, header + MIN_SLOT_BYTES_AT)[0])):
        return
    _read_only[segment] = ReadOnlyMapping(int(mem.__array_interface__["data"][0]), len(mem))


def read_only(segment: str) -> ReadOnlyMapping | None:
    """This process's mapping of ``segment`` when it is kept read-only (:mod:`kvstore.dram.protect`:
    nothing in this process can write a slot it did not allocate), else None (a slab this process
    owns, one whose slots are not whole OS pages, or one not attached yet)."""
    return _read_only.get(segment)


def read_only_at(address: int) -> ReadOnlyMapping | None:
    """The read-only mapping (:func:`read_only`) that holds byte ``address``, else None."""
    for m in _read_only.values():
        if m.base <= address < m.base + m.size:
            return m
    return None


def _mapping(shm: shared_memory.SharedMemory) -> memoryview:
    buf = shm.buf
    assert buf is not None, "a closed shared-memory segment has no mapping"
    return buf


MADV_POPULATE_WRITE = 23  # Linux 5.14+; not exported by Python 3.11's mmap module


def _prefault(shm: shared_memory.SharedMemory) -> None:
    """Map every page of the slab into this process now, writable, without touching the data:
    otherwise each worker pays a page fault per 4 KiB on its first copy into a slot."""
    mapping = _mapping(shm).obj  # the mmap.mmap object the segment's buffer views
    assert isinstance(mapping, mmap.mmap)
    with contextlib.suppress(OSError, AttributeError, ValueError):  # older kernel: pages fault in on first use
        mapping.madvise(MADV_POPULATE_WRITE)


def _untrack(shm: shared_memory.SharedMemory) -> None:
    """Take ``shm`` off this process's resource tracker: it must not unlink the sidecar's slab at exit.

    The tracker knows the segment by the name ``shm_open`` got: on POSIX, SharedMemory puts a
    "/" before the name it reports as ``shm.name``."""
    with contextlib.suppress(Exception):  # the tracker is not running in this process: nothing to undo
        resource_tracker.unregister("/" + shm.name, "shared_memory")


def unlink_stale(segment: str) -> bool:
    """Remove a segment left behind by a sidecar that died (kill -9)."""
    try:
        shm = shared_memory.SharedMemory(name=segment, create=False)
    except FileNotFoundError:
        return False
    shm.close()
    shm.unlink()  # and off the resource tracker, which the attach put it on (no second unregister)
    return True
