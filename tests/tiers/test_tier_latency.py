"""Latency of tier moves through a real sidecar: demotions and promotions (SSD), write-through
(redis-server), on /stats by tier and outcome; and a call to a tier that fails (redis-server
stopped) timed too, as ``outcome="error"`` on /metrics (before, only the calls that succeeded were)."""

from __future__ import annotations

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.client import KVStoreClient
from kvstore.server.sidecar import Sidecar
from tests.tiers.test_tiering import NS, PAGE, blocks_for, chain, placement, settle, tiered_config


def by_tier(doc: dict, family: str, outcome: str = "ok") -> dict[str, dict]:
    return {r["tier"]: r for r in doc["latency"][family] if r["outcome"] == outcome}


async def test_demotions_promotions_and_write_through_are_timed_by_tier(tmp_path, redis_clean):
    cfg = tiered_config(
        tmp_path, **{"redis.enabled": True, "redis.url": redis_clean.url, "tiering.write_through": ["redis"]}
    )
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        a, b = chain(1, 4), chain(2, 4)
        await c.put_blocks(NS, a, blocks_for(4, 1), wait_write_through=True)
        await c.put_blocks(NS, b, blocks_for(4, 2), wait_write_through=True)  # DRAM holds 4: a goes down
        await settle(sc)
        assert len(await c.get_blocks(NS, a)) == 4  # promoted back (from the SSD, the fastest copy)
        doc = await c.stats()
    wt = by_tier(doc, "write_through")
    assert set(wt) == {"redis"} and wt["redis"]["count"] == 2  # one per commit
    demoted = by_tier(doc, "demotion")
    assert demoted["ssd"]["count"] >= 1 and demoted["ssd"]["p99_s"] > 0
    promoted = by_tier(doc, "promotion")
    assert promoted["ssd"]["count"] >= 1 and 0 < promoted["ssd"]["p50_s"] <= promoted["ssd"]["p99_s"]
    assert doc["tiers"]["ssd"]["promotions"] == 4
    assert not any(by_tier(doc, f, "error") for f in ("write_through", "demotion", "promotion"))  # all went well


async def timed_calls(sc: Sidecar, family: str) -> dict[tuple[str, str], float]:
    """``kvstore_<family>_duration_seconds_count`` on /metrics, by (tier, outcome)."""
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{sc.http_port}/metrics") as r:
        text = await r.text()
    [fam] = [f for f in text_string_to_metric_families(text) if f.name == f"kvstore_{family}_duration_seconds"]
    return {(s.labels["tier"], s.labels["outcome"]): s.value for s in fam.samples if s.name.endswith("_count")}


def redis_config(tmp_path, redis, **over):
    return tiered_config(
        tmp_path, **{"ssd.enabled": False, "redis.enabled": True, "redis.url": redis.url, "redis.retries": 0, **over}
    )


async def test_a_promotion_from_a_stopped_redis_is_timed_as_an_error(tmp_path, redis_clean):
    async with (
        Sidecar(redis_config(tmp_path, redis_clean)) as sc,
        KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c,
    ):
        a = chain(50, 2)
        await c.put_blocks(NS, a, blocks_for(2, 50))
        await c.put_blocks(NS, chain(51, 4), blocks_for(4, 51))  # DRAM holds 4: a goes down
        await settle(sc)
        assert placement(sc, a) == ["redis", "redis"]
        redis_clean.stop()
        assert len(await c.get_blocks(NS, a)) == 0  # the read failed: a miss
        calls = await timed_calls(sc, "promotion")
    assert calls[("redis", "error")] == 1 and ("redis", "ok") not in calls


@pytest.mark.parametrize("below", ["dram", "ssd"])
async def test_a_demotion_to_a_stopped_redis_is_timed_as_an_error(tmp_path, redis_clean, below):
    """The batch written from DRAM (kvstore/movers/demotion.py), or the copy of a block an SSD
    eviction passes down (kvstore/movers/eviction.py)."""
    over = {"ssd.enabled": True, "ssd.capacity_bytes": 2 * PAGE + 8192} if below == "ssd" else {}
    async with (
        Sidecar(redis_config(tmp_path, redis_clean, **over)) as sc,
        KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c,
    ):
        redis_clean.stop()  # (once the sidecar found it up: a tier down from the start is never written to)
        for i in range(4):  # DRAM holds 4 blocks, the SSD 2: the first chains go down
            await c.put_blocks(NS, chain(60 + i, 2), blocks_for(2, 60 + i))
            await settle(sc)
        calls = await timed_calls(sc, "demotion")
        assert (await c.stats())["tiers"]["redis"]["down"] is True
    assert calls[("redis", "error")] >= 1 and ("redis", "ok") not in calls
    if below == "ssd":
        assert calls[("ssd", "ok")] >= 1


async def test_a_write_through_to_a_stopped_redis_is_timed_as_an_error(tmp_path, redis_clean):
    cfg = redis_config(tmp_path, redis_clean, **{"tiering.write_through": ["redis"]})
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        redis_clean.stop()
        r = await c.put_blocks(NS, chain(70, 2), blocks_for(2, 70), wait_write_through=True)
        assert (r.stored, r.written_through) == (2, 0)
        calls = await timed_calls(sc, "write_through")
    assert calls == {("redis", "error"): 1}
