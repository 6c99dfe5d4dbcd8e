"""SSD tier, segment layout (``ssd.layout = "segments"``): many blocks a file, one log of records.

On disk, under the tier's directory::

    LAYOUT               "segments 1": which layout this directory holds
    index.log            append-only 128-byte records, in crc-checked frames (kvstore.tiers.segments.log)
    namespaces.log       namespace id -> root, label, tenant
    seg/<bytes>/<n>.seg  segment files of one slot size class each (kvstore.tiers.segments.files)

No header page: a 16 KiB block takes 16 KiB of a segment plus its 128-byte record (0.8 %).

**A put batch** (the durability rules of the file layout): slots taken (:mod:`kvstore.tiers.segments.slots`);
the payloads written into them, ``io_threads`` at once, with O_DIRECT where the filesystem allows
it; ``fsync``: each segment touched ``fdatasync``'ed; then the batch's records appended to the log
as one frame and the log ``fdatasync``'ed -- the commit point. Only then does the tier answer for
the blocks. A crash before the commit leaves slots no record names (free at the next start, the
blocks never seen); a torn frame fails its crc and ends the log. ``fsync = false``: nothing is
synced; a killed sidecar loses nothing the kernel has, a power loss the last batches.

**A delete** appends a tombstone and frees the slot; the slot is handed out again only once the
tombstone is durable (the next log sync), so a crash never revives a record naming a slot that
holds other bytes. A put of a key the tier holds writes a new slot and frees the old one at commit.

**Reads** hash the bytes read (xxh3-64) in the reading thread: the tiering layer compares that with
the checksum it recorded at commit (the same one the record holds), as for every tier, so a torn or
stale slot is never handed out (:mod:`kvstore.tiers.verify`, :mod:`kvstore.movers.promotion`).

**Restart** (the constructor): ``namespaces.log`` and ``index.log`` read sequentially and decoded
with numpy; the last record of each block decides; the free slots are the complement of the live
ones; segment files are cut to the slots in use. :meth:`SegmentTier.scan` then lists the live
blocks for the sidecar's index (after importing a directory of the file layout:
:mod:`kvstore.tiers.segments.migrate`).

**Checkpoint**: when the log holds more than twice the live records (and at least
``checkpoint_min``), the live records are rewritten as a new log, synced and renamed over it.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import threading
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.checksum import checksum
from kvstore.config import SsdConfig
from kvstore.errors import ChecksumMismatch, ConfigError, InvalidArgument
from kvstore.tiers.base import BlockMeta, BlockRef, HashedRead, Row, ThreadedTier
from kvstore.tiers.file_io import DEFAULT_DISK, DiskSettings, fsync_dir, probe_direct_io, write_all
from kvstore.tiers.private import FILE_MODE, private_dir, tighten
from kvstore.tiers.segments.files import SegmentFiles
from kvstore.tiers.segments.log import DEL, HAS_PARENT, PUT, RECORD, IndexLog, Namespaces
from kvstore.tiers.segments.rows import Rows
from kvstore.tiers.segments.slots import PAGE, Slots, pages
from kvstore.util.threads import in_threads, let_go, split

log = logging.getLogger(__name__)

LAYOUT_FILE = "LAYOUT"
LAYOUT = "segments 1\n"
CHECKPOINT_MIN = 1 << 20  # records in the log before a checkpoint is worth it


def is_segment_dir(root: Path) -> bool:
    return (root / LAYOUT_FILE).exists()


def _has_files(root: Path) -> bool:
    """Whether ``root`` holds blocks of the file layout to import (its namespace directories or free pool)."""
    from kvstore.tiers.segments.migrate import has_files

    return has_files(root)


class SegmentTier(ThreadedTier):
    """Blocks in segment files under ``path``, at most ``capacity_bytes`` of slots."""

    name = "ssd"

    def __init__(
        self,
        path: str | Path,
        capacity_bytes: int,
        disk: DiskSettings = DEFAULT_DISK,
        *,
        checkpoint_min: int = CHECKPOINT_MIN,
    ) -> None:
        self.root = Path(path)
        private_dir(self.root, parents=True)
        marker = self.root / LAYOUT_FILE
        if marker.exists() and marker.read_text() != LAYOUT:
            found = marker.read_text().strip()
            raise ConfigError(f"ssd.path: {self.root} holds layout {found!r}, not {LAYOUT.strip()!r}")
        if not marker.exists():
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)  # 0600, as every file here
            try:
                write_all(fd, LAYOUT.encode())
            finally:
                os.close(fd)
            fsync_dir(self.root)
        tighten(marker)  # (one an earlier version wrote 0644)
        self.capacity_bytes = capacity_bytes
        self.direct_io = disk.direct_io and probe_direct_io(self.root)
        self.fsync = disk.fsync
        self.checkpoint_min = checkpoint_min
        self.io_threads = disk.io_threads
        self._io = ThreadPoolExecutor(disk.io_threads, thread_name_prefix="kvstore-ssd")
        self._lock = threading.Lock()  # the rows and the map
        self._commit = threading.Lock()  # log appends, in order, and what they make true
        self._log = IndexLog(self.root, disk.fsync)
        self._ns = Namespaces(self.root, disk.fsync)
        self.slots = Slots(capacity_bytes, self._punch, self._log_sync)
        self._files = SegmentFiles(self.root, self.slots, self.direct_io)
        self._rows = Rows()
        self._seq = itertools.count(self._load())
        # Keys deleted since the start, while a file-layout directory waits to be imported (None:
        # nothing to import): an imported file never brings one back (:meth:`import_blocks`).
        # While any such file may be left (``_legacy``), a delete also unlinks the key's file, so
        # that a later start's import does not bring it back either.
        self._legacy = _has_files(self.root)
        self._deleted: set[tuple[bytes, bytes]] | None = set() if self._legacy else None
        self.checkpoints = 0
        self.closed = False

    @classmethod
    def from_config(cls, cfg: SsdConfig, data_dir: str | Path = "./kvstore-data") -> SegmentTier:
        return cls(
            cfg.path or Path(data_dir) / "ssd",
            cfg.capacity_bytes,
            DiskSettings.from_config(cfg),
            checkpoint_min=cfg.checkpoint_records,
        )

    @classmethod
    def from_app_config(cls, config: Any) -> SegmentTier:
        return cls.from_config(config.ssd, data_dir=config.data_dir)

    # ---- restart -----------------------------------------------------------------------------

    def _load(self) -> int:
        """The index rebuilt from the logs; the next sequence number."""
        self._ns.load()
        records = self._log.load()
        roots = [e[0] for e in self._ns.entries]
        live = self._rows.restore(records, roots)
        self.slots.restore(live)
        self._files.trim()
        return int(records["seq"].max()) + 1 if len(records) else 0

    # ---- accounting ----------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return self.slots.used

    @property
    def recycled_bytes(self) -> int:
        """Bytes of free slots on disk (deleted blocks' room, overwritten by the next puts)."""
        return self.slots.free_bytes

    @staticmethod
    def footprint(size: int, label: str) -> int:
        """Bytes of the capacity a block takes: its slot (no header; the label is in the log)."""
        return pages(size) * PAGE

    def __len__(self) -> int:
        return len(self._rows)

    def index_bytes(self) -> int:
        """Bytes of this tier's in-memory index (its record array and key dict)."""
        with self._lock:
            return self._rows.nbytes()

    @property
    def log_records(self) -> int:
        return self._log.records

    def locate(self, ref: BlockRef) -> tuple[Path, int, int] | None:
        """Where a block's bytes lie: (segment file, offset, size); None if the tier lacks it."""
        with self._lock:
            rec = self._rows.get(ref.ns, ref.key)
        if rec is None:
            return None
        seg, offset = self.slots.place(int(rec["cls"]), int(rec["slot"]))
        return self._files.path(int(rec["cls"]), seg), offset, int(rec["size"])

    # ---- Tier ----------------------------------------------------------------------------------

    async def contains(self, ref: BlockRef) -> bool:
        return (await self.contains_many([ref]))[0]

    async def contains_many(self, refs: Sequence[BlockRef]) -> list[bool]:
        with self._lock:
            has = self._rows.has
            return [has(r.ns, r.key) for r in refs]

    async def close(self) -> None:
        self.closed = True
        self._io.shutdown(wait=True)
        with self._commit:
            self._log.close()
            self._ns.close()
            self._files.close()

    async def scan(self) -> AsyncIterator[BlockMeta]:
        """Every block the log names (after importing a file-layout directory's blocks)."""
        async for rows in self.scan_rows():
            for root, key, parent, size, csum, label, tenant, codec in rows:
                yield BlockMeta(BlockRef(root, key), parent, size, csum, label, tenant, codec)

    async def scan_rows(self) -> AsyncIterator[list[Row]]:
        """:meth:`scan`'s blocks as rows, 4,096 a batch (the recovery's input: no object per block
        but its tuple and its key's bytes)."""
        from kvstore.tiers.segments.migrate import import_files

        await import_files(self)
        with self._lock:
            records, keys = self._rows.live_keys()
        for a in range(0, len(records), 4096):
            yield self._row_batch(records[a : a + 4096], keys[a : a + 4096])

    # ---- blocking work (worker threads) -----------------------------------------------------

    def _row_batch(self, records: np.ndarray, keys: list[bytes]) -> list[Row]:
        """``records`` as rows, column by column (numpy's ``tolist``; the 32-byte parents as
        ``bytes`` whole, a void field's ``tolist`` keeps trailing zeros), ``keys`` their key objects
        (the index's: one object each, issue 41)."""
        entries, n = self._ns.entries, len(records)
        ns = records["ns"]
        if n and (ns == ns[0]).all():  # (one namespace: the usual batch)
            root, label, tenant = entries[int(ns[0])]
            roots, labels, tenants = itertools.repeat(root, n), itertools.repeat(label, n), itertools.repeat(tenant, n)
        else:
            info = [entries[i] for i in ns.tolist()]
            roots, labels, tenants = ([e[j] for e in info] for j in range(3))  # type: ignore[assignment]
        parents = records["parent"].tolist()
        for i in np.flatnonzero((records["flags"] & HAS_PARENT) == 0).tolist():  # (a prompt's first block)
            parents[i] = b""
        columns = (records[f].tolist() for f in ("size", "checksum", "codec"))
        sizes, csums, codecs = columns
        return list(zip(roots, keys, parents, sizes, csums, labels, tenants, codecs))

    async def _read_many(
        self, refs: Sequence[BlockRef], into: Sequence[memoryview], hashed: bool
    ) -> list[HashedRead]:
        """As :class:`ThreadedTier`'s (the batch split over the ``io_threads``), each thread's share
        read by :meth:`_read_chunk`: two lock round trips a share, not two a block."""
        calls = [
            functools.partial(self._read_chunk, refs[a:b], into[a:b], hashed)
            for a, b in split(len(refs), self.io_threads)
        ]
        parts = await in_threads(self._io, calls)
        return [got for part in parts for got in part]

    def read_one(self, ref: BlockRef, into: memoryview, hashed: bool) -> HashedRead:
        return self._read_chunk([ref], [into], hashed)[0]

    def _read_chunk(self, refs: Sequence[BlockRef], into: Sequence[memoryview], hashed: bool) -> list[HashedRead]:
        """Blocks read into ``into``: their rows found under one lock (tuples read from the row
        array: no record, no new ``BlockRef``; a meta names the caller's ``ref``, equal to the
        record's), their slots read and hashed, then their sequence numbers checked again under one
        more (deleted or overwritten meanwhile: a miss, the slot may have held other bytes)."""
        find, seq_of, entries, read = self._rows.find, self._rows.seq, self._ns.entries, self._files.read
        with self._lock:
            rows = [find(r.ns, r.key) for r in refs]
        got: list[HashedRead] = []
        for ref, row, buf in zip(refs, rows, into):
            if row is None:
                got.append((None, None))
                continue
            _, flags, cls, ns, _, parent, size, csum, _, slot, codec = row
            if size > len(buf):
                raise InvalidArgument(f"buffer of {len(buf)} bytes for a block of {size}")
            view = buf[:size]
            if read(cls, slot, view) < size:
                raise ChecksumMismatch(f"ssd slot of {ref.name} is cut short")
            _, label, tenant = entries[ns]
            meta = BlockMeta(ref, parent if flags & HAS_PARENT else b"", size, csum, label, tenant, codec)
            got.append((meta, checksum(view) if hashed else None))
        with self._lock:
            now = [seq_of(r.ns, r.key) if row is not None else None for r, row in zip(refs, rows)]
        return [
            g if row is None or seq == row[4] else (None, None)  # (row[4]: the seq the read began with)
            for g, row, seq in zip(got, rows, now)
        ]

    def _punch(self, cls: int, g: int) -> bool:
        return self._files.punch(cls, g)

    def _log_sync(self) -> None:
        with self._commit:  # (a checkpoint may be swapping the log's file)
            self._log.sync()

    def write_batch(self, items: Sequence[tuple[BlockMeta, memoryview]]) -> None:
        """Write, make durable, log (the commit point), then answer for the blocks."""
        self._write(items, older=False)

    def import_blocks(self, items: Sequence[tuple[BlockMeta, memoryview]]) -> int:
        """The import's put (:mod:`kvstore.tiers.segments.migrate`): as :meth:`write_batch`, but
        a block whose key the tier holds, or has had deleted since it started, is left out, checked
        again at the commit: a put or a delete since the start wins over the older file (a key
        held at the start was imported already by a start that crashed before unlinking its file,
        or put after). How many blocks were written."""
        return self._write(items, older=True)

    def imported(self, complete: bool = True) -> None:
        """The import is over: the deletes since the start need no remembering any more. Not
        ``complete`` (it failed): files may be left for the next start, so deletes still unlink them."""
        with self._lock:
            self._deleted = None
            self._legacy = not complete

    def _superseded(self, ref: BlockRef) -> bool:
        """Whether an imported block of ``ref`` would replace a put or undo a delete (``_lock`` held)."""
        gone = self._deleted
        return self._rows.has(ref.ns, ref.key) or (gone is not None and (ref.ns, ref.key) in gone)

    def _write(self, items: Sequence[tuple[BlockMeta, memoryview]], older: bool) -> int:
        """Write, make durable, log, answer (``older``: none that would supersede a put or a
        delete, :meth:`import_blocks`); how many were written."""
        if older:
            with self._lock:
                items = [it for it in items if not self._superseded(it[0].ref)]
            if not items:
                return 0
        for meta, data in items:  # the whole batch checked before anything changes
            if len(data) != meta.size:
                raise InvalidArgument(f"block {meta.ref.name}: {len(data)} bytes, header says {meta.size}")
        taken: list[tuple[int, int]] = []
        try:
            for meta, _ in items:
                cls = pages(meta.size)
                taken.append((cls, self.slots.take(cls)))
            records = self._records(items, taken)
            touched = self._write_slots(items, taken)
            if self.fsync:
                self._files.sync(touched)
            with self._commit:
                if older:  # (a put or a delete may have committed while these were written)
                    with self._lock:
                        keep = [not self._superseded(m.ref) for m, _ in items]
                    if not all(keep):
                        for (cls, g), k in zip(taken, keep):
                            if not k:
                                self.slots.untake(cls, g)  # (written, but no record names it)
                        taken = [t for t, k in zip(taken, keep) if k]
                        items = [it for it, k in zip(items, keep) if k]
                        records = records[np.array(keep, dtype=bool)]
                        if not items:
                            return 0
                self._ns.sync()
                records["seq"] = [next(self._seq) for _ in items]
                self._log.append(records, sync=True)
                taken = []  # committed: the slots are the blocks' now
                with self._lock:
                    old = self._rows.put(records, [(m.ref.ns, m.ref.key) for m, _ in items])
                self.slots.free(old, durable=True)  # the new records are durable: the old slots are free
                self.slots.settle()
                self._checkpoint()
        finally:
            for cls, g in taken:
                self.slots.untake(cls, g)
        return len(items)

    def _records(self, items: Sequence[tuple[BlockMeta, memoryview]], taken: list[tuple[int, int]]) -> np.ndarray:
        """The batch's put records (all but their sequence numbers), column by column."""
        metas = [m for m, _ in items]
        records = np.zeros(len(items), RECORD)
        with self._lock:
            records["ns"] = [self._ns.id_of(m.ref.ns, m.label, m.tenant) for m in metas]
        records["op"] = PUT
        records["flags"] = [HAS_PARENT if m.parent else 0 for m in metas]
        records["cls"] = [cls for cls, _ in taken]
        records["slot"] = [g for _, g in taken]
        records["seg"] = [self.slots.place(cls, g)[0] for cls, g in taken]
        records["key"] = np.frombuffer(b"".join(m.ref.key for m in metas), "V32")
        records["parent"] = np.frombuffer(b"".join(m.parent.ljust(32, b"\0") for m in metas), "V32")
        records["size"] = [m.size for m in metas]
        records["checksum"] = [m.checksum for m in metas]
        records["codec"] = [m.codec for m in metas]
        return records

    def _write_slots(
        self, items: Sequence[tuple[BlockMeta, memoryview]], taken: list[tuple[int, int]]
    ) -> set[tuple[int, int]]:
        """Every payload into its slot, the batch split over the ``io_threads``; the segments touched."""

        def write(a: int, b: int) -> set[tuple[int, int]]:
            return {self._files.write(cls, g, data) for (cls, g), (_, data) in zip(taken[a:b], items[a:b])}

        parts = split(len(items), self.io_threads)  # (each worker lets go of its part as it starts)
        futures = [self._io.submit(let_go(functools.partial(write, a, b))) for a, b in parts]
        errors = [f.exception() for f in futures]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return set().union(*(f.result() for f in futures))

    def remove_batch(self, refs: Sequence[BlockRef]) -> None:
        """Tombstones for the blocks the tier holds; their slots free once those are durable."""
        with self._commit:
            with self._lock:
                gone = self._rows.pop([(r.ns, r.key) for r in refs])
                if self._deleted is not None:  # (also those not imported yet: their files stay out)
                    self._deleted.update((r.ns, r.key) for r in refs)
            if self._legacy:  # (a key the import has not reached yet: its file goes for good)
                from kvstore.tiers.segments.migrate import unlink_files

                unlink_files(self.root, refs, self.fsync)
            if not len(gone):
                return
            gone["op"] = DEL
            gone["seq"] = [next(self._seq) for _ in range(len(gone))]
            self._log.append(gone, sync=False)  # durable with the next sync
            self.slots.free(zip(gone["cls"].tolist(), gone["slot"].tolist()), durable=not self.fsync)
            self._checkpoint()

    def _checkpoint(self) -> None:
        """The log rewritten from the live records when it holds twice as many (the caller holds
        ``_commit``: no append meanwhile)."""
        if self._log.records < max(self.checkpoint_min, 2 * len(self._rows)):
            return
        with self._lock:
            live = self._rows.live()
        self._log.rewrite(live)
        self.slots.settle()  # no record names a freed slot any more
        self.checkpoints += 1

    def sync_all(self) -> None:
        """Flush the log's tombstones (the tier's state is durable once this returns)."""
        with self._commit:
            self._log.sync()
            self.slots.settle()

    def disk_bytes(self) -> int:
        """Bytes the directory's files take on disk (allocated blocks)."""
        return sum(p.stat().st_blocks * 512 for p in self.root.rglob("*") if p.is_file())
