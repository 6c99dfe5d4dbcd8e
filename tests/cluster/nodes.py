"""Helpers of the in-process cluster tests: sidecar configs that form one cluster, blocks, keys."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.client import KVStoreClient
from kvstore.cluster import peer_frames, peer_hello
from kvstore.cluster.cluster_key import NONCE_BYTES, PROOF_BYTES, ClusterKey, HelloTranscript
from kvstore.cluster.peer_frames import Frames
from kvstore.config import Config
from kvstore.harness.servers import RedisServer
from kvstore.keys import Namespace, prefix_keys
from kvstore.server.sidecar import Sidecar
from kvstore.wire import peer as w
from tests.conftest import small_config

TOKEN = "cluster-secret"
BLOCK = 8192


def node_config(tmp_path: Path, name: str, directory: RedisServer, **extra: Any) -> Config:
    return small_config(
        tmp_path / name,
        **{
            "cluster.enabled": True,
            "cluster.directory_url": directory.url,
            "cluster.node_id": name,
            "cluster.peer_address": "127.0.0.1:0",
            "cluster.token": TOKEN,
            "cluster.key_prefix": f"t{abs(hash(tmp_path)) % 10**8}",
            "cluster.publish_interval_ms": 2,
            "cluster.heartbeat_ms": 100,
            "cluster.lease_ms": 1000,
            **extra,
        },
    )


def blocks(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(n)]


def keys_for(ns: Namespace, n: int, seed: int = 0) -> list[bytes]:
    return prefix_keys(ns, list(range(seed * 1000, seed * 1000 + n * ns.block_size)))


def client_of(sc: Sidecar) -> KVStoreClient:
    return KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}")


async def hello_stream(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, me: str, holder: Sidecar, encrypt: bool = False
) -> Frames:
    """The fetcher's side of the peer hello (kvstore.cluster.peer_hello) on a stream, with the
    cluster token, to ``holder`` (node "a", at the address its member entry names): the holder
    proves itself, then this side, then the holder's welcome. How the connection's exchanges go on
    the wire (encrypted when either side asked): requests on it are made with ``frames.request``."""
    assert holder.cluster is not None
    at = holder.cluster.address.encode()
    key, mine, flags = ClusterKey(TOKEN), os.urandom(NONCE_BYTES), peer_hello.ENCRYPT if encrypt else 0
    writer.write(peer_hello.opening(me, mine, flags))
    magic, n, theirs_flags = peer_hello.GREETING.unpack(await reader.readexactly(peer_hello.GREETING.size))
    rest = await reader.readexactly(NONCE_BYTES + n + peer_hello.INCARNATION.size + PROOF_BYTES)
    theirs, name = rest[:NONCE_BYTES], rest[NONCE_BYTES : NONCE_BYTES + n]
    (incarnation,), proof = peer_hello.INCARNATION.unpack_from(rest, NONCE_BYTES + n), rest[-PROOF_BYTES:]
    both = bytes([flags, theirs_flags])
    assert (magic, name) == (peer_hello.MAGIC, b"a")
    hello = HelloTranscript(mine, theirs, me.encode(), name, incarnation, at, both)
    assert proof == key.proof(peer_hello.HOLDER, hello)
    writer.write(key.proof(peer_hello.FETCHER, hello))
    assert await reader.readexactly(len(w.WELCOME)) == w.WELCOME
    encrypted = bool((flags | theirs_flags) & peer_hello.ENCRYPT)
    session = key.session(hello, encrypted)
    return peer_frames.frames(session, fetcher=True)


async def hello_socket(sock: socket.socket, me: str, holder: Sidecar) -> Frames:
    """The fetcher's side of the peer hello on a connected non-blocking socket, as PeerClient says
    it to ``holder`` (node "a", of its incarnation now); how the connection's exchanges go."""
    assert holder.cluster is not None
    greeted = peer_hello.greet(sock, ClusterKey(TOKEN), me, "a", holder.cluster.incarnation, holder.cluster.address)
    return peer_frames.frames(await asyncio.wait_for(greeted, 10), fetcher=True)


def serve_env(directory: RedisServer, name: str, prefix: str, **extra: str) -> dict[str, str]:
    """The environment of a ``kvstore serve`` subprocess that joins the cluster on ``directory``
    as ``name`` (the settings of :func:`node_config`, as ``KVSTORE_`` variables)."""
    return {
        "KVSTORE_DRAM__CAPACITY_BYTES": str(4 * 65536),
        "KVSTORE_DRAM__PAGE_BYTES": "65536",
        "KVSTORE_DRAM__MIN_SLOT_BYTES": "4096",
        "KVSTORE_SSD__ENABLED": "false",
        "KVSTORE_INDEX__REAPER_INTERVAL_MS": "50",
        "KVSTORE_CLUSTER__ENABLED": "true",
        "KVSTORE_CLUSTER__DIRECTORY_URL": directory.url,
        "KVSTORE_CLUSTER__NODE_ID": name,
        "KVSTORE_CLUSTER__PEER_ADDRESS": "127.0.0.1:0",
        "KVSTORE_CLUSTER__TOKEN": TOKEN,
        "KVSTORE_CLUSTER__KEY_PREFIX": prefix,
        "KVSTORE_CLUSTER__PUBLISH_INTERVAL_MS": "2",
        "KVSTORE_CLUSTER__HEARTBEAT_MS": "100",
        "KVSTORE_CLUSTER__LEASE_MS": "1000",
        **{f"KVSTORE_{k.upper()}": v for k, v in extra.items()},
    }


def serve_args(tmp_path: Path, name: str) -> list[str]:
    return ["--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0", "--data-dir", str(tmp_path / name)]
