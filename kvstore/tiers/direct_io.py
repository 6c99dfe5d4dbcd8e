"""O_DIRECT on the SSD tier's directory: whether the file system takes it, and its alignment.

Both SSD layouts (:mod:`kvstore.tiers.ssd`, one file per block; :mod:`kvstore.tiers.segments`,
segment files) ask here once at start and fall back to buffered I/O where it is refused (tmpfs,
some overlay file systems).
"""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

from kvstore.tiers.private import FILE_MODE

ALIGN = 4096  # O_DIRECT's offset, length and buffer alignment on every Linux file system here
O_DIRECT = getattr(os, "O_DIRECT", 0)


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
