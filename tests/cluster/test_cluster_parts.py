"""The cluster node split into membership, publisher and fetcher (issue #31) behaves as the one
``ClusterNode`` did: what a lookup does when the publisher holds as many void records as it keeps;
and each part logs under its own module's logger (issue #40). Real sidecars and a real
redis-server as the directory."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest
import redis

from kvstore.cluster import publisher as publisher_module
from kvstore.cluster.directory import Directory, Record
from kvstore.harness.servers import RedisServer
from kvstore.keys import Namespace
from kvstore.server.sidecar import Sidecar
from kvstore.store.books.index import DRAM
from tests.cluster.nodes import BLOCK, client_of, keys_for, node_config
from tests.cluster.test_cluster_races import eventually

HEARTBEAT_LOGGER = "kvstore.cluster.membership"  # the module that runs the heartbeat


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_the_heartbeat_logs_under_its_own_modules_logger(
    tmp_path: Path, directory: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A log line goes out under the logger of the module that writes it (the JSON logs' ``logger``
    field): the heartbeat's under ``kvstore.cluster.membership``, not the facade's
    ``kvstore.cluster.node`` as before issue #40; an operator filters on ``kvstore.cluster`` for
    every part of the node (loggers are a hierarchy)."""
    caplog.set_level(logging.INFO, logger="kvstore")
    cfg = node_config(tmp_path, "a", directory, **{"cluster.directory_url": f"redis://127.0.0.1:{_closed_port()}/0"})
    async with Sidecar(cfg) as a:  # (no server at that port: the start's heartbeat fails)
        assert a.cluster is not None and not a.cluster.active
    lines = [r for r in caplog.records if "cluster directory unreachable" in r.getMessage()]
    assert lines, caplog.text
    assert {r.name for r in lines} == {HEARTBEAT_LOGGER}


async def test_a_lookup_past_the_void_records_kept_leaves_the_absent_members_alone(
    tmp_path: Path, directory: RedisServer, ns: Namespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With as many void records waiting as the publisher keeps (``STALE_MAX``; 0 here, so a
    background publish pass cannot make room), a lookup reads no further record (the sweep gets
    the rest): a node missing from the members is not seen missing by it. The split judged each
    record first and stopped only at the first void one, so the lookup started the absence clock
    of every node missing from the members it met: the next sweep a lease later deleted the
    record of a node it had never seen missing for a lease."""
    monkeypatch.setattr(publisher_module, "STALE_MAX", 0)
    cfg = node_config(tmp_path, "b", directory, **{"cluster.sweep_keys_per_s": 0})
    [key] = keys_for(ns, 1, seed=92)
    async with Sidecar(cfg) as b, client_of(b) as cb:
        assert b.cluster is not None and b.store is not None
        members, stats = b.cluster.membership, b.store.stats.cluster
        await eventually(lambda: members.up, "B's heartbeat got through")
        root = b.store.namespace(ns).root
        ghost = Directory.from_config(cfg.cluster, "ghost")  # a record of a node that never joins
        try:
            await ghost.publish([(root, key, Record(1, DRAM, BLOCK, 7))], [])
        finally:
            await ghost.close()
        r = redis.Redis.from_url(directory.url)
        try:
            dkey = b.cluster.directory.key(root, key)
            assert r.hexists(dkey, "ghost")
            t0 = members.now_ms()
            assert (await cb.lookup(ns, [key])).matched == 0  # meets the record: no room for a void one
            await eventually(lambda: members.now_ms() > t0 + cfg.cluster.lease_ms, "a lease of B's clock passed")
            beats = stats["heartbeats"]
            await eventually(lambda: stats["heartbeats"] >= beats + 2, "two heartbeats since")
            walks = stats["sweep_walks"]
            while stats["sweep_walks"] < walks + 2:  # two walks of the sweep over the directory
                await members.sweep()
            assert r.hexists(dkey, "ghost"), "the sweep deleted the record of a node it first saw missing now"
        finally:
            r.close()
