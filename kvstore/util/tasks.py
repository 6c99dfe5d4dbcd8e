"""The sidecar's asyncio tasks: background loops that outlive their errors, and ending tasks from
a close or stop path."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from kvstore.util.backoff import Backoff
from kvstore.util.logs import Throttled

log = logging.getLogger(__name__)
SEEN_ERRORS = 256  # distinct errors logged in full (with their traceback); the rest are throttled
BACKOFF_CAP_S = 10.0  # the longest wait between two failed passes of a background loop


class TaskHealth:
    """The sidecar's background loops, as ``/readyz`` and ``/stats`` see them: how many passes of
    each failed (``errors``, counted into the Counter given: ``Stats.errors``, as ``task:<name>``)
    and those whose last pass failed (``failing``: name -> the error). Each distinct error is
    logged once with its traceback, its repeats at most every 10 s."""

    def __init__(self, errors: Counter[str] | None = None) -> None:
        self.errors: Counter[str] = errors if errors is not None else Counter()
        self.failing: dict[str, str] = {}
        self._seen: set[tuple[str, str]] = set()
        self._repeats = Throttled(log)

    def failed(self, name: str, exc: BaseException) -> None:
        what = f"{type(exc).__name__}: {exc}"[:500]
        self.errors[f"task:{name}"] += 1
        self.failing[name] = what
        if (name, what) not in self._seen and len(self._seen) < SEEN_ERRORS:
            self._seen.add((name, what))
            log.error("background task %s failed (retried with back-off): %s", name, what, exc_info=exc)
        else:
            self._repeats.warning("background task %s failed again (retried with back-off): %s", name, what)

    def ok(self, name: str) -> None:
        self.failing.pop(name, None)

    def ended(self, task: asyncio.Task[Any]) -> None:
        """A done callback: a task that ended with an error (a loop that should never end) is
        failing for good."""
        if not task.cancelled() and (exc := task.exception()) is not None:
            self.failed(task.get_name(), exc)


async def every(
    name: str,
    interval_s: float,
    step: Callable[[], Awaitable[None]],
    health: TaskHealth,
    *,
    stop: Callable[[], bool] = lambda: False,
    backoff: Backoff | None = None,
) -> None:
    """Run ``step`` every ``interval_s`` until ``stop()`` (or a cancellation). A pass that raises
    does not end the loop: ``health`` is told (counted, logged, reported by ``/readyz`` until a
    pass succeeds) and the next pass waits longer (``backoff``: from ``interval_s``, doubling,
    at most :data:`BACKOFF_CAP_S` or ``interval_s`` where that is longer)."""
    backoff = backoff or Backoff(interval_s, max(interval_s, BACKOFF_CAP_S))
    wait = interval_s
    while not stop():
        await asyncio.sleep(wait)
        try:
            await step()
        except Exception as exc:  # noqa: BLE001  (logged by health.failed)
            health.failed(name, exc)
            wait = backoff.next()
        else:
            health.ok(name)
            backoff.reset()
            wait = interval_s


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any] | None]) -> list[BaseException]:
    """Cancel ``tasks`` (None: none) and wait until every one has ended. Their own
    ``CancelledError`` is what was asked for and is not raised; nor is an error a task ended with
    (a close or stop goes on to its next step whatever its tasks died of): each is logged, and
    they are returned. A cancellation of the caller itself while it waits (its own deadline,
    ``asyncio.timeout`` around a stop) is raised at once: the pattern this replaces,
    ``with suppress(CancelledError): await task``, swallowed it with the task's, and the caller's
    deadline never fired."""
    pending = [t for t in tasks if t is not None]
    for t in pending:
        t.cancel()
    if not pending:
        return []
    await asyncio.wait(pending)  # raises only the caller's own cancellation, never a task's
    errors: list[BaseException] = []
    for t in pending:
        if not t.cancelled() and (e := t.exception()) is not None:
            log.error("task %s had ended with an error (its stop goes on): %s: %s",
                      t.get_name(), type(e).__name__, e, exc_info=e)
            errors.append(e)
    return errors
