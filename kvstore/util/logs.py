"""Structured logs: one JSON object per line on stderr (``--log-format text`` for people)."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Hashable
from typing import Any


class Throttled:
    """Warnings to ``logger`` at most once per ``interval`` seconds, each saying how many were held
    back since the last one (a flood of bad input must not flood the log)."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0) -> None:
        self._log = logger
        self._interval = interval
        self._last = -interval
        self._held = 0

    def due(self) -> bool:
        """Whether a warning now would be logged (one was not, within the interval): counts
        those held back."""
        now = time.monotonic()
        if now - self._last < self._interval:
            self._held += 1
            return False
        self._last = now
        return True

    def warning(self, msg: str, *args: object) -> None:
        if not self.due():
            return
        held, self._held = self._held, 0
        if held:
            msg, args = msg + " (%d more since the last warning)", (*args, held)
        self._log.warning(msg, *args)


_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in record.__dict__.items():
            if k not in _STANDARD and not k.startswith("_"):
                doc[k] = v
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def setup_logging(level: str = "info", fmt: str = "json") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter() if fmt == "json" else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


class Once:
    """Warnings to ``logger`` once per distinct subject (a key, an error): a fault that recurs on
    every pass is told once, not every pass. Past ``limit`` subjects, new ones are throttled
    (:class:`Throttled`)."""

    def __init__(self, logger: logging.Logger, limit: int = 1024) -> None:
        self._log = logger
        self._limit = limit
        self._seen: set[Hashable] = set()
        self._more = Throttled(logger)

    def warning(self, subject: Hashable, msg: str, *args: object) -> None:
        if subject in self._seen:
            return
        if len(self._seen) >= self._limit:
            self._more.warning(msg, *args)
            return
        self._seen.add(subject)
        self._log.warning(msg, *args)


def throttle_loop_errors(loop: asyncio.AbstractEventLoop, interval: float = 10.0) -> None:
    """asyncio's own error reports through ``loop``'s default handler, each distinct message at
    most every ``interval`` seconds: a listener out of file descriptors is reported once a second
    for as long as that lasts ("socket.accept() out of system resource")."""
    throttles: dict[str, Throttled] = {}
    quiet = logging.getLogger("asyncio")

    def handle(lp: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        msg = str(context.get("message", ""))
        gate = throttles.get(msg)
        if gate is None:
            if len(throttles) >= 256:
                throttles.clear()
            gate = throttles[msg] = Throttled(quiet, interval)
        if gate.due():
            lp.default_exception_handler(context)

    loop.set_exception_handler(handle)
