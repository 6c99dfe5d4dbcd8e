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

import numpy as np
import pytest
from redis.asyncio import Redis, RedisCluster

from kvstore.cluster.cluster_key import ClusterKey
from kvstore.cluster.peer_client import PeerClient
from kvstore.keys import Namespace
from kvstore.server.sidecar import Sidecar
from tests.cluster.directories import KINDS, DirectoryServer, directory_server
from tests.cluster.nodes import BLOCK, TOKEN, blocks, client_of, keys_for
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



@pytest.mark.parametrize("written", ["999 above", "its own, run out"])
async def test_a_directory_writer_cannot_walk_a_nodes_incarnation(
    tmp_path: Path, directory: DirectoryServer, redis: Redis | RedisCluster, written: str
) -> None:
    """The heartbeat takes up an incarnation up to 999 above a node's from the entry under its name
    (one it gave the node in a reply the node never read), or the next one where that entry's lease
    ran out; the script cannot check a seal. A directory writer without the token puts such an entry
    there: the node finds it is not one it sealed and keeps its incarnation (fdcc228 took it up: a
    writer walked a node's incarnation 999 a beat, to any value, a past life's included), writes its
    own entry again, and publishes what it holds again (whoever read the writer's entry may have
    taken its records for void)."""
    async with Sidecar(directory.config(tmp_path, "a", **QUIET)) as a:
        assert a.cluster is not None
        m, life = a.cluster.membership, a.cluster.incarnation
        forged = b"x|%d|%d" % ((life + 999, FAR_MS) if written == "999 above" else (life, 1))
        members = members_key(a)
        republished: list[int] = []
        republish = m._republish
        m._republish = lambda: (republished.append(1), republish())[1]  # (counted, then done)
        for i in range(1, 4):
            await redis.hset(members, "a", forged)  # type: ignore[misc]
            await m.heartbeat()
            assert m.incarnation == life == a.cluster.incarnation, "the writer moved the node's incarnation"
            assert len(republished) == i, "the node did not publish again what it holds"
        entry = await redis.hget(members, "a")  # type: ignore[misc]
        assert entry != forged and entry.rsplit(b"|", 2)[1] == b"%d" % life, "the node's own entry not written again"


async def test_a_fetcher_that_dials_a_relay_to_a_node_is_refused_even_with_its_name_and_incarnation(
    tmp_path: Path, directory: DirectoryServer, ns: Namespace
) -> None:
    """Defence in depth, should a fetcher ever dial an address the node does not live at with the
    node's current incarnation (a walk of incarnations, refused above; a clock stepped back at a
    restart within a lease): the hello proves the holder's address too, the one its member entry
    names, and the fetcher checks it against the one it dialled. Through a relay on another port,
    with encryption off on both sides (the case where a relay would read), the fetcher closes after
    the holder's proof: nothing asked, no block. On fdcc228 all 32 blocks crossed the relay in the
    clear (the hello proved name and incarnation only)."""
    keys, data = keys_for(ns, 32, seed=52), blocks(32, seed=52)
    clear = {"cluster.peer_encryption": False}
    async with Sidecar(directory.config(tmp_path, "a", **clear)) as a, client_of(a) as ca:
        assert a.cluster is not None
        await ca.put_blocks(ns, keys, data, wait_published=True)
        relay = Relay(target=a.cluster.server.port)
        await relay.start()
        into = [np.empty(BLOCK, dtype=np.uint8) for _ in keys]
        client = PeerClient(f"127.0.0.1:{relay.port}", ClusterKey(TOKEN), "b", "a", a.cluster.incarnation, 5.0)
        try:
            root = a.store.namespace(ns).root
            got = await client.fetch(root, keys, into, 5.0)
            assert relay.connections == 1, "the fetcher never dialled the relay: the test shows nothing"
            assert got.checksums == [] and "lives at" in got.error, got.error
            assert not any(bytes(d) in relay.back for d in data), "block bytes crossed the relay"
            assert root not in relay.sent and a.cluster.server.served_blocks == 0
        finally:
            client.close()
            await relay.close()
