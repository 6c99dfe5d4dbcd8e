"""Helpers of the in-process cluster tests: sidecar configs that form one cluster, blocks, keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvstore.client import KVStoreClient
from kvstore.config import Config
from kvstore.keys import Namespace, prefix_keys
from kvstore.server.sidecar import Sidecar
from kvstore.testing.servers import RedisServer
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
