"""Deleted block files kept for reuse (the SSD tier's free list).

A block file written into a new file makes the filesystem allocate its extents and journal them;
overwriting a file that already has them costs only the data (measured here: 1.3-1.5x the rate
of fresh O_DIRECT files, on a fast or a slow phase of this VM's disk). In steady state every put
to a full tier follows an eviction, so the SSD tier keeps a deleted block's file in ``<root>/.free``
instead of unlinking it, and the next put of a block with the same file size renames it into
place and overwrites it whole (header, padding and payload).

The pool is bounded (``limit`` bytes) and its files count against the tier's capacity: a put
that needs the room unlinks free files first (:meth:`FreeFiles.reclaim`), so the directory never
holds more than the capacity. Names say nothing a restart needs beyond their size, which is
re-read from the file: a restarted tier adopts what fits and unlinks the rest.

A file moves between a block and the pool in two steps (:meth:`FreeFiles.admit` counts it in the
pool, :meth:`FreeFiles.move_in` renames and lists it), so the tier can move its bytes out of its
own count in the same breath as they enter the pool's: they are never counted twice (which made
a put that fitted exactly fail "ssd tier full") nor not at all.

Thread-safe: the SSD tier's worker threads take and give files concurrently. The SSD tier calls
in with its own lock held, and nothing here calls back into it.
"""

from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path

from kvstore.tiers.private import private_dir, tighten

FREE_DIR = ".free"


class FreeFiles:
    """Files of deleted blocks by file size, at most ``limit`` bytes of them."""

    def __init__(self, root: Path, limit: int) -> None:
        self.dir = root / FREE_DIR
        self.limit = max(0, limit)
        self._lock = threading.Lock()
        self._by_size: dict[int, list[Path]] = {}
        self._ids = itertools.count()
        self.bytes = 0
        self.reused = 0  # files handed out for a put (a counter for tests and stats)
        self._adopt()

    def _adopt(self) -> None:
        """Files a previous process left: kept while they fit, unlinked after that."""
        if not self.dir.is_dir():
            return
        tighten(self.dir)
        for entry in os.scandir(self.dir):
            st = entry.stat()
            size = st.st_size
            if self.bytes + size <= self.limit:
                tighten(entry.path, st.st_mode)
                self._by_size.setdefault(size, []).append(Path(entry.path))
                self.bytes += size
            else:
                os.unlink(entry.path)

    def take(self, size: int) -> Path | None:
        """A free file of exactly ``size`` bytes (the caller renames it into place), or None."""
        with self._lock:
            files = self._by_size.get(size)
            if not files:
                return None
            self.bytes -= size
            self.reused += 1
            return files.pop()

    def admit(self, size: int) -> Path | None:
        """Room in the pool for a deleted block's file of ``size`` bytes, counted from now: the
        name to :meth:`move_in` it under; None when the pool is full (the caller unlinks it)."""
        with self._lock:
            if self.bytes + size > self.limit:
                return None
            self.bytes += size  # before the rename, so concurrent admits stay in bounds
            return self.dir / f"{size}.{os.getpid()}.{next(self._ids)}"

    def move_in(self, path: Path, dest: Path, size: int) -> bool:
        """Rename ``path`` to ``dest`` (from :meth:`admit`) and list it for reuse; False, and no
        longer counted, when the file is gone."""
        try:
            try:
                os.replace(path, dest)
            except FileNotFoundError:
                # Which one was missing: the block's file (gone), or the pool's directory (the first
                # gives: made here, not at start, so an unused tier stays bare). Not "is the
                # directory there now": a concurrent first give may have made it since, and this
                # block's file was then taken for gone and left where it was, on disk but counted
                # nowhere (a deleted block that a restart would bring back).
                if not os.path.lexists(path):
                    raise
                private_dir(self.dir)
                os.replace(path, dest)
        except FileNotFoundError:
            with self._lock:
                self.bytes -= size
            return False
        with self._lock:
            self._by_size.setdefault(size, []).append(dest)
        return True

    def reclaim(self, nbytes: int) -> int:
        """Unlink free files until ``nbytes`` are given back (or none is left); returns the bytes
        freed. Called when a put needs the room under the tier's capacity."""
        freed = 0
        while freed < nbytes:
            with self._lock:
                size = next((s for s, files in self._by_size.items() if files), None)
                if size is None:
                    break
                path = self._by_size[size].pop()
                self.bytes -= size
            path.unlink(missing_ok=True)
            freed += size
        return freed
