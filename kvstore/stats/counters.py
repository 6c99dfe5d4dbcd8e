"""Service counters, and the one JSON document served by /stats, the Stats RPC and /metrics.

Counters are plain ints bumped on the event loop thread; :meth:`Stats.snapshot` turns them into
the document. Rates are derived there, never stored. The document is strict JSON
(:func:`document_json`) and bounded whatever clients send: per-namespace counters are kept for a
few namespaces (the busiest; the rest are folded into ``"other"``), and reported decisions are
checked by :func:`check_decision` before they are kept.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter, deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvstore.errors import InvalidArgument
from kvstore.stats.latency import Latencies
from kvstore.tier_table import NAMES

TIER_LABELS = NAMES  # every row of kvstore/tier_table.py
OTHER = "other"  # the /stats namespace (or tenant) entry that sums every one not shown on its own
OUTCOMES = ("loaded", "recomputed", "fallback", "bypass")  # or "fallback:<reason>", "bypass:<BYPASS_REASONS>"
# Why a connector served a request without the cache at all (no lookup, no save): its KV depends on
# more than what its keys hold. A closed set of the reasons connector/vllm/ can give (multimodal
# items are keyed, not bypassed): /stats and /metrics count bypasses by these reasons only.
# lora: an adapter without local files; cache_salt: longer than a namespace field holds.
BYPASS_REASONS = ("lora", "prompt_embeds", "cache_salt")
DECISION_STRINGS = {"namespace": 1024, "tier": 16, "outcome": 64}  # longest allowed, in characters
DECISION_TIERS = ("", *TIER_LABELS, "peer")  # a decision's slowest tier ("peer": another node's copy)
DECISION_SECONDS = ("predicted_load_s", "predicted_recompute_s", "actual_s")
TIER_COUNTERS = (
    "hits", "misses", "bytes_in", "bytes_out", "evictions", "demotions", "demotions_skipped", "promotions", "errors",
    "checksum_failures",
)
# Why an eviction dropped a block (no tier holds it afterwards), counted per evicting tier: /stats'
# ``tiers.<tier>.drops`` and /metrics' ``kvstore_tier_drops_total{tier,reason}``. A closed set.
DROP_REASONS = (
    "backlog",  # demotions were behind: the staging buffers (tiering.staging_bytes) were all in flight
    "refused",  # the tiers below would not take it (full of blocks that may not go, a tenant's quota)
    "failed",  # its write below failed (an error, an unreadable copy, a stop before it was written)
    "no_tier",  # no tier below this one is up, or it is the last (a DRAM-only sidecar counts none: all its
    # evictions are drops)
)


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

    def merge(self, other: LookupCounters) -> None:
        self.calls += other.calls
        self.blocks_requested += other.blocks_requested
        self.blocks_hit += other.blocks_hit
        self.full_hits += other.full_hits


def _traffic(counters: LookupCounters) -> tuple[int, int]:
    return counters.blocks_requested, counters.calls


def busiest(counts: Mapping[str, float], shown: int) -> set[str]:
    """The ``shown`` labels with the largest counts (``shown``: ``server.stats_namespaces``, the cap
    on the per-tenant series of /stats and /metrics, as on the per-namespace ones). ``"other"``, a
    sum folded already (a tenant tag is never that), is never one of them."""
    return {label for label, _ in Counter({k: n for k, n in counts.items() if k != OTHER}).most_common(shown)}


def folded(counts: Mapping[str, int], keep: Collection[str]) -> dict[str, int]:
    """``counts`` of the labels in ``keep``, every other label's summed under ``"other"`` (absent
    when none is left out): a series per client-chosen label (a cache salt) stays bounded."""
    out = {label: n for label, n in sorted(counts.items()) if label in keep and label != OTHER}
    rest = sum(n for label, n in counts.items() if label not in out)
    if rest:
        out[OTHER] = rest
    return out


def document_json(doc: dict[str, Any]) -> str:
    """The /stats document as strict JSON (a NaN or an infinity raises rather than leak out)."""
    return json.dumps(doc, allow_nan=False)


def check_decision(record: dict[str, Any], where: str) -> None:
    """Raise InvalidArgument, naming ``where``'s field, unless ``record`` is a decision /stats can keep."""
    for name, limit in DECISION_STRINGS.items():
        if len(record[name]) > limit:
            raise InvalidArgument(f"{where}.{name}: {len(record[name])} characters exceed the limit of {limit}")
    for name in DECISION_SECONDS:
        value = record[name]
        if not (math.isfinite(value) and value >= 0):
            raise InvalidArgument(f"{where}.{name}: must be a finite number of seconds >= 0, got {value!r}")
    if record["tier"] not in DECISION_TIERS:
        raise InvalidArgument(f"{where}.tier: {record['tier']!r} is not one of {list(DECISION_TIERS)}")
    kind, colon, reason = record["outcome"].partition(":")
    if record["outcome"] and (kind not in OUTCOMES or (colon and kind not in ("fallback", "bypass"))
                              or (kind == "bypass" and reason not in BYPASS_REASONS)):
        allowed = f"{list(OUTCOMES[:3])}, 'fallback:<reason>' or 'bypass:<one of {list(BYPASS_REASONS)}>'"
        raise InvalidArgument(f"{where}.outcome: {record['outcome']!r} is not one of {allowed}")


@dataclass(slots=True)
class Stats:
    started: float = field(default_factory=time.time)
    lookups: LookupCounters = field(default_factory=LookupCounters)
    per_namespace: dict[str, LookupCounters] = field(default_factory=dict)  # at most 4 x namespaces_shown
    other_namespaces: LookupCounters = field(default_factory=LookupCounters)  # those folded out of it
    namespaces_shown: int = 32  # server.stats_namespaces
    bad_requests: int = 0  # request bodies that did not decode
    tiers: dict[str, Counter[str]] = field(default_factory=lambda: {t: Counter() for t in TIER_LABELS})
    drops: dict[str, Counter[str]] = field(default_factory=lambda: {t: Counter() for t in TIER_LABELS})
    writes: Counter[str] = field(default_factory=Counter)
    reads: Counter[str] = field(default_factory=Counter)
    cluster: Counter[str] = field(default_factory=Counter)  # kvstore/cluster/: directory, peers, fetches
    errors: Counter[str] = field(default_factory=Counter)
    decisions: Counter[str] = field(default_factory=Counter)
    bypasses: Counter[str] = field(default_factory=Counter)  # requests served without the cache, by reason
    recent_decisions: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=50))
    history: deque[dict[str, float]] = field(default_factory=lambda: deque(maxlen=360))
    latency: Latencies = field(default_factory=Latencies)  # histograms (kvstore/stats/latency.py)

    def lookup(self, label: str, requested: int, hit: int) -> None:
        self.lookups.add(requested, hit)
        ns = self.per_namespace.get(label)
        if ns is None:
            if len(self.per_namespace) >= 4 * self.namespaces_shown:
                self._fold_quietest()
            ns = self.per_namespace[label] = LookupCounters()
        ns.add(requested, hit)

    def _fold_quietest(self) -> None:
        """Keep the per-namespace counters bounded: the namespace with the least traffic (the
        longest tracked among equals, so a newcomer has a chance to grow) goes into "other"."""
        quietest = min(self.per_namespace, key=lambda label: _traffic(self.per_namespace[label]))
        self.other_namespaces.merge(self.per_namespace.pop(quietest))

    def namespace_counters(self) -> dict[str, dict[str, Any]]:
        """The busiest ``namespaces_shown`` namespaces by blocks requested, the others summed as "other"."""
        ranked = sorted(self.per_namespace, key=lambda label: _traffic(self.per_namespace[label]), reverse=True)
        shown = sorted([label for label in ranked if label != OTHER][: self.namespaces_shown])
        other = LookupCounters()
        other.merge(self.other_namespaces)
        for label in set(self.per_namespace).difference(shown):
            other.merge(self.per_namespace[label])
        out = {label: self.per_namespace[label].as_dict() for label in shown}
        if other.calls:
            out[OTHER] = other.as_dict()
        return out

    def tier(self, tier: str, counter: str, n: int = 1) -> None:
        self.tiers[tier][counter] += n

    def drop(self, tier: str, reason: str) -> None:
        """An eviction from ``tier`` dropped a block: no tier holds it now (``reason``: DROP_REASONS)."""
        assert reason in DROP_REASONS, reason
        self.drops[tier][reason] += 1

    def decision(self, record: dict[str, Any]) -> None:
        kind, _, reason = record.get("outcome", "unknown").partition(":")
        self.decisions[kind] += 1
        self.decisions["total"] += 1
        if kind == "bypass":
            self.bypasses[reason] += 1
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
            entry["drops"] = {r: self.drops[name].get(r, 0) for r in DROP_REASONS}
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
            "namespaces": self.namespace_counters(),
            "tiers": tiers,
            "writes": dict(self.writes),
            "reads": dict(self.reads),
            "cluster": dict(self.cluster),
            "index": index_counts,
            "errors": dict(self.errors),
            "bad_requests": self.bad_requests,
            "decisions": {"counts": dict(self.decisions), "bypasses": dict(self.bypasses),
                          "recent": list(self.recent_decisions)},
            "history": list(self.history),
            "latency": self.latency.snapshot(),
        }
