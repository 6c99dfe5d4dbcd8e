"""One retention bound, held on the cluster's paths too (kvstore/store/books/retention.py): a hinted
Acquire whose run is fetched from a peer is checked on the whole run, a retention adopted from a
peer is checked against this node's bounds (N holders do not make N times the bound) and taken
from the holder's answer, not from its directory record (a record a directory writer puts back
after the holder ended the retention, or one whose end lies a year ahead, has no say), and a
Retain that changes no retention re-publishes nothing (Redis commands counted with INFO commandstats). Two sidecars and
a real redis-server as the directory; each node's tenant bound is 8 blocks (64 KiB), the runs 16."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from kvstore.checksum import checksum
from kvstore.errors import ResourceExhausted
from kvstore.harness.servers import RedisServer
from kvstore.keys import Namespace, salt_tag
from kvstore.server.sidecar import Sidecar
from kvstore.wire import peer as peer_wire
from tests.cluster.fake_holder import answering
from tests.cluster.nodes import BLOCK, blocks, client_of, keys_for, node_config
from tests.cluster.test_cluster_auth import dir_key

MINUTE = 60_000
BOUND = 8 * BLOCK


@pytest.fixture
def agent() -> Namespace:
    return Namespace(model="tiny-llama", kv_layout="raw", dtype="float16", block_size=16, cache_salt="agent")


@pytest.fixture
async def bounded(tmp_path: Path, directory: RedisServer) -> AsyncIterator[tuple[Sidecar, Sidecar]]:
    """A (no tenant bound) and B (a tenant may retain 8 blocks in its DRAM)."""
    async with Sidecar(node_config(tmp_path, "a", directory)) as a, \
            Sidecar(node_config(tmp_path, "b", directory, **{"tenants.dram_retained_bytes": BOUND})) as b:
        await asyncio.sleep(0.25)  # a heartbeat each: both see the other
        yield a, b


def retained_on(sc: Sidecar, ns: Namespace, ks: list[bytes]) -> int:
    entry = sc.store.index.namespaces[ns.root]
    now = sc.store.clock()
    return sum(entry.blocks[k].retain_until > now for k in ks if k in entry.blocks)


async def test_a_hinted_acquire_of_a_run_fetched_from_a_peer_is_checked_whole(
    bounded: tuple[Sidecar, Sidecar], agent: Namespace
) -> None:
    """B holds none of the 16 blocks: its bound was checked on nothing before the fetch, then the
    whole fetched run retained (66d9839: 16 blocks, twice the bound). Now refused whole."""
    a, b = bounded
    ks = keys_for(agent, 16, seed=1)
    async with client_of(a) as ca, client_of(b) as cb:
        await ca.put_blocks(agent, ks, blocks(16, seed=1), wait_published=True)
        with pytest.raises(ResourceExhausted, match=r"tenants\.dram_retained_bytes"):
            async with cb.acquire(agent, ks, retain=(MINUTE, 0)):
                pass
        assert retained_on(b, agent, ks) == 0
        assert not b.store.index.leases  # nothing leased
        assert (await cb.stats())["retained"]["refused"] == {salt_tag("agent"): 1}


async def test_a_retention_adopted_from_a_peers_record_is_held_to_this_nodes_bound(
    bounded: tuple[Sidecar, Sidecar], agent: Namespace
) -> None:
    """A retains 16 blocks; B's plain Acquire fetches them and adopts their retention (A's answer's):
    8 of them, its bound, the rest refused (66d9839: all 16 adopted unchecked)."""
    a, b = bounded
    ks = keys_for(agent, 16, seed=2)
    async with client_of(a) as ca, client_of(b) as cb:
        await ca.put_blocks(agent, ks, blocks(16, seed=2), wait_published=True, retain=(MINUTE, 1))
        assert len(await cb.get_blocks(agent, ks, verify=True)) == 16
        retained = (await cb.stats())["retained"]
        assert retained["tenants"] == {"dram": {salt_tag("agent"): BOUND}}
        assert retained_on(b, agent, ks) == 8
        assert retained["refused"] == {salt_tag("agent"): 8}


async def test_an_end_a_year_ahead_in_a_record_is_not_adopted(pair: tuple[Sidecar, Sidecar], ns: Namespace) -> None:
    """A record whose retention ends a year ahead (a holder's clock, a careless operator: written
    with the cluster's key): the fetching node retains the block for what the holder's answer
    says is left of its retention, a minute, never the record's end (66d9839: 365 days, and
    re-published to every node that fetched from it; an answer's retention is at most a day,
    the hint's limit, and the fetcher caps what it adopts there too)."""
    a, b = pair
    ks = keys_for(ns, 2, seed=3)
    async with client_of(a) as ca, client_of(b) as cb:
        await ca.put_blocks(ns, ks, blocks(2, seed=3), wait_published=True, retain=(MINUTE, 2))
        node = a.cluster
        assert node is not None
        year = round((time.time() + 365 * 86_400) * 1000)
        found = await node.directory.find(ns.root, ks)
        puts = [(ns.root, k, f[node.node]._replace(retain_until_ms=year)) for k, f in zip(ks, found, strict=True)]
        await node.directory.publish(puts, [])
        assert len(await cb.get_blocks(ns, ks, verify=True)) == 2
        entry = b.store.index.namespaces[ns.root]
        left = [entry.visible[k].retain_until - b.store.clock() for k in ks]
        assert all(MINUTE / 1000 - 5 < s <= MINUTE / 1000 for s in left), left


async def commandstats(r: Any) -> dict[str, int]:
    info = await r.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in info.items()}


async def test_a_retain_publishes_nothing(
    pair: tuple[Sidecar, Sidecar], ns: Namespace, directory: RedisServer
) -> None:
    """16 published blocks retained, then the same Retain again at once: no record is re-written
    either time, since a record carries no retention (no node reads one: a fetcher adopts the
    holder's answer). 66d9839 re-wrote all 16 both times, a Redis HSET each (a Retain of 16 k
    keys made ~8,600 Redis commands); the release before, all 16 the first time. A commit
    published after them bounds the wait: it is the only record written."""
    a, _ = pair
    ks, probe = keys_for(ns, 16, seed=4), keys_for(ns, 1, seed=5)
    r = Redis.from_url(directory.url)
    try:
        async with client_of(a) as ca:
            await ca.put_blocks(ns, ks, blocks(16, seed=4), wait_published=True)
            await asyncio.sleep(0.05)  # (that pass's pipeline done)
            before = await commandstats(r)
            assert await ca.retain(ns, ks, MINUTE, 1) == 16
            assert await ca.retain(ns, ks, MINUTE, 1) == 16
            await ca.put_blocks(ns, probe, blocks(1, seed=5), wait_published=True)
            after = await commandstats(r)
        assert after.get("hset", 0) - before.get("hset", 0) == 1  # the probe's record only
    finally:
        await r.aclose()


async def test_a_retained_record_written_back_after_its_holder_ended_the_retention_is_not_taken_up(
    pair: tuple[Sidecar, Sidecar], ns: Namespace, directory: RedisServer
) -> None:
    """A retains 4 blocks and B, fetching them, retains them too. A directory writer (no token:
    raw HGET and HSET on the directory's Redis) keeps A's records of that time. A ends the
    retention, the writer puts the old records back, and B, having lost its copies, fetches the
    blocks again: it retains none of them, since it takes a block's retention from A's answer to
    the fetch (66d9839: all 4 retained again, for the rest of the old record's minute, and
    re-published to the directory as B's). The records carry no retention at all: A's were
    the same 42 bytes while it retained the blocks (the release before: 51, with the end)."""
    a, b = pair
    ks = keys_for(ns, 4, seed=6)
    r = Redis.from_url(directory.url)
    try:
        async with client_of(a) as ca, client_of(b) as cb:
            await ca.put_blocks(ns, ks, blocks(4, seed=6), wait_published=True, retain=(MINUTE, 2))
            old = [await r.hget(dir_key(a, ns, k), "a") for k in ks]
            assert all(v is not None and len(v) == 42 for v in old)  # no retention in the record
            assert len(await cb.get_blocks(ns, ks, verify=True)) == 4
            assert retained_on(b, ns, ks) == 4  # adopted while A holds it

            assert await ca.retain(ns, ks, 0) == 4  # A ends the retention
            for k, v in zip(ks, old, strict=True):  # the directory writer puts the old records back
                await r.hset(dir_key(a, ns, k), "a", v)
            assert await cb.delete(ns, ks) == (4, 0)  # B loses its copies
            assert (await cb.stats())["retained"]["blocks"] == 0

            assert len(await cb.get_blocks(ns, ks, verify=True)) == 4  # fetched from A again
            assert (await cb.stats())["cluster"]["blocks_fetched"] == 8
            assert retained_on(b, ns, ks) == 0
            assert (await cb.stats())["retained"]["blocks"] == 0
    finally:
        await r.aclose()


@pytest.mark.parametrize("retain_ms, priority", [(86_400_001, 1), (MINUTE, 4)])
async def test_an_answer_with_a_retention_no_hint_could_give_is_refused(retain_ms: int, priority: int) -> None:
    """A holder with the token (a real PeerClient against a holder on a real socket that says the
    hello right) whose answer gives a block a retention past a day, or a priority past 3: the
    fetch ends there, a miss (nothing is adopted), the connection dropped. On 66d9839 an answer
    had no retention to give."""
    data = blocks(1, seed=7)[0]
    entry = peer_wire.Entry(BLOCK, checksum(data), retain_ms, priority)
    async with answering(entry, data.tobytes()) as holder:
        result = await holder.fetch()
        with pytest.raises(ConnectionError):  # the fetcher dropped the connection
            await asyncio.wait_for(holder.serving, 5)
        assert holder.answered == [True]
        assert result.checksums == [] and result.retained == []
        assert "retention of" in result.error and "0..86400000, 0..3" in result.error
