"""A block corrupted in a sidecar's shared memory, for the tests of what a reader does with it.

This process's own mapping of a sidecar's slab is read-only (``kvstore/dram/protect.py``: a write
through it faults), so the bytes are changed through a read-write mapping of the segment of its
own: what any process of the sidecar's user that maps the slab without that guard (a client of
an older release, a tool) can do. A load under ``load_guard="read_only"`` trusts the slab against
this process's writes only; the readers these tests exercise hash (``load_guard="hash"``, the
client's ``verify``, the sidecar's own checks)."""

from __future__ import annotations

import mmap
import os
import time
from typing import Any


def flip(segment: str, offset: int, mask: int = 0xFF) -> None:
    """XOR the byte at ``offset`` of the shared-memory ``segment`` with ``mask``, through a
    read-write mapping of its own."""
    fd = os.open(f"/dev/shm/{segment}", os.O_RDWR)
    try:
        with mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as m:
            m[offset] ^= mask
    finally:
        os.close(fd)


def corrupt_dram_block(client: Any, ns: Any, key: bytes, timeout: float = 30.0) -> None:
    """Flip one byte of a committed block in the sidecar's shared memory, its recorded checksum
    unchanged -- once the sidecar has sealed it (checksums are computed off the commit's path)."""
    deadline = time.monotonic() + timeout
    while True:
        with client.acquire(ns, [key]) as lease:
            if lease.checksums[0]:
                slot = lease.slots[0]
                flip(slot.segment, slot.offset + slot.length // 2)
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"block {key.hex()[:16]} was not sealed within {timeout}s")
        time.sleep(0.01)
