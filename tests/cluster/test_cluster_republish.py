"""A restarted cluster node re-publishes what its recovery loads paced (issue 41 item 3): its
records go to the directory (a real redis-server) in pipelines of at most
``cluster.publish_records_per_s`` x ``publish_interval_ms`` records a pass, and it is ready
(``/readyz`` 200) before they are all out. Before, the first pass wrote every recovered block's
record at once (one pipeline of 4,096, back to back, for a million blocks).

Counted, not timed: every directory publish call is counted (records per pipeline) and the
calls after the first are held until the test has looked, so "before publishing ends" is the
count of records the directory holds (one pass's), not a race."""

from __future__ import annotations

import asyncio
import hashlib
import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from kvstore.cluster.directory import Directory
from kvstore.cluster.publisher import Publisher
from kvstore.errors import Unavailable
from kvstore.harness.servers import RedisServer
from kvstore.keys import Namespace, prefix_keys
from kvstore.server.sidecar import Sidecar
from tests.cluster.nodes import node_config
from tests.tiers.segment_dir import fill_segment_dir

NS = Namespace(model="tiny-llama", kv_layout="raw", dtype="float16", block_size=16)
BLOCKS = 600
INTERVAL_MS, RATE = 10, 5000
BUDGET = RATE * INTERVAL_MS // 1000  # records of moved blocks a pass writes at most: 50


async def test_a_restarted_nodes_records_go_out_paced_and_it_is_ready_first(
    tmp_path: Path, directory: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = [prefix_keys(NS, [i] * 16)[0] for i in range(BLOCKS)]
    await fill_segment_dir(tmp_path / "a" / "data" / "ssd", NS, [(k, hashlib.sha256(k).digest() * 128) for k in keys])
    calls: list[int] = []  # records (puts) per directory pipeline
    first, go, done = asyncio.Event(), asyncio.Event(), asyncio.Event()
    publish = Directory.publish

    async def counted(self: Directory, puts: Any, removes: Any, **kw: Any) -> Any:
        if not puts:
            return await publish(self, puts, removes, **kw)
        if calls:
            await go.wait()  # held after the first pipeline until the test has looked
        out = await publish(self, puts, removes, **kw)
        calls.append(len(puts))
        first.set()
        if sum(calls) >= BLOCKS:
            done.set()
        return out

    monkeypatch.setattr(Directory, "publish", counted)
    cfg = node_config(tmp_path, "a", directory, **{
        "ssd.enabled": True, "ssd.layout": "segments", "ssd.capacity_bytes": 1 << 30,
        "cluster.publish_interval_ms": INTERVAL_MS, "cluster.publish_records_per_s": RATE,
        "cluster.lease_ms": 6000, "cluster.heartbeat_ms": 1000,
    })
    redis = Redis.from_url(directory.url)
    sc = Sidecar(cfg)
    try:
        await sc.start(recovered=False)
        assert (await sc.recovered())["blocks"] == BLOCKS  # every block loaded, in one batch (4096)
        await first.wait()
        records = [k async for k in redis.scan_iter(match=cfg.cluster.key_prefix.encode() + b":d:*", count=1000)]
        assert len(records) == calls[0] <= BUDGET, calls  # one paced pass is out; the rest wait
        url = f"http://127.0.0.1:{sc.http_port}/readyz"
        ready = await asyncio.to_thread(lambda: json.loads(urllib.request.urlopen(url).read()))
        assert ready["ready"] is True  # ready while publishing is held after its first pipeline
        go.set()
        await asyncio.wait_for(done.wait(), 120)  # (a hang guard, not a measure)
        assert max(calls) <= BUDGET and len(calls) >= BLOCKS // BUDGET, calls
        records = [k async for k in redis.scan_iter(match=cfg.cluster.key_prefix.encode() + b":d:*", count=1000)]
        assert len(records) == BLOCKS
        stats = sc.store.stats.cluster
        assert stats["records_published"] == BLOCKS and stats["records_paced"] >= BLOCKS - BUDGET, dict(stats)
    finally:
        await sc.stop()
        await redis.aclose()


async def restarted_node(tmp_path: Path, directory: RedisServer) -> Sidecar:
    """A node started on a segment directory of BLOCKS blocks, every one loaded (its records go
    out paced: BUDGET a pass)."""
    keys = [prefix_keys(NS, [i] * 16)[0] for i in range(BLOCKS)]
    await fill_segment_dir(tmp_path / "a" / "data" / "ssd", NS, [(k, hashlib.sha256(k).digest() * 128) for k in keys])
    cfg = node_config(tmp_path, "a", directory, **{
        "ssd.enabled": True, "ssd.layout": "segments", "ssd.capacity_bytes": 1 << 30,
        "cluster.publish_interval_ms": INTERVAL_MS, "cluster.publish_records_per_s": RATE,
        "cluster.lease_ms": 6000, "cluster.heartbeat_ms": 100,
    })
    sc = Sidecar(cfg)
    await sc.start(recovered=False)
    assert (await sc.recovered())["blocks"] == BLOCKS
    return sc


async def test_a_failed_paced_pass_counts_its_records_in_records_paced_once(
    tmp_path: Path, directory: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second paced pass fails (the directory refuses it): its records go back to the front of
    the backlog, not through it a second time, so ``records_paced`` counts each block once -- plus
    those a re-publish after the outage (the heartbeat back) holds back anew: the blocks out before
    it, counted as the re-publish feeds them. (Before: the failed pass's records went back to the
    feed and through the backlog again, counted twice.)"""
    calls: list[int] = []  # records (puts) per directory pipeline that landed
    failed: list[int] = []
    refed = 0  # blocks a re-publish fed that were neither waiting in the backlog nor in the feed
    publish, republish_all = Directory.publish, Publisher.republish_all

    async def failing(self: Directory, puts: Any, removes: Any, **kw: Any) -> Any:
        if puts and len(calls) == 1 and not failed:
            failed.append(len(puts))
            raise Unavailable("test: the directory refuses this pipeline")
        out = await publish(self, puts, removes, **kw)
        calls.append(len(puts))
        return out

    def counted(self: Publisher) -> None:
        nonlocal refed
        waiting = set(self._backlog) | set(self._feed.changes if self._feed else ())
        refed += sum(1 for b in self.store.held() if b not in waiting)
        republish_all(self)

    monkeypatch.setattr(Directory, "publish", failing)
    monkeypatch.setattr(Publisher, "republish_all", counted)
    sc = await restarted_node(tmp_path, directory)
    try:
        assert sc.cluster is not None
        publisher = sc.cluster.publisher

        async def drained() -> None:
            while not failed or publisher.backlog or not sc.cluster.membership.up or sum(calls) < BLOCKS:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(drained(), 120)  # (a hang guard, not a measure)
        assert failed == [BUDGET] and calls[0] == BUDGET, (calls, failed)
        paced = sc.store.stats.cluster["records_paced"]
        assert paced == BLOCKS + refed, (paced, BLOCKS, refed)
    finally:
        await sc.stop()


async def test_a_delete_of_a_moved_block_leaves_the_directory_in_the_next_pass_not_behind_the_backlog(
    tmp_path: Path, directory: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a restarted node's records go out paced (held after the first pipeline, 550 waiting),
    a block published in the first pipeline is deleted: its record's delete goes in the first pass
    gathered after it, not paced behind the backlog's re-publishes. (Before: it waited at the
    backlog's end, ten passes later.)"""
    entered: list[tuple[list[bytes], list[bytes]]] = []  # per pipeline: the keys put, the keys removed
    go = asyncio.Event()
    publish = Directory.publish

    async def held(self: Directory, puts: Any, removes: Any, **kw: Any) -> Any:
        entered.append(([p[1] for p in puts], [r[1] for r in removes]))
        if puts and len(entered) > 1:
            await go.wait()  # held after the first pipeline until the test has deleted
        return await publish(self, puts, removes, **kw)

    monkeypatch.setattr(Directory, "publish", held)
    sc = await restarted_node(tmp_path, directory)
    try:
        while not entered or not entered[0][0]:  # (the first pipeline is gathered on the next pass)
            await asyncio.sleep(0.01)
        doomed = entered[0][0][0]
        ns = sc.store.namespace(NS)
        after = len(entered)  # the pipelines gathered before the delete (it feeds its change before its first await)
        assert await sc.store.delete(ns, [doomed], all_keys=False) == (1, 0)
        go.set()

        async def removed() -> int:
            while True:
                for i, (_, removes) in enumerate(entered):
                    if doomed in removes:
                        return i
                await asyncio.sleep(0.01)

        at = await asyncio.wait_for(removed(), 120)  # (a hang guard, not a measure)
        assert at == after, (at, after, [len(p) for p, _ in entered])
    finally:
        await sc.stop()
