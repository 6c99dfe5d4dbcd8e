"""Latency of tier moves through a real sidecar: demotions and promotions (SSD), write-through
(redis-server), on /stats by tier."""

from __future__ import annotations

from kvstore.client import KVStoreClient
from kvstore.server.sidecar import Sidecar
from tests.tiers.test_tiering import NS, blocks_for, chain, settle, tiered_config


def by_tier(doc: dict, family: str) -> dict[str, dict]:
    return {r["tier"]: r for r in doc["latency"][family]}


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
