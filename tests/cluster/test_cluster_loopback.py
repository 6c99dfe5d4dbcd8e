"""Two sidecars in one process on loopback, one redis-server as the directory: the cluster's
logic (publish, find, fetch, adopt from a shared tier, membership) without namespaces. The tests
with separate hosts are in test_cluster_hosts.py."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from kvstore.harness.servers import RedisServer, redis_server
from kvstore.keys import Namespace
from kvstore.server.sidecar import Sidecar
from tests.cluster.nodes import TOKEN, blocks, client_of, hello_stream, keys_for, node_config


async def test_a_block_put_on_one_node_is_found_and_fetched_on_another(
    pair: tuple[Sidecar, Sidecar], ns: Namespace
) -> None:
    a, b = pair
    keys, data = keys_for(ns, 4), blocks(4)
    async with client_of(a) as ca, client_of(b) as cb:
        await ca.put_blocks(ns, keys, data, wait_published=True)
        found = await cb.lookup(ns, keys)
        assert found.matched == 4
        assert [t for t, _ in found.blocks] == ["peer"] * 4
        got = await cb.get_blocks(ns, keys, verify=True)
        assert [bytes(g) for g in got] == [bytes(d) for d in data]
        again = await cb.lookup(ns, keys)  # now a local replica
        assert [t for t, _ in again.blocks] == ["dram"] * 4
        stats = await cb.stats()
        assert stats["cluster"]["blocks_fetched"] == 4


async def test_write_through_to_a_shared_redis_is_found_by_the_other_node_at_once(
    tmp_path: Path, directory: RedisServer, ns: Namespace
) -> None:
    """The issue's case: a shared redis-server with write-through; B matched 0 until it restarted."""
    shared = {"redis.enabled": True, "redis.url": directory.url, "redis.key_prefix": f"wt{id(tmp_path)}",
              "tiering.write_through": ["redis"]}
    keys, data = keys_for(ns, 8, seed=1), blocks(8, seed=1)
    async with Sidecar(node_config(tmp_path, "a", directory, **shared)) as a, \
            Sidecar(node_config(tmp_path, "b", directory, **shared)) as b:
        await asyncio.sleep(0.25)
        async with client_of(a) as ca, client_of(b) as cb:
            put = await ca.put_blocks(ns, keys, data, wait_write_through=True, wait_published=True)
            assert put.written_through == 8
            found = await cb.lookup(ns, keys)
            assert found.matched == 8
            assert [t for t, _ in found.blocks] == ["redis"] * 8  # read from the shared tier, not from A
            await a.stop()  # A gone: the shared tier still has them
            got = await cb.get_blocks(ns, keys, verify=True)
            assert [bytes(g) for g in got] == [bytes(d) for d in data]
            assert (await cb.stats())["cluster"]["blocks_adopted"] == 8


async def test_a_stopped_node_is_no_longer_offered(pair: tuple[Sidecar, Sidecar], ns: Namespace) -> None:
    a, b = pair
    keys = keys_for(ns, 3, seed=2)
    async with client_of(a) as ca, client_of(b) as cb:
        await ca.put_blocks(ns, keys, blocks(3, seed=2), wait_published=True)
        assert (await cb.lookup(ns, keys)).matched == 3
        await a.stop()
        assert await cb.get_blocks(ns, keys) == []  # B has not heard yet: the fetch fails, a miss
        await asyncio.sleep(0.3)  # B's next heartbeat reads the members without A
        assert (await cb.lookup(ns, keys)).matched == 0


async def test_delete_and_eviction_stop_a_block_being_offered(pair: tuple[Sidecar, Sidecar], ns: Namespace) -> None:
    a, b = pair
    keys = keys_for(ns, 2, seed=3)
    async with client_of(a) as ca, client_of(b) as cb:
        await ca.put_blocks(ns, keys, blocks(2, seed=3), wait_published=True)
        assert (await cb.lookup(ns, keys)).matched == 2
        await ca.delete(ns, keys)
        await a.cluster.flush()  # type: ignore[union-attr]
        assert (await cb.lookup(ns, keys)).matched == 0
        # fill A's 256 KiB slab with other blocks: the first ones are evicted (no tier below) and unlisted
        first = keys_for(ns, 4, seed=4)
        await ca.put_blocks(ns, first, blocks(4, seed=4), wait_published=True)
        for i in range(6):
            await ca.put_blocks(ns, keys_for(ns, 6, seed=10 + i), blocks(6, seed=10 + i))
        await a.cluster.flush()  # type: ignore[union-attr]
        assert (await ca.lookup(ns, first)).matched == 0
        assert (await cb.lookup(ns, first)).matched == 0


async def test_namespaces_stay_apart_across_the_cluster(pair: tuple[Sidecar, Sidecar], ns: Namespace) -> None:
    a, b = pair
    keys = keys_for(ns, 2, seed=5)
    other = Namespace(model=ns.model, kv_layout=ns.kv_layout, dtype=ns.dtype, block_size=ns.block_size,
                      cache_salt="another-tenant")
    async with client_of(a) as ca, client_of(b) as cb:
        await ca.put_blocks(ns, keys, blocks(2, seed=5), wait_published=True)
        assert (await cb.lookup(other, keys)).matched == 0  # the same keys, another tenant's namespace
        assert await cb.get_blocks(other, keys) == []
        assert (await cb.lookup(ns, keys)).matched == 2


async def test_a_corrupted_peer_block_is_never_served(pair: tuple[Sidecar, Sidecar], ns: Namespace) -> None:
    from kvstore.dram.slab import attach

    a, b = pair
    keys, data = keys_for(ns, 3, seed=6), blocks(3, seed=6)
    async with client_of(a) as ca, client_of(b) as cb:
        await ca.put_blocks(ns, keys, data, checksums=True, wait_published=True)
        async with ca.acquire(ns, keys) as lease:  # flip a byte of A's second block, its checksum unchanged
            slot = lease.slots[1]
            attach(slot.segment)[slot.offset + 7] ^= 0xFF
        got = await cb.get_blocks(ns, keys, verify=True)
        assert [bytes(g) for g in got] == [bytes(data[0])]  # the run ends before the bad block
        stats = (await cb.stats())["cluster"]
        assert stats["checksum_failures"] == 1 and stats["blocks_fetched"] == 1


async def test_a_wrong_token_gets_nothing(
    tmp_path: Path, directory: RedisServer, ns: Namespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node with another token reads none of the cluster's records or member entries (each
    counted), and the peer port welcomes no fetcher whose proof is not made with the token. Each
    proof goes through the one constant-time comparison; the token itself is never compared, and
    never sent (kvstore.cluster.peer_hello)."""
    import hmac
    import os

    from kvstore.cluster import peer_hello
    from kvstore.cluster.cluster_key import NONCE_BYTES, PROOF_BYTES, ClusterKey, HelloTranscript
    from kvstore.wire import peer as w

    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((bytes(a), bytes(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    keys = keys_for(ns, 2, seed=7)
    async with Sidecar(node_config(tmp_path, "a", directory)) as a, \
            Sidecar(node_config(tmp_path, "b", directory, **{"cluster.token": "not-the-token"})) as b:
        await asyncio.sleep(0.25)
        assert a.cluster is not None and b.cluster is not None
        async with client_of(a) as ca, client_of(b) as cb:
            await ca.put_blocks(ns, keys, blocks(2, seed=7), wait_published=True)
            assert (await cb.lookup(ns, keys)).matched == 0  # A's records do not check out with B's key
            assert await cb.get_blocks(ns, keys) == []
            stats = (await cb.stats())["cluster"]
            assert stats["records_rejected"] >= 1 and stats["members_rejected"] >= 1
            assert [m.node for m in b.cluster.live_members()] == ["b"]
        # a fetcher with the wrong token that goes on past the holder's proof: no welcome
        reader, writer = await asyncio.open_connection("127.0.0.1", a.cluster.server.port)
        try:
            mine, wrong = os.urandom(NONCE_BYTES), ClusterKey("not-the-token")
            writer.write(peer_hello.opening("b", mine))
            _, n, flags = peer_hello.GREETING.unpack(await reader.readexactly(peer_hello.GREETING.size))
            rest = await reader.readexactly(NONCE_BYTES + n + peer_hello.INCARNATION.size + PROOF_BYTES)
            theirs, name = rest[:NONCE_BYTES], rest[NONCE_BYTES : NONCE_BYTES + n]
            (incarnation,) = peer_hello.INCARNATION.unpack_from(rest, NONCE_BYTES + n)
            both = bytes([0, flags])
            at = a.cluster.address.encode()
            hello = HelloTranscript(mine, theirs, b"b", name, incarnation, at, both)
            proof = wrong.proof(peer_hello.FETCHER, hello)
            writer.write(proof)
            with contextlib.suppress(ConnectionResetError):
                assert await asyncio.wait_for(reader.read(), 10) == b""  # closed, no welcome
        finally:
            writer.close()
        assert a.cluster.server.refused == 1
        right = ClusterKey(TOKEN).proof(peer_hello.FETCHER, hello)
        assert (proof, right) in compared
        assert not any(TOKEN.encode() in pair for pair in compared)
        assert w.WELCOME not in rest


async def test_garbage_on_the_peer_port_drops_that_connection_only(
    pair: tuple[Sidecar, Sidecar], ns: Namespace
) -> None:
    import struct
    from collections.abc import Callable

    from kvstore.cluster.cluster_key import MAC_BYTES
    from kvstore.cluster.peer_frames import Frames
    from kvstore.wire import peer as w

    a, b = pair
    assert a.cluster is not None
    port = a.cluster.server.port
    old_hello = b"KVP1" + struct.pack("<HH", len(TOKEN), 1) + TOKEN.encode() + b"x"  # version 1: the token in clear
    one = (b"\0" * 32, [b"\1" * 32])
    unsealed = w.REQUEST.pack(1) + one[0] + one[1][0] + b"\0" * MAC_BYTES
    cases: list[tuple[bool, Callable[[Frames | None], bytes], bool]] = [
        # whether a hello is said first, what is sent (given its connection's key), whether it counts as refused
        (False, lambda _: b"GET / HTTP/1.1\r\n\r\n", True),
        (True, lambda _: b"\xff\xff\xff\xff", True),  # a request for 4 billion blocks
        (True, lambda s: s.request(*one)[:-5] if s else b"", False),  # cut short: the fetcher went away
        (False, lambda _: b"\0" * 3, False),
        (False, lambda _: old_hello, True),
        (True, lambda _: unsealed, True),  # not sealed with the connection's key: injected by another party
    ]
    for hello, payload, _ in cases:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        session = await asyncio.wait_for(hello_stream(reader, writer, "x", a), 10) if hello else None
        writer.write(payload(session))
        writer.write_eof()
        with contextlib.suppress(ConnectionResetError):  # (a reset when it closes with our bytes unread)
            assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()
    assert a.cluster.server.refused == sum(refused for *_, refused in cases)
    keys, data = keys_for(ns, 2, seed=8), blocks(2, seed=8)
    async with client_of(a) as ca, client_of(b) as cb:
        await ca.put_blocks(ns, keys, data, wait_published=True)
        got = await cb.get_blocks(ns, keys, verify=True)
        assert [bytes(g) for g in got] == [bytes(d) for d in data]


async def test_directory_down_then_back(tmp_path: Path, ns: Namespace) -> None:
    with redis_server() as own:
        async with Sidecar(node_config(tmp_path, "a", own)) as a, Sidecar(node_config(tmp_path, "b", own)) as b:
            await asyncio.sleep(0.25)
            keys, data = keys_for(ns, 2, seed=9), blocks(2, seed=9)
            async with client_of(a) as ca, client_of(b) as cb:
                own.stop()
                await ca.put_blocks(ns, keys, data)  # stored locally while the directory is away
                assert (await ca.lookup(ns, keys)).matched == 2
                assert (await cb.lookup(ns, keys)).matched == 0  # a miss, answered at once
                own.start()  # empty: everything it knew is gone
                for _ in range(100):
                    await asyncio.sleep(0.05)
                    if (await cb.lookup(ns, keys)).matched == 2:
                        break
                got = await cb.get_blocks(ns, keys, verify=True)
                assert [bytes(g) for g in got] == [bytes(d) for d in data]
