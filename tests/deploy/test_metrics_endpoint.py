"""/metrics: the /stats document in Prometheus exposition, names ``kvstore_*``."""

from __future__ import annotations

import json
import urllib.request

import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families
from traffic import NAMESPACES, one_round

from kvstore.client import SyncClient
from kvstore.stats.prometheus import render
from tests.support.sidecar_args import loopback_args


def scrape(http: str) -> tuple[dict[str, dict[tuple, float]], str]:
    with urllib.request.urlopen(f"http://{http}/metrics") as r:
        ctype = r.headers["Content-Type"]
        text = r.read().decode()
    samples: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples, ctype


@pytest.fixture
def busy_sidecar(serve_process, tmp_path):
    sc = serve_process(loopback_args(tmp_path / "d", 8 << 20))
    with SyncClient(sc.grpc) as c:
        for r in range(6):
            one_round(c, r)
    return sc


def test_metrics_match_stats(busy_sidecar):
    m, ctype = scrape(busy_sidecar.http)
    doc = json.loads(urllib.request.urlopen(f"http://{busy_sidecar.http}/stats").read())
    assert ctype == CONTENT_TYPE_LATEST and ctype.startswith("text/plain")
    assert all(name.startswith("kvstore_") for name in m)
    assert m["kvstore_lookups_total"][()] == doc["lookups"]["calls"] == 6
    assert m["kvstore_lookup_blocks_requested_total"][()] == doc["lookups"]["blocks_requested"]
    assert m["kvstore_lookup_blocks_hit_total"][()] == doc["lookups"]["blocks_hit"] > 0
    assert m["kvstore_hit_ratio"][()] == pytest.approx(doc["hit_rate"])
    for ns in NAMESPACES:
        key = (("namespace", ns.label),)
        assert m["kvstore_namespace_blocks_hit_total"][key] == doc["namespaces"][ns.label]["blocks_hit"]
        assert m["kvstore_namespace_hit_ratio"][key] == pytest.approx(doc["namespaces"][ns.label]["hit_rate"])
    dram = (("tier", "dram"),)
    assert m["kvstore_tier_hits_total"][dram] == doc["tiers"]["dram"]["hits"]
    assert m["kvstore_tier_used_bytes"][dram] == doc["tiers"]["dram"]["used_bytes"] > 0
    assert m["kvstore_tier_capacity_bytes"][dram] == 8 << 20
    assert m["kvstore_tier_enabled"][dram] == 1 and m["kvstore_tier_enabled"][(("tier", "s3"),)] == 0
    assert set(m["kvstore_tier_evictions_total"]) == {(("tier", t),) for t in ("dram", "ssd", "redis", "s3")}
    for outcome, n in doc["decisions"]["counts"].items():
        if outcome != "total":
            assert m["kvstore_decisions_total"][(("outcome", outcome),)] == n
    assert (
        sum(m["kvstore_decisions_total"].values()) == doc["decisions"]["counts"]["total"] == 4
    )  # rounds 2..5 found a prefix
    assert m["kvstore_writes_total"][(("event", "blocks_committed"),)] == doc["writes"]["blocks_committed"]
    assert m["kvstore_policy_info"][(("policy", doc["policy"]),)] == 1


def test_render_covers_every_section_of_a_snapshot():
    doc = {
        "uptime_s": 3.5, "policy": "lru", "hit_rate": 0.5, "index": {"blocks": 4},
        "lookups": {"calls": 2, "blocks_requested": 8, "blocks_hit": 4, "full_hits": 1, "hit_rate": 0.5},
        "hit_rate_by_tier": {"dram": 0.25, "ssd": 0.25},
        "namespaces": {'m "quoted"\\ns': {"calls": 2, "blocks_requested": 8, "blocks_hit": 4, "hit_rate": 0.5}},
        "tiers": {"dram": {"hits": 2, "enabled": True, "used_bytes": 10, "capacity_bytes": 100, "blocks": 1},
                  "ssd": {"hits": 2, "demotions": 3, "enabled": True, "down": True, "used_bytes": 5}},
        "writes": {"commits": 1}, "reads": {"bytes": 9}, "errors": {"NOT_FOUND": 2},
        "decisions": {"counts": {"loaded": 1, "fallback": 1, "bypass": 1, "total": 3}, "bypasses": {"lora": 1},
                      "recent": []},
    }
    body, _ = render(doc)
    fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert (
        fams["kvstore_tier_down"].samples[1].labels == {"tier": "ssd"}
        and fams["kvstore_tier_down"].samples[1].value == 1
    )
    assert fams["kvstore_tier_demotions"].type == "counter"
    assert fams["kvstore_namespace_blocks_hit"].samples[0].labels == {"namespace": 'm "quoted"\\ns'}
    assert fams["kvstore_errors"].samples[0].labels == {"code": "NOT_FOUND"}
    assert {s.labels["outcome"] for s in fams["kvstore_decisions"].samples} == {"loaded", "fallback", "bypass"}
    assert [(s.labels, s.value) for s in fams["kvstore_bypasses"].samples] == [({"reason": "lora"}, 1)]
    assert fams["kvstore_uptime_seconds"].samples[0].value == 3.5
