"""Owner-only files and directories, for a tier that keeps blocks on the local filesystem (SSD).

A block's bytes say as much as the prompt they came from: block files are created 0600 in 0700
directories, as the local socket, the slab and the lock already are, and whatever an older
version left looser (0644 files in 0755 directories) is tightened when the tier starts.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

FILE_MODE = 0o600
DIR_MODE = 0o700
_OTHERS = stat.S_IRWXG | stat.S_IRWXO


def private_dir(path: Path, *, parents: bool = False) -> None:
    """Make ``path`` (mode 0700; ``parents`` get the default mode) or tighten the one there."""
    path.mkdir(mode=DIR_MODE, parents=parents, exist_ok=True)
    tighten(path)


def tighten(path: str | Path, mode: int | None = None) -> None:
    """Take group and other permissions off ``path`` (``mode``: its ``st_mode``, if known)."""
    if mode is None:
        mode = os.stat(path).st_mode
    if mode & _OTHERS:
        os.chmod(path, stat.S_IMODE(mode) & ~_OTHERS)
