"""Counters of the connector's work, thread-safe, as one JSON-able dict for ``/stats``."""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from typing import Any

from connector.roles.metadata import LoadResult, SaveResult


class ConnectorStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n: Counter[str] = Counter()
        self._f: Counter[str] = Counter()  # failures, "load.<reason>" / "save.<reason>" / "lookup.<reason>"
        self._seconds: defaultdict[str, float] = defaultdict(float)

    def add(self, **counts: int) -> None:
        with self._lock:
            self._n.update(counts)

    def failure(self, op: str, reason: str) -> None:
        with self._lock:
            self._f[f"{op}.{reason}"] += 1

    def record_load(self, r: LoadResult) -> None:
        with self._lock:
            self._n.update(
                loads=1, loaded_blocks=r.loaded, load_failed_blocks=len(r.failed_block_ids), loaded_bytes=r.nbytes
            )
            self._seconds["load"] += r.seconds
            if r.failure is not None:
                self._f[f"load.{r.failure.value}"] += 1

    def record_save(self, r: SaveResult) -> None:
        with self._lock:
            self._n.update(saves=1, saved_blocks=r.written, save_present_blocks=r.present, saved_bytes=r.nbytes)
            self._seconds["save"] += r.seconds
            if r.failure is not None:
                self._f[f"save.{r.failure.value}"] += 1

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            return {**self._n, "failures": dict(self._f), "seconds": dict(self._seconds)}

    def __getitem__(self, name: str) -> int:
        with self._lock:
            return self._n[name] if "." not in name else self._f[name]
