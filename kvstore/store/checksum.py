"""Block checksums: xxh3_64 (fast, portable, available in every language)."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeAlias

import xxhash

from kvstore.util.threads import in_threads, split

if TYPE_CHECKING:
    import numpy as np

Bytes: TypeAlias = "bytes | memoryview | np.ndarray"  # anything with the buffer protocol, read as bytes

HASH_THREADS = min(4, os.cpu_count() or 1)  # xxhash releases the GIL: a batch hashes on several cores
_pool = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="kvstore-hash")


def checksum(data: Bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)  # type: ignore[arg-type]  # an ndarray is a buffer (numpy says so for 3.12+)


def _checksums(views: Sequence[Bytes], a: int, b: int) -> list[int]:
    return [checksum(v) for v in views[a:b]]


async def checksums(views: Sequence[Bytes]) -> list[int]:
    """The checksum of every buffer, the batch split over ``HASH_THREADS`` threads (64 MiB
    hashed in 1.3 ms instead of 2.4 on two cores). Returns once every thread is done with the
    buffers, even when cancelled."""
    calls = [functools.partial(_checksums, views, a, b) for a, b in split(len(views), HASH_THREADS)]
    parts = await in_threads(_pool, calls)
    return [c for part in parts for c in part]
