"""kvstore.util.tuning.trim_heap: the heap's free memory goes back to the system although the
trim threshold (256 MiB, for the block-sized buffers of steady work) would keep it: a Redis outage
left ~1,000 failed calls' tracebacks and dead connections in reference cycles, and the soak's
sidecar kept +8 MiB of RssAnon per Redis restart after they were freed."""

from __future__ import annotations

import gc
import os
from pathlib import Path

from kvstore.util.tuning import trim_heap, tune_malloc

MiB = 1 << 20


def _rss_anon() -> int:
    for line in Path(f"/proc/{os.getpid()}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


def test_the_garbage_of_a_burst_goes_back_to_the_system():
    assert tune_malloc()  # the trim threshold the sidecar runs with

    class Node:  # a cycle each, as an exception's traceback and its frame are
        def __init__(self) -> None:
            self.me = self
            self.payload = bytearray(4096)  # a glibc heap allocation, not pymalloc's

    trim_heap()  # what earlier tests in this process freed and the heap kept: the burst would reuse it
    before = _rss_anon()
    burst = [Node() for _ in range(16_384)]  # 64 MiB
    assert _rss_anon() - before >= 48 * MiB
    del burst
    gc.collect()  # every node freed; the heap keeps their pages below the trim threshold
    kept = _rss_anon()
    trim_heap()
    assert kept - _rss_anon() >= 32 * MiB
