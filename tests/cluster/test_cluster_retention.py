"""Retention in a cluster (kvstore/store/books/retention.py, kvstore/cluster/directory.py): a retained
block's directory record carries its retention (an optional trailing field), and a peer that
fetched the block retains it too (as the holder's answer to the fetch says, kvstore/wire/peer.py).
Two sidecars and a real redis-server as the directory."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvstore.cluster.directory import Record
from kvstore.harness.servers import RedisServer
from kvstore.keys import Namespace
from kvstore.server.sidecar import Sidecar
from kvstore.store.books.index import TOP_LABEL
from tests.cluster.nodes import blocks, client_of, keys_for, node_config

MINUTE = 60_000


def test_a_record_without_retention_keeps_the_old_format() -> None:
    plain = Record(5, 1, 4096, 77)
    assert len(plain.pack()) == 25 and Record.unpack(plain.pack()) == plain
    kept = Record(5, 1, 4096, 77, 1_900_000_000_000, 2)
    assert len(kept.pack()) == 34 and Record.unpack(kept.pack()) == kept
    assert Record.unpack(kept.pack()[:30]) is None  # another version's: not read


async def test_a_peer_that_fetched_a_retained_block_retains_it(pair: tuple[Sidecar, Sidecar], ns: Namespace) -> None:
    a, b = pair
    kept, plain = keys_for(ns, 3, seed=1), keys_for(ns, 2, seed=2)
    async with client_of(a) as ca, client_of(b) as cb:
        await ca.put_blocks(ns, kept, blocks(3, seed=1), wait_published=True, retain=(MINUTE, 2))
        await ca.put_blocks(ns, plain, blocks(2, seed=2), wait_published=True)
        assert len(await cb.get_blocks(ns, kept, verify=True)) == 3
        assert len(await cb.get_blocks(ns, plain, verify=True)) == 2
        entry = b.store.index.namespaces[ns.root]
        left = [entry.visible[k].retain_until - b.store.clock() for k in kept]
        assert all(0 < s <= MINUTE / 1000 for s in left)
        assert {entry.visible[k].retain_priority for k in kept} == {2}
        assert [entry.visible[k].retain_until for k in plain] == [0.0, 0.0]
        assert (await cb.stats())["retained"]["blocks"] == 3


async def test_a_later_retain_reaches_a_fetcher_by_the_holders_answer_not_the_record(
    pair: tuple[Sidecar, Sidecar], ns: Namespace
) -> None:
    """Blocks retained after they were published: their records stay as they were (a record
    carries no retention), and a node that fetches them retains them as the holder's answer says."""
    a, b = pair
    ks = keys_for(ns, 2, seed=3)
    async with client_of(a) as ca, client_of(b) as cb:
        await ca.put_blocks(ns, ks, blocks(2, seed=3), wait_published=True)
        node = a.cluster
        assert node is not None
        before = await node.directory.find(ns.root, ks)
        assert await ca.retain(ns, ks, MINUTE, 1) == 2
        assert await node.directory.find(ns.root, ks) == before
        assert all(f[node.node].retain_until_ms == 0 for f in before)
        await cb.get_blocks(ns, ks)
        assert (await cb.stats())["retained"]["blocks"] == 2


async def test_a_retained_replica_is_demoted_where_an_unretained_one_is_dropped(
    tmp_path: Path, directory: RedisServer, ns: Namespace
) -> None:
    # the soft pin with DRAM full of retained blocks: no budget for hints (tenants.retained_fraction 1)
    ssd = {"ssd.enabled": True, "ssd.path": str(tmp_path / "ssd-b"), "ssd.capacity_bytes": 1 << 20,
           "tenants.retained_fraction": 1.0}
    async with Sidecar(node_config(tmp_path, "a", directory)) as a, \
            Sidecar(node_config(tmp_path, "b", directory, **ssd)) as b:
        await asyncio.sleep(0.25)  # a heartbeat each: both see the other
        kept, plain = keys_for(ns, 3, seed=4), keys_for(ns, 2, seed=5)
        async with client_of(a) as ca, client_of(b) as cb:
            await ca.put_blocks(ns, kept, blocks(3, seed=4), wait_published=True, retain=(MINUTE, 2))
            await ca.put_blocks(ns, plain, blocks(2, seed=5), wait_published=True)
            await cb.get_blocks(ns, [*kept])
            await cb.get_blocks(ns, [*plain])
            for seed in range(10, 20):  # 40 of B's own blocks, retained higher: B's 32-block DRAM overflows
                await cb.put_blocks(ns, keys_for(ns, 4, seed=seed), blocks(4, seed=seed), retain=(MINUTE, 3))
            await b.store.tiering.flush()
        entry = b.store.index.namespaces[ns.root]
        assert [TOP_LABEL[entry.blocks[k].tiers] for k in kept] == ["ssd"] * 3  # demoted, still retained
        assert [k in entry.blocks for k in plain] == [False, False]  # replicas: dropped, A holds them
