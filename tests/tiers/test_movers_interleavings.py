"""The DRAM space and the tier movers under interleavings that the event loop makes exact.

Each test drives a real sidecar (its store, slab and tiers in this process; Redis and the SSD
directory real) through one ordering of two requests: a task started and run to its first await,
then the other request, then the first again. Nothing is timed: a step either has happened or
has not when the next one starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import warnings
from collections.abc import Iterator

import numpy as np
import pytest

from kvstore.client import KVStoreClient
from kvstore.harness.servers import RedisServer
from kvstore.server.sidecar import Sidecar
from kvstore.store.block_store import BlockSpec, CommitSpec
from kvstore.store.books.index import DRAM, REDIS
from tests.tiers.test_tiering import NS, PAGE, blocks_for, chain, placement, settle, tiered_config


def dram_blocks(sc: Sidecar) -> set[object]:
    return {b for ns in sc.store.index.namespaces.values() for b in ns.blocks.values() if b.tiers & DRAM}


def check_policy(sc: Sidecar) -> None:
    """The DRAM policy orders exactly the blocks in DRAM (what evictions pick from)."""
    resident = dram_blocks(sc)
    assert all(b in sc.store.space.policy for b in resident)
    assert len(sc.store.space.policy) == len(resident)


def write(sc: Sidecar, keys: list[bytes], data: list[bytes]) -> str:
    """Allocate slots for ``keys`` on the store and fill them; the allocation's id."""
    ns = sc.store.namespace(NS)
    parents = [b"", *keys[:-1]]
    alloc, slots = sc.store.allocate_now(ns, [BlockSpec(k, p, len(d)) for k, p, d in zip(keys, parents, data)])
    for slot, d in zip(slots, data):
        assert slot is not None
        sc.slab.view(slot, len(d))[:] = np.frombuffer(d, np.uint8)
    return alloc.id


def commit_specs(sc: Sidecar, alloc_id: str) -> list[CommitSpec]:
    return [CommitSpec(b.key, slot_id, None) for slot_id, b in sc.store.index.allocation(alloc_id).blocks.items()]


@contextlib.contextmanager
def writes_paused(redis: RedisServer) -> Iterator[None]:
    """Redis holds every write command until the block ends (CLIENT PAUSE ... WRITE); reads go on."""
    redis.cli("CLIENT", "PAUSE", "60000", "WRITE")
    try:
        yield
    finally:
        redis.cli("CLIENT", "UNPAUSE")


async def test_a_commit_cancelled_while_it_waits_for_write_through_leaves_its_blocks_evictable(tmp_path, redis_clean):
    """The commit's caller goes away (a deadline) before the write-through has begun: the write
    still happens and the blocks are not pinned for ever (before, ``asyncio.gather`` cancelled the
    write, which never unpinned them: every later put was refused, "DRAM is full ... leased or
    being written")."""
    cfg = tiered_config(tmp_path, **{"ssd.enabled": False, "redis.enabled": True, "redis.url": redis_clean.url,
                                     "tiering.write_through": ["redis"]})
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        first, data = chain(80, 4), blocks_for(4, 80)  # the slab's four 64 KiB slots
        alloc_id = write(sc, first, data)
        commit = asyncio.create_task(sc.store.commit(alloc_id, commit_specs(sc, alloc_id), wait_write_through=True))
        await asyncio.sleep(0)  # the commit ran up to its wait; the write-through has not started
        commit.cancel()
        with pytest.raises(asyncio.CancelledError):
            await commit
        await settle(sc)

        assert placement(sc, first) == ["dram"] * 4
        assert all(b.tiers == DRAM | REDIS and not b.pinned for b in dram_blocks(sc))
        second = chain(81, 4)
        assert (await c.put_blocks(NS, second, blocks_for(4, 81))).stored == 4  # evicts all four
        assert placement(sc, first) == ["redis"] * 4
        await settle(sc)  # the second four are written through: they may leave DRAM again
        assert [g.tobytes() for g in await c.get_blocks(NS, first)] == data


async def test_an_allocate_cancelled_while_it_waits_for_the_movers_loses_no_demotion(tmp_path):
    """A full DRAM of leased blocks makes an Allocate wait for the movers; its caller goes away
    while a demotion is in flight. The demotion still reaches the SSD (before, the wait
    cancelled it and the block, which had left DRAM already, was lost)."""
    async with Sidecar(tiered_config(tmp_path)) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        a, data = chain(90, 4), blocks_for(4, 90)
        await c.put_blocks(NS, a, data)
        lease = (await c.lookup(NS, a[1:], lease_ttl_ms=60_000)).lease_id
        assert lease
        b_id = write(sc, chain(91, 1), blocks_for(1, 91))  # evicts a[0], the only unleased block
        assert placement(sc, a) == ["ssd", "dram", "dram", "dram"]  # demotion queued, not written yet
        ns = sc.store.namespace(NS)
        waiting = asyncio.create_task(sc.store.allocate(ns, [BlockSpec(chain(92, 1)[0], b"", PAGE)]))
        await asyncio.sleep(0)  # the allocate was refused once and now waits for the movers
        assert not waiting.done()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await c.release(lease)
        sc.store.abort(b_id)
        await settle(sc)

        assert (await c.stats())["tiers"]["ssd"]["bytes_in"] == PAGE
        assert placement(sc, a[:1]) == ["ssd"]
        assert [g.tobytes() for g in await c.get_blocks(NS, a)] == data


async def one_block_on_redis(sc: Sidecar, c: KVStoreClient, seed: int) -> list[bytes]:
    """A one-block prompt put, then sent down to Redis by a prompt of four blocks put after it: its keys."""
    a, rest = chain(seed, 1), chain(seed + 1, 4)
    await c.put_blocks(NS, a, blocks_for(1, seed))
    await c.put_blocks(NS, rest, blocks_for(4, seed + 1))
    await settle(sc)
    assert placement(sc, a) == ["redis"]
    return a


async def test_a_promotion_that_lands_while_a_delete_of_its_block_waits_leaves_no_dead_entry(tmp_path, redis_clean):
    """A delete waits for Redis to remove the block's copy; meanwhile a Prefetch of the same key
    promotes it. The block is gone for both: the prefetch finds nothing, and the DRAM policy
    holds no entry for it (before, the promotion put it back in the policy after the delete had
    taken it out; the delete then freed its slot, and an eviction that reached the dead entry
    failed: INTERNAL, 'NoneType' object has no attribute 'cls')."""
    cfg = tiered_config(tmp_path, **{"ssd.enabled": False, "redis.enabled": True, "redis.url": redis_clean.url})
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        a = await one_block_on_redis(sc, c, 100)
        ns = sc.store.namespace(NS)
        with writes_paused(redis_clean):
            delete = asyncio.create_task(sc.store.delete(ns, a, all_keys=False))
            await asyncio.sleep(0)  # the delete is waiting for Redis
            assert not delete.done()
            assert await sc.store.prefetch(ns, a) == 0
        assert await delete == (1, 0)
        await settle(sc)

        check_policy(sc)
        assert (await c.lookup(NS, a)).matched == 0
        for k in range(2):  # every block in DRAM is evicted in turn, the promoted one too
            keys, data = chain(102 + k, 4), blocks_for(4, 102 + k)
            assert (await c.put_blocks(NS, keys, data)).stored == 4
            assert [g.tobytes() for g in await c.get_blocks(NS, keys)] == data
        check_policy(sc)


async def test_a_delete_cancelled_while_it_waits_for_its_copies_leaves_no_awaitable_unawaited(tmp_path, redis_clean):
    """A delete's caller goes away (a deadline) while the delete waits for Redis to remove the
    block's copy: the removal still happens, and none of the delete's awaitables is left never
    awaited (before, the wait for the records a restart's recovery had not loaded, created before
    the wait for the copies, was dropped unawaited: "RuntimeWarning: coroutine 'nothing' was never
    awaited", as tests/core/test_fuzz.py printed)."""
    cfg = tiered_config(tmp_path, **{"ssd.enabled": False, "redis.enabled": True, "redis.url": redis_clean.url})
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        a = await one_block_on_redis(sc, c, 110)
        ns = sc.store.namespace(NS)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with writes_paused(redis_clean):
                delete = asyncio.create_task(sc.store.delete(ns, a, all_keys=False))
                await asyncio.sleep(0)  # the delete is waiting for Redis
                assert not delete.done()
                delete.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await delete
            await settle(sc)
            del delete
            gc.collect()  # (a coroutine never awaited warns when it is freed)
        assert [str(w.message) for w in caught if "never awaited" in str(w.message)] == []
        assert (await c.lookup(NS, a)).matched == 0
        assert redis_clean.cli("DBSIZE").strip() in ("0", "(integer) 0")  # its copy was removed all the same
