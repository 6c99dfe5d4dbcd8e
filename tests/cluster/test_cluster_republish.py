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
