"""A directory writer cannot tap the peer path (docs/security.md, "The cluster"): a member entry is
sealed whole (address, incarnation, expiry: kvstore/cluster/cluster_key.py), and the peer hello
proves which incarnation of a node answers (kvstore/cluster/peer_hello.py), so a fetcher talks only
to the incarnation the entry names. Real sidecars in-process on loopback, a real redis-server and a
real 3-node Redis Cluster as the directory, a real TCP relay.

The attack (issue 37): someone with write access to the directory's Redis (no token) keeps node A's
sealed member entry and records, A restarts on another port, and the writer puts A's old entry back
(with A's current incarnation and expiry, or whole, of A's past life, with that life's records) and
relays A's old address to its new one. On 66d9839 B fetched every block through the relay, in the
clear: the hello passed through it, both proofs good, since they named no incarnation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis, RedisCluster

from kvstore.keys import Namespace
from kvstore.server.sidecar import Sidecar
from tests.cluster.directories import KINDS, DirectoryServer, directory_server
from tests.cluster.nodes import blocks, client_of, keys_for
from tests.cluster.relay import Relay
from tests.cluster.test_cluster_auth import FAR_MS, dir_key, eventually_true, members_key

# A writes its member entry at its start and not again during the test (a heartbeat every 30 s, a
# lease of 60 s): what the writer puts back stays until B has read it.
QUIET = {"cluster.heartbeat_ms": 30_000, "cluster.lease_ms": 60_000}


@pytest.fixture(scope="module", params=KINDS)
def directory(request: pytest.FixtureRequest) -> Iterator[DirectoryServer]:
    with directory_server(request.param) as d:
        yield d


@pytest.mark.parametrize("put_back", ["with A's current incarnation and expiry", "whole, with A's past life's records"])
async def test_a_directory_writer_cannot_point_a_fetcher_at_a_relay_to_a_restarted_node(
    tmp_path: Path, directory: DirectoryServer, redis: Redis | RedisCluster, ns: Namespace, put_back: str
) -> None:
    """B's fetch of A's 32 blocks is a miss, and no block byte crosses the relay: the entry with
    A's current incarnation and expiry under the old address does not check out (B leaves A out of
    its members, counted); the whole old entry does, with its past life's records, but A, reached
    through the relay, proves its current incarnation in the hello, and B closes before it asks."""
    keys, data = keys_for(ns, 32, seed=50), blocks(32, seed=50)
    async with Sidecar(directory.config(tmp_path, "b", **QUIET)) as b, client_of(b) as cb:
        assert b.cluster is not None  # (B's heartbeat runs when the test calls it: no sweep in between)
        prefix = {"cluster.key_prefix": b.config.cluster.key_prefix}
        async with Sidecar(directory.config(tmp_path / "first", "a", **QUIET, **prefix)) as a, client_of(a) as ca:
            assert a.cluster is not None
            await ca.put_blocks(ns, keys, data, wait_published=True)
            old_entry = await redis.hget(members_key(b), "a")  # type: ignore[misc]
            old_records = [await redis.hget(dir_key(b, ns, k), "a") for k in keys]  # type: ignore[misc]
            old_port, old_life = a.cluster.server.port, a.cluster.incarnation
        assert old_entry is not None and None not in old_records
        async with Sidecar(directory.config(tmp_path / "again", "a", **QUIET, **prefix)) as a, client_of(a) as ca:
            assert a.cluster is not None and a.cluster.server.port != old_port
            assert a.cluster.incarnation != old_life
            await ca.put_blocks(ns, keys, data, wait_published=True)
            entry = await redis.hget(members_key(b), "a")  # type: ignore[misc]
            relay = Relay(target=a.cluster.server.port)
            await relay.start(old_port)  # A's old address, relayed to where A lives now
            try:
                if put_back.startswith("with"):
                    old_address = old_entry.rsplit(b"|", 2)[0]
                    forged = b"|".join([old_address, *entry.rsplit(b"|", 2)[1:]])
                else:
                    forged = old_entry
                    for k, raw in zip(keys, old_records, strict=True):
                        await redis.hset(dir_key(b, ns, k), "a", raw)  # type: ignore[misc]
                rejected = (await cb.stats())["cluster"]["members_rejected"]
                await redis.hset(members_key(b), "a", forged)  # type: ignore[misc]
                await b.cluster.membership.heartbeat()

                put = int(forged.rsplit(b"|", 2)[1])  # (B's view of A's first life, before a heartbeat, is not it)

                async def read() -> bool:  # B's heartbeat read the entry put back (taken, or refused)
                    m = b.cluster.membership.member("a")  # type: ignore[union-attr]
                    taken = m is not None and m.address == f"127.0.0.1:{old_port}" and m.incarnation == put
                    return taken or (await cb.stats())["cluster"]["members_rejected"] > rejected

                await eventually_true(read, "B reads the entry put back")
                got = await cb.get_blocks(ns, keys, verify=True)
                stats = (await cb.stats())["cluster"]
                assert got == [], "B's fetch was not a miss"
                assert not any(bytes(d) in relay.back for d in data), "block bytes crossed the relay"
                assert stats["blocks_fetched"] == 0 and a.cluster.server.served_blocks == 0
                if put_back.startswith("with"):
                    assert stats["members_rejected"] > rejected and b.cluster.membership.member("a") is None
                else:
                    assert relay.connections >= 1, "B never dialled the relay: the test shows nothing"
                    assert stats["fetch_failures"] >= 1
                    assert ns.root not in relay.sent, "B sent a request through the relay"
            finally:
                await relay.close()


async def push(sc: Sidecar, redis: Redis | RedisCluster, members: str, to: int) -> None:
    """Walk ``sc``'s incarnation up to ``to`` as a directory writer can, without the token: put an
    entry under its name whose incarnation lies up to 999 above the node's (the heartbeat takes it
    for one it gave the node in a reply that was lost), then let a heartbeat run."""
    assert sc.cluster is not None
    m = sc.cluster.membership
    while m.incarnation < to:
        step = min(m.incarnation + 999, to)
        await redis.hset(members, sc.config.cluster.node_id, b"x|%d|%d" % (step, FAR_MS))  # type: ignore[misc]
        await m.heartbeat()
        assert m.incarnation == step, "the heartbeat did not take up the incarnation written"


async def test_a_directory_writer_cannot_relay_to_a_node_it_steered_into_a_past_lifes_incarnation(
    tmp_path: Path, directory: DirectoryServer, redis: Redis | RedisCluster, ns: Namespace
) -> None:
    """Incarnations are not the writer's to choose, yet it can move them: the heartbeat takes up an
    incarnation up to 999 above a node's from the entry under its name (one it may have given in a
    lost reply), and cannot tell who wrote that. So the writer walks A's first life up to a time
    ahead (A seals its entry, old address, with it), then walks A's next life, restarted on
    another port, up to the same incarnation, puts the first life's entry back (sealed whole, its
    lease still running) and relays the old address to the new one. The hello's incarnation then
    matches the entry's; what must not is the address: A proves where it lives, and B, which dialled
    the old address, closes before it asks. With encryption off on both nodes (the case where a
    relay would read): on the code before the hello proved the address, all 32 blocks crossed the
    relay in the clear."""
    keys, data = keys_for(ns, 32, seed=52), blocks(32, seed=52)
    clear = {"cluster.peer_encryption": False}
    async with Sidecar(directory.config(tmp_path, "b", **QUIET, **clear)) as b, client_of(b) as cb:
        assert b.cluster is not None  # (B's heartbeats run when the test calls them)
        prefix = {"cluster.key_prefix": b.config.cluster.key_prefix}
        members = members_key(b)
        async with Sidecar(directory.config(tmp_path / "first", "a", **QUIET, **prefix, **clear)) as a:
            assert a.cluster is not None
            target = a.cluster.incarnation + 20_000  # ahead of the next life's start
            await push(a, redis, members, target)
            old_entry = await redis.hget(members, "a")  # type: ignore[misc]
            old_port = a.cluster.server.port
        assert old_entry is not None and old_entry.rsplit(b"|", 2)[1] == b"%d" % target
        async with Sidecar(directory.config(tmp_path / "again", "a", **QUIET, **prefix, **clear)) as a, \
                client_of(a) as ca:
            assert a.cluster is not None and a.cluster.server.port != old_port
            assert a.cluster.incarnation < target
            await push(a, redis, members, target)
            await ca.put_blocks(ns, keys, data, wait_published=True)
            relay = Relay(target=a.cluster.server.port)
            await relay.start(old_port)  # A's old address, relayed to where A lives now
            try:
                await redis.hset(members, "a", old_entry)  # type: ignore[misc]
                await b.cluster.membership.heartbeat()
                m = b.cluster.membership.member("a")
                assert m is not None and m.address == f"127.0.0.1:{old_port}", "B did not take the entry put back"
                assert m.incarnation == a.cluster.incarnation == target
                got = await cb.get_blocks(ns, keys, verify=True)
                stats = (await cb.stats())["cluster"]
                assert relay.connections >= 1, "B never dialled the relay: the test shows nothing"
                assert not any(bytes(d) in relay.back for d in data), "block bytes crossed the relay"
                assert ns.root not in relay.sent, "B sent a request through the relay"
                assert got == [] and stats["blocks_fetched"] == 0 and a.cluster.server.served_blocks == 0
            finally:
                await relay.close()
