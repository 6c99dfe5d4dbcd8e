"""Tenant quotas below DRAM (a tenant is a namespace's cache_salt): on the SSD, in Redis and in S3
a tenant within its quota keeps its blocks however another floods the tier; a tenant past its
quota loses its own oldest blocks first; the per-tier figures are on /stats and /metrics and are
rebuilt from the blocks' headers at restart; a tenant that knows another's keys can neither read,
evict, delete nor probe the blocks it holds below DRAM. Real sidecar over gRPC, an SSD directory,
redis-server (single and a 3-node Redis Cluster), moto's S3."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from kvstore.client import KVStoreClient
from kvstore.config import Config, SsdConfig
from kvstore.keys import Namespace, prefix_keys
from kvstore.server.sidecar import Sidecar
from kvstore.store.books.index import TOP_LABEL
from kvstore.store.books.tenants import salt_tag
from kvstore.tiers import build_tier
from kvstore.tiers.base import BlockRef
from kvstore.tiers.segments.tier import SegmentTier
from kvstore.tiers.ssd import SsdTier
from tests.conftest import small_config
from tests.support.audit import audit

BLOCK = 16 * 1024  # 4 to a 64 KiB page: DRAM holds 16
A = Namespace(model="m", kv_layout="raw", dtype="float16", block_size=16, cache_salt="tenant-a")
B = Namespace(model="m", kv_layout="raw", dtype="float16", block_size=16, cache_salt="tenant-b")
C = Namespace(model="m", kv_layout="raw", dtype="float16", block_size=16, cache_salt="tenant-c")
SSD = SegmentTier if SsdConfig().layout == "segments" else SsdTier  # the default layout's tier
FILE = SSD.footprint(BLOCK, A.label)  # what one block takes of the SSD (header and alignment, if any)
TAG_A, TAG_B = salt_tag("tenant-a"), salt_tag("tenant-b")


def keys(ns: Namespace, n: int, seed: int) -> list[bytes]:
    return prefix_keys(ns, list(range(seed * 10_000, seed * 10_000 + n * 16)))


def data(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(n)]


def ssd_config(tmp_path: Path, **overrides: Any) -> Config:
    base = {"ssd.enabled": True, "ssd.path": str(tmp_path / "ssd"), "ssd.capacity_bytes": 8 * FILE}
    base.update(overrides)
    return small_config(tmp_path, **base)


def where(sc: Sidecar, ns: Namespace, ks: list[bytes]) -> list[str]:
    entry = sc.store.index.namespaces.get(ns.root)
    blocks = entry.blocks if entry is not None else {}
    return [TOP_LABEL[blocks[k].tiers] if k in blocks else "gone" for k in ks]


async def put(sc: Sidecar, c: KVStoreClient, ns: Namespace, ks: list[bytes], bs: list[np.ndarray]) -> None:
    """Write, then wait for the movers (demotions, write-throughs), so every step is ordered."""
    await c.put_blocks(ns, ks, bs)
    await sc.store.tiering.flush()


async def flood(sc: Sidecar, c: KVStoreClient, ns: Namespace, batches: int, seed: int) -> list[list[bytes]]:
    """``batches`` x 4 blocks of ``ns``, each pushing the oldest DRAM blocks below."""
    written = []
    for i in range(batches):
        ks = keys(ns, 4, seed + i)
        await put(sc, c, ns, ks, data(4, seed + i))
        written.append(ks)
    return written


def healthy(sc: Sidecar) -> None:
    assert audit(sc.store, quiescent=True) == []


# ---- the SSD ---------------------------------------------------------------------------------


@pytest.mark.parametrize("quota", [True, False], ids=["with-quota", "without-quota"])
async def test_a_tenant_flooding_the_ssd_cannot_push_another_below_its_quota(tmp_path: Path, quota: bool) -> None:
    """Without the quota the same flood pushes A's blocks off the SSD (the control)."""
    over = {"tenants.ssd_quotas": {"tenant-a": 4 * FILE}} if quota else {}
    async with Sidecar(ssd_config(tmp_path, **over)) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        mine = keys(A, 4, 1)
        await put(sc, c, A, mine, data(4, 1))
        await flood(sc, c, B, 10, 2)  # 40 of B's blocks through 16 DRAM slots and an 8-block SSD
        healthy(sc)
        if not quota:
            assert where(sc, A, mine) == ["gone"] * 4
            return
        assert where(sc, A, mine) == ["ssd"] * 4
        assert [bytes(g) for g in await c.get_blocks(A, mine)] == [bytes(d) for d in data(4, 1)]
        stats = await c.stats()
        assert stats["tenants"][TAG_A]["ssd"] == {"bytes": 4 * FILE, "quota_bytes": 4 * FILE, "evictions": 0,
                                                  "refused": 0}
        assert stats["tenants"][TAG_B]["ssd"]["quota_bytes"] == 0  # B has none: the flood evicted B's own
        assert stats["tenants"][TAG_B]["ssd"]["evictions"] > 0


async def test_a_tenant_over_its_ssd_quota_loses_its_own_oldest_blocks(tmp_path: Path) -> None:
    cfg = ssd_config(tmp_path, **{"ssd.capacity_bytes": 64 * FILE, "tenants.ssd_quota_bytes": 4 * FILE})
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        theirs, old, new = keys(B, 4, 3), keys(A, 4, 4), keys(A, 4, 5)
        await put(sc, c, B, theirs, data(4, 3))
        await put(sc, c, A, old, data(4, 4))
        await put(sc, c, A, new, data(4, 5))
        await flood(sc, c, C, 4, 6)  # 16 blocks of C: B's, then A's old, then A's new go to the SSD
        healthy(sc)
        assert where(sc, B, theirs) == ["ssd"] * 4  # within its quota: untouched
        assert where(sc, A, new) == ["ssd"] * 4
        assert where(sc, A, old) == ["gone"] * 4  # nothing below the SSD: dropped
        stats = (await c.stats())["tenants"]
        a = stats[TAG_A]["ssd"]
        assert (a["bytes"], a["quota_bytes"], a["evictions"] + a["refused"]) == (4 * FILE, 4 * FILE, 4)
        assert stats[TAG_B]["ssd"] == {"bytes": 4 * FILE, "quota_bytes": 4 * FILE, "evictions": 0, "refused": 0}
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{sc.http_port}/metrics") as r:
            text = await r.text()
        assert f'kvstore_tenant_bytes{{tenant="{TAG_A}",tier="ssd"}} {float(4 * FILE)}' in text
        assert f'kvstore_tenant_quota_bytes{{tenant="{TAG_B}",tier="ssd"}} {float(4 * FILE)}' in text


async def test_ssd_quota_evictions_go_on_down_the_chain(tmp_path: Path, redis_clean: Any) -> None:
    """A block the SSD quota pushes out is demoted to Redis (the SSD's normal eviction path)."""
    cfg = ssd_config(tmp_path, **{"ssd.capacity_bytes": 64 * FILE, "tenants.ssd_quota_bytes": 4 * FILE,
                                  "redis.enabled": True, "redis.url": redis_clean.url})
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        old, new = keys(A, 4, 7), keys(A, 4, 8)
        await put(sc, c, A, old, data(4, 7))
        await put(sc, c, A, new, data(4, 8))
        await flood(sc, c, C, 4, 9)
        healthy(sc)
        assert where(sc, A, new) == ["ssd"] * 4 and where(sc, A, old) == ["redis"] * 4
        assert [bytes(g) for g in await c.get_blocks(A, old)] == [bytes(d) for d in data(4, 7)]


async def test_ssd_quotas_are_rebuilt_from_the_block_headers_at_restart(tmp_path: Path) -> None:
    """The tenants of a restarted sidecar's SSD blocks come from their headers: the same figures,
    and a quota lowered meanwhile is enforced on what was recovered (A's oldest go)."""
    quotas = {"tenants.ssd_quotas": {"tenant-a": 4 * FILE, "tenant-b": 4 * FILE}, "ssd.capacity_bytes": 64 * FILE}
    theirs, mine = keys(B, 4, 10), keys(A, 4, 11)
    async with (
        Sidecar(ssd_config(tmp_path, **quotas)) as sc,
        KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c,
    ):
        await put(sc, c, B, theirs, data(4, 10))
        await put(sc, c, A, mine, data(4, 11))
        await flood(sc, c, C, 4, 12)
        before = (await c.stats())["tenants"]
        assert before[TAG_A]["ssd"]["bytes"] == before[TAG_B]["ssd"]["bytes"] == 4 * FILE
    async with Sidecar(ssd_config(tmp_path, **quotas)) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        after = (await c.stats())["tenants"]
        assert {t: after[t]["ssd"]["bytes"] for t in (TAG_A, TAG_B)} == {TAG_A: 4 * FILE, TAG_B: 4 * FILE}
        assert where(sc, A, mine) == ["ssd"] * 4
    lowered = {**quotas, "tenants.ssd_quotas": {"tenant-a": 2 * FILE, "tenant-b": 4 * FILE}}
    async with Sidecar(ssd_config(tmp_path, **lowered)) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        await sc.store.tiering.flush()  # the trim started with the recovery
        healthy(sc)
        after = (await c.stats())["tenants"]
        assert after[TAG_A]["ssd"]["bytes"] == 2 * FILE and after[TAG_A]["ssd"]["evictions"] == 2
        assert where(sc, B, theirs) == ["ssd"] * 4
        assert sorted(where(sc, A, mine)) == ["gone", "gone", "ssd", "ssd"]


async def test_recovered_blocks_take_their_tenant_from_the_header_not_the_label(tmp_path: Path) -> None:
    """Issue 29 item 4 at restart: the blocks of a namespace without salt whose model reads
    "m#<A's tag>" are the unsalted tenant's on the SSD, and stay so when a restarted sidecar
    recovers them (the header carries the tenant as a field); A's figures are its own blocks'.
    On 8dc5782 the tenant was parsed out of the label: the posing blocks counted as A's."""
    posing = Namespace(model=f"m#{TAG_A}", kv_layout="raw", dtype="float16", block_size=16)
    quotas = {"tenants.ssd_quotas": {"tenant-a": 4 * FILE}, "ssd.capacity_bytes": 64 * FILE}
    mine, theirs = keys(A, 4, 20), keys(posing, 4, 21)
    posing_file = SSD.footprint(BLOCK, posing.label)
    async with (
        Sidecar(ssd_config(tmp_path, **quotas)) as sc,
        KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c,
    ):
        await put(sc, c, A, mine, data(4, 20))
        await put(sc, c, posing, theirs, data(4, 21))
        await flood(sc, c, C, 4, 22)  # 16 blocks: the 8 above go down to the SSD
        assert where(sc, A, mine) == where(sc, posing, theirs) == ["ssd"] * 4
    async with Sidecar(ssd_config(tmp_path, **quotas)) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        await sc.store.tiering.flush()  # (a trim, were any tenant over its quota)
        healthy(sc)
        after = (await c.stats())["tenants"]
        assert after[TAG_A]["ssd"] == {"bytes": 4 * FILE, "quota_bytes": 4 * FILE, "evictions": 0, "refused": 0}
        assert after["-"]["ssd"]["bytes"] == 4 * posing_file
        assert where(sc, A, mine) == where(sc, posing, theirs) == ["ssd"] * 4
        got = await c.get_blocks(A, mine)
        assert [bytes(g) for g in got] == [bytes(d) for d in data(4, 20)]


# ---- Redis and S3: a cap per tenant on what kvstore writes there ---------------------------------


@pytest.fixture(params=["redis", "redis-cluster", "s3"])
def remote(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    """Overrides for a sidecar with a write-through remote tier (and no SSD)."""
    if request.param == "redis":
        srv = request.getfixturevalue("redis_clean")
        over = {"redis.enabled": True, "redis.url": srv.url, "redis.chunk_bytes": 65536}
    elif request.param == "redis-cluster":
        srv = request.getfixturevalue("cluster_clean")
        over = {"redis.enabled": True, "redis.cluster": True, "redis.url": srv.url, "redis.chunk_bytes": 65536}
    else:
        srv = request.getfixturevalue("moto_clean")
        request.getfixturevalue("aws_env")
        over = {"s3.enabled": True, "s3.endpoint_url": srv.url}
    tier = "s3" if request.param == "s3" else "redis"
    return {"ssd.enabled": False, "tiering.write_through": [tier], "tiering.chain": [tier], **over, "_tier": tier}


def remote_config(tmp_path: Path, remote: dict[str, Any], **overrides: Any) -> tuple[Config, str]:
    over = {k: v for k, v in remote.items() if k != "_tier"}
    return small_config(tmp_path, **over, **overrides), remote["_tier"]


async def in_tier(cfg: Config, name: str, ns: Namespace, ks: list[bytes]) -> list[bool]:
    """What the tier's server itself holds (a fresh client of its own, not the sidecar's books)."""
    tier = build_tier(name, cfg)
    try:
        return await tier.contains_many([BlockRef(ns.root, k) for k in ks])  # type: ignore[arg-type]
    finally:
        await tier.close()


async def test_a_tenant_flooding_a_remote_tier_stays_within_its_cap(tmp_path: Path, remote: dict[str, Any]) -> None:
    """B floods write-through: what the server holds of B never passes B's cap, B's oldest go
    first, and A's blocks (within A's cap) all stay, readable after DRAM has let them go."""
    cfg, name = remote_config(tmp_path, remote, **{f"tenants.{remote['_tier']}_quota_bytes": 4 * BLOCK})
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        mine = keys(A, 4, 20)
        await put(sc, c, A, mine, data(4, 20))
        floods = await flood(sc, c, B, 10, 21)
        healthy(sc)
        assert await in_tier(cfg, name, A, mine) == [True] * 4
        held = [await in_tier(cfg, name, B, ks) for ks in floods]
        assert held == [[False] * 4] * 9 + [[True] * 4]  # B's newest 4: its cap
        stats = (await c.stats())["tenants"]
        assert stats[TAG_A][name] == {"bytes": 4 * BLOCK, "quota_bytes": 4 * BLOCK, "evictions": 0, "refused": 0}
        # B's copies of 9 batches went as newer ones came; the demotions of the 6 batches DRAM let
        # go were refused (older than what B has there: its write-throughs)
        assert stats[TAG_B][name] == {"bytes": 4 * BLOCK, "quota_bytes": 4 * BLOCK, "evictions": 36, "refused": 24}
        assert where(sc, A, mine) == [name] * 4  # DRAM let them go; the remote copy serves
        assert [bytes(g) for g in await c.get_blocks(A, mine)] == [bytes(d) for d in data(4, 20)]
    # A restart recovers the blocks from the tier's headers: the same figures per tenant.
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        stats = (await c.stats())["tenants"]
        assert {t: stats[t][name]["bytes"] for t in (TAG_A, TAG_B)} == {TAG_A: 4 * BLOCK, TAG_B: 4 * BLOCK}


# ---- isolation below DRAM ------------------------------------------------------------------------


@pytest.mark.parametrize("tier", ["ssd", "redis"])
async def test_a_tenant_knowing_anothers_keys_cannot_reach_its_blocks_below_dram(
    tmp_path: Path, tier: str, request: pytest.FixtureRequest
) -> None:
    """A's blocks live only on the SSD (or in Redis); B sends A's keys under its own namespace:
    Lookup, Get, Delete and a probing Allocate find nothing, B's own blocks under the same keys
    leave A's bytes as they were, and B's flood cannot evict them."""
    if tier == "ssd":
        cfg = ssd_config(tmp_path, **{"ssd.capacity_bytes": 64 * FILE, "tenants.ssd_quota_bytes": 4 * FILE})
    else:
        srv = request.getfixturevalue("redis_clean")
        cfg = small_config(tmp_path, **{"redis.enabled": True, "redis.url": srv.url, "redis.chunk_bytes": 65536,
                                        "tenants.redis_quota_bytes": 4 * BLOCK})
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        mine = keys(A, 4, 30)
        await put(sc, c, A, mine, data(4, 30))
        await flood(sc, c, C, 4, 31)
        assert where(sc, A, mine) == [tier] * 4
        assert (await c.lookup(B, mine)).matched == 0  # probe by lookup
        assert await c.get_blocks(B, mine) == []  # read
        assert await c.delete(B, mine) == (0, 0)  # delete
        async with c.allocate(B, mine, [BLOCK] * 4) as alloc:  # probe by a write: nothing is "present"
            assert [i for i, _ in alloc.writable()] == [0, 1, 2, 3]
            await alloc.abort()
        await put(sc, c, B, mine, data(4, 32))  # B's own blocks under A's keys
        await flood(sc, c, B, 6, 33)  # and B floods the tier: B's quota, B's blocks
        healthy(sc)
        assert where(sc, A, mine) == [tier] * 4
        assert [bytes(g) for g in await c.get_blocks(A, mine)] == [bytes(d) for d in data(4, 30)]
