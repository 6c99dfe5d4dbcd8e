"""The cluster node split into membership, publisher and fetcher (issue #31) behaves as the one
``ClusterNode`` did: what it logs under which logger, and what a lookup does when the publisher
holds as many void records as it keeps. Real sidecars and a real redis-server as the directory."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

from kvstore.harness.servers import RedisServer
from kvstore.server.sidecar import Sidecar
from tests.cluster.nodes import node_config

NODE_LOGGER = "kvstore.cluster.node"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_the_cluster_logs_under_the_nodes_logger_as_before_the_split(
    tmp_path: Path, directory: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Every log line of the cluster node went out under ``kvstore.cluster.node`` (the JSON logs'
    ``logger`` field, what an operator filters on); the split sent the heartbeat's, the
    publisher's and the fetcher's under loggers of their own modules. (The tiers' split kept
    ``kvstore.tiers.movers`` for all of its modules.)"""
    caplog.set_level(logging.INFO, logger="kvstore")
    cfg = node_config(tmp_path, "a", directory, **{"cluster.directory_url": f"redis://127.0.0.1:{_closed_port()}/0"})
    async with Sidecar(cfg) as a:  # (no server at that port: the start's heartbeat fails)
        assert a.cluster is not None and not a.cluster.active
    lines = [r for r in caplog.records if "cluster directory unreachable" in r.getMessage()]
    assert lines, caplog.text
    assert {r.name for r in lines} == {NODE_LOGGER}

