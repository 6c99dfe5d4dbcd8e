"""Shared helpers for benchmark suites: result format, percentiles, a sidecar subprocess, a process's CPU time."""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np

from kvstore.harness.sidecar import ServeProcess


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


CLOCK_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far, in seconds (``/proc/PID/stat``; OSError
    once the process is gone)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # (the name, in parentheses, may hold spaces)
    return (int(fields[11]) + int(fields[12])) * CLOCK_TICK_S


def pages(n: int, size: int) -> tuple[list[memoryview], mmap.mmap]:
    """N buffers of ``size`` bytes, each starting on a page of one mapping, as the sidecar's
    slab slots and an allocator's memory objects do (LMCache's). A kernel copy into a buffer
    that starts mid-page (a ``bytearray``, a numpy array: 16-64 bytes into their pages) runs
    15-20% slower here: 32 page-cache reads of 2 MiB took 5.2-6.2 ms into bytearrays against
    4.1-4.9 ms into one mapping. The views keep the mapping alive; it is returned for filling
    it in one go."""
    stride = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
    mapping = mmap.mmap(-1, max(1, n * stride))
    view = memoryview(mapping)
    return [view[i * stride : i * stride + size] for i in range(n)], mapping


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
