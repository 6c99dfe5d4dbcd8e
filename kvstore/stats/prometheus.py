"""/metrics: the /stats snapshot as Prometheus exposition (prometheus-client).

    body, content_type = render(store.snapshot())

One custom collector reads the snapshot document; nothing is counted twice and there is no
global registry. Every name starts with ``kvstore_``; per-tier series carry ``tier``, per
namespace series ``namespace`` (the busiest ``server.stats_namespaces`` and ``other``, as on
/stats). Counters end in ``_total``; ratios and occupancy are gauges; latencies are histograms
``kvstore_<family>_duration_seconds`` (buckets 50 µs to 10 s, kvstore/stats/latency.py), each
family exported, with its HELP and TYPE, before its first observation.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstore.stats.counters import DROP_REASONS
from kvstore.stats.latency import BOUNDS_S, FAMILIES

PREFIX = "kvstore_"

# /stats tier counter -> (metric name without prefix/_total, help)
TIER_COUNTERS = {
    "hits": "blocks found in this tier by lookups",
    "misses": "lookups that fell through this tier",
    "bytes_in": "bytes written into this tier",
    "bytes_out": "bytes read out of this tier",
    "evictions": "blocks evicted from this tier",
    "demotions": "blocks demoted from this tier to a lower one",
    "demotions_skipped": "blocks let go without a demotion: a lower tier held them and demotions were behind",
    "promotions": "blocks promoted from this tier to DRAM",
    "errors": "failed operations on this tier",
    "checksum_failures": "blocks whose checksum did not match when read from this tier",
}
TIER_GAUGES = {
    "used_bytes": "bytes held in this tier",
    "capacity_bytes": "configured capacity of this tier in bytes (0: unbounded)",
    "recycled_bytes": "bytes of deleted blocks' files kept to be overwritten (SSD; on disk, within the capacity)",
    "blocks": "blocks held in this tier",
}


def _counter(name: str, doc: str, labels: list[str] | None = None) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, labels=labels)


def _gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, labels=labels)


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) else 0.0


class SnapshotCollector(Collector):
    """Prometheus families from one /stats document."""

    def __init__(self, snapshot: Mapping[str, Any]) -> None:
        self.doc = snapshot

    def collect(self) -> Iterator[Metric]:
        yield from self._service()
        yield from self._lookups()
        yield from self._namespaces()
        yield from self._tiers()
        yield from self._events()
        yield from self._tenants()
        yield from self._retained()
        yield from self._latencies()

    def _retained(self) -> Iterator[Metric]:
        """Retention hints (kvstore/store/books/retention.py): bytes retained now per tier and tenant."""
        doc: Mapping[str, Any] = self.doc.get("retained", {})
        if not doc:
            return
        g = _gauge("retained_bytes", "bytes of blocks retained now (retention hints), per tier and tenant",
                   ["tier", "tenant"])
        for tier, by_tenant in sorted(doc.get("tenants", {}).items()):
            for t, n in sorted(by_tenant.items()):
                g.add_metric([tier, t], _num(n))
        blocks = _gauge("retained_blocks", "blocks retained now (retention hints) that some tier holds")
        blocks.add_metric([], _num(doc.get("blocks")))
        refused = _counter("retain_refused", "retention hints refused by a tenant's bound", ["tenant"])
        for t, n in sorted(doc.get("refused", {}).items()):
            refused.add_metric([t], _num(n))
        yield from (g, blocks, refused)

    def _latencies(self) -> Iterator[Metric]:
        section: Mapping[str, Any] = self.doc.get("latency", {})
        bounds = [repr(float(b)) for b in section.get("bounds_s", BOUNDS_S)] + ["+Inf"]  # (5e-05, 0.0001, 1.0)
        for family, (names, doc) in FAMILIES.items():
            h = HistogramMetricFamily(f"{PREFIX}{family}_duration_seconds", f"seconds: {doc}", labels=list(names))
            for row in section.get(family, []):
                seen, cumulative = 0, []
                for le, n in zip(bounds, row["buckets"]):
                    seen += n
                    cumulative.append((le, float(seen)))
                h.add_metric([str(row[n]) for n in names], cumulative, _num(row.get("sum_s")))
            yield h

    def _tenants(self) -> Iterator[Metric]:
        tenants: Mapping[str, Any] = self.doc.get("tenants", {})
        if not tenants:
            return
        labels = ["tenant", "tier"]
        used = _gauge("tenant_bytes", "bytes of each tenant's (cache_salt tag's) blocks per tier with quotas", labels)
        quota = _gauge("tenant_quota_bytes", "each tenant's quota in each tier (0: none)", labels)
        ev = _counter("tenant_evictions", "evictions of each tenant's blocks from each tier with quotas", labels)
        refused = _counter("tenant_refused_blocks", "blocks a tenant's quota kept out of a tier", labels)
        for t, tiers in sorted(tenants.items()):
            for tier, c in sorted(tiers.items()):
                used.add_metric([t, tier], _num(c.get("bytes")))
                quota.add_metric([t, tier], _num(c.get("quota_bytes")))
                ev.add_metric([t, tier], _num(c.get("evictions")))
                refused.add_metric([t, tier], _num(c.get("refused")))
        yield from (used, quota, ev, refused)

    def _service(self) -> Iterator[Metric]:
        g = _gauge("uptime_seconds", "seconds since the sidecar started")
        g.add_metric([], _num(self.doc.get("uptime_s")))
        yield g
        info = _gauge("policy_info", "the eviction policy in use (value is always 1)", ["policy"])
        info.add_metric([str(self.doc.get("policy", "unknown"))], 1.0)
        yield info
        index = _gauge("index_entries", "entries in the block index", ["kind"])
        for kind, n in sorted(self.doc.get("index", {}).items()):
            index.add_metric([kind], _num(n))
        yield index

    def _lookups(self) -> Iterator[Metric]:
        lk = self.doc.get("lookups", {})
        for key, name, doc in (
            ("calls", "lookups", "Lookup calls"),
            ("blocks_requested", "lookup_blocks_requested", "blocks asked for by lookups"),
            ("blocks_hit", "lookup_blocks_hit", "blocks found by lookups (leading run)"),
            ("full_hits", "lookup_full_hits", "lookups whose every block was found"),
        ):
            c = _counter(name, doc)
            c.add_metric([], _num(lk.get(key)))
            yield c
        g = _gauge("hit_ratio", "blocks hit / blocks requested, since start")
        g.add_metric([], _num(self.doc.get("hit_rate")))
        yield g

    def _namespaces(self) -> Iterator[Metric]:
        nss: Mapping[str, Any] = self.doc.get("namespaces", {})
        calls = _counter("namespace_lookups", "Lookup calls per namespace", ["namespace"])
        req = _counter("namespace_blocks_requested", "blocks asked for per namespace", ["namespace"])
        hit = _counter("namespace_blocks_hit", "blocks found per namespace", ["namespace"])
        ratio = _gauge("namespace_hit_ratio", "blocks hit / blocks requested per namespace", ["namespace"])
        for label, c in nss.items():
            calls.add_metric([label], _num(c.get("calls")))
            req.add_metric([label], _num(c.get("blocks_requested")))
            hit.add_metric([label], _num(c.get("blocks_hit")))
            ratio.add_metric([label], _num(c.get("hit_rate")))
        yield from (calls, req, hit, ratio)

    def _tiers(self) -> Iterator[Metric]:
        tiers: Mapping[str, Any] = self.doc.get("tiers", {})
        by_tier: Mapping[str, Any] = self.doc.get("hit_rate_by_tier", {})
        for key, doc in TIER_COUNTERS.items():
            c = _counter(f"tier_{key}", doc, ["tier"])
            for tier, t in tiers.items():
                c.add_metric([tier], _num(t.get(key)))
            yield c
        for key, doc in TIER_GAUGES.items():
            g = _gauge(f"tier_{key}", doc, ["tier"])
            for tier, t in tiers.items():
                if t.get("enabled"):
                    g.add_metric([tier], _num(t.get(key)))
            yield g
        drops = _counter("tier_drops", "blocks an eviction from this tier dropped (no tier holds them now), by reason",
                         ["tier", "reason"])
        for tier, t in tiers.items():
            for reason in DROP_REASONS:
                drops.add_metric([tier, reason], _num(t.get("drops", {}).get(reason)))
        yield drops
        enabled = _gauge("tier_enabled", "1 when the tier is configured", ["tier"])
        down = _gauge("tier_down", "1 while the tier is unreachable", ["tier"])
        ratio = _gauge("tier_hit_ratio", "blocks hit in this tier / blocks requested", ["tier"])
        for tier, t in tiers.items():
            enabled.add_metric([tier], 1.0 if t.get("enabled") else 0.0)
            down.add_metric([tier], 1.0 if t.get("down") else 0.0)
            ratio.add_metric([tier], _num(by_tier.get(tier)))
        yield from (enabled, down, ratio)

    def _events(self) -> Iterator[Metric]:
        for section, name, doc in (
            ("writes", "writes", "write-path events (allocations, commits, blocks committed, ...)"),
            ("reads", "reads", "read-path events (acquires, blocks, bytes, expired leases)"),
            ("cluster", "cluster", "cluster events (directory round trips, peer hits, blocks fetched, ...)"),
        ):
            c = _counter(name, doc, ["event"])
            for event, n in sorted(self.doc.get(section, {}).items()):
                c.add_metric([event], _num(n))
            yield c
        errors = _counter("errors", "requests answered with an error, by gRPC status code", ["code"])
        for code, n in sorted(self.doc.get("errors", {}).items()):
            errors.add_metric([code], _num(n))
        yield errors
        bad = _counter("bad_requests", "request bodies that did not decode as their method's message")
        bad.add_metric([], _num(self.doc.get("bad_requests")))
        yield bad
        decisions = _counter("decisions", "reload-vs-recompute outcomes reported by connectors", ["outcome"])
        for outcome, n in sorted(self.doc.get("decisions", {}).get("counts", {}).items()):
            if outcome != "total":
                decisions.add_metric([outcome], _num(n))
        yield decisions
        bypasses = _counter("bypasses", "requests connectors served without the cache (no lookup, no save), by reason",
                            ["reason"])
        for reason, n in sorted(self.doc.get("decisions", {}).get("bypasses", {}).items()):
            bypasses.add_metric([reason], _num(n))
        yield bypasses


def render(snapshot: Mapping[str, Any]) -> tuple[bytes, str]:
    """(exposition body, Content-Type) for one /stats snapshot."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snapshot))
    return generate_latest(registry), CONTENT_TYPE_LATEST
