"""Blocking work on worker threads, for code whose buffers must not be reused while a thread
still touches them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import TypeVar

T = TypeVar("T")


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous (start, end) ranges covering ``range(n)``, none empty."""
    parts = max(1, min(parts, n))
    step = -(-n // parts) if n else 0
    return [(a, min(a + step, n)) for a in range(0, n, step)] if n else []


async def in_threads(executor: Executor, calls: Sequence[Callable[[], T]]) -> list[T]:
    """Run blocking calls on ``executor``. They read into and write from the caller's buffers,
    so this returns (or raises, or is cancelled) only once every one of them has finished."""
    loop = asyncio.get_running_loop()
    futs = [loop.run_in_executor(executor, c) for c in calls]
    if not futs:
        return []
    try:
        await asyncio.shield(asyncio.wait(futs))
    except asyncio.CancelledError:
        await asyncio.wait(futs)
        raise
    # every failure is retrieved (else asyncio logs "Future exception was never retrieved" for
    # each one after the first); the first is raised
    failures = [exc for f in futs if (exc := f.exception()) is not None]
    if failures:
        raise failures[0]
    return [f.result() for f in futs]
