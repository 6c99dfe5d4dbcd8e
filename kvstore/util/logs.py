"""Structured logs: one JSON object per line on stderr (``--log-format text`` for people)."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Hashable


class Throttled:
    """Warnings to ``logger`` at most once per ``interval`` seconds, each saying how many were held
    back since the last one (a flood of bad input must not flood the log)."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0) -> None:
        self._log = logger
        self._interval = interval
        self._last = -interval
        self._held = 0

    def warning(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last < self._interval:
            self._held += 1
            return
        held, self._held, self._last = self._held, 0, now
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
