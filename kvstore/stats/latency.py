"""Latency histograms: one fixed bucket array per series, one ``bisect`` and one increment a call.

    h = stats.latency.histogram("rpc", ("grpc", "Lookup", "ok"))
    start = time.perf_counter(); ...; h.since(start)

    with stats.latency.timed("promotion", (tier,)):  # outcome "ok", or "error" if it raised
        ...

The buckets (seconds, Prometheus' ``le``) run from 50 µs to 10 s in 1-2-5 steps, and one more
takes anything slower (``+Inf``). A family has fixed label names (:data:`FAMILIES`); its series
are made on first use, so the labels' values must come from bounded sets (method names, status
codes, tier names), never from a request. The /stats document carries each series' bucket
counts, sum, and its p50 and p99 estimated from the buckets as Prometheus' ``histogram_quantile``
does (linear within the bucket); /metrics renders the same counts as Prometheus histograms
(kvstore/stats/prometheus.py). Bumped on the event loop thread, like every counter of
:class:`~kvstore.stats.counters.Stats`.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from time import perf_counter
from typing import Any

BOUNDS_S: tuple[float, ...] = (
    50e-6,
    100e-6,
    200e-6,
    500e-6,
    1e-3,
    2e-3,
    5e-3,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
)
QUANTILES = {"p50_s": 0.5, "p99_s": 0.99}

# The outcome of a call to a tier (promotion, demotion, write-through). Every call is timed, however
# it ends: a tier timing out is what an operator looks for in these histograms.
TIER_OUTCOMES = "ok; error: the call raised, timed out or was cancelled"

# family -> (label names, what one observation is); kvstore_<family>_duration_seconds on /metrics
FAMILIES: dict[str, tuple[tuple[str, ...], str]] = {
    "rpc": (
        ("transport", "method", "outcome"),
        "KVStore calls, from the decoded request to the answer, by transport (grpc, local), method and "
        "outcome (ok, or the status code answered)",
    ),
    "promotion": (
        ("tier", "outcome"),
        "promotion batches: one read of a batch of blocks from the tier below DRAM into DRAM, by tier and "
        f"outcome ({TIER_OUTCOMES}; a block the tier did not hold is a miss within an ok read)",
    ),
    "demotion": (
        ("tier", "outcome"),
        "demotions: one batch written to the tier (a write of one block for an eviction's), by tier and outcome "
        f"({TIER_OUTCOMES})",
    ),
    "write_through": (
        ("tier", "outcome"),
        "write-throughs of a commit's blocks to the tier, from the commit to the write, by tier and outcome "
        f"({TIER_OUTCOMES}; a tenant past its quota writes nothing and is not timed)",
    ),
    "peer_fetch": (("outcome",), "fetches of a run of blocks from one peer (ok, short: fewer lent, error)"),
    "peer_answer": (("outcome",), "answers to a peer's fetch: lend, hash and send the run (ok, error)"),
    "directory": (
        ("op", "outcome"),
        "round trips to the cluster directory (find, publish, forget, heartbeat; sweep: one pass of the walk "
        "that deletes void records, its scan, reads and deletes together; forget_members: the deletion of "
        "members entries nobody could read for a lease, after the heartbeat that found them due)",
    ),
}


class Histogram:
    """One series: counts per bucket (the last one past 10 s) and the sum of the seconds seen."""

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(BOUNDS_S) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(BOUNDS_S, seconds)] += 1
        self.sum += seconds

    def since(self, start: float) -> None:
        """Observe the time since ``start`` (a ``time.perf_counter()`` reading)."""
        seconds = perf_counter() - start
        self.counts[bisect_left(BOUNDS_S, seconds)] += 1
        self.sum += seconds


def quantile(counts: Sequence[int], q: float) -> float:
    """The ``q`` quantile (0 < q < 1) of bucket ``counts``, as Prometheus' histogram_quantile
    estimates it: linear within the bucket it falls in (the first from 0), the highest finite
    bound when it falls past it; 0.0 when nothing was counted."""
    total = sum(counts)
    if not total:
        return 0.0
    rank = q * total
    seen = 0
    for i, n in enumerate(counts):
        if n and seen + n >= rank:
            if i == len(BOUNDS_S):
                return BOUNDS_S[-1]
            low = BOUNDS_S[i - 1] if i else 0.0
            return low + (BOUNDS_S[i] - low) * (rank - seen) / n
        seen += n
    return BOUNDS_S[-1]  # (not reached: the last non-empty bucket holds the rank)


class Latencies:
    """Every family's series, by label values."""

    def __init__(self) -> None:
        self.series: dict[str, dict[tuple[str, ...], Histogram]] = {f: {} for f in FAMILIES}

    def histogram(self, family: str, labels: tuple[str, ...]) -> Histogram:
        """The series of ``family`` with these label values (made on first use)."""
        got = self.series[family].get(labels)
        if got is None:
            names = FAMILIES[family][0]
            if len(labels) != len(names):
                raise ValueError(f"latency family {family}: labels {names}, got {labels!r}")
            got = self.series[family][labels] = Histogram()
        return got

    @contextmanager
    def timed(self, family: str, labels: tuple[str, ...]) -> Iterator[None]:
        """Time the ``with`` block however it ends, its outcome the last label: ``ok``, or
        ``error`` when it raised, timed out or was cancelled (the exception goes on)."""
        start, outcome = perf_counter(), "error"
        try:
            yield
            outcome = "ok"
        finally:
            self.histogram(family, (*labels, outcome)).since(start)

    def snapshot(self) -> dict[str, Any]:
        """The /stats section: the bucket bounds, then per family a list of its series, each its
        labels, ``count``, ``sum_s``, ``p50_s``, ``p99_s`` and ``buckets`` (counts per bucket)."""
        out: dict[str, Any] = {"bounds_s": list(BOUNDS_S)}
        for family, series in self.series.items():
            names = FAMILIES[family][0]
            rows = []
            for labels, h in sorted(series.items()):
                counts = list(h.counts)
                row: dict[str, Any] = dict(zip(names, labels))
                row.update(count=sum(counts), sum_s=h.sum)
                row.update({k: quantile(counts, q) for k, q in QUANTILES.items()})
                row["buckets"] = counts
                rows.append(row)
            out[family] = rows
        return out
