"""A client's mapping of the sidecar's slab kept read-only: the guard that a sealed slot is written
by nobody but the sidecar.

Every client process maps the slab, and the sidecar's pods share the host's IPC namespace, so a
stray write of an engine process (a bad pointer, a wrong copy plan) could change a sealed slot
under a model that reads it later. A client's mapping is therefore ``PROT_READ`` from the moment
it is attached (:func:`kvstore.dram.slab.attach`); the only pages it makes writable are those of
the slots its own allocations were handed, while they are written (:meth:`ReadOnlyMapping.open`
at the Allocate's answer, :meth:`ReadOnlyMapping.close` before the Commit or Abort is sent, so
never a sealed slot's). A stray write into any other page faults (SIGSEGV) instead of changing a
block: the process dies, the block stays as the sidecar sealed it. A load may then skip the hash
(:mod:`connector.roles.guard`).

This holds only where every slot is whole OS pages (the slab's smallest slot a multiple of the
page size): otherwise a slot being written would share a page with a sealed one. A slab that is
not so, or whose sidecar runs in this process (its own writes go through the same mapping), is
left read-write: :func:`kvstore.dram.slab.read_only` says which, and loads from it keep hashing.

An ``mprotect`` that fails once the mapping is read-only (ENOMEM at ``vm.max_map_count``: each
writable run splits the mapping's VMA; a change can also stop partway through a range) may leave
pages writable that nothing tracks any more. The mapping is then marked not :attr:`intact
<ReadOnlyMapping.intact>` for good, so loads from its slab hash again
(:func:`connector.roles.guard.must_hash`), and the call raises :class:`ProtectionError`.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mprotect.restype = ctypes.c_int

Run = tuple[int, int]  # [start, end) offsets in the mapping, page-aligned


class ProtectionError(OSError):
    """An ``mprotect`` of a read-only mapping failed: some of its pages may be writable while no
    open run accounts for them, so loads from its slab hash from now on (:attr:`ReadOnlyMapping.intact`)."""


def mprotect(address: int, size: int, writable: bool) -> None:
    """Make ``[address, address + size)`` (page-aligned) readable, and writable or not."""
    if size <= 0:
        return
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    if _libc.mprotect(address, size, prot) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mprotect({address:#x}, {size}, {'rw' if writable else 'r'}): {os.strerror(err)}")


def pages_whole(page_bytes: int, min_slot_bytes: int) -> bool:
    """Whether every slot of a slab with these sizes is whole OS pages (and so can be made
    writable alone)."""
    return min_slot_bytes > 0 and min_slot_bytes % PAGE == 0 and page_bytes % PAGE == 0


def runs(ranges: Iterable[tuple[int, int]]) -> list[Run]:
    """``(offset, length)`` ranges as the page-aligned runs that cover them, adjacent ones merged
    (one mprotect each)."""
    out: list[Run] = []
    for off, n in sorted(ranges):
        if n <= 0:
            continue
        a, b = off - off % PAGE, -(-(off + n) // PAGE) * PAGE
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(b, out[-1][1]))
        else:
            out.append((a, b))
    return out


class ReadOnlyMapping:
    """One mapping of the slab, read-only but for the runs its allocations opened (counted: the
    same run opened twice stays writable until both closed it; a run closed is made read-only
    again except where another open run overlaps it)."""

    def __init__(self, base: int, size: int) -> None:
        self.base, self.size = base, size
        self._open: dict[Run, int] = {}
        self._lock = threading.Lock()
        # False once an mprotect failed: what is writable is no longer known (loads hash).
        self.intact = True
        mprotect(base, size, writable=False)

    def _mprotect(self, a: int, b: int, writable: bool) -> OSError | None:
        """mprotect run ``[a, b)``; its error, after which the mapping is not :attr:`intact`."""
        try:
            mprotect(self.base + a, b - a, writable)
            return None
        except OSError as exc:
            self.intact = False
            return exc

    def _failed(self, what: str, exc: OSError) -> ProtectionError:
        return ProtectionError(
            exc.errno,
            f"slab mapping at {self.base:#x}: {what} failed ({exc}); pages of it may be writable that no "
            f"allocation tracks, so loads from this slab hash from now on",
        )

    def open(self, ranges: Iterable[tuple[int, int]]) -> list[Run]:
        """Make the pages of ``ranges`` (``(offset, length)`` of slots) writable; the runs to
        :meth:`close` when they are written."""
        rs = runs(ranges)
        for a, b in rs:
            if a < 0 or b > self.size:
                raise ValueError(f"slot range [{a}, {b}) is not within the mapping ({self.size} bytes)")
        with self._lock:
            done: list[Run] = []
            for r in rs:
                if not self._open.get(r) and (exc := self._mprotect(*r, writable=True)) is not None:
                    self._close(done)  # (what this call opened: read-only again where it can be)
                    self._close([r])  # (a change can stop partway: this run's pages too)
                    raise self._failed("making an allocation's slots writable", exc)
                self._open[r] = self._open.get(r, 0) + 1
                done.append(r)
        return rs

    def close(self, rs: Iterable[Run]) -> None:
        """Make the runs :meth:`open` returned read-only again (but pages another open run holds)."""
        with self._lock:
            exc = self._close(rs)
        if exc is not None:
            raise self._failed("making an allocation's slots read-only again", exc)

    def _close(self, rs: Iterable[Run]) -> OSError | None:
        """:meth:`close` under the lock: every run of ``rs`` is done (the first error returned)."""
        first: OSError | None = None
        for r in rs:
            left = self._open.get(r, 0) - 1
            if left > 0:
                self._open[r] = left
                continue
            self._open.pop(r, None)
            for a, b in self._uncovered(r):
                exc = self._mprotect(a, b, writable=False)
                first = first or exc
        return first

    def _uncovered(self, r: Run) -> Iterator[Run]:
        """The parts of ``r`` no open run covers."""
        a, end = r
        for oa, ob in sorted(o for o in self._open if o[0] < end and o[1] > a):
            if oa > a:
                yield a, oa
            a = max(a, ob)
        if a < end:
            yield a, end

    @property
    def writable_runs(self) -> list[Run]:
        with self._lock:
            return sorted(self._open)

    @contextmanager
    def unprotected(self) -> Iterator[None]:
        """The whole mapping writable for the time of the block, then read-only again but for the
        open runs: for what must see it writable once (pinning it for a device's DMA)."""
        with self._lock:
            if (exc := self._mprotect(0, self.size, writable=True)) is not None:
                raise self._failed("making the whole mapping writable", exc)
            try:
                yield
            finally:
                exc = self._mprotect(0, self.size, writable=False)
                for a, b in self._open:  # (each one, whatever failed before: its writer writes on)
                    again = self._mprotect(a, b, writable=True)
                    exc = exc or again
                if exc is not None:
                    raise self._failed("making the mapping read-only again", exc)


def protection(address: int) -> str:
    """The permissions (``"r--s"``, ``"rw-s"``, ...) of the mapping at ``address`` in this process,
    from ``/proc/self/maps``: what tests and a start-up check read."""
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                return perms
    raise LookupError(f"no mapping at {address:#x}")
