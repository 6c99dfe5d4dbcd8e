"""The sidecar over real gRPC on loopback with the real shared-memory slab."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from kvstore.client import KVStoreClient
from kvstore.errors import FailedPrecondition, NotFound, ResourceExhausted
from kvstore.keys import prefix_keys

PAGE = 65536  # small_config: 4 pages of 64 KiB -> four 64 KiB slots


def blocks_for(n: int, size: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]


def chain(ns, first_token: int, n: int) -> list[bytes]:
    return prefix_keys(ns, [first_token] * (n * ns.block_size))


async def test_put_then_get_is_byte_exact(client: KVStoreClient, ns):
    keys = chain(ns, 1, 3)
    data = blocks_for(3, 10_000, seed=1)
    r = await client.put_blocks(ns, keys, data)
    assert (r.stored, r.present) == (3, 0)
    got = await client.get_blocks(ns, keys, verify=True)
    assert [g.tobytes() for g in got] == data
    look = await client.lookup(ns, keys)
    assert look.matched == 3 and look.blocks == [("dram", 10_000)] * 3


async def test_lookup_reports_the_leading_run_only(client: KVStoreClient, ns):
    keys = chain(ns, 2, 4)
    await client.put_blocks(ns, keys[:2], blocks_for(2, 4096, 2))
    await client.put_blocks(ns, keys[3:], blocks_for(1, 4096, 3), first_parent=keys[2])
    assert (await client.lookup(ns, keys)).matched == 2
    assert len(await client.get_blocks(ns, keys)) == 2


async def test_second_put_of_the_same_blocks_is_deduplicated(client: KVStoreClient, ns):
    keys = chain(ns, 3, 2)
    data = blocks_for(2, 4096, 4)
    await client.put_blocks(ns, keys, data)
    r = await client.put_blocks(ns, keys, blocks_for(2, 4096, 5))
    assert (r.stored, r.present) == (0, 2)
    assert [g.tobytes() for g in await client.get_blocks(ns, keys)] == data  # first write wins


def resident(sidecar, ns, *chains: list[bytes]) -> list[int]:
    """How many blocks of each chain the server holds (without touching them)."""
    blocks = sidecar.store.index.namespaces[ns.root].blocks
    return [sum(k in blocks for k in ch) for ch in chains]


async def test_eviction_follows_lru_leaves_first_exactly(client: KVStoreClient, sidecar, ns):
    a, b, c = chain(ns, 10, 2), chain(ns, 11, 2), chain(ns, 12, 3)
    await client.put_blocks(ns, a, blocks_for(2, PAGE, 10))
    await client.put_blocks(ns, b, blocks_for(2, PAGE, 11))
    assert (await client.lookup(ns, a)).matched == 2  # a is now more recent than b
    await client.put_blocks(ns, c[:1], blocks_for(1, PAGE, 12))
    # b's leaf goes first, not b's root: a prefix is trimmed from its tail.
    assert resident(sidecar, ns, a, b, c) == [2, 1, 1]
    await client.put_blocks(ns, c[1:2], blocks_for(1, PAGE, 13), first_parent=c[0])
    assert resident(sidecar, ns, a, b, c) == [2, 0, 2]
    # Now a (looked up before c was written) is the oldest: its leaf, then its root.
    await client.put_blocks(ns, c[2:], blocks_for(1, PAGE, 14), first_parent=c[1])
    assert resident(sidecar, ns, a, b, c) == [1, 0, 3]
    assert (await client.stats())["tiers"]["dram"]["evictions"] == 3


async def test_leases_prevent_eviction(client: KVStoreClient, ns):
    a, b = chain(ns, 20, 4), chain(ns, 21, 1)
    await client.put_blocks(ns, a, blocks_for(4, PAGE, 20))
    look = await client.lookup(ns, a, lease_ttl_ms=60_000)
    assert look.lease_id
    with pytest.raises(ResourceExhausted, match="leased"):
        await client.put_blocks(ns, b, blocks_for(1, PAGE, 21))
    assert (await client.lookup(ns, a)).matched == 4  # nothing was lost
    await client.release(look.lease_id)
    assert (await client.put_blocks(ns, b, blocks_for(1, PAGE, 21))).stored == 1
    assert (await client.lookup(ns, a)).matched == 3  # the leaf of a made room


async def test_acquired_blocks_are_not_evicted_while_read(client: KVStoreClient, ns):
    a, b = chain(ns, 30, 4), chain(ns, 31, 1)
    data = blocks_for(4, PAGE, 30)
    await client.put_blocks(ns, a, data)
    async with client.acquire(ns, a) as lease:
        with pytest.raises(ResourceExhausted):
            await client.put_blocks(ns, b, blocks_for(1, PAGE, 31))
        assert [v.tobytes() for v in lease.views] == data
        assert not lease.views[0].flags.writeable


async def test_reaper_reclaims_abandoned_allocations(client: KVStoreClient, sidecar, ns):
    keys = chain(ns, 40, 2)
    alloc = client.allocate(ns, keys, 4096, ttl_ms=100)
    await alloc.__aenter__()
    assert sidecar.store.index.count()["allocations"] == 1
    for _ in range(100):
        await asyncio.sleep(0.05)
        if not sidecar.store.index.allocations:
            break
    assert sidecar.store.index.count() == {"namespaces": 0, "blocks": 0, "allocations": 0, "leases": 0}  # emptied: gone
    assert sidecar.slab.used_bytes == 0
    with pytest.raises(FailedPrecondition, match="reclaimed"):
        await alloc.commit()
    assert (await client.lookup(ns, keys)).matched == 0
    assert (await client.stats())["writes"]["reclaimed"] == 1


async def test_lease_expiry_releases_blocks(client: KVStoreClient, sidecar, ns):
    keys = chain(ns, 41, 1)
    await client.put_blocks(ns, keys, blocks_for(1, 4096, 41))
    look = await client.lookup(ns, keys, lease_ttl_ms=50)
    for _ in range(100):
        await asyncio.sleep(0.05)
        if not sidecar.store.index.leases:
            break
    with pytest.raises(NotFound, match="lease_id"):
        await client.release(look.lease_id)


async def test_abort_on_exception_releases_slots(client: KVStoreClient, sidecar, ns):
    keys = chain(ns, 50, 2)
    with pytest.raises(RuntimeError):
        async with client.allocate(ns, keys, 4096) as alloc:
            for _, view in alloc.writable():
                view[:] = 7
            raise RuntimeError("engine failed mid-copy")
    assert sidecar.slab.used_bytes == 0
    assert (await client.lookup(ns, keys)).matched == 0


async def test_delete_keys_and_whole_namespace(client: KVStoreClient, ns):
    import dataclasses

    other = dataclasses.replace(ns, cache_salt="tenant-b")
    a, b = chain(ns, 60, 2), chain(other, 60, 2)
    await client.put_blocks(ns, a, blocks_for(2, 4096, 60))
    await client.put_blocks(other, b, blocks_for(2, 4096, 61))
    assert await client.delete(ns, a[1:]) == (1, 0)
    assert (await client.lookup(ns, a)).matched == 1
    look = await client.lookup(other, b, lease_ttl_ms=10_000)
    assert await client.delete(other, all_keys=True) == (0, 2)  # leased blocks are skipped
    await client.release(look.lease_id)
    assert await client.delete(other, all_keys=True) == (2, 0)
    assert (await client.lookup(ns, a)).matched == 1  # the other tenant's delete left ns alone


async def test_verify_local_reads_drops_a_corrupted_block(tmp_path, ns):
    from kvstore.server.sidecar import Sidecar
    from tests.conftest import small_config

    async with (
        Sidecar(small_config(tmp_path, **{"dram.verify_local_reads": True})) as sc,
        KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c,
    ):
        keys = chain(ns, 70, 3)
        await c.put_blocks(ns, keys, blocks_for(3, 4096, 70), checksums=True)
        block = sc.store.index.namespaces[ns.root].blocks[keys[1]]
        sc.slab.view(block.slot, 4096)[100] ^= 0xFF  # a stray write into the slab
        got = await c.get_blocks(ns, keys)
        assert len(got) == 1  # the corrupted block and everything after it are a miss
        assert (await c.lookup(ns, keys)).matched == 1
        assert (await c.stats())["tiers"]["dram"]["checksum_failures"] == 1


async def test_blocks_written_without_checksum_are_sealed_by_the_server(client: KVStoreClient, sidecar, ns):
    keys = chain(ns, 80, 2)
    data = blocks_for(2, 4096, 80)
    await client.put_blocks(ns, keys, data)
    for _ in range(100):
        if all(b.checksum is not None for b in sidecar.store.index.namespaces[ns.root].blocks.values()):
            break
        await asyncio.sleep(0.05)
    from kvstore.checksum import checksum

    assert [sidecar.store.index.namespaces[ns.root].blocks[k].checksum for k in keys] == [checksum(d) for d in data]


def test_slab_is_private_to_its_owner(sidecar):
    mode = os.stat(f"/dev/shm/{sidecar.slab.name}").st_mode & 0o777
    assert mode == 0o600


@pytest.mark.parametrize("policy", __import__("kvstore.policy", fromlist=["policy_names"]).policy_names())
async def test_every_policy_runs_in_the_server(tmp_path, ns, policy):
    """Churn DRAM under each registered policy: no errors, capacity respected, the index and the
    slab agree, and every block a lookup reports can be read back byte-exact."""
    from kvstore.server.sidecar import Sidecar
    from tests.conftest import small_config

    async with (
        Sidecar(small_config(tmp_path, **{"index.policy": policy})) as sc,
        KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c,
    ):
        chains = [chain(ns, 100 + i % 7, 2) for i in range(30)]
        for i, keys in enumerate(chains):
            await c.lookup(ns, keys)
            await c.put_blocks(ns, keys, blocks_for(2, 32768, 100 + i % 7))
        assert sc.slab.used_bytes <= sc.slab.capacity_bytes
        resident = [b for b in sc.store.index.namespaces[ns.root].blocks.values()]
        assert len(resident) == len(sc.store.policy) == sc.slab.used_bytes // 32768
        for i in range(7):
            got = await c.get_blocks(ns, chain(ns, 100 + i, 2))
            assert [g.tobytes() for g in got] == blocks_for(2, 32768, 100 + i)[: len(got)]


async def test_lookup_reports_each_size_when_sizes_differ(client: KVStoreClient, ns):
    keys = chain(ns, 90, 3)
    await client.put_blocks(ns, keys[:2], blocks_for(2, 4096, 90))
    assert (await client.lookup(ns, keys)).blocks == [("dram", 4096)] * 2  # uniform: sent as one number
    await client.put_blocks(ns, keys[2:], blocks_for(1, 5000, 91), first_parent=keys[1])
    assert (await client.lookup(ns, keys)).blocks == [("dram", 4096), ("dram", 4096), ("dram", 5000)]
    await client.delete(ns, keys[2:])
    assert (await client.lookup(ns, keys)).blocks == [("dram", 4096)] * 2
