"""Who can write the cluster directory without holding the cluster token, and what that gets them
(docs/security.md, "The cluster"): records and member entries are sealed with a key derived from
the token (kvstore/cluster/cluster_key.py), the peer hello proves both sides hold it without
sending it (kvstore/cluster/peer_hello.py). Real sidecars in-process on loopback, a real
redis-server and a real 3-node Redis Cluster as the directory (the lookup's code path differs:
a script on one Redis, a pipeline over the shards on a cluster), and an attacker's real listener.

Each test failed on 8dc5782 (the token sent in clear in the hello, records and member entries
taken as written): attacker bytes served for blocks host A holds, the token and the namespace root
sent to the attacker's listener, the poisoned replicas re-published and served to A."""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from redis.asyncio import Redis, RedisCluster

from kvstore.checksum import checksum
from kvstore.cluster import peer_hello
from kvstore.cluster.cluster_key import NONCE_BYTES, PROOF_BYTES
from kvstore.cluster.directory import Directory, Record
from kvstore.keys import Namespace
from kvstore.server.sidecar import Sidecar
from tests.cluster.directories import KINDS, DirectoryServer, directory_server
from tests.cluster.listening import LoopbackServer
from tests.cluster.nodes import BLOCK, TOKEN, blocks, client_of, keys_for
from tests.cluster.relay import Relay

DRAM = 1
FAR_MS = 10**13  # an expiry past any test's end (ms since the epoch, in the directory's clock)


@pytest.fixture(scope="module", params=KINDS)
def directory(request: pytest.FixtureRequest) -> Iterator[DirectoryServer]:
    with directory_server(request.param) as d:
        yield d


@dataclass
class Listener(LoopbackServer):
    """An attacker's TCP listener posing as a node. It records every byte it receives. To a version
    1 hello ("KVP1", the token in clear) it says welcome and answers every request with its own
    bytes for the keys it has (``serve``, under its own checksums); to a version 3 opening it
    answers with the fetcher's own nonce reflected back under the name the fetcher expects
    (``holder``), a made-up incarnation and proof, then records whatever comes."""

    serve: dict[bytes, np.ndarray]
    holder: str = "a"
    received: bytearray = field(default_factory=bytearray)

    async def _read(self, reader: asyncio.StreamReader, n: int) -> bytes:
        got = await reader.readexactly(n)
        self.received += got
        return got

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            magic = await self._read(reader, 4)
            if magic == b"KVP1":
                tlen, nlen = struct.unpack("<HH", await self._read(reader, 4))
                await self._read(reader, tlen + nlen)
                writer.write(b"OK\0\0")
                while True:
                    (n,) = struct.unpack("<I", await self._read(reader, 4))
                    body = await self._read(reader, 32 + 32 * n)
                    writer.write(self._answer([body[i : i + 32] for i in range(32, len(body), 32)]))
            elif magic == b"KVP5":
                (n, _) = struct.unpack("<HB", await self._read(reader, 3))
                nonce = await self._read(reader, 16)
                await self._read(reader, n)
                name = self.holder.encode()
                writer.write(b"KVP5" + struct.pack("<HB", len(name), 0) + nonce + name + os.urandom(8 + 32))
                self.received += await reader.read()  # whatever the fetcher says next, until it closes
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            if isinstance(exc, asyncio.IncompleteReadError):
                self.received += exc.partial
        finally:
            writer.close()

    def _answer(self, keys: list[bytes]) -> bytes:
        run = []
        for k in keys:
            if k not in self.serve:
                break
            run.append(self.serve[k])
        head = struct.pack("<I", len(run)) + b"".join(struct.pack("<QQ", d.nbytes, checksum(d)) for d in run)
        return head + b"".join(d.tobytes() for d in run)


def dir_key(sc: Sidecar, ns: Namespace, key: bytes) -> bytes:
    return f"{sc.config.cluster.key_prefix}:d:".encode() + ns.root[:16] + key


def members_key(sc: Sidecar) -> str:
    return f"{sc.config.cluster.key_prefix}:members"


async def eventually_true(check: Any, what: str, tries: int = 600) -> None:
    for _ in range(tries):
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never: {what}")


async def forge(redis: Redis | RedisCluster, sc: Sidecar, ns: Namespace, listener: Listener) -> None:
    """What a process with write access to the directory and without the token writes: member
    entries naming its listener (``0evil``: the old format; ``1evil``: with a made-up MAC; both
    names sort before every real node's) and, for every key the listener serves, ``d:`` records of
    both under the checksum of its bytes (old-format records; new-format ones with a made-up MAC)."""
    address = f"127.0.0.1:{listener.port}"
    await redis.hset(members_key(sc), "0evil", f"{address}|1|{FAR_MS}")  # type: ignore[misc]
    await redis.hset(members_key(sc), "1evil", f"{'0' * 32}@{address}|1|{FAR_MS}")  # type: ignore[misc]
    for k, d in listener.serve.items():
        fields = Record(1, DRAM, BLOCK, checksum(d)).pack()
        await redis.hset(dir_key(sc, ns, k), mapping={  # type: ignore[misc]
            "0evil": fields, "1evil": b"\x02" + fields + os.urandom(16)})
    await asyncio.sleep(0.3)  # every node's heartbeats read the forged members


async def unforge(redis: Redis | RedisCluster, sc: Sidecar, ns: Namespace, listener: Listener) -> None:
    """Delete every key :func:`forge` wrote."""
    await redis.hdel(members_key(sc), "0evil", "1evil")  # type: ignore[misc]
    for k in listener.serve:
        await redis.hdel(dir_key(sc, ns, k), "0evil", "1evil")  # type: ignore[misc]


@pytest.fixture
async def attacker(ns: Namespace) -> AsyncIterator[Listener]:
    """A listener serving its own bytes for the 4 keys of seed 40 (which A holds in these tests)
    and the 3 of seed 41 (which nobody holds)."""
    keys = keys_for(ns, 4, seed=40) + keys_for(ns, 3, seed=41)
    listener = Listener(dict(zip(keys, blocks(7, seed=666), strict=True)))
    await listener.start()
    try:
        yield listener
    finally:
        await listener.close()


async def test_forged_members_and_records_get_no_attacker_bytes_served(
    tmp_path: Path, directory: DirectoryServer, redis: Redis | RedisCluster, ns: Namespace, attacker: Listener
) -> None:
    """The issue's case 2 (:func:`forge`): B fetches A's bytes or nothing, for the blocks A holds
    and for those nobody holds; the listener hears nothing; the forgeries are counted."""
    held, free, data = keys_for(ns, 4, seed=40), keys_for(ns, 3, seed=41), blocks(4, seed=40)
    async with Sidecar(directory.config(tmp_path, "a")) as a, Sidecar(directory.config(tmp_path, "b")) as b, \
            client_of(a) as ca, client_of(b) as cb:
        await ca.put_blocks(ns, held, data, wait_published=True)
        await forge(redis, a, ns, attacker)
        got = await cb.get_blocks(ns, held, verify=True)
        assert [bytes(g) for g in got] == [bytes(d) for d in data], "B served bytes that are not A's"
        assert await cb.get_blocks(ns, free, verify=True) == [], "B served the attacker's bytes"
        assert attacker.connections == 0 and attacker.received == b"", "B called the attacker's listener"
        stats = (await cb.stats())["cluster"]
        assert stats["records_rejected"] >= 2 * len(free) and stats["members_rejected"] >= 2
        assert stats["checksum_failures"] == 0  # never fetched from the listener at all
        assert {m.node for m in b.cluster.live_members()} == {"a", "b"}  # type: ignore[union-attr]


async def test_once_the_forgeries_are_deleted_no_poisoned_replica_remains(
    tmp_path: Path, directory: DirectoryServer, redis: Redis | RedisCluster, ns: Namespace, attacker: Listener
) -> None:
    """B fetches while the forgeries (:func:`forge`) are there and publishes what it fetched as its
    replicas; the forged keys deleted, A lets its own copies go and reads the blocks back from B:
    its own bytes (8dc5782: the attacker's, re-published by B with the attacker's checksums)."""
    held, free, data = keys_for(ns, 4, seed=40), keys_for(ns, 3, seed=41), blocks(4, seed=40)
    async with Sidecar(directory.config(tmp_path, "a")) as a, Sidecar(directory.config(tmp_path, "b")) as b, \
            client_of(a) as ca, client_of(b) as cb:
        assert a.cluster is not None and b.cluster is not None
        await ca.put_blocks(ns, held, data, wait_published=True)
        await forge(redis, a, ns, attacker)
        await cb.get_blocks(ns, held, verify=True)  # B's replicas, whatever it got
        await cb.get_blocks(ns, free, verify=True)
        await b.cluster.flush()
        await unforge(redis, a, ns, attacker)
        await ca.delete(ns, held)
        await a.cluster.flush()
        again = await ca.get_blocks(ns, held, verify=True)
        assert [bytes(g) for g in again] == [bytes(d) for d in data], "A got poisoned replicas from B"
        assert (await ca.stats())["cluster"]["blocks_fetched"] == 4
        assert await ca.get_blocks(ns, free, verify=True) == []


async def test_a_listener_at_a_replayed_member_address_learns_no_token_and_no_root(
    tmp_path: Path, directory: DirectoryServer, redis: Redis | RedisCluster, ns: Namespace
) -> None:
    """A directory writer cannot forge an entry, but it can replay one: A's own member entry and
    records, put back whole after A left (within A's lease: its expiry is sealed with the rest),
    while the attacker listens on A's old port. B connects: the listener gets
    B's opening (a nonce and B's name) and nothing else, answers with a reflected one, and B, the
    proof wrong, closes. No token, no namespace root, no key; B's fetch is a miss."""
    keys, data = keys_for(ns, 3, seed=42), blocks(3, seed=42)
    long_lease = {"cluster.lease_ms": 60_000}  # A's entry, put back, still runs when B reads it
    async with Sidecar(directory.config(tmp_path, "a", **long_lease)) as a, \
            Sidecar(directory.config(tmp_path, "b", **{"cluster.fetch_timeout_s": 2.0})) as b:
        assert a.cluster is not None and b.cluster is not None
        port = a.cluster.server.port
        async with client_of(a) as ca, client_of(b) as cb:
            await ca.put_blocks(ns, keys, data, wait_published=True)
            entry = await redis.hget(members_key(a), "a")  # type: ignore[misc]
            records = [await redis.hget(dir_key(a, ns, k), "a") for k in keys]  # type: ignore[misc]
            assert entry is not None and None not in records
            await a.stop()
            listener = Listener({k: d for k, d in zip(keys, blocks(3, seed=667), strict=True)})
            await listener.start(port)
            try:
                await redis.hset(members_key(a), "a", entry)  # type: ignore[misc]
                for k, raw in zip(keys, records, strict=True):
                    await redis.hset(dir_key(a, ns, k), "a", raw)  # type: ignore[misc]

                async def listed() -> bool:
                    return any(m.node == "a" for m in b.cluster.live_members())  # type: ignore[union-attr]

                await eventually_true(listed, "B reads the replayed entry of A")
                got = await cb.get_blocks(ns, keys, verify=True)
                assert got == [], "B served bytes from the listener"
                assert listener.connections >= 1, "B never called the listener: the test shows nothing"
                heard = bytes(listener.received)
                assert TOKEN.encode() not in heard, "the cluster token crossed the wire"
                root = ns.root
                assert root not in heard and root[:16] not in heard, "the namespace root went to the listener"
                assert not any(k in heard for k in keys), "a block key went to the listener"
                assert heard[:4] == b"KVP5" and len(heard) == 4 + 2 + 1 + 16 + len(b"b")  # B's opening only
                assert (await cb.stats())["cluster"]["fetch_failures"] >= 1
            finally:
                await listener.close()


async def test_a_record_or_member_entry_moved_to_another_key_or_node_is_rejected(
    directory: DirectoryServer, redis: Redis | RedisCluster, request: pytest.FixtureRequest
) -> None:
    """The MACs bind a record to its directory key (prefix, namespace root, block key) and its
    node, and a member entry to its node's name: copied elsewhere, each is ignored and counted.
    A directory of another token reads none of them."""
    prefix = f"t{abs(hash(request.node.nodeid)) % 10**8}"
    d = Directory(directory.client(), prefix, "x", token=TOKEN)
    other = Directory(directory.client(), prefix, "z", token="another-token")
    try:
        root, keys = bytes(range(16)), [bytes([i]) * 32 for i in range(3)]
        rec = Record(1, DRAM, 8192, 7)
        await d.publish([(root, keys[0], rec)], [])
        raw = await redis.hget(d.key(root, keys[0]), "x")  # type: ignore[misc]
        await redis.hset(d.key(root, keys[1]), "x", raw)  # type: ignore[misc]  # another block key
        await redis.hset(d.key(root, keys[2]), "y", raw)  # type: ignore[misc]  # another node's field
        assert await d.find(root, keys) == [{"x": rec}, {}, {}]
        assert d.rejected_records == 2
        assert await other.find(root, keys) == [{}, {}, {}] and other.rejected_records == 3
        beat = await d.heartbeat("127.0.0.1:1", 5, 1000)
        entry = await redis.hget(d.members_key, "x")  # type: ignore[misc]
        await redis.hset(d.members_key, "y", entry)  # type: ignore[misc]  # x's entry under another name
        beat = await d.heartbeat("127.0.0.1:1", 5, 1000)
        assert set(beat.members) == {"x"} and beat.members["x"].address == "127.0.0.1:1"
        assert d.rejected_members == 1
        assert set((await other.heartbeat("127.0.0.1:2", 5, 1000)).members) == {"z"}  # its own only
        assert other.rejected_members == 2
    finally:
        await d.close()
        await other.close()


async def test_an_observer_on_the_path_sees_blocks_but_not_the_token_and_cannot_replay_the_hello(
    tmp_path: Path, directory: DirectoryServer, ns: Namespace
) -> None:
    """With ``cluster.peer_encryption`` off on both nodes, whoever sees the traffic between them
    sees the blocks' bytes, the namespace root and the block keys of each request: said in
    docs/security.md, shown here (encrypted, it sees none: tests/cluster/test_cluster_encryption.py).
    It does not see the token, and what it recorded of a fetcher's side, played back to the holder
    on a new connection, gets the holder's greeting and nothing more (the holder's fresh nonce makes
    the recorded proof wrong)."""
    keys, data = keys_for(ns, 2, seed=43), blocks(2, seed=43)
    relay = Relay()
    await relay.start()
    try:
        via = {"cluster.advertise_address": f"127.0.0.1:{relay.port}"}  # B reaches A through the relay
        clear = {"cluster.peer_encryption": False}
        async with Sidecar(directory.config(tmp_path, "a", **via, **clear)) as a, \
                Sidecar(directory.config(tmp_path, "b", **clear)) as b, client_of(a) as ca, client_of(b) as cb:
            assert a.cluster is not None
            relay.target = a.cluster.server.port
            await ca.put_blocks(ns, keys, data, wait_published=True)
            got = await cb.get_blocks(ns, keys, verify=True)
            assert [bytes(g) for g in got] == [bytes(d) for d in data]
            sent, back = bytes(relay.sent), bytes(relay.back)
            assert all(bytes(d) in back for d in data) and ns.root in sent  # what an observer sees
            assert TOKEN.encode() not in sent + back, "the cluster token crossed the wire"
            refused = a.cluster.server.refused
            reader, writer = await asyncio.open_connection("127.0.0.1", a.cluster.server.port)
            answer = b""
            try:
                writer.write(sent)  # B's side of the conversation, played back whole
                writer.write_eof()
                with contextlib.suppress(ConnectionResetError):  # (closed with our bytes unread)
                    while chunk := await asyncio.wait_for(reader.read(65536), 10):
                        answer += chunk
            finally:
                writer.close()
            assert not any(bytes(d) in answer for d in data), "a replayed hello got blocks"
            assert answer[:4] == b"KVP5" and len(answer) == 4 + 2 + 1 + 16 + len(b"a") + 8 + 32  # its greeting only
            assert a.cluster.server.refused == refused + 1
    finally:
        await relay.close()


@pytest.mark.parametrize("encrypt", [False, True], ids=["clear", "encrypted"])
async def test_a_party_on_the_path_cannot_send_a_request_of_its_own_on_a_relayed_connection(
    tmp_path: Path, directory: DirectoryServer, ns: Namespace, encrypt: bool
) -> None:
    """A relay between B and A, after B's hello and fetch went through it, writes B's request
    again on the connection to A (as it could any request naming a root it saw): A refuses it,
    since it does not carry the MAC of this exchange under the connection's key, and closes the
    connection; nothing more comes back (8dc5782: A answered it with the blocks again). Encrypted,
    the same: the replayed request's frame no longer opens under the connection's key (its nonce,
    a count of frames, has moved on)."""
    keys, data = keys_for(ns, 2, seed=44), blocks(2, seed=44)
    relay = Relay()
    await relay.start()
    try:
        via = {"cluster.advertise_address": f"127.0.0.1:{relay.port}"}
        mode = {"cluster.peer_encryption": encrypt}
        async with Sidecar(directory.config(tmp_path, "a", **via, **mode)) as a, \
                Sidecar(directory.config(tmp_path, "b", **mode)) as b, client_of(a) as ca, client_of(b) as cb:
            assert a.cluster is not None
            relay.target = a.cluster.server.port
            await ca.put_blocks(ns, keys, data, wait_published=True)
            got = await cb.get_blocks(ns, keys, verify=True)
            assert [bytes(g) for g in got] == [bytes(d) for d in data]
            assert len(relay.upstreams) == 1
            hello = peer_hello.GREETING.size + NONCE_BYTES + len(b"b") + PROOF_BYTES  # B's side of it
            request = bytes(relay.sent[hello:])
            answered, refused = len(relay.back), a.cluster.server.refused
            relay.upstreams[0].write(request)

            async def settled() -> bool:
                return a.cluster.server.refused > refused or len(relay.back) >= answered + BLOCK * 2  # type: ignore[union-attr]

            await eventually_true(settled, "A refused the injected request or answered it")
            assert len(relay.back) == answered, "A answered a request the relay injected"
            assert a.cluster.server.refused == refused + 1
    finally:
        await relay.close()
