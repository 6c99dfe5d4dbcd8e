"""The cluster configuration of tests/core/test_fuzz.py's state machine: two real sidecars, each on
an event loop of its own thread (:class:`~tests.core.fuzz_model.ServerThread`), that form one
cluster over a real redis-server as the directory; what a process with write access to that Redis
(and no cluster token) can do to it (:class:`DirectoryFaults`); the listener such a process runs as
a fake holder (:class:`FakeHolder`); and the model the machine checks the nodes' answers against
(:class:`ClusterModel`).

Nothing is mocked: the nodes publish, look up and fetch over real sockets; the faults are raw
writes to the directory's Redis, in the layout of ``kvstore/cluster/directory.py`` as a client of
that Redis reads it off the server.
"""

from __future__ import annotations

import hashlib
import os
import socket
import socketserver
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from kvstore.checksum import checksum
from kvstore.client import SyncClient
from kvstore.cluster import peer_hello
from kvstore.cluster.directory import ROOT_BYTES, Record
from kvstore.config import Config
from kvstore.keys import Namespace
from kvstore.store.books.index import DRAM
from kvstore.wire import peer as peer_wire
from tests.conftest import small_config
from tests.core.fuzz_model import ServerThread

NODES = ("a", "b")
EVIL = "0evil"  # sorts before every real node's id: a fetch tries its records first
BLOCK = 4096
EVIL_BYTES = b"\xee" * BLOCK
TOKEN = "fuzz-cluster-token"
POLL_S = 10.0  # the most a check waits for a heartbeat
UNDECODABLE = b"\xff\xfe"  # no UTF-8 text starts so


def node_config(tmp: Path, node: str, redis_url: str, prefix: str) -> Config:
    """A node of the fuzzed cluster: DRAM for every block the machine can write (16 pages of
    64 KiB, 256 blocks of 4 KiB), so nothing is evicted and a committed block is always found."""
    return small_config(
        tmp / node,
        **{
            "dram.capacity_bytes": 16 * 65536,
            "cluster.enabled": True,
            "cluster.directory_url": redis_url,
            "cluster.node_id": node,
            "cluster.peer_address": "127.0.0.1:0",
            "cluster.token": TOKEN,
            "cluster.key_prefix": prefix,
            "cluster.publish_interval_ms": 2,
            "cluster.heartbeat_ms": 100,
            # Generous deadlines: a loaded host must not turn a slow heartbeat or round trip into
            # a miss the model does not allow (a stopped heartbeat is caught by Cluster.wait_heartbeats).
            "cluster.lease_ms": 30_000,
            "cluster.directory_timeout_s": 30.0,
            "cluster.fetch_timeout_s": 30.0,
        },
    )


class Cluster:
    """The two nodes, a blocking gRPC client of each, the directory's Redis as a raw client."""

    def __init__(self, tmp: Path, redis_url: str, prefix: str) -> None:
        self.prefix = prefix
        self.nodes: list[ServerThread] = []
        self.clients: list[SyncClient] = []
        try:
            for node in NODES:
                self.nodes.append(ServerThread(node_config(tmp, node, redis_url, prefix)).start())
                self.clients.append(SyncClient(self.nodes[-1].grpc_url, local=False))
        except BaseException:
            self.close()
            raise
        self.wait_heartbeats()  # each node has seen the other

    def heartbeats(self) -> list[int]:
        return [int(c.stats()["cluster"].get("heartbeats", 0)) for c in self.clients]

    def wait_heartbeats(self) -> None:
        """Until every node has beaten twice more (a heartbeat reads what was written before it
        began): each has read the members as they are now. AssertionError when one stops."""
        start = self.heartbeats()
        deadline = time.monotonic() + POLL_S
        while True:
            now = self.heartbeats()
            if all(n >= s + 2 for n, s in zip(now, start)):
                return
            assert time.monotonic() < deadline, f"heartbeats stopped: {start} -> {now} in {POLL_S} s"
            time.sleep(0.02)

    def close(self) -> None:
        for c in self.clients:
            c.close()
        for n in self.nodes:
            n.stop()


class FakeHolder:
    """A listener posing as a holder, for forged member entries to point at: it keeps what
    fetchers send it and answers with :data:`EVIL_BYTES` under the checksum of those bytes."""

    def __init__(self) -> None:
        holder = self
        self.received: list[bytes] = []  # every byte fetchers sent it
        self.name = EVIL  # the node its forged member entry names

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                self.request.settimeout(1)  # a fetcher sends each message whole: waiting is a hello it cannot read
                holder.serve(self.request)

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="fuzz-evil", daemon=True)
        self._thread.start()

    def serve(self, sock: socket.socket) -> None:
        """One connection as an attacker without the token can speak the peer hello
        (``kvstore/cluster/peer_hello.py``): it keeps every byte the fetcher sends, answers the
        greeting with its own (a nonce, the name the fetcher asked for, a proof it cannot make:
        random bytes) and, should the fetcher go on, answers every request with EVIL_BYTES."""
        try:
            magic, n, _ = peer_hello.GREETING.unpack(self._keep(sock, peer_hello.GREETING.size))
            if magic != peer_hello.MAGIC:
                return
            self._keep(sock, peer_hello.NONCE_BYTES + n)
            sock.sendall(peer_hello.opening(self.name, os.urandom(peer_hello.NONCE_BYTES))
                         + os.urandom(peer_hello.INCARNATION.size + peer_hello.PROOF_BYTES))
            entry = peer_wire.ENTRY.pack(BLOCK, checksum(EVIL_BYTES), 0, 0, 0)
            while True:
                self._keep(sock, 4096)
                sock.sendall(entry + EVIL_BYTES)
        except (OSError, struct.error, EOFError):
            return

    def _keep(self, sock: socket.socket, n: int) -> bytes:
        got = _read(sock, n)
        self.received.append(got)
        return got

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(10)


def _read(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            raise EOFError
        buf += got
    return bytes(buf)


class DirectoryFaults:
    """What a writer of the directory's Redis who lacks the cluster token writes there; each
    fault is listed, so :meth:`clear` takes them all back."""

    def __init__(self, redis_url: str, prefix: str, evil_address: str) -> None:
        self.r = redis.Redis.from_url(redis_url)
        self.prefix = prefix.encode()
        self.evil_address = evil_address
        self.keys: set[bytes] = set()  # keys it wrote whole
        self.fields: set[tuple[bytes, bytes]] = set()  # (hash, field) it wrote

    def d_key(self, ns: Namespace, key: bytes) -> bytes:
        return self.prefix + b":d:" + ns.root[:ROOT_BYTES] + key

    @property
    def members(self) -> bytes:
        return self.prefix + b":members"

    def _hset(self, name: bytes, fld: bytes, value: bytes) -> None:
        if name in self.keys:  # made a string by wrong_type: a writer of the directory replaces it
            self.r.delete(name)
            self.keys.discard(name)
        self.r.hset(name, fld, value)
        self.fields.add((name, fld))

    def forge(self, ns: Namespace, key: bytes) -> None:
        """A record in the valid format: the fake holder holds the block, in DRAM, with the
        checksum of the attacker's bytes; and a live member entry for that holder."""
        seconds, micros = self.r.time()
        expiry = seconds * 1000 + micros // 1000 + 600_000
        self._hset(self.members, EVIL.encode(), f"{self.evil_address}|1|{expiry}".encode())
        self._hset(self.d_key(ns, key), EVIL.encode(), Record(1, DRAM, BLOCK, checksum(EVIL_BYTES)).pack())

    def undecodable_member(self) -> None:
        """A ``members`` field that is not UTF-8 (its value well-formed, its lease far off)."""
        self._hset(self.members, UNDECODABLE, b"127.0.0.1:1|1|99999999999999")

    def undecodable_holder(self, ns: Namespace, key: bytes) -> None:
        """A field of a block's ``d:`` hash that is not UTF-8, valued with a record."""
        self._hset(self.d_key(ns, key), UNDECODABLE, Record(1, DRAM, BLOCK, 1).pack())

    def wrong_type(self, ns: Namespace, key: bytes) -> None:
        """A block's ``d:`` key made a string (what records it held are gone)."""
        name = self.d_key(ns, key)
        self.r.delete(name)
        self.r.set(name, b"not a hash")
        self.keys.add(name)

    def clear(self) -> None:
        for name in self.keys:
            self.r.delete(name)
        for name, fld in self.fields:
            if name not in self.keys:
                self.r.hdel(name, fld)
        self.keys.clear()
        self.fields.clear()

    def close(self) -> None:
        self.r.close()


@dataclass
class ClusterModel:
    """What the cluster holds: each (namespace, key)'s bytes as last committed, on whichever node
    (one block's bytes are the same on every node: a write of a block some node holds writes those
    bytes; a Delete removes it from every node), None once deleted; and the keys a fault names."""

    blocks: dict[tuple[int, bytes], bytes] = field(default_factory=dict)
    faulted: set[tuple[int, bytes]] = field(default_factory=set)
    unpublishable: set[tuple[int, bytes]] = field(default_factory=set)  # their d: key is not a hash
    writes: int = 0

    def bytes_for(self, ns: int, key: bytes, seed: int) -> bytes:
        """The bytes a write of ``key`` now commits: the block's, or new ones."""
        old = self.blocks.get((ns, key))
        return old if old is not None else hashlib.shake_128(f"cluster {seed} {ns}".encode() + key).digest(BLOCK)

    def found_surely(self, ns: int, keys: list[bytes]) -> int:
        """How many of ``keys`` a read must find: the leading ones committed and named by no fault
        (a node holds each; none is evicted: DRAM holds every block the machine writes)."""
        n = 0
        for k in keys:
            if (ns, k) not in self.blocks or (ns, k) in self.faulted:
                break
            n += 1
        return n

    def check_read(self, ns: int, keys: list[bytes], got: list[Any], where: str) -> None:
        for k, g in zip(keys, got):
            want = self.blocks.get((ns, k))
            assert want is not None and g.tobytes() == want, (
                f"{where}: block {k.hex()[:8]} of namespace {ns} read as bytes never committed there"
                + (" (the fake holder's)" if g.tobytes() == EVIL_BYTES else ""))
        surely = self.found_surely(ns, keys)
        assert len(got) >= surely, f"{where}: read {len(got)} of {len(keys)} blocks, {surely} are surely held"
