"""Blocking work on worker threads, for code whose buffers must not be reused while a thread
still touches them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Generic, TypeVar

T = TypeVar("T")


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous (start, end) ranges covering ``range(n)``, none empty."""
    parts = max(1, min(parts, n))
    step = -(-n // parts) if n else 0
    return [(a, min(a + step, n)) for a in range(0, n, step)] if n else []


class _Once(Generic[T]):
    """A call that lets go of what it calls as it starts. A pool's worker holds its work item
    until after the item's future is done, so the caller may resume while the worker still
    references the call and the buffers bound into it (the slab's views: a slab closed right
    after an Acquire's hashing could not release its mapping, "cannot close exported pointers
    exist", in one call of six)."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Callable[[], T]) -> None:
        self._fn: Callable[[], T] | None = fn

    def __call__(self) -> T:
        fn, self._fn = self._fn, None
        assert fn is not None, "called twice"
        return fn()


def let_go(fn: Callable[[], T]) -> Callable[[], T]:
    """``fn`` as a pool's work item that lets go of it as it starts (:class:`_Once`): for a call
    bound to a caller's buffers submitted to a pool directly, the caller waiting on its future."""
    return _Once(fn)


async def in_threads(executor: Executor | None, calls: Sequence[Callable[[], T]]) -> list[T]:
    """Run blocking calls on ``executor``. They read into and write from the caller's buffers,
    so this returns (or raises, or is cancelled) only once every one of them has finished, and
    no worker references them any more. ``executor`` None: the loop's default one."""
    loop = asyncio.get_running_loop()
    futs = [loop.run_in_executor(executor, _Once(c)) for c in calls]
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
