"""Fixtures of the in-process cluster tests: one redis-server as the directory, two sidecars."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis, RedisCluster

from kvstore.harness.servers import RedisServer, redis_server
from kvstore.server.sidecar import Sidecar
from tests.cluster.directories import DirectoryServer
from tests.cluster.nodes import node_config


@pytest.fixture(scope="module")
def directory() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


@pytest.fixture
async def pair(tmp_path: Path, directory: RedisServer) -> AsyncIterator[tuple[Sidecar, Sidecar]]:
    async with Sidecar(node_config(tmp_path, "a", directory)) as a, Sidecar(node_config(tmp_path, "b", directory)) as b:
        await asyncio.sleep(0.25)  # a heartbeat each: both see the other
        yield a, b


@pytest.fixture
async def redis(directory: DirectoryServer) -> AsyncIterator[Redis | RedisCluster]:
    """An async client of the module's :class:`~tests.cluster.directories.DirectoryServer`."""
    client = directory.client()
    try:
        yield client
    finally:
        await client.aclose()
