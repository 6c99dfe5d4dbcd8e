"""Ending asyncio tasks from a close or stop path."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any] | None]) -> None:
    """Cancel ``tasks`` (None: none) and wait until every one has ended. Their own
    ``CancelledError`` is what was asked for and is not raised; an error a task ended with is, the
    first of them, once all have ended. A cancellation of the caller itself while it waits (its own
    deadline, ``asyncio.timeout`` around a stop) is raised at once: the pattern this replaces,
    ``with suppress(CancelledError): await task``, swallowed it with the task's, and the caller's
    deadline never fired."""
    pending = [t for t in tasks if t is not None]
    for t in pending:
        t.cancel()
    if not pending:
        return
    await asyncio.wait(pending)  # raises only the caller's own cancellation, never a task's
    errors = [t.exception() for t in pending if not t.cancelled()]
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
