"""The cluster's directory on one redis-server or on a 3-node Redis Cluster, for tests that run
on both: a module's ``directory`` fixture, parametrized over :data:`KINDS`, opens one with
:func:`directory_server`; ``redis`` (tests/cluster/conftest.py) is an async client of it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redis.asyncio import Redis, RedisCluster

from kvstore.config import Config
from kvstore.harness.servers import RedisServer, redis_cluster, redis_server
from tests.cluster.nodes import node_config

KINDS = ["redis", "redis-cluster"]


@dataclass
class DirectoryServer:
    server: RedisServer  # the redis-server, or the first node of the Redis Cluster
    clustered: bool
    defaults: dict[str, Any] = field(default_factory=dict)  # config every node of the module gets

    def config(self, tmp_path: Path, name: str, **extra: Any) -> Config:
        return node_config(tmp_path, name, self.server,
                           **{"cluster.directory_cluster": self.clustered, **self.defaults, **extra})

    def client(self) -> Redis | RedisCluster:
        return RedisCluster.from_url(self.server.url) if self.clustered else Redis.from_url(self.server.url)


@contextlib.contextmanager
def directory_server(kind: str, **defaults: Any) -> Iterator[DirectoryServer]:
    if kind == "redis":
        with redis_server() as server:
            yield DirectoryServer(server, False, defaults)
    else:
        with redis_cluster(3) as cluster:
            yield DirectoryServer(cluster.nodes[0], True, defaults)
