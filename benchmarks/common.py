"""Shared helpers for benchmark suites: result format, percentiles, a sidecar subprocess."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np

from kvstore.testing.sidecar import ServeProcess


class Result:
    def __init__(self, suite: str) -> None:
        self.suite = suite
        self.figures: dict[str, dict[str, Any]] = {}
        self.ratios: dict[str, float] = {}
        self.notes: dict[str, Any] = {}

    def figure(self, name: str, value: float, unit: str) -> None:
        self.figures[name] = {"value": round(float(value), 6), "unit": unit}

    def ratio(self, name: str, value: float) -> None:
        self.ratios[name] = round(float(value), 4)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"suite": self.suite, "figures": self.figures, "ratios": self.ratios}
        if self.notes:
            out["notes"] = self.notes
        return out


def percentile(samples: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples), q))


@contextlib.contextmanager
def sidecar_process(dram_bytes: int, *extra: str, env: dict[str, str] | None = None) -> Iterator[ServeProcess]:
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-") as d:
        sc = ServeProcess(
            ["--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0", "--data-dir", d,
             "--dram-bytes", str(dram_bytes), *extra],
            env={"KVSTORE_SSD__ENABLED": "false", **(env or {})},
        )
        try:
            yield sc
        finally:
            sc.stop()
