"""Tenant quotas across the cluster: a block fetched from a peer counts against the tenant of the
namespace that asked for it (the wire carries only the namespace root; the fetching node's entry
carries the tenant), never against one parsed out of a label. Two sidecars in one process, one
redis-server as the directory."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvstore.harness.servers import RedisServer
from kvstore.keys import Namespace
from kvstore.server.sidecar import Sidecar
from kvstore.store.books.tenants import salt_tag
from tests.cluster.nodes import BLOCK, blocks, client_of, keys_for, node_config

QUOTAS = {"dram.capacity_bytes": 64 * 65536, "tenants.dram_quota_bytes": 1 << 20}  # 4 MiB; 1 MiB a tenant
VICTIM = Namespace(model="llama", kv_layout="raw", dtype="uint8", block_size=16, cache_salt="victim-salt")


@pytest.mark.parametrize("attacker", ["posing", "salted"])
async def test_a_posing_flood_leaves_a_tenants_peer_fetched_replicas(
    tmp_path: Path, directory: RedisServer, attacker: str
) -> None:
    """Issue 29 item 4 through the cluster: the victim writes 768 KiB on A and reads it on B (96
    replicas fetched from A, counted as the victim's on B); a client without salt whose model
    reads "llama#<the victim's tag on B's /stats>" floods 4 MiB on B. The replicas all stay in B's
    DRAM, as under a differently salted tenant's flood. On 8dc5782 the flood counted as the
    victim's and evicted its replicas."""
    async with (
        Sidecar(node_config(tmp_path, "a", directory, **QUOTAS)) as a,
        Sidecar(node_config(tmp_path, "b", directory, **QUOTAS)) as b,
        client_of(a) as ca,
        client_of(b) as cb,
    ):
        await asyncio.sleep(0.25)  # a heartbeat each: both see the other
        mine, data = keys_for(VICTIM, 96, 1), blocks(96, 1)
        await ca.put_blocks(VICTIM, mine, data, wait_published=True)
        got = await cb.get_blocks(VICTIM, mine, verify=True)
        assert [bytes(g) for g in got] == [bytes(d) for d in data]
        assert (await cb.stats())["cluster"]["blocks_fetched"] == 96
        tenants = (await cb.stats())["tenants"]
        (tag,) = [t for t, tiers in tenants.items() if tiers["dram"]["bytes"]]
        assert tenants[tag]["dram"]["bytes"] == 96 * BLOCK  # the replicas are the victim's on B
        flooder = (Namespace(model=f"llama#{tag}", kv_layout="raw", dtype="uint8", block_size=16)
                   if attacker == "posing" else
                   Namespace(model="llama", kv_layout="raw", dtype="uint8", block_size=16, cache_salt="other"))
        for seed in range(2, 18):  # 16 x 32 x 8 KiB = 4 MiB
            await cb.put_blocks(flooder, keys_for(flooder, 32, seed), blocks(32, seed))
        found = await cb.lookup(VICTIM, mine)
        assert found.matched == 96 and {t for t, _ in found.blocks} == {"dram"}  # B's own replicas
        after = (await cb.stats())["tenants"]
        assert after[tag]["dram"] == {"bytes": 96 * BLOCK, "quota_bytes": 1 << 20, "evictions": 0, "refused": 0}
        assert after[salt_tag(flooder.cache_salt) or "-"]["dram"]["bytes"] == 1 << 20
        again = await cb.get_blocks(VICTIM, mine, verify=True)
        assert [bytes(g) for g in again] == [bytes(d) for d in data]
