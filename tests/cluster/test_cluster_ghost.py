"""The cluster's ghost (kvstore/cluster/directory.py, the ``g:`` keys): a block one node let go
leaves its use count in the directory, and the next node to hold it anew (a commit, a fetch from a
peer) resumes that count in its credit policy. On a real redis-server and a real 3-node Redis
Cluster, with in-process sidecars."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from redis.asyncio import Redis, RedisCluster

from kvstore.client import KVStoreClient
from kvstore.cluster.directory import Directory, Record
from kvstore.harness.servers import redis_server
from kvstore.keys import Namespace
from kvstore.policy import make_policy
from kvstore.server.sidecar import Sidecar
from kvstore.store.block_store import BlockSpec, CommitSpec
from kvstore.store.books.index import SSD, Block
from tests.cluster.directories import KINDS, DirectoryServer, directory_server
from tests.cluster.nodes import BLOCK, blocks, client_of, keys_for
from tests.tiers.test_tier_uses import Traffic, reused_on_ssd
from tests.tiers.test_tiering import PAGE


@pytest.fixture(scope="module", params=KINDS)
def directory(request: pytest.FixtureRequest) -> Iterator[DirectoryServer]:
    with directory_server(request.param, **{"index.policy": "credit"}) as d:
        yield d


def ghost_keys(sc: Sidecar, ns: Namespace, keys: Sequence[bytes]) -> list[bytes]:
    """The directory's ghost keys of ``keys``, spelled out: ``{prefix}:g:`` + root[:16] + key."""
    return [f"{sc.config.cluster.key_prefix}:g:".encode() + ns.root[:16] + k for k in keys]


def held(sc: Sidecar, ns: Namespace, keys: Sequence[bytes]) -> list[Block]:
    entry = sc.store.index.namespaces.get(ns.root)
    return [b for k in keys if entry is not None and (b := entry.visible.get(k)) is not None]


def uses(sc: Sidecar, ns: Namespace, keys: Sequence[bytes]) -> list[int]:
    """What the node's DRAM policy counts of each of ``keys`` (held, or on its own ghost list)."""
    sc.store.drain_touches()
    entry = sc.store.index.namespaces.get(ns.root)
    blocks_ = [entry.visible.get(k) if entry is not None else None for k in keys]
    return [sc.store.space.policy.uses(b if b is not None else k) for b, k in zip(blocks_, keys)]


def resumed(sc: Sidecar, counts: Sequence[int]) -> list[int]:
    """What the node's policy counts of a block it stored anew and then resumed each of ``counts``
    for (the policy's own arithmetic, :meth:`~kvstore.policy.base.EvictionPolicy.resume`)."""
    out = []
    for n in counts:
        p = make_policy(sc.config.index.policy)
        p.insert("x", None, 1, 8192)
        p.access("x")  # (the commit's ordering)
        p.resume("x", n)
        out.append(p.uses("x"))
    return out


async def reuse(c: KVStoreClient, ns: Namespace, keys: Sequence[bytes]) -> None:
    """Hits: every block twice, the first two three times (credit counts each; a run read twice
    in a row is touched once, hence the shorter read between)."""
    await c.get_blocks(ns, keys)
    await c.get_blocks(ns, keys[:2])
    await c.get_blocks(ns, keys)


async def published(sc: Sidecar) -> None:
    """Until the node's publisher wrote every change made so far (a pass that began after now)."""
    assert sc.cluster is not None
    listed = sc.cluster.published([])
    assert listed is not None, "the directory is down"
    await listed


async def let_go(sc: Sidecar, c: KVStoreClient, ns: Namespace, keys: Sequence[bytes]) -> None:
    """Fill the node's DRAM with other prompts until none of ``keys`` is held (evicted), then
    publish (the blocks' removes, and their ghosts)."""
    for seed in range(100, 160):
        if not held(sc, ns, keys):
            break
        await c.put_blocks(ns, keys_for(ns, 6, seed=seed), blocks(6, seed=seed))
    assert not held(sc, ns, keys)
    await sc.store.space.movers.flush()
    await published(sc)


async def test_a_count_left_by_one_node_is_resumed_by_the_next_to_store_the_block(
    tmp_path: Path, directory: DirectoryServer, redis: Redis | RedisCluster, ns: Namespace
) -> None:
    keys, data = keys_for(ns, 4, seed=1), blocks(4, seed=1)
    async with Sidecar(directory.config(tmp_path, "a")) as a, Sidecar(directory.config(tmp_path, "b")) as b:
        await asyncio.sleep(0.25)
        async with client_of(a) as ca, client_of(b) as cb:
            await ca.put_blocks(ns, keys, data, wait_published=True)
            await reuse(ca, ns, keys)
            counts = uses(a, ns, keys)
            assert min(counts) >= 2, counts
            await let_go(a, ca, ns, keys)
            assert uses(a, ns, keys) == counts  # on A's own ghost list
            ghosts = ghost_keys(a, ns, keys)
            assert [await redis.get(g) for g in ghosts] == [str(n).encode() for n in counts]
            ttls = [await redis.pttl(g) for g in ghosts]
            assert all(0 < t <= 3_600_000 for t in ttls), ttls  # (a new node's rate unknown: the ceiling)
            written = (await ca.stats())["cluster"]["ghosts_written"]
            assert written >= 4 + 6  # and the fillers let go, each used once

            await cb.put_blocks(ns, keys, data, wait_published=True)  # the same prompt, stored on B
            assert uses(b, ns, keys) == resumed(b, counts) != [1] * 4
            assert [await redis.exists(g) for g in ghosts] == [0] * 4
            assert (await cb.stats())["cluster"]["ghosts_resumed"] == 4


async def test_a_block_let_go_from_the_ssd_leaves_the_count_the_ssd_kept(
    tmp_path: Path, directory: DirectoryServer, redis: Redis | RedisCluster, ns: Namespace
) -> None:
    """A node with an SSD lets a block go from there long after DRAM's ghost forgot it: it leaves
    the count the SSD's policy remembers (DramSpace.uses, the most of its tiers'), not none."""
    (key,) = keys_for(ns, 1, seed=9)
    ssd = {"ssd.enabled": True, "ssd.capacity_bytes": 64 * PAGE}
    async with Sidecar(directory.config(tmp_path, "a", **ssd)) as a, client_of(a) as ca:
        traffic = Traffic(a, ca, ns, PAGE)
        b, n = await reused_on_ssd(traffic, key)
        await traffic.until(lambda: not held(a, ns, [key]), 200, "let go by the SSD")
        await published(a)
        assert a.store.space.policy.uses(b) == 0
        assert await redis.get(ghost_keys(a, ns, [key])[0]) == str(n).encode()


async def test_a_record_a_peer_asked_for_is_deleted_without_rewriting_a_ghost(
    tmp_path: Path, directory: DirectoryServer, redis: Redis | RedisCluster, ns: Namespace
) -> None:
    """A peer that asks a node for a block it no longer holds makes the node delete its record
    again (a stale record left behind). That is not a block let go now: the count went to the
    ghost when the block left, and writing it again could replace a count another node left
    since (here: the ghost taken meanwhile, so none must appear)."""
    keys, data = keys_for(ns, 2, seed=7), blocks(2, seed=7)
    async with Sidecar(directory.config(tmp_path, "a")) as a:
        assert a.cluster is not None
        async with client_of(a) as ca:
            await ca.put_blocks(ns, keys, data, wait_published=True)
            await reuse(ca, ns, keys)
            await let_go(a, ca, ns, keys)
            ghosts = ghost_keys(a, ns, keys)
            assert all([await redis.exists(g) for g in ghosts])
            for g in ghosts:
                await redis.delete(g)  # taken by another node meanwhile
            lent = await a.cluster.lend(ns.root, keys)  # a peer asks for what A let go
            assert not lent.blocks
            lent.release()
            await published(a)
            assert [await redis.exists(g) for g in ghosts] == [0, 0]


async def test_a_block_fetched_from_a_peer_resumes_the_count_a_third_node_left(
    tmp_path: Path, directory: DirectoryServer, redis: Redis | RedisCluster, ns: Namespace
) -> None:
    keys, data = keys_for(ns, 4, seed=2), blocks(4, seed=2)
    async with Sidecar(directory.config(tmp_path, "a")) as a, Sidecar(directory.config(tmp_path, "b")) as b, \
            Sidecar(directory.config(tmp_path, "c")) as c:
        await asyncio.sleep(0.25)
        async with client_of(a) as ca, client_of(b) as cb, client_of(c) as cc:
            await cc.put_blocks(ns, keys, data, wait_published=True)  # C holds the prompt throughout
            await ca.put_blocks(ns, keys, data, wait_published=True)
            await reuse(ca, ns, keys)
            counts = uses(a, ns, keys)
            await let_go(a, ca, ns, keys)
            ghosts = ghost_keys(a, ns, keys)
            assert [await redis.get(g) for g in ghosts] == [str(n).encode() for n in counts]

            got = await cb.get_blocks(ns, keys, verify=True)  # fetched from C: new on B
            assert [bytes(g) for g in got] == [bytes(d) for d in data]
            await published(b)
            stats = (await cb.stats())["cluster"]
            assert stats["blocks_fetched"] == 4 and stats["ghosts_resumed"] == 4
            assert uses(b, ns, keys) == resumed(b, counts) != [1] * 4
            assert [await redis.exists(g) for g in ghosts] == [0] * 4


async def test_a_re_publish_of_blocks_held_already_leaves_their_ghosts(
    tmp_path: Path, directory: DirectoryServer, redis: Redis | RedisCluster, ns: Namespace
) -> None:
    """A move between a node's tiers (DRAM -> SSD) and the re-publish of everything after the
    directory lost the node's entry are no new blocks: the ghost stays for the next node."""
    keys, data = keys_for(ns, 4, seed=3), blocks(4, seed=3)
    ssd = {"ssd.enabled": True, "ssd.capacity_bytes": 4 << 20}
    async with Sidecar(directory.config(tmp_path, "a")) as a, Sidecar(directory.config(tmp_path, "b", **ssd)) as b:
        await asyncio.sleep(0.25)
        assert a.cluster is not None and b.cluster is not None
        async with client_of(a) as ca, client_of(b) as cb:
            await cb.put_blocks(ns, keys, data, wait_published=True)  # B holds them before any ghost
            await ca.put_blocks(ns, keys, data, wait_published=True)
            await reuse(ca, ns, keys)
            counts = uses(a, ns, keys)
            await let_go(a, ca, ns, keys)
            ghosts = ghost_keys(a, ns, keys)
            remembered = [str(n).encode() for n in counts]
            assert [await redis.get(g) for g in ghosts] == remembered

            # B's DRAM fills: its blocks move to its SSD, and B publishes their new placement
            for seed in range(200, 230):
                if not any(blk.tiers & 1 for blk in held(b, ns, keys)):
                    break
                await cb.put_blocks(ns, keys_for(ns, 6, seed=seed), blocks(6, seed=seed))
            await b.store.space.movers.flush()
            await published(b)
            records = await b.cluster.directory.find(ns.root, keys)
            assert [r["b"].tiers for r in records] == [SSD] * 4
            assert [await redis.get(g) for g in ghosts] == remembered

            # the directory loses B's member entry: B's next heartbeat re-publishes all it holds
            before = b.cluster.stats["records_published"]
            await redis.hdel(f"{b.config.cluster.key_prefix}:members", "b")
            for _ in range(100):
                await asyncio.sleep(0.02)
                if b.cluster.stats["records_published"] >= before + len(b.store.index.namespaces[ns.root].visible):
                    break
            else:
                raise AssertionError("B did not re-publish")
            await published(b)
            assert [await redis.get(g) for g in ghosts] == remembered
            assert (await cb.stats())["cluster"]["ghosts_resumed"] == 0
            assert uses(b, ns, keys) == [1] * 4


async def test_a_block_stored_and_let_go_within_one_pass_lowers_no_count_it_never_read(
    tmp_path: Path, directory: DirectoryServer, redis: Redis | RedisCluster, ns: Namespace
) -> None:
    """A node reads a block's ghost in the pass that publishes the block. One that stores a block
    and lets it go again before that pass never read the count another node left: it stays, not
    overwritten by the single use this node saw; with no count there, this node's is written."""
    (left,), (other,) = keys_for(ns, 1, seed=6), keys_for(ns, 1, seed=7)
    data = blocks(2, seed=6)
    async with Sidecar(directory.config(tmp_path, "a")) as a, Sidecar(directory.config(tmp_path, "b")) as b:
        await asyncio.sleep(0.25)
        async with client_of(a) as ca:
            await ca.put_blocks(ns, [left], data[:1], wait_published=True)
            await reuse(ca, ns, [left])
            (count,) = uses(a, ns, [left])
            assert count >= 2
            await let_go(a, ca, ns, [left])
        ghost, others = ghost_keys(a, ns, [left, other])
        assert await redis.get(ghost) == str(count).encode()

        # on B, in one turn of the event loop (no publisher pass between): both stored, then let
        # go for a DRAM's worth (32 blocks) of others
        store = b.store
        alloc, slots = store.allocate_now(store.namespace(ns), [BlockSpec(k, b"", BLOCK) for k in (left, other)])
        specs = []
        for k, slot, d in zip((left, other), slots, data, strict=True):
            assert slot is not None
            store.slab.view(slot, BLOCK)[:] = d
            specs.append(CommitSpec(k, slot.slot_id, None))
        await store.commit(alloc.id, specs)  # (unverified: nothing in it awaits)
        fill = keys_for(ns, 32, seed=8)
        filler, _ = store.allocate_now(store.namespace(ns), [BlockSpec(k, b"", BLOCK) for k in fill])
        assert not held(b, ns, [left, other])
        store.abort(filler.id)
        await published(b)
        assert await redis.get(ghost) == str(count).encode()
        assert await redis.get(others) == b"1"


async def test_no_ghost_with_a_ttl_of_zero(
    tmp_path: Path, directory: DirectoryServer, redis: Redis | RedisCluster, ns: Namespace
) -> None:
    keys, data = keys_for(ns, 4, seed=4), blocks(4, seed=4)
    off = {"cluster.ghost_ttl_s": 0}
    async with Sidecar(directory.config(tmp_path, "a", **off)) as a, \
            Sidecar(directory.config(tmp_path, "b", **off)) as b:
        await asyncio.sleep(0.25)
        async with client_of(a) as ca, client_of(b) as cb:
            await ca.put_blocks(ns, keys, data, wait_published=True)
            await reuse(ca, ns, keys)
            assert min(uses(a, ns, keys)) >= 2
            await let_go(a, ca, ns, keys)
            assert [await redis.exists(g) for g in ghost_keys(a, ns, keys)] == [0] * 4
            assert (await ca.stats())["cluster"]["ghosts_written"] == 0
            await cb.put_blocks(ns, keys, data, wait_published=True)
            assert uses(b, ns, keys) == [1] * 4
            assert (await cb.stats())["cluster"]["ghosts_resumed"] == 0


async def test_a_ghost_that_is_not_a_count_is_ignored(
    directory: DirectoryServer, redis: Redis | RedisCluster, request: pytest.FixtureRequest
) -> None:
    """Whoever can write to the directory may leave anything in a g: key: a run of digits longer
    than any count (Python's int() refuses 4,300 and more), a negative or empty value. None is
    taken up and the publish goes through."""
    d = Directory(directory.client(), f"t{abs(hash(request.node.nodeid)) % 10**8}", "x", ghost_ttl_ms=60_000)
    try:
        root, keys = bytes(range(16)), [bytes([i]) * 32 for i in range(4)]
        for k, raw in zip(keys, (b"9" * 5000, b"-3", b"", b"3"), strict=True):
            await redis.set(d.ghost_key(root, k), raw)
        rec = Record(1, 1, 8192, 7)
        ghosts = (await d.publish([(root, k, rec) for k in keys], [], fresh=[True] * 4)).ghosts
        assert ghosts.found == {3: 3}
        assert [f.get("x") for f in await d.find(root, keys)] == [rec] * 4
    finally:
        await d.close()


async def test_a_ghost_command_the_directory_refuses_fails_no_record(
    directory: DirectoryServer, redis: Redis | RedisCluster, request: pytest.FixtureRequest
) -> None:
    """(As GETDEL on a Redis before 6.2 would be: here a g: key of another type.) The records land,
    the refusal is told, the ghosts that could be read are."""
    d = Directory(directory.client(), f"t{abs(hash(request.node.nodeid)) % 10**8}", "x", ghost_ttl_ms=60_000)
    try:
        root, keys = bytes(range(16)), [bytes([i]) * 32 for i in range(4)]  # (spread over the slots)
        await d.publish([], [(root, k) for k in keys[1:]], uses=[3, 3, 3])
        await redis.hset(d.ghost_key(root, keys[0]), "not", "a count")
        rec = Record(1, 1, 8192, 7)
        ghosts = (await d.publish([(root, k, rec) for k in keys], [], fresh=[True] * 4)).ghosts
        assert "WRONGTYPE" in ghosts.error
        assert [f.get("x") for f in await d.find(root, keys)] == [rec] * 4
        assert ghosts.found == {1: 3, 2: 3, 3: 3}
    finally:
        await d.close()


async def test_a_refused_ghost_loses_none_of_the_others(
    directory: DirectoryServer, redis: Redis | RedisCluster, request: pytest.FixtureRequest
) -> None:
    """A ghost the directory cannot read (a g: key of another type) among a publish's others: the
    ghosts before it are not deleted unread, those after it are read, and it is left alone."""
    d = Directory(directory.client(), f"t{abs(hash(request.node.nodeid)) % 10**8}", "x", ghost_ttl_ms=60_000)
    try:
        root, keys = bytes(range(16)), [bytes([i]) * 32 for i in range(4)]
        bad = d.ghost_key(root, keys[2])
        await d.publish([], [(root, k) for i, k in enumerate(keys) if i != 2], uses=[2, 3, 4])
        await redis.hset(bad, "not", "a count")
        rec = Record(1, 1, 8192, 7)
        ghosts = (await d.publish([(root, k, rec) for k in keys], [], fresh=[True] * 4)).ghosts
        assert "WRONGTYPE" in ghosts.error
        assert ghosts.found == {0: 2, 1: 3, 3: 4}
        assert [await redis.exists(d.ghost_key(root, k)) for k in keys] == [0, 0, 1, 0]
        assert await redis.type(bad) == b"hash"
    finally:
        await d.close()


async def test_each_pass_writes_its_ghosts_for_the_time_it_is_given(
    directory: DirectoryServer, redis: Redis | RedisCluster, request: pytest.FixtureRequest
) -> None:
    """The node gives each publish the time its ghosts should last (kvstore.policy.ghost): written
    for that long, never past the directory's ceiling, and not at all for 0."""
    d = Directory(directory.client(), f"t{abs(hash(request.node.nodeid)) % 10**8}", "x", ghost_ttl_ms=60_000)
    try:
        root, keys = bytes(range(16)), [bytes([i]) * 32 for i in range(3)]
        for key, ttl_ms in zip(keys, (5_000, 3_600_000, None), strict=True):
            ghosts = (await d.publish([], [(root, key)], uses=[1], ttl_ms=ttl_ms)).ghosts
            assert ghosts.written == 1
        ttls = [await redis.pttl(d.ghost_key(root, k)) for k in keys]
        assert 0 < ttls[0] <= 5_000 and 5_000 < ttls[1] <= 60_000 and 5_000 < ttls[2] <= 60_000, ttls
        other = b"\xff" * 32
        ghosts = (await d.publish([], [(root, other)], uses=[4], ttl_ms=0)).ghosts
        assert ghosts.written == 0 and not await redis.exists(d.ghost_key(root, other))
        assert await redis.get(d.ghost_key(root, keys[0])) == b"1"  # a count of 1 is kept (GHOST_MIN_USES)
    finally:
        await d.close()


async def test_an_unread_remove_sets_its_count_only_where_none_is(
    directory: DirectoryServer, redis: Redis | RedisCluster, request: pytest.FixtureRequest
) -> None:
    d = Directory(directory.client(), f"t{abs(hash(request.node.nodeid)) % 10**8}", "x", ghost_ttl_ms=60_000)
    try:
        root, keys = bytes(range(16)), [bytes([i]) * 32 for i in range(4)]
        await d.publish([], [(root, k) for k in keys[:2]], uses=[5, 5])
        ghosts = (await d.publish([], [(root, k) for k in keys], uses=[1, 2, 3, 4], unread=[True, False, True])).ghosts
        assert ghosts.written == 3
        assert [await redis.get(d.ghost_key(root, k)) for k in keys] == [b"5", b"2", b"3", b"4"]
    finally:
        await d.close()


async def test_a_redis_without_getdel_carries_the_counts() -> None:
    """A Redis before 6.2 has no GETDEL (here a redis-server with it renamed away): on one Redis the
    ghosts are read and deleted all the same (TAKE: GET, then DEL), not written for no reader."""
    with redis_server("--rename-command", "GETDEL", "") as server:
        d = Directory(Redis.from_url(server.url), "t", "x", ghost_ttl_ms=60_000)
        try:
            root, keys = bytes(range(16)), [bytes([i]) * 32 for i in range(3)]
            await d.publish([], [(root, k) for k in keys], uses=[1, 2, 3])
            rec = Record(1, 1, 8192, 7)
            ghosts = (await d.publish([(root, k, rec) for k in keys], [], fresh=[True, False, True])).ghosts
            assert (ghosts.found, ghosts.error) == ({0: 1, 2: 3}, "")
            assert [await d.client.exists(d.ghost_key(root, k)) for k in keys] == [0, 1, 0]
        finally:
            await d.close()
