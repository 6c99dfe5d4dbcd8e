"""Importing a directory of the file layout (one ``<ns>/<key>.blk`` a block) into segments.

A segment tier started on a directory that still holds block files (``ssd.layout`` switched from
``files`` to ``segments``) copies them in before its first scan: batches of files are read (their
header pages, as the file layout's scan; a file that is not whole is dropped), written into
segments and logged as any put, and each file is unlinked only once the batch that copied it is
durable. A crash mid-import leaves every block in one layout or both; the next start imports what
is left (a block in both is not put again: the segment copy is the file's, or a later put's).
Temp files and the file layout's free pool (``.free``) are removed; blocks beyond the capacity are
dropped, counted in the log line.

**The put wins** (as everywhere while a restart loads, :mod:`kvstore.movers.recovery`): under
``kvstore serve`` the import runs in the background recovery, so a block may be demoted to the tier,
or deleted from it, before the import reaches that key's older file. An imported block never
replaces a key the tier holds, nor one deleted since the tier started
(:meth:`~kvstore.tiers.segments.tier.SegmentTier.import_blocks`, checked at its commit); such a
file is unlinked unread into the segments, counted as ``superseded`` in the log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kvstore.errors import ChecksumMismatch, ResourceExhausted
from kvstore.tiers.base import BlockMeta, BlockRef
from kvstore.tiers.file_io import fsync_dir
from kvstore.tiers.recycle import FREE_DIR

log = logging.getLogger(__name__)

BATCH = 64
_NS_DIR = re.compile(r"[0-9a-f]{16}")


class SegmentTier(Protocol):
    """What the import needs of :class:`kvstore.tiers.segments.tier.SegmentTier` (not imported: it
    imports this module)."""

    @property
    def root(self) -> Path: ...

    def import_blocks(self, items: Sequence[tuple[BlockMeta, memoryview]]) -> int: ...

    def imported(self, complete: bool = True) -> None: ...


@dataclass(slots=True)
class Imported:
    blocks: int = 0
    dropped: int = 0
    superseded: int = 0  # files of keys put or deleted since the start: not imported


def legacy_dirs(root: Path) -> list[Path]:
    """The file layout's namespace directories under ``root``."""
    return sorted(p for p in root.iterdir() if p.is_dir() and _NS_DIR.fullmatch(p.name))


def has_files(root: Path) -> bool:
    """Whether :func:`import_files` has anything to do under ``root``."""
    return bool(legacy_dirs(root)) or (root / FREE_DIR).exists()


def _files(dirs: list[Path]) -> list[Path]:
    out = []
    for d in dirs:
        for entry in os.scandir(d):
            if entry.name.endswith(".tmp"):
                os.unlink(entry.path)  # a crash mid-write of the file layout: never visible
            elif entry.name.endswith(".blk"):
                out.append(Path(entry.path))
    return out


def _read(paths: list[Path], into: Imported) -> list[tuple[BlockMeta, memoryview]]:
    from kvstore.tiers.ssd import read_block_file

    items = []
    for path in paths:
        try:
            meta, data = read_block_file(path)
        except FileNotFoundError:  # unlinked by a delete since the start (SegmentTier.remove_batch)
            into.superseded += 1
            continue
        except ChecksumMismatch as exc:
            log.warning("ssd import: dropping %s: %s", path, exc)
            into.dropped += 1
            continue
        items.append((meta, memoryview(data)))
    return items


def unlink_files(root: Path, refs: Sequence[BlockRef], fsync: bool) -> None:
    """The file-layout files of ``refs`` under ``root``, where any are left, unlinked and their
    directories synced (``fsync``): a delete while the import is pending or failed stays a delete
    after a restart (:meth:`SegmentTier.remove_batch`)."""
    from kvstore.tiers.ssd import SUFFIX

    dirs = set()
    for r in refs:
        path = root / (r.name + SUFFIX)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            dirs.add(path.parent)
    if fsync:
        for d in dirs:
            fsync_dir(d)


def import_batch(tier: SegmentTier, paths: list[Path], into: Imported) -> None:
    """Copy one batch of block files into segments (durable), then unlink them."""
    items = _read(paths, into)
    try:
        written = tier.import_blocks(items)
        into.blocks += written
        into.superseded += len(items) - written
    except ResourceExhausted as exc:
        log.warning("ssd import: %d blocks beyond the capacity dropped: %s", len(items), exc)
        into.dropped += len(items)
    for path in paths:
        path.unlink(missing_ok=True)


async def import_files(tier: SegmentTier) -> Imported:
    """Every block file under the tier's root imported (none there: nothing done)."""
    dirs = await asyncio.to_thread(legacy_dirs, tier.root)
    free = tier.root / FREE_DIR
    done = Imported()
    if not dirs and not free.exists():
        tier.imported()
        return done
    complete = False
    try:
        paths = await asyncio.to_thread(_files, dirs)
        log.info("ssd: importing %d block files of the file layout into segments", len(paths))
        for a in range(0, len(paths), BATCH):
            await asyncio.to_thread(import_batch, tier, paths[a : a + BATCH], done)
        for d in dirs:
            await asyncio.to_thread(shutil.rmtree, d, True)
        await asyncio.to_thread(shutil.rmtree, free, True)
        complete = True
    finally:  # (failed or cancelled: the deletes since the start stop being remembered, their files unlinked)
        tier.imported(complete)
    log.info("ssd: imported %d blocks (%d dropped, %d superseded by puts or deletes since the start)",
             done.blocks, done.dropped, done.superseded)
    return done
