"""Block checksums: xxh3_64 (fast, portable, available in every language)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, TypeAlias

import xxhash

from kvstore.util.threads import _Once, in_threads, split

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


def start_checksums(views: Sequence[Bytes]) -> Callable[[], list[int]]:
    """Start hashing every buffer on the pool's threads (split as :func:`checksums` does) and
    return the call that waits for them: it returns the checksums in order, and returns (or
    raises) only once no thread touches the buffers any more. A part no thread has started by
    then is hashed by the caller (a busy host: no slower than hashing it there at once). For
    synchronous callers that overlap the hashing with other work (a load's copy,
    :mod:`connector.roles.verified`)."""
    calls = [functools.partial(_checksums, views, a, b) for a, b in split(len(views), HASH_THREADS)]
    futs = [_pool.submit(_Once(c)) for c in calls]

    def join() -> list[int]:
        parts: list[list[int] | None] = [None] * len(futs)
        started: list[Future[list[int]]] = []  # the parts a pool thread took
        try:
            for i, (f, call) in enumerate(zip(futs, calls)):
                if f.cancel():  # no thread took it yet: hashed here
                    parts[i] = call()
                else:
                    started.append(f)
        finally:  # after a failure, the parts not reached yet are withdrawn or waited for too
            started += [f for f, p in zip(futs, parts) if p is None and f not in started and not f.cancel()]
            wait(started)  # (a cancelled part counts as done only once a thread dequeues it: not waited for)
        return [c for f, part in zip(futs, parts) for c in (f.result() if part is None else part)]

    return join
