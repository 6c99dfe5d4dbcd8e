"""Process-level tuning shared by the service, workers and benchmarks.

glibc serves multi-MiB allocations with fresh mmaps by default and returns them at once, so
Python code that allocates block-sized buffers pays page faults on every call (up to 4x slower).
Raising the mmap and trim thresholds keeps those buffers in the heap.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 128 << 20
TRIM_THRESHOLD = 256 << 20
ENV = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}


def tune_malloc() -> bool:
    """Same effect as MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_, applied via mallopt()."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
            libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        )
    except (OSError, AttributeError):
        return False
