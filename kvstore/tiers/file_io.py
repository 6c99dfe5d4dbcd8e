"""The file I/O both SSD layouts share (:mod:`kvstore.tiers.ssd`, one file per block;
:mod:`kvstore.tiers.segments.tier`, segment files): whether the file system takes O_DIRECT (asked
once at start; buffered I/O where it is refused: tmpfs, some overlay file systems) and its
alignment, a write that finishes short writes (at the fd's offset: :func:`write_all`; at a given
one: :func:`pwrite_all`), a read that fills its buffer (short only at EOF), a directory's fsync,
and each I/O thread's own page-aligned staging buffer.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from kvstore.config import SSD_IO_THREADS, SsdConfig
from kvstore.tiers.private import FILE_MODE

ALIGN = 4096  # O_DIRECT's offset, length and buffer alignment on every Linux file system here
O_DIRECT = getattr(os, "O_DIRECT", 0)


@dataclass(frozen=True)
class DiskSettings:
    """How an SSD tier of either layout does its I/O: ``direct_io`` (O_DIRECT where the file
    system takes it, see :func:`probe_direct_io`), ``io_threads`` (the threads a batch is split
    over) and ``fsync`` (a put durable on return; False: the kernel's page cache decides)."""

    direct_io: bool = True
    io_threads: int = SSD_IO_THREADS
    fsync: bool = True

    @classmethod
    def from_config(cls, cfg: SsdConfig) -> DiskSettings:
        """Those ``cfg`` (the ``[ssd]`` table) sets."""
        return cls(direct_io=cfg.direct_io, io_threads=cfg.io_threads, fsync=cfg.fsync)


DEFAULT_DISK = DiskSettings()


def probe_direct_io(directory: Path) -> bool:
    """Whether files in ``directory`` can be opened and written with O_DIRECT."""
    if not O_DIRECT:
        return False
    probe = directory / f".direct-probe.{os.getpid()}.tmp"
    buf = mmap.mmap(-1, ALIGN)
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | O_DIRECT, FILE_MODE)
        try:
            os.write(fd, buf)
        finally:
            os.close(fd)
        return True
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            return False
        raise
    finally:
        buf.close()
        probe.unlink(missing_ok=True)


def write_all(fd: int, data: bytes | memoryview) -> None:
    """All of ``data`` at ``fd``'s offset (a short write finished piecewise)."""
    view, done = memoryview(data), 0
    while done < len(view):
        done += os.write(fd, view[done:])


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """All of ``data`` at ``offset`` (``os.pwrite``: ``fd``'s own offset untouched; a short write
    finished piecewise)."""
    view, done = memoryview(data), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def read_all(fd: int, into: memoryview, offset: int) -> int:
    """``os.preadv`` at ``offset`` until ``into`` is full or the file ends; the bytes read."""
    done = 0
    while done < len(into):
        n = os.preadv(fd, [into[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (files created, renamed, removed) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def staging(local: threading.local, nbytes: int) -> mmap.mmap:
    """This thread's page-aligned buffer (an anonymous map) of at least ``nbytes``, kept in
    ``local`` between calls and grown to ALIGN multiples when a bigger one is asked."""
    buf: mmap.mmap | None = getattr(local, "buf", None)
    if buf is None or len(buf) < nbytes:
        if buf is not None:
            buf.close()
        buf = local.buf = mmap.mmap(-1, (nbytes + ALIGN - 1) // ALIGN * ALIGN)
    return buf
