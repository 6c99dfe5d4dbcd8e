"""SSD tier, file layout (``ssd.layout = "files"``; the default is the segment layout,
:mod:`kvstore.tiers.segments.tier`): one file per block in a directory, with a byte capacity.

File layout (the same with or without O_DIRECT)::

    [encode_header(meta)][zero pad to a 4 KiB boundary][payload: meta.size bytes]

Files live at ``<root>/<ns hex 16>/<key hex 64>.blk``. A write goes to a temp file
(``.<key>.<pid>.<n>.tmp``) that is renamed over the final name only once its bytes are durable,
so a half-written block is never visible; :meth:`SsdTier.scan` removes temp files left by a crash.

Durability is per batch, not per block (an fsync costs ~4 ms): :meth:`put_many` writes every temp
file, makes them durable together, renames them, then fsyncs each directory touched once.
With O_DIRECT (where the filesystem allows it; tmpfs does not, and we fall back to buffered
writes) the data bypasses the page cache and the directory fsync's journal commit carries the
metadata; with buffered writes every temp file is fdatasync'ed before the renames. With
``fsync=False`` (LMCache's LocalDisk behaves so) nothing is synced: a block still appears whole
or not at all to a restarted sidecar (the kernel keeps what a killed process wrote), but a power
loss can take the last batches.

A deleted block's file is kept for reuse (:mod:`kvstore.tiers.recycle`; up to ``recycle_bytes``,
by default the capacity, ``ssd.recycle_fraction``; free files give way to blocks): the next put
of a block with the same file size renames it to its temp name and overwrites it, so the
filesystem allocates no new extents (1.3-1.5x the rate of writing new files here).

Reads are buffered ``preadv`` straight into the caller's memoryview (the header page and the
payload in one call), a batch spread over the ``io_threads``. Eviction is not decided here (the
index does that): :attr:`used_bytes` / :attr:`capacity_bytes` are exposed, :meth:`SsdTier.footprint`
says exactly how many bytes of them a block's file takes (a long label makes its header longer
than a page), and a put that would exceed the capacity raises :class:`~kvstore.errors.ResourceExhausted`.

Files are 0600 and directories 0700 (:mod:`kvstore.tiers.private`); a start tightens what an
older version left readable by others.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import mmap
import os
import threading
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.checksum import checksum
from kvstore.config import SsdConfig
from kvstore.errors import ChecksumMismatch, ConfigError, InvalidArgument, ResourceExhausted
from kvstore.tiers.base import (
    HEADER_FIXED,
    BlockMeta,
    BlockRef,
    HashedRead,
    ThreadedTier,
    decode_header,
    encode_header,
    header_bytes,
    header_size,
)
from kvstore.tiers.file_io import (
    ALIGN,
    DEFAULT_DISK,
    O_DIRECT,
    DiskSettings,
    fsync_dir,
    probe_direct_io,
    read_all,
    staging,
    write_all,
)
from kvstore.tiers.private import DIR_MODE, FILE_MODE, private_dir, tighten
from kvstore.tiers.recycle import FREE_DIR, FreeFiles
from kvstore.tiers.segments.tier import LAYOUT_FILE, SegmentTier
from kvstore.util.threads import let_go

log = logging.getLogger(__name__)

SUFFIX = ".blk"
TMP_SUFFIX = ".tmp"


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def file_bytes(size: int, label: str, codec: int = 0) -> int:
    """Bytes of the file of a block of ``size`` bytes whose header carries ``label`` (and
    ``codec``): the header (as :func:`encode_header` writes it) padded to a page, then the payload."""
    return _align(header_bytes(label, codec)) + size


def _aligned(data: memoryview) -> bool:
    """Whether O_DIRECT can write ``data`` in place (page-aligned address and length)."""
    return len(data) % ALIGN == 0 and np.frombuffer(data, dtype=np.uint8).ctypes.data % ALIGN == 0


def _fit(fd: int, size: int, reused: bool) -> None:
    """A reused file ends where this block ends (a free file can be longer than its name says)."""
    if reused and os.fstat(fd).st_size != size:
        os.ftruncate(fd, size)


def _renamed(src: Path, dest: Path) -> bool:
    """Move a free file to a block's temp name; False if it is gone (then a new file is made)."""
    try:
        os.replace(src, dest)
        return True
    except FileNotFoundError:
        return False


def read_block_file(path: str | Path) -> tuple[BlockMeta, bytearray]:
    """A block file's header and payload; :class:`ChecksumMismatch` when it is not whole."""
    fd = os.open(path, os.O_RDONLY)
    try:
        meta, offset = SsdTier.read_header(fd)
        data = bytearray(meta.size)
        if read_all(fd, memoryview(data), offset) < meta.size:
            raise ChecksumMismatch(f"ssd file {path} is truncated")
        return meta, data
    finally:
        os.close(fd)


class SsdTier(ThreadedTier):
    """Blocks as files under ``path``, at most ``capacity_bytes`` of them (file bytes)."""

    name = "ssd"

    def __init__(
        self,
        path: str | Path,
        capacity_bytes: int,
        disk: DiskSettings = DEFAULT_DISK,
        *,
        recycle_bytes: int | None = None,
    ) -> None:
        """``recycle_bytes``: deleted block files kept for reuse (None: up to the capacity, as a
        preallocated cache file would hold it; 0: deleted files are unlinked)."""
        self.root = Path(path)
        private_dir(self.root, parents=True)
        if (self.root / LAYOUT_FILE).exists():
            raise ConfigError(
                f"ssd.path: {self.root} holds the segment layout (its LAYOUT file); set ssd.layout = "
                '"segments" to use it, or point ssd.path at another directory for the file layout'
            )
        for sub in self.root.iterdir():  # namespace directories (and .free) an older version made 0755
            if sub.is_dir():
                tighten(sub)
        self._prefix = os.path.join(os.fspath(self.root), "")  # file names as plain strings: reads build one per block
        self.capacity_bytes = capacity_bytes
        self.direct_io = disk.direct_io and probe_direct_io(self.root)
        self.fsync = disk.fsync
        # Guards _sizes, _used and every move of a file into or out of the free pool (worker
        # threads put and delete at once): bytes are counted once, as a block's or as the pool's.
        self._lock = threading.Lock()
        # Bytes of every block file, by path: the accounting does not depend on re-stat'ing files.
        self._sizes = {str(p): self._file_size(p) for p in self.root.glob(f"*/*{SUFFIX}")}
        self._used = sum(self._sizes.values())
        self._tmp_ids = itertools.count()
        self._free = FreeFiles(self.root, capacity_bytes if recycle_bytes is None else recycle_bytes)
        self._local = threading.local()  # per-thread aligned staging buffer for O_DIRECT
        # A batch's files are written by several threads at once: one synchronous O_DIRECT
        # write at a time leaves the device idle between requests (queue depth 1).
        self.io_threads = disk.io_threads
        self._io = ThreadPoolExecutor(disk.io_threads, thread_name_prefix="kvstore-ssd")

    @classmethod
    def from_config(cls, cfg: SsdConfig, data_dir: str | Path = "./kvstore-data") -> SsdTier | SegmentTier:
        """``cfg.path``, or ``<data_dir>/ssd`` when it is empty (as ``Config.ssd_path``); the
        tier of ``cfg.layout`` (``segments``: :class:`~kvstore.tiers.segments.tier.SegmentTier`)."""
        if cfg.layout == "segments":
            return SegmentTier.from_config(cfg, data_dir)
        return cls(
            cfg.path or Path(data_dir) / "ssd",
            cfg.capacity_bytes,
            DiskSettings.from_config(cfg),
            recycle_bytes=int(cfg.capacity_bytes * cfg.recycle_fraction),
        )

    @classmethod
    def from_app_config(cls, config: Any) -> SsdTier | SegmentTier:
        return cls.from_config(config.ssd, data_dir=config.data_dir)

    @property
    def used_bytes(self) -> int:
        return self._used

    @staticmethod
    def footprint(size: int, label: str) -> int:
        """Bytes of the capacity a block takes: its file's (:func:`file_bytes`)."""
        return file_bytes(size, label)

    # ---- paths and accounting ---------------------------------------------------------------

    def path_of(self, ref: BlockRef) -> Path:
        return Path(self._file(ref))

    def _file(self, ref: BlockRef) -> str:
        return self._prefix + ref.name + SUFFIX

    @staticmethod
    def _file_size(path: Path) -> int:
        """A block file's size, found at start (and its mode tightened if an older version made it)."""
        try:
            st = path.stat()
        except FileNotFoundError:
            return 0
        tighten(path, st.st_mode)
        return st.st_size

    @property
    def recycled_bytes(self) -> int:
        """Bytes of deleted block files kept for reuse (on disk, under the capacity)."""
        return self._free.bytes

    def _reserve(self, nbytes: int) -> Path | None:
        """Count a file of ``nbytes`` against the capacity; returns a free file of that size to
        overwrite, if there is one (its bytes were counted already, as the pool's). Else free
        files are unlinked to make room, under the lock: no other put counts on the same room."""
        with self._lock:
            src = self._free.take(nbytes)
            if src is None and self._used + self._free.bytes + nbytes > self.capacity_bytes:
                self._free.reclaim(self._used + self._free.bytes + nbytes - self.capacity_bytes)
                if self._used + self._free.bytes + nbytes > self.capacity_bytes:
                    raise ResourceExhausted(
                        f"ssd tier full: {self._used} bytes of blocks + {self._free.bytes} of free files"
                        f" + {nbytes} bytes > capacity {self.capacity_bytes}"
                    )
            self._used += nbytes
            return src

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self._used -= nbytes

    def _settle(self, path: Path, nbytes: int | None) -> None:
        """Record that ``path`` now holds ``nbytes`` (None: gone); give back what it held before."""
        with self._lock:
            old = self._sizes.pop(str(path), 0) if nbytes is None else self._sizes.get(str(path), 0)
            if nbytes is not None:
                self._sizes[str(path)] = nbytes
            self._used -= old

    # ---- Tier -----------------------------------------------------------------------------

    async def contains(self, ref: BlockRef) -> bool:
        return (await self.contains_many([ref]))[0]

    async def contains_many(self, refs: Sequence[BlockRef]) -> list[bool]:
        return await asyncio.to_thread(lambda: [self.path_of(r).exists() for r in refs])

    def read_one(self, ref: BlockRef, into: memoryview, hashed: bool) -> HashedRead:
        meta = self._read(ref, into)
        return meta, checksum(into[: meta.size]) if hashed and meta is not None else None

    async def close(self) -> None:
        self._io.shutdown(wait=True)  # no file handles are held between calls

    async def scan(self) -> AsyncIterator[BlockMeta]:
        """Every block's header; removes temp files a crash left behind, and files whose header
        is unreadable (their room goes back to the tier)."""
        for ns_dir in await asyncio.to_thread(
            lambda: sorted(p for p in self.root.iterdir() if p.is_dir() and p.name != FREE_DIR)
        ):
            metas = await asyncio.to_thread(self._scan_dir, ns_dir)
            for meta in metas:
                yield meta

    # ---- blocking work (runs in a worker thread) ----------------------------------------------

    def _read(self, ref: BlockRef, into: memoryview) -> BlockMeta | None:
        """The header page and the payload in one ``preadv`` (a header fits its page unless the
        label is long). Cost over a bare open + preadv + close of the payload, per 2 MiB block
        from the page cache: 7-9 us, against 14-16 us with the header read on its own."""
        try:
            fd = os.open(self._file(ref), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            head = self._head()
            n = os.preadv(fd, [head, into], 0)
            if n < HEADER_FIXED:
                raise ChecksumMismatch("ssd file shorter than a block header")
            hsize = header_size(head)
            if hsize <= ALIGN:
                if hsize > n:
                    raise ChecksumMismatch(f"ssd file for {ref.name} is truncated")
                meta, offset, got = decode_header(head), ALIGN, max(0, n - ALIGN)
            else:  # a long label: the payload starts further on, and what landed in ``into`` is not it
                (meta, offset), got = self.read_header(fd), 0
            if meta.ref != ref:
                raise ChecksumMismatch(f"ssd file for {ref.name} holds {meta.ref.name}")
            if meta.size > len(into):
                raise InvalidArgument(f"buffer of {len(into)} bytes for a block of {meta.size}")
            if got < meta.size:  # a short read, or the payload not read yet
                got += read_all(fd, into[got : meta.size], offset + got)
            if got < meta.size:
                raise ChecksumMismatch(f"ssd file for {ref.name} is truncated")
            return meta
        finally:
            os.close(fd)

    def _head(self) -> bytearray:
        head = getattr(self._local, "head", None)
        if head is None:
            head = self._local.head = bytearray(ALIGN)
        return head

    @staticmethod
    def read_header(fd: int) -> tuple[BlockMeta, int]:
        """The header of the block file open at ``fd``, and where its payload starts."""
        head = bytearray(ALIGN)
        n = read_all(fd, memoryview(head), 0)
        if n < HEADER_FIXED:
            raise ChecksumMismatch("ssd file shorter than a block header")
        hsize = header_size(head)
        if hsize > n:
            head = bytearray(hsize)
            read_all(fd, memoryview(head), 0)
        return decode_header(head), _align(hsize)

    def _header_page(self) -> mmap.mmap:
        page = getattr(self._local, "page", None)
        if page is None:
            page = self._local.page = mmap.mmap(-1, ALIGN)
        return page

    def _write_tmp(self, tmp: Path, header: bytes, data: memoryview, reused: bool) -> int:
        """Write one temp file (``reused``: a free file renamed to ``tmp``, overwritten in place);
        returns its fd (still open) for the batch's sync step."""
        offset = _align(len(header))
        total = offset + len(data)
        flags = os.O_WRONLY if reused else os.O_CREAT | os.O_WRONLY | os.O_TRUNC
        if self.direct_io and offset == ALIGN and _aligned(data):
            # Zero copy: a page-aligned source (a DRAM slab slot) goes to the device as it is.
            head = self._header_page()
            head[: len(header)] = header
            head[len(header) :] = bytes(ALIGN - len(header))
            fd = os.open(tmp, flags | O_DIRECT, FILE_MODE)
            try:
                n = os.writev(fd, [head, data])
                if n < ALIGN:  # short writes: finish piecewise
                    write_all(fd, memoryview(head)[n:])
                write_all(fd, data[max(0, n - ALIGN) :])
                _fit(fd, total, reused)
            except BaseException:
                os.close(fd)
                raise
            return fd
        if self.direct_io:
            buf = staging(self._local, total)
            buf[: len(header)] = header
            buf[len(header) : offset] = bytes(offset - len(header))
            buf[offset:total] = data
            buf[total : _align(total)] = bytes(_align(total) - total)
            fd = os.open(tmp, flags | O_DIRECT, FILE_MODE)
            try:
                write_all(fd, memoryview(buf)[: _align(total)])
                os.ftruncate(fd, total)
            except BaseException:
                os.close(fd)
                raise
            return fd
        fd = os.open(tmp, flags, FILE_MODE)
        try:
            write_all(fd, memoryview(header.ljust(offset, b"\0")))
            write_all(fd, data)
            _fit(fd, total, reused)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def write_batch(self, items: Sequence[tuple[BlockMeta, memoryview]]) -> None:
        staged: list[tuple[Path, Path, int]] = []  # (tmp, final, file bytes)
        jobs: list[tuple[Path, bytes, memoryview, bool]] = []
        fds: list[int] = []
        reserved = 0
        new_dirs = False
        try:
            for meta, data in items:
                if len(data) != meta.size:
                    raise InvalidArgument(f"block {meta.ref.name}: {len(data)} bytes, header says {meta.size}")
                header = encode_header(meta)
                nbytes = file_bytes(meta.size, meta.label, meta.codec)
                src = self._reserve(nbytes)
                reserved += nbytes
                final = self.path_of(meta.ref)
                if not final.parent.is_dir():
                    final.parent.mkdir(mode=DIR_MODE, exist_ok=True)
                    new_dirs = True
                tmp = final.with_name(f".{final.stem}.{os.getpid()}.{next(self._tmp_ids)}{TMP_SUFFIX}")
                staged.append((tmp, final, nbytes))
                jobs.append((tmp, header, data, src is not None and _renamed(src, tmp)))
            fds = self._write_tmps(jobs)
            if self.fsync and not self.direct_io:
                for fd in fds:
                    os.fdatasync(fd)
            for tmp, final, nbytes in staged:
                os.replace(tmp, final)
                self._settle(final, nbytes)  # an overwrite gives back the old file's bytes
                reserved -= nbytes
            if self.fsync:  # makes the renames (and, with O_DIRECT, the file sizes) durable
                for d in {final.parent for _, final, _ in staged} | ({self.root} if new_dirs else set()):
                    fsync_dir(d)
        finally:
            for fd in fds:
                os.close(fd)
            if reserved:
                self._release(reserved)
                for tmp, _, _ in staged:
                    tmp.unlink(missing_ok=True)

    def _write_tmps(self, jobs: Sequence[tuple[Path, bytes, memoryview, bool]]) -> list[int]:
        """Write every temp file (``io_threads`` at once); returns their open fds. If one fails,
        the others' fds are closed and the first error is raised."""
        futures = [self._io.submit(let_go(functools.partial(self._write_tmp, *job))) for job in jobs]
        errors = [f.exception() for f in futures]
        if any(errors):
            for f, e in zip(futures, errors):
                if e is None:
                    os.close(f.result())
            raise next(e for e in errors if e is not None)
        return [f.result() for f in futures]

    def remove_batch(self, refs: Sequence[BlockRef]) -> None:
        for r in refs:
            self._unlink(self.path_of(r))

    def _unlink(self, path: Path) -> None:
        """Delete a block's file: into the free pool while it has room (its bytes move from the
        blocks' count to the pool's in one step), else unlinked (and counted until it is gone)."""
        with self._lock:
            nbytes = self._sizes.pop(str(path), None)
            dest = None if nbytes is None else self._free.admit(nbytes)
            if nbytes is not None and dest is not None:
                self._used -= nbytes
        if nbytes is not None and dest is not None:
            self._free.move_in(path, dest, nbytes)
            return
        path.unlink(missing_ok=True)
        if nbytes is not None:
            self._release(nbytes)

    def _scan_dir(self, ns_dir: Path) -> list[BlockMeta]:
        metas: list[BlockMeta] = []
        unreadable: list[Path] = []
        for entry in os.scandir(ns_dir):
            if entry.name.endswith(TMP_SUFFIX):
                Path(entry.path).unlink(missing_ok=True)  # a crash mid-write: never visible
                continue
            if not entry.name.endswith(SUFFIX):
                continue
            try:
                fd = os.open(entry.path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                metas.append(self.read_header(fd)[0])
            except ChecksumMismatch as exc:  # a bad copy: never served, and its room given back
                log.warning("ssd: dropping %s at start: %s", entry.path, exc)
                unreadable.append(Path(entry.path))
            finally:
                os.close(fd)
        for path in unreadable:
            self._unlink(path)
        return metas
