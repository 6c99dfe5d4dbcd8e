"""Crew: the movers' background tasks.

Every move between DRAM and the tiers below (a demotion's sealer and write batches, a promotion
batch, a write-through, a delete of copies) runs as a task of one crew: started with the cleanup its
waiters need, listed while it runs, waited for by :meth:`Crew.flush`.

Why one place: a task cancelled before its first step runs none of its own code (asyncio.run's sweep
of leftover tasks, a stop that cancels the movers), so the cleanup (an unpin, a future settled, room
given back) must run as the task ends, however it ends; and the store waits for the moves in flight
when only their pins stand in a write's way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Set
from typing import Any

log = logging.getLogger(__name__)


class Crew:
    """The mover tasks in flight."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def tasks(self) -> Set[asyncio.Task[None]]:
        return self._tasks

    def spawn(self, coro: Coroutine[Any, Any, None], ended: Callable[[], None] | None = None) -> asyncio.Task[None]:
        """A mover task. ``ended`` runs as it ends, however it ends: a task cancelled before its
        first step runs none of its own code, so the cleanup that its waiters need (an unpin, a
        future settled, room given back) is there, not in a ``finally`` of ``coro``."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        if ended is not None:
            task.add_done_callback(lambda _: ended())
        return task

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("tier mover failed", exc_info=exc)

    async def flush(self) -> bool:
        """Wait for the tasks in flight; whether there were any. A caller that is cancelled while it
        waits (an Allocate past its deadline) leaves them running: ``asyncio.gather`` cancelled its
        children, and a write-through cancelled before it began never unpinned its blocks (their
        DRAM was "leased or being written" for the process's life)."""
        busy = bool(self._tasks)
        while self._tasks:
            await asyncio.wait(list(self._tasks))
        return busy


def ended(task: asyncio.Task[None]) -> asyncio.Future[None]:
    """A future done when ``task`` ends, however it ends: a waiter that is cancelled cancels only
    the future (the task runs on), and the task ending cancelled is not the waiter's cancellation.
    A future, not a coroutine: one its caller never awaits (an earlier await raised, or the caller
    was cancelled first) is dropped silently, where a coroutine warned "never awaited"."""
    done: asyncio.Future[None] = task.get_loop().create_future()

    def fire(_: object) -> None:
        if not done.done():  # (its waiter cancelled it)
            done.set_result(None)

    task.add_done_callback(fire)
    return done
