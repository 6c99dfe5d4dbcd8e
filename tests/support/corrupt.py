"""A block corrupted in a sidecar's shared memory, for the tests of what a reader does with it."""

from __future__ import annotations

import time
from typing import Any


def corrupt_dram_block(client: Any, ns: Any, key: bytes, timeout: float = 30.0) -> None:
    """Flip one byte of a committed block in the sidecar's shared memory, its recorded checksum
    unchanged -- once the sidecar has sealed it (checksums are computed off the commit's path)."""
    from kvstore.dram.slab import attach

    deadline = time.monotonic() + timeout
    while True:
        with client.acquire(ns, [key]) as lease:
            if lease.checksums[0]:
                slot = lease.slots[0]
                attach(slot.segment)[slot.offset + slot.length // 2] ^= 0xFF
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"block {key.hex()[:16]} was not sealed within {timeout}s")
        time.sleep(0.01)
