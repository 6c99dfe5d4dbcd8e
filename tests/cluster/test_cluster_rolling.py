"""A rolling update (docs/cluster.md, "Rolling updates"): nodes of this version and of the one
before it (66d9839: member entries with the address alone sealed, the "KVP2" hello) miss each other
until all are replaced, and once the last old node is gone the new ones publish again what the old
ones deleted. The old node is played by what it writes to the directory and says on the wire,
exactly as it would (its member entry sealed with the v1 derivation, its hello's opening), beside
two real sidecars of this version and a real redis-server."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os

from redis.asyncio import Redis

from kvstore.cluster.cluster_key import MAC_BYTES, NONCE_BYTES, framed, hkdf
from kvstore.harness.servers import RedisServer
from kvstore.keys import Namespace
from kvstore.server.sidecar import Sidecar
from tests.cluster.nodes import TOKEN, blocks, client_of, keys_for
from tests.cluster.test_cluster_auth import FAR_MS, dir_key, eventually_true, members_key


def v1_entry(prefix: str, node: str, address: str, incarnation: int, expiry_ms: int) -> bytes:
    """The member entry a node of the version before writes: the MAC over the address only."""
    key = hkdf(TOKEN.encode(), b"member entry")
    mac = hashlib.blake2b(framed(prefix.encode(), node.encode(), address.encode()), key=key, digest_size=MAC_BYTES)
    return f"{mac.hexdigest()}@{address}|{incarnation}|{expiry_ms}".encode()


async def test_old_and_new_nodes_miss_each_other_until_all_are_replaced(
    pair: tuple[Sidecar, Sidecar], directory: RedisServer, ns: Namespace
) -> None:
    a, b = pair
    assert a.cluster is not None and b.cluster is not None
    keys, data = keys_for(ns, 4, seed=60), blocks(4, seed=60)
    redis = Redis.from_url(directory.url)
    try:
        async with client_of(a) as ca, client_of(b) as cb:
            await ca.put_blocks(ns, keys, data, wait_published=True)
            assert (await cb.lookup(ns, keys)).matched == 4
            # an old node "o" joins: its entry is read by no new node (counted), so none dials it
            rejected = (await cb.stats())["cluster"]["members_rejected"]
            await redis.hset(members_key(a), "o", v1_entry(a.config.cluster.key_prefix, "o", "127.0.0.1:9", 1, FAR_MS))

            async def counted() -> bool:
                return (await cb.stats())["cluster"]["members_rejected"] > rejected

            await eventually_true(counted, "B reads the old node's entry")
            assert {m.node for m in b.cluster.live_members()} == {"a", "b"}
            assert {m.node for m in a.cluster.live_members()} == {"a", "b"}
            # its hello ("KVP2") gets nothing from a new node: closed before a byte is sent
            refused = a.cluster.server.refused
            reader, writer = await asyncio.open_connection("127.0.0.1", a.cluster.server.port)
            try:
                writer.write(b"KVP2" + len(b"o").to_bytes(2, "little") + os.urandom(NONCE_BYTES) + b"o")
                with contextlib.suppress(ConnectionResetError):
                    assert await asyncio.wait_for(reader.read(), 10) == b""
            finally:
                writer.close()
            assert a.cluster.server.refused == refused + 1
            # the old node reads A's entry as one that does not check out and sweeps A's records as void
            for k in keys:
                await redis.hdel(dir_key(a, ns, k), "a")
            assert (await cb.lookup(ns, keys)).matched == 0
            # the old node is replaced (its entry leaves): A publishes again what it holds

            async def found() -> bool:
                return (await cb.lookup(ns, keys)).matched == 4  # type: ignore[no-any-return]

            await redis.hdel(members_key(a), "o")
            await eventually_true(found, "A's blocks listed again once no old node is left")
            got = await cb.get_blocks(ns, keys, verify=True)
            assert [bytes(g) for g in got] == [bytes(d) for d in data]
    finally:
        await redis.aclose()
