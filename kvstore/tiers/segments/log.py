"""The segment layout's index log: what the SSD holds, as append-only fixed records.

One file, ``<root>/index.log``: *frames*, each a 128-byte frame header (magic, record count,
crc32 of the records) followed by that many 128-byte records (:data:`RECORD`): a ``put`` names a
block (namespace id, key, parent, size, checksum, codec) and where its bytes lie (size class, segment,
slot); a ``del`` (tombstone) names a block that is gone. A restart reads the file sequentially and
decodes it with numpy (:func:`read_log`); the last record of a block decides. A frame whose crc
does not match (a torn append: the process died inside a ``write``) ends the log, and the file is
cut there.

Namespaces (root, label, tenant) are few and their labels long: they live in
``<root>/namespaces.log``, one length-prefixed, crc-checked entry each (:class:`Namespaces`),
appended (and synced) before the first record that names them.

A checkpoint (:meth:`IndexLog.rewrite`) writes the live records to ``index.log.new``, syncs it and
renames it over the log (then syncs the directory): a crash leaves one complete log or the other.
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

import numpy as np

from kvstore.keys import NamespaceRoot
from kvstore.tiers.file_io import fsync_dir, write_all
from kvstore.tiers.private import FILE_MODE

PUT, DEL = 1, 2
HAS_PARENT = 1  # flags: the parent field is a key (else the block starts its prefix)
RECORD = np.dtype(
    [
        ("op", "u1"),
        ("flags", "u1"),
        ("cls", "<u2"),  # the slot's size class, in 4 KiB pages
        ("ns", "<u4"),  # the namespace's id in namespaces.log
        ("seq", "<u8"),
        ("key", "V32"),
        ("parent", "V32"),
        ("size", "<u8"),
        ("checksum", "<u8"),
        ("seg", "<u4"),
        ("slot", "<u4"),
        ("codec", "u1"),  # the codec the slot's bytes went through (kvstore.tiers.codec; 0: identity)
        ("reserved", "V23"),  # (zeros: a log written before the codec field reads as identity)
    ]
)
assert RECORD.itemsize == 128
_FRAME = struct.Struct("<4sHHIIQ104x")  # magic, version, 0, count, crc32 of the records, first seq
assert _FRAME.size == RECORD.itemsize
MAGIC = b"KVSL"
VERSION = 1
FRAME_MAX = 65536  # records a checkpoint puts in one frame
LOG_NAME = "index.log"
NS_NAME = "namespaces.log"
_NS_HEAD = struct.Struct("<II")  # length of the rest, crc32 of the rest
_NS_FIXED = struct.Struct("<I32s16s")  # id, root, tenant tag (NUL-padded)


def frame(records: np.ndarray) -> bytes:
    """``records`` as one frame: its header, then the records."""
    body = records.tobytes()
    first = int(records["seq"][0]) if len(records) else 0
    return _FRAME.pack(MAGIC, VERSION, 0, len(records), zlib.crc32(body), first) + body


def read_log(path: Path) -> tuple[np.ndarray, int]:
    """Every record of the complete frames at the start of ``path``, in order, and the byte
    length of those frames (where a torn tail begins)."""
    try:
        raw = np.fromfile(path, dtype=np.uint8)
    except FileNotFoundError:
        return np.zeros(0, RECORD), 0
    buf = memoryview(raw.data)
    parts, at, size = [], 0, RECORD.itemsize
    while at + size <= len(raw):
        magic, version, _, count, crc, _ = _FRAME.unpack_from(buf, at)
        end = at + size + count * size
        if magic != MAGIC or version != VERSION or end > len(raw) or zlib.crc32(buf[at + size : end]) != crc:
            break
        parts.append(raw[at + size : end])
        at = end
    if not parts:
        return np.zeros(0, RECORD), at
    return np.concatenate(parts).view(RECORD), at


class IndexLog:
    """The append side of ``index.log`` (one writer at a time: the caller holds its lock)."""

    def __init__(self, root: Path, fsync: bool) -> None:
        self.root = root
        self.path = root / LOG_NAME
        self.fsync = fsync
        self.records = 0  # records in the file
        self._fd = -1

    def load(self) -> np.ndarray:
        """Every record in the log; a torn tail (and a checkpoint's leftover) is removed."""
        (self.root / (LOG_NAME + ".new")).unlink(missing_ok=True)
        records, good = read_log(self.path)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, FILE_MODE)
        if os.fstat(self._fd).st_size != good:
            os.ftruncate(self._fd, good)
            os.fsync(self._fd)
        self.records = len(records)
        return records

    def append(self, records: np.ndarray, sync: bool) -> None:
        """One frame of ``records``; durable when ``sync`` (and the log syncs). A failed write
        is cut off again, so that the frames after it are not lost behind a torn one."""
        end = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            write_all(self._fd, frame(records))
            if sync and self.fsync:
                os.fdatasync(self._fd)
        except BaseException:
            os.ftruncate(self._fd, end)
            raise
        self.records += len(records)

    def sync(self) -> None:
        if self.fsync:
            os.fdatasync(self._fd)

    def rewrite(self, records: np.ndarray) -> None:
        """The checkpoint: the log replaced by ``records`` alone, atomically."""
        new = self.root / (LOG_NAME + ".new")
        fd = os.open(new, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
        try:
            for a in range(0, len(records), FRAME_MAX):
                write_all(fd, frame(records[a : a + FRAME_MAX]))
            os.fsync(fd)  # always: the rename must never name a file whose bytes are not there
        finally:
            os.close(fd)
        os.replace(new, self.path)
        fsync_dir(self.root)
        os.close(self._fd)
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND)
        self.records = len(records)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class Namespaces:
    """``namespaces.log``: id -> (root, label, tenant), and the id of each triple."""

    def __init__(self, root: Path, fsync: bool) -> None:
        self.path = root / NS_NAME
        self.fsync = fsync
        self.entries: list[tuple[NamespaceRoot, str, str]] = []
        self.ids: dict[tuple[bytes, str, str], int] = {}
        self._fd = -1
        self._dirty = False

    def load(self) -> None:
        raw = self.path.read_bytes() if self.path.exists() else b""
        at = 0
        while at + _NS_HEAD.size <= len(raw):
            n, crc = _NS_HEAD.unpack_from(raw, at)
            rest = raw[at + _NS_HEAD.size : at + _NS_HEAD.size + n]
            if len(rest) != n or n < _NS_FIXED.size or zlib.crc32(rest) != crc:
                break
            ident, ns_root, tenant = _NS_FIXED.unpack_from(rest)
            if ident != len(self.entries):
                break
            self._add(ns_root, rest[_NS_FIXED.size :].decode(errors="replace"), tenant.rstrip(b"\0").decode())
            at += _NS_HEAD.size + n
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, FILE_MODE)
        if os.fstat(self._fd).st_size != at:
            os.ftruncate(self._fd, at)

    def _add(self, ns_root: bytes, label: str, tenant: str) -> int:
        ident = len(self.entries)
        self.entries.append((NamespaceRoot(ns_root), label, tenant))
        self.ids[(ns_root, label, tenant)] = ident
        return ident

    def id_of(self, ns_root: bytes, label: str, tenant: str) -> int:
        """The id of this namespace, appended now if it is new (durable at :meth:`sync`)."""
        ident = self.ids.get((ns_root, label, tenant))
        if ident is not None:
            return ident
        ident = self._add(ns_root, label, tenant)
        rest = _NS_FIXED.pack(ident, ns_root, tenant.encode()) + label.encode()
        write_all(self._fd, _NS_HEAD.pack(len(rest), zlib.crc32(rest)) + rest)
        self._dirty = True
        return ident

    def sync(self) -> None:
        """Make the new entries durable (before the records that name them)."""
        if self._dirty and self.fsync:
            os.fdatasync(self._fd)
        self._dirty = False

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
