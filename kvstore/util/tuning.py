"""Process-level tuning shared by the service, workers and benchmarks.

glibc serves multi-MiB allocations with fresh mmaps by default and returns them at once, so
Python code that allocates block-sized buffers pays page faults on every call (up to 4x slower).
Raising the mmap and trim thresholds keeps those buffers in the heap.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

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


def trim_heap() -> bool:
    """Give the heap's free memory back to the system now: the cyclic garbage collected first, then
    ``malloc_trim(0)`` (every arena, free pages inside it too). ``TRIM_THRESHOLD`` keeps the heap at
    its peak otherwise, which is right for the block-sized buffers of steady work and wrong after
    a burst of garbage: a Redis outage leaves ~1,000 failed calls' tracebacks, frames and dead
    connections in reference cycles that only a full collection frees (the soak's sidecar kept
    +8 MiB of ``RssAnon`` per Redis restart). False where there is no glibc."""
    gc.collect()
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        return bool(ctypes.CDLL(name).malloc_trim(0))
    except (OSError, AttributeError):
        return False


# --- the collector while a sidecar runs ---------------------------------------------------------

# The index holds millions of long-lived objects; default GC thresholds rescan them every few
# requests. While a sidecar runs, young objects are collected rarely (request lists are freed by
# refcount anyway) and what exists at its start is frozen out of the scans.
GC_THRESHOLDS = (50_000, 50, 100)
_quiet: list[tuple[int, int, int]] = []  # one entry per sidecar running in this process: the thresholds before


def quiet_gc() -> None:
    """A sidecar starts: the thresholds above, and everything alive now frozen (gc.freeze)."""
    _quiet.append(gc.get_threshold())
    gc.set_threshold(*GC_THRESHOLDS)
    gc.freeze()


def restore_gc() -> None:
    """A sidecar stopped: when it was the last one in this process, the thresholds it found and
    nothing frozen. Frozen objects are never collected, not even at interpreter exit, so a frozen
    cycle of an extension's objects outlived the interpreter: triton's nanobind module, imported
    by transformers, printed ~30 lines of "leaked" warnings after every test run."""
    if not _quiet:
        return
    before = _quiet.pop()
    if not _quiet:
        gc.set_threshold(*before)
        gc.unfreeze()


def freeze_loaded() -> None:
    """While a sidecar runs (:func:`quiet_gc`): what is alive now frozen too. A restart's recovery
    loads the index after the sidecar started serving (kvstore.movers.recovery), a batch at a time:
    each batch's blocks are frozen out of the scans as those alive at the start are (a full scan of
    a million unfrozen blocks took ~40 % of a recovery's CPU). Outside a sidecar: nothing."""
    if _quiet:
        gc.freeze()
