"""Service counters, and the one JSON document served by /stats, the Stats RPC and /metrics.

Counters are plain ints bumped on the event loop thread; :meth:`Stats.snapshot` turns them into
the document. Rates are derived there, never stored.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

TIER_LABELS = ("dram", "ssd", "redis", "s3")
TIER_COUNTERS = ("hits", "misses", "bytes_in", "bytes_out", "evictions", "demotions", "promotions", "errors", "checksum_failures")


@dataclass(slots=True)
class LookupCounters:
    calls: int = 0
    blocks_requested: int = 0
    blocks_hit: int = 0
    full_hits: int = 0  # lookups whose every block was present

    def add(self, requested: int, hit: int) -> None:
        self.calls += 1
        self.blocks_requested += requested
        self.blocks_hit += hit
        if requested and hit == requested:
            self.full_hits += 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "blocks_requested": self.blocks_requested,
            "blocks_hit": self.blocks_hit,
            "full_hits": self.full_hits,
            "hit_rate": self.blocks_hit / self.blocks_requested if self.blocks_requested else 0.0,
        }


@dataclass(slots=True)
class Stats:
    started: float = field(default_factory=time.time)
    lookups: LookupCounters = field(default_factory=LookupCounters)
    per_namespace: dict[str, LookupCounters] = field(default_factory=dict)
    tiers: dict[str, Counter[str]] = field(default_factory=lambda: {t: Counter() for t in TIER_LABELS})
    writes: Counter[str] = field(default_factory=Counter)
    reads: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    decisions: Counter[str] = field(default_factory=Counter)
    recent_decisions: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=50))
    history: deque[dict[str, float]] = field(default_factory=lambda: deque(maxlen=360))

    def lookup(self, label: str, requested: int, hit: int) -> None:
        self.lookups.add(requested, hit)
        ns = self.per_namespace.get(label)
        if ns is None:
            ns = self.per_namespace[label] = LookupCounters()
        ns.add(requested, hit)

    def tier(self, tier: str, counter: str, n: int = 1) -> None:
        self.tiers[tier][counter] += n

    def decision(self, record: dict[str, Any]) -> None:
        self.decisions[record.get("outcome", "unknown").split(":")[0]] += 1
        self.decisions["total"] += 1
        self.recent_decisions.append(record)

    def sample(self) -> None:
        """Append a point to the hit-rate history (called by the server every few seconds)."""
        self.history.append(
            {"t": time.time(), "blocks_requested": self.lookups.blocks_requested, "blocks_hit": self.lookups.blocks_hit}
        )

    def snapshot(self, occupancy: dict[str, dict[str, Any]], index_counts: dict[str, int]) -> dict[str, Any]:
        tiers: dict[str, Any] = {}
        for name in TIER_LABELS:
            c = self.tiers[name]
            entry: dict[str, Any] = {k: c.get(k, 0) for k in TIER_COUNTERS}
            occ = occupancy.get(name)
            entry["enabled"] = occ is not None
            if occ:
                entry.update(occ)
            tiers[name] = entry
        hits_by_tier = {t: tiers[t]["hits"] for t in TIER_LABELS}
        requested = self.lookups.blocks_requested
        return {
            "uptime_s": time.time() - self.started,
            "lookups": self.lookups.as_dict(),
            "hit_rate": self.lookups.as_dict()["hit_rate"],
            "hit_rate_by_tier": {t: (h / requested if requested else 0.0) for t, h in hits_by_tier.items()},
            "namespaces": {label: c.as_dict() for label, c in sorted(self.per_namespace.items())},
            "tiers": tiers,
            "writes": dict(self.writes),
            "reads": dict(self.reads),
            "index": index_counts,
            "errors": dict(self.errors),
            "decisions": {"counts": dict(self.decisions), "recent": list(self.recent_decisions)},
            "history": list(self.history),
        }
