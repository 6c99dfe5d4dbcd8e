"""The SSD's segment files: ``<root>/seg/<class bytes>/<n>.seg``, slots of one size class each.

A slot is written whole with O_DIRECT where the filesystem allows it (straight from a page-aligned
source such as a DRAM slab slot, else through a per-thread aligned buffer, zero-padded to the
slot), read with buffered ``preadv`` straight into the caller's buffer. The files stay open for the
tier's life (two descriptors each: the direct writer and the buffered reader).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from pathlib import Path

import numpy as np

from kvstore.tiers.file_io import O_DIRECT, pwrite_all, read_all, staging
from kvstore.tiers.private import DIR_MODE, FILE_MODE, private_dir
from kvstore.tiers.segments.slots import PAGE, Slots

SEG_DIR = "seg"

_PUNCH = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_fallocate = getattr(_libc, "fallocate", None)
if _fallocate is not None:
    _fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def _aligned(data: memoryview) -> bool:
    return len(data) % PAGE == 0 and np.frombuffer(data, dtype=np.uint8).ctypes.data % PAGE == 0


class SegmentFiles:
    """Open segment files, by (class, segment)."""

    def __init__(self, root: Path, slots: Slots, direct_io: bool) -> None:
        self.dir = root / SEG_DIR
        private_dir(self.dir)
        self.slots = slots
        self.direct_io = direct_io
        self._fds: dict[tuple[int, int], tuple[int, int]] = {}  # (writer, reader)
        self._lock = threading.Lock()
        self._local = threading.local()

    def path(self, cls: int, seg: int) -> Path:
        return self.dir / str(cls * PAGE) / f"{seg}.seg"

    def _open(self, cls: int, seg: int) -> tuple[int, int]:
        with self._lock:
            fds = self._fds.get((cls, seg))
            if fds is None:
                path = self.path(cls, seg)
                if not path.parent.is_dir():
                    path.parent.mkdir(mode=DIR_MODE, exist_ok=True)
                w = os.open(path, os.O_RDWR | os.O_CREAT | (O_DIRECT if self.direct_io else 0), FILE_MODE)
                fds = self._fds[(cls, seg)] = (w, os.open(path, os.O_RDONLY))
            return fds

    def write(self, cls: int, g: int, data: memoryview) -> tuple[int, int]:
        """Write a block's bytes into slot ``g`` of class ``cls``; the (class, segment) touched."""
        seg, offset = self.slots.place(cls, g)
        fd = self._open(cls, seg)[0]
        if not self.direct_io or _aligned(data):
            pwrite_all(fd, data, offset)
        else:
            nbytes = -(-len(data) // PAGE) * PAGE
            buf = staging(self._local, cls * PAGE)
            buf[: len(data)] = data
            buf[len(data) : nbytes] = bytes(nbytes - len(data))
            pwrite_all(fd, memoryview(buf)[:nbytes], offset)
        return cls, seg

    def read(self, cls: int, g: int, into: memoryview) -> int:
        """Read ``len(into)`` bytes of slot ``g``; the bytes read (short at a file's end)."""
        seg, offset = self.slots.place(cls, g)
        fds = self._fds.get((cls, seg))  # (entries are only added, under the lock: one open)
        return read_all((fds or self._open(cls, seg))[1], into, offset)

    def sync(self, touched: set[tuple[int, int]]) -> None:
        for cls, seg in touched:
            os.fdatasync(self._open(cls, seg)[0])

    def punch(self, cls: int, g: int) -> bool:
        """Give a free slot's disk back (its bytes read as zeros after)."""
        if _fallocate is None:
            return False
        seg, offset = self.slots.place(cls, g)
        return int(_fallocate(self._open(cls, seg)[0], _PUNCH, offset, cls * PAGE)) == 0

    def trim(self) -> None:
        """At start: cut every segment file to the slots its class has handed out (a crash can
        leave bytes past them; freed slots at the end give their disk back)."""
        for class_dir in (p for p in self.dir.iterdir() if p.is_dir() and p.name.isdigit()):
            cls = int(class_dir.name) // PAGE
            high = self.slots.high(cls)
            per = self.slots.per_segment(cls)
            for path in class_dir.glob("*.seg"):
                seg = int(path.stem)
                end = min(max(0, high - seg * per), per) * cls * PAGE
                if end == 0:
                    path.unlink()
                elif path.stat().st_size > end:
                    os.truncate(path, end)

    def close(self) -> None:
        with self._lock:
            for w, r in self._fds.values():
                os.close(w)
                os.close(r)
            self._fds.clear()
