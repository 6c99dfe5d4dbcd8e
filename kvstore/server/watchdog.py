"""A bound on the sidecar's shutdown: once it has been signalled, it exits within a deadline.

A drain that never finishes (a task that does not end when cancelled, a tier that does not answer
its close) would otherwise keep a signalled sidecar alive until an orchestrator kills it with
SIGKILL -- without a word about where it stuck. Past the deadline (``server.shutdown_grace_s +
server.drain_s + server.shutdown_watchdog_s``) the watchdog thread writes, to the log stream (stderr), the step the
shutdown is in, every thread's stack and every asyncio task's awaits, removes the shared-memory
segment, and ends the process with ``EXIT_STUCK``.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from kvstore.dram.slab import unlink_stale

log = logging.getLogger(__name__)
EXIT_STUCK = 70  # EX_SOFTWARE


class ShutdownWatchdog:
    def __init__(self, loop: asyncio.AbstractEventLoop, limit_s: float, phase: Callable[[], str],
                 segment: Callable[[], str]) -> None:
        self._loop = loop
        self._limit = limit_s
        self._phase = phase
        self._segment = segment
        self._done = threading.Event()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._watch, name="kvstore-shutdown-watchdog", daemon=True)

    def start(self) -> ShutdownWatchdog:
        self._thread.start()
        return self

    def finished(self) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        if self._done.wait(self._limit):
            return
        err = sys.stderr
        log.critical("shutdown did not finish within %.0f s (stuck in: %s); exiting with %d; stacks follow",
                     self._limit, self._phase(), EXIT_STUCK)
        with _quietly():
            faulthandler.dump_traceback(file=err, all_threads=True)
        with _quietly():
            for task in list(asyncio.all_tasks(self._loop)):  # read from another thread: a best effort
                print(f"--- asyncio task {task.get_name()} (innermost await last) ---", file=err)
                print("".join(traceback.format_list(_awaiting(task.get_coro()))), end="", file=err)
        with _quietly():
            name = self._segment()
            if name:
                unlink_stale(name)
        with _quietly():
            err.flush()
        os._exit(EXIT_STUCK)


def _awaiting(coro: Any) -> traceback.StackSummary:
    """The chain of coroutines a task is suspended in, outermost first (``Task.print_stack``
    shows only the outermost)."""
    frames = []
    while coro is not None and getattr(coro, "cr_frame", None) is not None:
        frames.append((coro.cr_frame, coro.cr_frame.f_lineno))
        coro = coro.cr_await
    return traceback.StackSummary.extract(iter(frames))


def _quietly() -> contextlib.suppress:
    """Diagnostics on the way out must not stop the way out."""
    return contextlib.suppress(Exception)
