"""Two sidecars in one process on loopback, one redis-server as the directory: the cluster's
logic (publish, find, fetch, adopt from a shared tier, membership) without namespaces. The tests
with separate hosts are in test_cluster_hosts.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.client import KVStoreClient
from kvstore.keys import Namespace, prefix_keys
from kvstore.server.sidecar import Sidecar
from kvstore.testing.servers import RedisServer, redis_server
from tests.conftest import small_config

TOKEN = "cluster-secret"
BLOCK = 8192


@pytest.fixture(scope="module")
def directory() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


def node_config(tmp_path: Path, name: str, directory: RedisServer, **extra: Any) -> Any:
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


@pytest.fixture
async def pair(tmp_path: Path, directory: RedisServer) -> AsyncIterator[tuple[Sidecar, Sidecar]]:
    async with Sidecar(node_config(tmp_path, "a", directory)) as a, Sidecar(node_config(tmp_path, "b", directory)) as b:
        await asyncio.sleep(0.25)  # a heartbeat each: both see the other
        yield a, b


def blocks(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(n)]


def keys_for(ns: Namespace, n: int, seed: int = 0) -> list[bytes]:
    return prefix_keys(ns, list(range(seed * 1000, seed * 1000 + n * ns.block_size)))


def client_of(sc: Sidecar) -> KVStoreClient:
    return KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}")


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
