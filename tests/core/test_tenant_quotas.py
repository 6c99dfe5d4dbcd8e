"""Tenant quotas and isolation (a tenant is a namespace's cache_salt): a tenant within its DRAM
quota is never evicted for another; a tenant over it evicts its own blocks first; a tenant that
knows another's keys can neither read, evict, delete nor probe for them. Real sidecar, real gRPC."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from kvstore.client import KVStoreClient
from kvstore.config import QUOTA_TIERS, load_config
from kvstore.errors import ConfigError, ResourceExhausted
from kvstore.keys import Namespace, prefix_keys
from kvstore.server.sidecar import Sidecar
from kvstore.store.books.tenants import Tenants, salt_tag
from tests.conftest import small_config

BLOCK = 16 * 1024  # 4 to a 64 KiB page: the slab holds 16
A = Namespace(model="m", kv_layout="raw", dtype="float16", block_size=16, cache_salt="tenant-a")
B = Namespace(model="m", kv_layout="raw", dtype="float16", block_size=16, cache_salt="tenant-b")
QUOTA_A = 4 * BLOCK


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[tuple[Sidecar, KVStoreClient]]:
    cfg = small_config(tmp_path, **{"tenants.dram_quotas": {"tenant-a": QUOTA_A}})
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        yield sc, c


def keys(ns: Namespace, n: int, seed: int) -> list[bytes]:
    return prefix_keys(ns, list(range(seed * 10_000, seed * 10_000 + n * 16)))


def data(n: int, seed: int) -> list[np.ndarray]:
    return [np.full(BLOCK, (seed * 31 + i) % 251, dtype=np.uint8) for i in range(n)]


async def test_a_flooding_tenant_cannot_push_another_below_its_quota(env: tuple[Sidecar, KVStoreClient]) -> None:
    _, c = env
    mine = keys(A, 4, 1)
    await c.put_blocks(A, mine, data(4, 1))
    for seed in range(2, 12):  # 40 blocks of tenant B through a 16-block slab
        await c.put_blocks(B, keys(B, 4, seed), data(4, seed))
    assert (await c.lookup(A, mine)).matched == 4  # all of A's quota is still there
    got = await c.get_blocks(A, mine)
    assert [bytes(g) for g in got] == [bytes(d) for d in data(4, 1)]
    assert (await c.lookup(B, keys(B, 4, 2))).matched == 0  # B made room from its own blocks


async def test_a_tenant_over_its_quota_evicts_its_own_blocks_first(env: tuple[Sidecar, KVStoreClient]) -> None:
    _, c = env
    theirs = keys(B, 4, 3)
    await c.put_blocks(B, theirs, data(4, 3))
    first, second = keys(A, 4, 4), keys(A, 2, 5)
    await c.put_blocks(A, first, data(4, 4))
    await c.put_blocks(A, second, data(2, 5))  # 2 over the quota, with free slots left
    assert (await c.lookup(B, theirs)).matched == 4  # B untouched
    assert (await c.lookup(A, second)).matched == 2
    held = [(await c.lookup(A, [k])).matched for k in first]
    assert sum(held) == 2  # two of A's first blocks made the room
    stats = await c.stats()
    assert stats["tenants"][salt_tag("tenant-a")] == {
        "dram": {"bytes": QUOTA_A, "quota_bytes": QUOTA_A, "evictions": 2, "refused": 0}}


async def test_a_tenant_whose_blocks_are_all_leased_is_refused_and_nothing_changes(
    env: tuple[Sidecar, KVStoreClient],
) -> None:
    sc, c = env
    mine, theirs = keys(A, 4, 6), keys(B, 2, 7)
    await c.put_blocks(A, mine, data(4, 6))
    await c.put_blocks(B, theirs, data(2, 7))
    before = sc.store.snapshot()
    async with c.acquire(A, mine):
        with pytest.raises(ResourceExhausted, match="DRAM quota of 65536 bytes"):
            await c.put_blocks(A, keys(A, 1, 8), data(1, 8))
    after = sc.store.snapshot()
    assert after["tiers"]["dram"]["evictions"] == before["tiers"]["dram"]["evictions"]
    assert after["tenants"][salt_tag("tenant-a")]["dram"]["refused"] == 1  # the one block asked for
    assert (await c.lookup(A, mine)).matched == 4 and (await c.lookup(B, theirs)).matched == 2


async def test_a_tenant_knowing_anothers_keys_can_neither_read_evict_delete_nor_probe(
    env: tuple[Sidecar, KVStoreClient],
) -> None:
    _, c = env
    mine = keys(A, 3, 9)
    await c.put_blocks(A, mine, data(3, 9))
    assert (await c.lookup(B, mine)).matched == 0  # probe by lookup
    assert await c.get_blocks(B, mine) == []  # read
    assert (await c.delete(B, mine)) == (0, 0)  # delete
    async with c.allocate(B, mine, [BLOCK] * 3) as alloc:  # probe by a write: nothing is "present"
        assert [i for i, _ in alloc.writable()] == [0, 1, 2]
        await alloc.abort()
    assert (await c.lookup(A, mine)).matched == 3


async def test_tenants_are_on_stats_and_metrics(env: tuple[Sidecar, KVStoreClient]) -> None:
    sc, c = env
    await c.put_blocks(A, keys(A, 2, 10), data(2, 10))
    await c.put_blocks(B, keys(B, 1, 11), data(1, 11))
    tenants = (await c.stats())["tenants"]
    assert tenants[salt_tag("tenant-a")]["dram"]["bytes"] == 2 * BLOCK
    assert tenants[salt_tag("tenant-b")] == {"dram": {"bytes": BLOCK, "quota_bytes": 0, "evictions": 0, "refused": 0}}
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{sc.http_port}/metrics") as r:
        text = await r.text()
    a = salt_tag("tenant-a")
    assert f'kvstore_tenant_bytes{{tenant="{a}",tier="dram"}} {float(2 * BLOCK)}' in text
    assert f'kvstore_tenant_quota_bytes{{tenant="{a}",tier="dram"}} {float(QUOTA_A)}' in text


# ---- configuration -------------------------------------------------------------------------------


def test_every_tier_takes_a_quota_from_the_file_and_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    toml = tmp_path / "kvstore.toml"
    toml.write_text('[tenants]\ndram_quota_bytes = 100\ndram_quotas = {"tenant-a" = 7}\nssd_quota_bytes = 200\n'
                    's3_quotas = {"tenant-b" = 9}\n')
    monkeypatch.setenv("KVSTORE_TENANTS__REDIS_QUOTA_BYTES", "300")
    monkeypatch.setenv("KVSTORE_TENANTS__SSD_QUOTAS", '{"tenant-a": 0}')
    t = load_config(toml).tenants
    assert [t.quota(tier) for tier in QUOTA_TIERS] == [
        (100, {"tenant-a": 7}), (200, {"tenant-a": 0}), (300, {}), (0, {"tenant-b": 9})]
    tenants = Tenants.from_config(t)
    assert sorted(tenants.by_tier) == ["dram", "redis", "s3", "ssd"]
    ssd = tenants.by_tier["ssd"]
    assert ssd.quota(salt_tag("tenant-a")) == 0 and ssd.quota(salt_tag("tenant-c")) == 200  # 0: exempt


@pytest.mark.parametrize(("overrides", "named"), [
    ({"tenants.ssd_quota_bytes": -1}, "tenants.ssd_quota_bytes"),
    ({"tenants.redis_quotas": {"tenant-a": -5}}, "tenants.redis_quotas"),
    ({"tenants.s3_quotas": {"tenant-a": "lots"}}, "tenants.s3_quotas.tenant-a"),
    ({"tenants.nvme_quota_bytes": 1}, "tenants.nvme_quota_bytes"),
])
def test_a_bad_quota_is_refused_at_start_naming_its_key(
    tmp_path: Path, overrides: dict[str, object], named: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(named)):
        small_config(tmp_path, **overrides)


def test_a_bad_quota_table_in_the_environment_is_refused_naming_its_section(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_TENANTS__SSD_QUOTAS", "{tenant-a: 1}")  # not JSON
    with pytest.raises(ConfigError, match='field "tenants"'):
        load_config()


# ---- a tenant is the namespace's salt, never its label -----------------------------------------

SMALL = 8192
FLOOD_CONFIG = {"dram.capacity_bytes": 64 * 65536, "tenants.dram_quota_bytes": 1 << 20}  # 4 MiB; 1 MiB each


def small_blocks(n: int, seed: int) -> list[np.ndarray]:
    return [np.full(SMALL, (seed * 31 + i) % 251, dtype=np.uint8) for i in range(n)]


async def tag_of(c: KVStoreClient, ns: Namespace) -> str:
    """The tenant tag /stats lists for ``ns``'s blocks (what an attacker reads there)."""
    tags = [t for t, tiers in (await c.stats())["tenants"].items() if tiers["dram"]["bytes"]]
    assert len(tags) == 1, tags
    return tags[0]


@pytest.mark.parametrize("attacker", ["posing", "salted"])
async def test_a_namespace_without_salt_naming_a_tenants_tag_is_not_that_tenant(
    tmp_path: Path, attacker: str
) -> None:
    """Issue 29 item 4: the victim (salted, a 1 MiB DRAM quota like every tenant) holds 768 KiB; a
    client without salt whose model reads "<model>#<the victim's tag, as /stats lists it>" floods
    4 MiB. It is the unsalted tenant: it evicts its own blocks, the victim keeps its whole run, as
    with a differently salted tenant's flood. On 8dc5782 the tenant was parsed out of the label, so
    the flood counted as the victim's and evicted it (its run fell to a few blocks)."""
    victim = Namespace(model="llama", kv_layout="raw", dtype="uint8", block_size=16, cache_salt="victim-salt")
    async with (
        Sidecar(small_config(tmp_path, **FLOOD_CONFIG)) as sc,
        KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c,
    ):
        mine = keys(victim, 96, 1)  # 96 x 8 KiB = 768 KiB
        await c.put_blocks(victim, mine, small_blocks(96, 1))
        tag = await tag_of(c, victim)
        flooder = (Namespace(model=f"llama#{tag}", kv_layout="raw", dtype="uint8", block_size=16)
                   if attacker == "posing" else Namespace(model="llama", kv_layout="raw", dtype="uint8",
                                                          block_size=16, cache_salt="other-salt"))
        for seed in range(2, 18):  # 16 x 32 x 8 KiB = 4 MiB
            await c.put_blocks(flooder, keys(flooder, 32, seed), small_blocks(32, seed))
        assert (await c.lookup(victim, mine)).matched == 96
        got = await c.get_blocks(victim, mine)
        assert [bytes(g) for g in got] == [bytes(d) for d in small_blocks(96, 1)]
        await c.lookup(flooder, keys(flooder, 32, 17))
        stats = await c.stats()
        tenants = stats["tenants"]
        assert tenants[tag]["dram"] == {"bytes": 96 * SMALL, "quota_bytes": 1 << 20, "evictions": 0, "refused": 0}
        theirs = tenants[salt_tag(flooder.cache_salt) or "-"]["dram"]
        assert theirs["bytes"] == 1 << 20 and theirs["evictions"] == 16 * 32 - 128
        lookups = stats["namespaces"]  # each namespace's lookups counted apart
        assert lookups[victim.label]["blocks_requested"] == 96 and lookups[flooder.label]["blocks_requested"] == 32


def test_a_label_escapes_its_markers_in_free_text() -> None:
    """The label's ``+``, ``@`` and ``#`` are its own: free text showing them is escaped, so no
    two namespaces that differ in model, adapter, rank or salt share a label."""
    base = {"kv_layout": "raw", "dtype": "uint8", "block_size": 16}
    salted = Namespace(model="llama", cache_salt="s", **base)  # type: ignore[arg-type]
    posing = Namespace(model=f"llama#{salted.tenant}", **base)  # type: ignore[arg-type]
    assert salted.label == f"llama#{salted.tenant}" and posing.label == f"llama%23{salted.tenant}"
    assert posing.tenant == "" and len(salted.tenant) == 16
    adapter = Namespace(model="m+a@1/2%", adapter="x#y", rank=1, world_size=2, **base)  # type: ignore[arg-type]
    assert adapter.label == "m%2Ba%401/2%25+x%23y@1/2"
