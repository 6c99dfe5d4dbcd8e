"""The sidecar with lower tiers: demotion, promotion, write-through, integrity, faults, restart.

Real servers throughout: the sidecar over gRPC, an SSD directory, redis-server, moto's S3."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

import numpy as np
import pytest

from kvstore.client import KVStoreClient
from kvstore.errors import Unavailable
from kvstore.keys import Namespace, prefix_keys
from kvstore.server.sidecar import Sidecar
from tests.conftest import small_config

PAGE = 65536
NS = Namespace(model="tiny-llama", kv_layout="raw", dtype="float16", block_size=16)


def blocks_for(n: int, seed: int, size: int = PAGE) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]


def chain(first_token: int, n: int) -> list[bytes]:
    return prefix_keys(NS, [first_token] * (n * NS.block_size))


def tiered_config(tmp_path: Path, **overrides):
    base = {"ssd.enabled": True, "ssd.path": str(tmp_path / "ssd"), "ssd.capacity_bytes": 64 * PAGE}
    base.update(overrides)
    return small_config(tmp_path, **base)


async def settle(sc: Sidecar) -> None:
    await sc.store.tiering.flush()


def placement(sc: Sidecar, keys: list[bytes]) -> list[str]:
    from kvstore.store.books.index import TOP_LABEL

    blocks = sc.store.index.namespaces[NS.root].blocks
    return [TOP_LABEL[blocks[k].tiers] if k in blocks else "gone" for k in keys]


async def test_dram_eviction_demotes_to_ssd_and_a_hit_promotes_back(tmp_path):
    async with Sidecar(tiered_config(tmp_path)) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        a, b = chain(1, 4), chain(2, 4)
        da, db = blocks_for(4, 1), blocks_for(4, 2)
        await c.put_blocks(NS, a, da)
        await c.put_blocks(NS, b, db)  # DRAM holds 4 slots: all of a goes down
        await settle(sc)
        assert placement(sc, a) == ["ssd"] * 4 and placement(sc, b) == ["dram"] * 4
        look = await c.lookup(NS, a)
        assert look.matched == 4 and [t for t, _ in look.blocks] == ["ssd"] * 4
        got = await c.get_blocks(NS, a)  # promotion: a comes back up, b goes down
        assert [g.tobytes() for g in got] == da
        await settle(sc)
        assert placement(sc, a) == ["dram"] * 4 and placement(sc, b) == ["ssd"] * 4
        stats = await c.stats()
        assert stats["tiers"]["dram"]["demotions"] == 8
        assert stats["tiers"]["ssd"]["promotions"] == 4
        assert stats["tiers"]["ssd"]["hits"] == 4


async def test_mover_tasks_cancelled_before_they_began_leave_no_waiter_waiting(tmp_path):
    """A promotion or a delete of lower-tier copies is a mover task; one cancelled before its first
    step (asyncio.run's sweep of leftover tasks, a stop that cancels its movers) ran none of the
    ``finally`` that settled its waiters: a promotion's reader waited for ever, a Delete raised the
    task's CancelledError as its own, and the copies' room stayed ``releasing`` (a write that needs it
    waits for ever). Their ends are the tasks' now, however the tasks end."""
    async with Sidecar(tiered_config(tmp_path)) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        a, b = chain(5, 2), chain(6, 4)
        await c.put_blocks(NS, a, blocks_for(2, 5))
        await c.put_blocks(NS, b, blocks_for(4, 6))  # DRAM holds 4 slots: a goes down
        await settle(sc)
        assert placement(sc, a) == ["ssd", "ssd"]
        store, tiering = sc.store, sc.store.tiering
        ns = store.index.namespaces[NS.root]

        promoting = asyncio.ensure_future(tiering.promote([ns.blocks[k] for k in a]))
        await asyncio.sleep(0)  # the promotion waits for its batch, which has not begun
        [batch] = tiering.crew.tasks
        batch.cancel()
        await asyncio.wait([promoting], timeout=30)
        assert promoting.done(), "a promotion waits for a batch that was cancelled before it began"
        assert promoting.result() == [] and placement(sc, a) == ["ssd", "ssd"]  # a miss, nothing changed

        deleting = asyncio.ensure_future(store.delete(ns, a, False))
        await asyncio.sleep(0)  # the Delete waits for its copies' removal, which has not begun
        [removal] = tiering.crew.tasks
        removal.cancel()
        await asyncio.wait([deleting], timeout=30)
        assert deleting.done() and not deleting.cancelled(), "the Delete ended as the removal's cancellation"
        assert deleting.result() == (2, 0)
        [ssd] = [lv for lv in tiering.levels if lv.name == "ssd"]
        assert tiering.removal.releasing(ssd) == 0, "the copies' room is counted as being released for ever"


@pytest.mark.parametrize("cancelled", ["sealer before its first step", "writer before its first step",
                                       "writer while it writes"])
async def test_demotions_whose_task_is_cancelled_give_their_buffers_back(tmp_path, monkeypatch, cancelled):
    """A demotion's sealer and its write batches are mover tasks; one cancelled before its first step
    (a stop that cancels its movers, asyncio.run's sweep of leftover tasks) ran none of its own code:
    its staging buffers were never given back, its blocks stayed counted in the SSD that never got
    them, and a writer's place among the ``DEMOTE_DEPTH`` batches in flight stayed taken for good.
    Their demotions fail now however the task ends (one cancelled as it writes, too: its buffers go
    back once, not twice), and the next ones are written as before."""
    from kvstore.movers.demotion import Demotion

    async with Sidecar(tiered_config(tmp_path)) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        tiering = sc.store.tiering
        [ssd] = tiering.levels
        pool, lane = tiering.demotion.pool, tiering.demotion.lane(ssd)
        stage = Demotion._seal_queue if cancelled.startswith("sealer") else Demotion._write_batch
        writing = asyncio.Event()
        if cancelled.endswith("first step"):
            spawn = tiering.crew.spawn

            def cancelled_at_once(coro, ended=None):
                task = spawn(coro, ended)
                if coro.cr_code is stage.__code__:
                    task.cancel()  # before the loop runs its first step
                return task

            monkeypatch.setattr(tiering.crew, "spawn", cancelled_at_once)
        else:
            async def held_put_many(items):
                writing.set()
                await asyncio.Event().wait()  # until cancelled

            monkeypatch.setattr(ssd.tier, "put_many", held_put_many)

        a, b = chain(7, 4), chain(8, 4)
        await c.put_blocks(NS, a, blocks_for(4, 7))
        await c.put_blocks(NS, b, blocks_for(4, 8))  # DRAM holds 4 slots: a is demoted
        if cancelled == "writer while it writes":
            await asyncio.wait([asyncio.ensure_future(writing.wait())], timeout=30)
            [writer] = [t for t in tiering.crew.tasks if t.get_coro().cr_code is stage.__code__]
            writer.cancel()
        await settle(sc)
        assert (pool.taken, pool.used) == (0, 0), "staging buffers of demotions that ended unwritten are still taken"
        assert lane.writing == 0, "a write batch that never ran still counts as in flight"
        assert not tiering.staged and not lane.queue and not lane.ready
        assert (ssd.used, tiering.queued[ssd][1]) == (0, 0)  # nothing of a counted in the SSD
        assert placement(sc, a) == ["gone"] * 4  # a demotion that failed: the block is lost, not found where it is not

        monkeypatch.undo()
        await c.put_blocks(NS, chain(9, 4), blocks_for(4, 9))  # b goes down, and is written
        await settle(sc)
        assert placement(sc, b) == ["ssd"] * 4
        assert [g.tobytes() for g in await c.get_blocks(NS, b)] == blocks_for(4, 8)
        await settle(sc)
        assert (pool.taken, pool.used, lane.writing) == (0, 0, 0)
        assert all(t["errors"] == 0 for t in (await c.stats())["tiers"].values())


async def test_prefetch_reports_readiness(tmp_path):
    async with Sidecar(tiered_config(tmp_path)) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        a, b = chain(3, 2), chain(4, 4)
        await c.put_blocks(NS, a, blocks_for(2, 3))
        await c.put_blocks(NS, b, blocks_for(4, 4))
        await settle(sc)
        assert placement(sc, a) == ["ssd", "ssd"]
        assert await c.prefetch(NS, a) == 2
        assert placement(sc, a) == ["dram", "dram"]


async def test_ssd_full_demotes_to_redis(tmp_path, redis_clean):
    cfg = tiered_config(
        tmp_path, **{"ssd.capacity_bytes": 2 * PAGE + 8192, "redis.enabled": True, "redis.url": redis_clean.url}
    )
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        chains = [chain(10 + i, 2) for i in range(4)]
        data = [blocks_for(2, 10 + i) for i in range(4)]
        for k, d in zip(chains, data):
            await c.put_blocks(NS, k, d)
            await settle(sc)
        # DRAM: the last two chains; SSD (2 blocks): the chain evicted last; Redis: the first.
        assert placement(sc, chains[0]) == ["redis", "redis"]
        assert placement(sc, chains[1]) == ["ssd", "ssd"]
        got = await c.get_blocks(NS, chains[0])
        assert [g.tobytes() for g in got] == data[0]
        stats = await c.stats()
        assert stats["tiers"]["redis"]["promotions"] == 2 and stats["tiers"]["ssd"]["evictions"] >= 2


async def test_write_through_lets_another_host_read_at_once(tmp_path, moto_clean, aws_env):
    s3 = {"s3.enabled": True, "s3.endpoint_url": moto_clean.url, "tiering.write_through": ["s3"], "ssd.enabled": False}
    host_a = tiered_config(tmp_path / "a", **s3)
    async with Sidecar(host_a) as sa, KVStoreClient.from_url(f"127.0.0.1:{sa.grpc_port}") as ca:
        keys, data = chain(20, 3), blocks_for(3, 20)
        await ca.put_blocks(NS, keys, data)
        await settle(sa)
        assert (await ca.stats())["tiers"]["s3"]["bytes_in"] == 3 * PAGE
        # host b: another sidecar with its own DRAM, the same bucket
        async with (
            Sidecar(tiered_config(tmp_path / "b", **s3)) as sb,
            KVStoreClient.from_url(f"127.0.0.1:{sb.grpc_port}") as cb,
        ):
            look = await cb.lookup(NS, keys)
            assert look.matched == 3 and {t for t, _ in look.blocks} == {"s3"}
            assert [g.tobytes() for g in await cb.get_blocks(NS, keys)] == data


async def test_commit_can_wait_for_the_write_through(tmp_path, redis_clean):
    """``wait_write_through``: the reply comes once Redis holds the blocks (a raw client sees
    every key at once), or says how many got there when Redis is down; the commit stands."""
    import redis as redis_py

    from kvstore.store.books.index import DRAM, REDIS

    cfg = tiered_config(tmp_path, **{"ssd.enabled": False, "redis.enabled": True, "redis.url": redis_clean.url,
                                     "redis.retries": 0, "tiering.write_through": ["redis"]})
    raw = redis_py.Redis(port=redis_clean.port)
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        keys, data = chain(25, 3), blocks_for(3, 25)
        async with c.allocate(NS, keys, PAGE) as alloc:
            for i, view in alloc.writable():
                view[:] = np.frombuffer(data[i], dtype=np.uint8)
            assert await alloc.commit(wait_write_through=True) == 3
        assert alloc.written_through == 3
        assert len(raw.keys("kvstore:*:m")) == 3  # no settle(): already there
        held = sc.store.index.namespaces[NS.root].blocks
        assert all(held[k].tiers == DRAM | REDIS for k in keys)
        r = await c.put_blocks(NS, chain(24, 2), blocks_for(2, 24), wait_write_through=True)  # the same, in one call
        assert (r.stored, r.written_through) == (2, 2) and len(raw.keys("kvstore:*:m")) == 5

        redis_clean.stop()
        more, more_data = chain(26, 2), blocks_for(2, 26)
        async with c.allocate(NS, more, PAGE) as alloc:
            for i, view in alloc.writable():
                view[:] = np.frombuffer(more_data[i], dtype=np.uint8)
            assert await alloc.commit(wait_write_through=True) == 2
        assert alloc.written_through == 0  # Redis is down: committed here, not written through
        assert [g.tobytes() for g in await c.get_blocks(NS, more)] == more_data
        assert (await c.stats())["tiers"]["redis"]["errors"] >= 1


async def test_without_write_through_tiers_nothing_is_waited_for(tmp_path):
    async with Sidecar(tiered_config(tmp_path)) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        async with c.allocate(NS, chain(27, 2), PAGE) as alloc:
            for _, view in alloc.writable():
                view[:] = 7
            assert await alloc.commit(wait_write_through=True) == 2
        assert alloc.written_through == 0


@pytest.mark.parametrize("tier", ["ssd", "redis", "s3"])
async def test_corruption_in_a_lower_tier_is_a_miss_and_never_served(tmp_path, tier, request):
    over = {"ssd.enabled": tier == "ssd", "tiering.chain": [tier]}
    if tier == "redis":
        srv = request.getfixturevalue("redis_clean")
        over.update({"redis.enabled": True, "redis.url": srv.url})
    if tier == "s3":
        srv = request.getfixturevalue("moto_clean")
        request.getfixturevalue("aws_env")
        over.update({"s3.enabled": True, "s3.endpoint_url": srv.url})
    async with Sidecar(tiered_config(tmp_path, **over)) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        a, b = chain(30, 2), chain(31, 4)
        da = blocks_for(2, 30)
        await c.put_blocks(NS, a, da)
        await c.put_blocks(NS, b, blocks_for(4, 31))
        await settle(sc)
        assert placement(sc, a) == [tier, tier]
        await corrupt(sc, tier, a[1], request)
        got = await c.get_blocks(NS, a)
        assert [g.tobytes() for g in got] == da[:1]  # the bad block and everything after it: a miss
        assert placement(sc, a)[1] == "gone"
        assert (await c.stats())["tiers"][tier]["checksum_failures"] == 1


async def test_a_redis_block_missing_a_chunk_is_a_miss_and_its_other_keys_go(tmp_path, redis_clean):
    """A chunk evicted by Redis itself (maxmemory) leaves a block that can never be read: the
    read is a miss, and the header and the other chunks are deleted, not left for nobody."""
    import redis as sync_redis

    from kvstore.tiers.base import BlockRef

    cfg = tiered_config(tmp_path, **{"ssd.enabled": False, "tiering.chain": ["redis"], "redis.enabled": True,
                                     "redis.url": redis_clean.url, "redis.chunk_bytes": 65536})
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        a, b = chain(35, 2), chain(36, 4)
        da = blocks_for(2, 35)
        await c.put_blocks(NS, a, da)
        await c.put_blocks(NS, b, blocks_for(4, 36))  # evicts a from DRAM to Redis
        await settle(sc)
        assert placement(sc, a) == ["redis", "redis"]
        tier = sc.store.tiering.levels[0].tier
        ref = BlockRef(NS.root, a[1])
        keys = [tier.header_key(ref), *tier.chunk_keys(ref, PAGE)]
        assert len(keys) == 3  # a header and two chunks (64 KiB - 64, then 64 bytes)
        r = sync_redis.Redis.from_url(redis_clean.url)
        assert r.delete(keys[2]) == 1  # as maxmemory eviction would
        got = await c.get_blocks(NS, a)
        assert [g.tobytes() for g in got] == da[:1]
        assert placement(sc, a)[1] == "gone"
        assert r.exists(*keys) == 0
        assert (await c.stats())["tiers"]["redis"]["misses"] >= 1


async def corrupt(sc: Sidecar, tier: str, key: bytes, request) -> None:
    from kvstore.tiers.base import BlockRef

    lv = next(lv for lv in sc.store.tiering.levels if lv.name == tier)
    ref = BlockRef(NS.root, key)
    if tier == "ssd":
        if hasattr(lv.tier, "locate"):  # the segment layout: the block's slot in its segment
            path, offset, size = lv.tier.locate(ref)
        else:  # one file a block: the payload ends the file
            path, offset, size = lv.tier.path_of(ref), 0, os.path.getsize(lv.tier.path_of(ref))
        with open(path, "r+b") as f:
            f.seek(offset + size - 100)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif tier == "redis":
        import redis as sync_redis

        r = sync_redis.Redis.from_url(request.getfixturevalue("redis_clean").url)
        chunk = lv.tier.chunk_keys(ref, PAGE)[0]
        r.setrange(chunk, 10, b"\xff\xfe")
    else:
        import boto3

        from kvstore.harness.servers import MOTO_CREDENTIALS

        s3 = boto3.client(
            "s3", endpoint_url=request.getfixturevalue("moto_clean").url, region_name="us-east-1", **MOTO_CREDENTIALS
        )
        key = lv.tier.object_key(ref)
        body = bytearray(s3.get_object(Bucket=lv.tier.bucket, Key=key)["Body"].read())
        body[-5] ^= 0xFF
        s3.put_object(Bucket=lv.tier.bucket, Key=key, Body=bytes(body))


async def test_redis_down_keeps_dram_serving_and_comes_back(tmp_path, redis_clean):
    cfg = tiered_config(tmp_path, **{"ssd.enabled": False, "redis.enabled": True, "redis.url": redis_clean.url,
                                     "redis.retries": 0, "redis.socket_timeout_s": 0.5})
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        a, b = chain(40, 2), chain(41, 4)
        await c.put_blocks(NS, a, blocks_for(2, 40))
        await c.put_blocks(NS, b, blocks_for(4, 41))
        await settle(sc)
        assert placement(sc, a) == ["redis", "redis"]
        redis_clean.stop()
        assert len(await c.get_blocks(NS, a)) == 0  # redis is gone: a miss, not an error
        assert (await c.lookup(NS, a)).matched == 0  # and lookups now treat it as one
        # DRAM still serves (the failed promotion may have pushed out part of b to make room;
        # those blocks stay readable from their staging copies until their demotion to the dead
        # Redis has failed, so let the movers finish first)
        await settle(sc)
        in_dram = placement(sc, b).count("dram")
        assert in_dram >= 2 and len(await c.get_blocks(NS, b)) == in_dram
        stats = await c.stats()
        assert stats["tiers"]["redis"]["errors"] >= 1 and stats["tiers"]["redis"]["down"] is True
        # while it is down, the outage's garbage is collected and the heap trimmed every OUTAGE_TRIM_S
        # (not only once it is back: an outage's failed calls would otherwise grow the heap for its length)
        for _ in range(300):
            if sc.store.tiering.outage_trims >= 1:
                break
            await asyncio.sleep(0.1)
        assert sc.store.tiering.outage_trims >= 1
        redis_clean.start()
        for _ in range(100):
            if not (await c.stats())["tiers"]["redis"]["down"]:
                break
            await asyncio.sleep(0.1)
        assert (await c.stats())["tiers"]["redis"]["down"] is False
        # new demotions reach redis again
        cc = chain(42, 4)
        await c.put_blocks(NS, cc, blocks_for(4, 42))
        await settle(sc)
        assert "redis" in placement(sc, b)


async def test_closing_ends_the_down_tier_probe_even_if_it_loses_its_cancel(tmp_path, redis_clean):
    """The probe of a down tier calls the tier (redis-py, whose wait_for can swallow a cancellation on
    Python 3.11, CPython gh-86296); close() used to cancel it and walk away, leaving it probing for
    the process's life. Now it ends on the closing flag and close() waits for it."""
    cfg = tiered_config(tmp_path, **{"ssd.enabled": False, "redis.enabled": True, "redis.url": redis_clean.url})
    sc = Sidecar(cfg)
    await sc.start()
    try:
        tiering = sc.store.tiering
        [level] = [lv for lv in tiering.levels if lv.name == "redis"]
        probed = asyncio.Event()

        async def contains_losing_its_cancel(ref):
            probed.set()
            with contextlib.suppress(asyncio.CancelledError):  # lost, as in gh-86296: the call fails as the tier
                await asyncio.sleep(3600)
            raise Unavailable("redis: still down")

        level.tier.contains = contains_losing_its_cancel
        level.mark_down(Unavailable("redis: down (the test)"))
        await asyncio.wait_for(probed.wait(), 30)
    finally:
        await asyncio.wait([asyncio.ensure_future(sc.stop())], timeout=60)
    assert tiering.probe.task is not None and tiering.probe.task.done()


async def test_s3_unreachable_is_counted_and_dram_keeps_serving(tmp_path, moto_clean, aws_env):
    cfg = tiered_config(tmp_path, **{"ssd.enabled": False, "s3.enabled": True, "s3.endpoint_url": moto_clean.url,
                                     "s3.max_attempts": 1, "s3.timeout_s": 1.0})
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        moto_clean.stop()
        try:
            a, b = chain(50, 2), chain(51, 4)
            await c.put_blocks(NS, a, blocks_for(2, 50))
            await c.put_blocks(NS, b, blocks_for(4, 51))
            await settle(sc)
            stats = await c.stats()
            assert stats["tiers"]["s3"]["errors"] >= 1
            assert placement(sc, a) == ["gone", "gone"]  # the demotion failed: dropped, not claimed
            assert len(await c.get_blocks(NS, b)) == 4
        finally:
            moto_clean.start()


RESTART_READER = """
import sys, json, hashlib
from kvstore.client import SyncClient
from kvstore.keys import Namespace, prefix_keys
ns = Namespace(model="tiny-llama", kv_layout="raw", dtype="float16", block_size=16)
keys = prefix_keys(ns, [60] * (16 * 8))
with SyncClient(sys.argv[1]) as c:
    look = c.lookup(ns, keys)
    got = []  # DRAM holds 4 blocks: read in pairs, each pair promoted on its own
    for i in range(0, 8, 2):
        got += c.get_blocks(ns, keys[i : i + 2])
    print(json.dumps({"matched": look.matched, "tiers": [t for t, _ in look.blocks],
                      "digest": hashlib.sha256(b"".join(g.tobytes() for g in got)).hexdigest(), "read": len(got)}))
"""


def test_kill_9_and_restart_finds_every_block_in_ssd_redis_and_s3(
    tmp_path, serve_process, redis_clean, moto_clean, aws_env
):
    import hashlib
    import json
    import signal
    import subprocess
    import sys

    from tests.conftest import REPO

    config = tmp_path / "kvstore.toml"
    config.write_text(f"""
data_dir = "{tmp_path / 'data'}"
[dram]
capacity_bytes = {4 * PAGE}
page_bytes = {PAGE}
[ssd]
capacity_bytes = {64 * PAGE}
[redis]
enabled = true
url = "{redis_clean.url}"
[s3]
enabled = true
endpoint_url = "{moto_clean.url}"
[tiering]
write_through = ["redis", "s3"]
""")
    args = ["--config", str(config), "--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0"]
    sc = serve_process(args)
    data = blocks_for(8, 60)
    writer = (
        "import sys, numpy as np; from kvstore.client import SyncClient;"
        " from kvstore.keys import Namespace, prefix_keys;"
        "ns = Namespace(model='tiny-llama', kv_layout='raw', dtype='float16', block_size=16);"
        "keys = prefix_keys(ns, [60] * (16 * 8)); rng = np.random.default_rng(60);"
        "blocks = [rng.integers(0, 256, 65536, dtype=np.uint8) for _ in range(8)];"
        "c = SyncClient(sys.argv[1]);"
        " [c.put_blocks(ns, keys[i:i+2], blocks[i:i+2], first_parent=keys[i-1] if i else b'') for i in range(0, 8, 2)];"
        "import time; time.sleep(0.5); c.close()"
    )
    subprocess.run([sys.executable, "-c", writer, sc.grpc], check=True, cwd=REPO)
    import urllib.request

    for _ in range(100):
        before = json.loads(urllib.request.urlopen(f"http://{sc.http}/stats").read())
        if (
            before["tiers"]["redis"]["blocks"] == 8
            and before["tiers"]["s3"]["blocks"] == 8
            and before["tiers"]["ssd"]["blocks"] == 4
        ):
            break
        import time

        time.sleep(0.1)
    assert [before["tiers"][t]["blocks"] for t in ("dram", "ssd", "redis", "s3")] == [4, 4, 8, 8]
    sc.stop(signal.SIGKILL)

    sc2 = serve_process(args)
    after = json.loads(urllib.request.urlopen(f"http://{sc2.http}/stats").read())
    assert [after["tiers"][t]["blocks"] for t in ("dram", "ssd", "redis", "s3")] == [0, 4, 8, 8]
    out = json.loads(subprocess.run([sys.executable, "-c", RESTART_READER, sc2.grpc], check=True, capture_output=True,
                                    text=True, cwd=REPO).stdout)
    assert out["matched"] == 8 and out["read"] == 8
    assert out["digest"] == hashlib.sha256(b"".join(data)).hexdigest()
    assert sorted(set(out["tiers"])) == ["redis", "ssd"]  # nothing claims the DRAM that died


async def test_redis_cluster_as_the_tier_below_dram(tmp_path, cluster_clean):
    cfg = tiered_config(tmp_path, **{"ssd.enabled": False, "redis.enabled": True, "redis.cluster": True,
                                     "redis.url": cluster_clean.url, "redis.chunk_bytes": 65536,
                                     "dram.page_bytes": 2 * PAGE, "dram.capacity_bytes": 4 * PAGE})
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        chains = [chain(70 + i, 2) for i in range(3)]
        data = [blocks_for(2, 70 + i, size=3 * PAGE // 2) for i in range(3)]  # 96 KiB: two chunks, 128 KiB slots
        for k, d in zip(chains, data):
            await c.put_blocks(NS, k, d)
            await settle(sc)
        # two 128 KiB slots: DRAM holds 2 blocks; everything else went to the cluster
        assert placement(sc, chains[0]) == ["redis"] * 2 and placement(sc, chains[2]) == ["dram"] * 2
        assert [g.tobytes() for g in await c.get_blocks(NS, chains[0])] == data[0]
        stats = await c.stats()
        assert stats["tiers"]["redis"]["promotions"] == 2 and stats["tiers"]["redis"]["errors"] == 0


async def test_a_burst_of_promotions_stays_within_the_connection_pool(tmp_path, redis_clean):
    """Promoting 120 blocks at once must not open 120 Redis connections (the pool stops at 100)."""
    cfg = tiered_config(tmp_path, **{"ssd.enabled": False, "redis.enabled": True, "redis.url": redis_clean.url,
                                     "dram.capacity_bytes": 8 * PAGE})  # 128 slots of 4 KiB
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        a, b = chain(80, 120), chain(81, 128)
        da = blocks_for(120, 80, size=4096)
        await c.put_blocks(NS, a, da)
        await c.put_blocks(NS, b, blocks_for(128, 81, size=4096))  # pushes all of a down to redis
        await settle(sc)
        assert set(placement(sc, a)) == {"redis"}
        got = await c.get_blocks(NS, a)
        assert [g.tobytes() for g in got] == da
        assert (await c.stats())["tiers"]["redis"]["errors"] == 0


async def test_a_backlog_of_demotions_stages_no_more_blocks_that_redis_holds(tmp_path, redis_clean):
    """A DRAM that evicts faster than the SSD writer writes: a block Redis holds already (written
    through) is staged for the SSD only while fewer than ``SPARE_STAGED`` demotions are in flight;
    past that it leaves DRAM as it is, counted in ``demotions_skipped``, and is read from Redis. The
    soak's sidecar kept ~5,300 such blocks (82 MiB of staging buffers, ~120 MiB in a burst) behind
    its SSD writer: its RSS moved with the backlog."""
    from kvstore.movers import demotion

    size = 4096  # 64 slots in the 4 x 64 KiB slab
    cfg = tiered_config(tmp_path, **{"ssd.capacity_bytes": 1000 * (size + 4096), "redis.enabled": True,
                                     "redis.url": redis_clean.url, "tiering.write_through": ["redis"]})
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        ssd, pool = sc.store.tiering.levels[0].tier, sc.store.tiering.demotion.pool
        real_put_many, real_take, gate, most = ssd.put_many, pool.take, asyncio.Event(), [0]

        async def held_put_many(items):
            await gate.wait()  # the SSD writer falls behind until the burst is over
            await real_put_many(items)

        def counted_take(n):
            got = real_take(n)
            most[0] = max(most[0], pool.taken)
            return got

        ssd.put_many, pool.take = held_put_many, counted_take
        keys, data = [], []
        try:
            for g in range(40):  # 640 blocks, each chain in Redis before the next evicts it
                k, d = chain(600 + g, 16), blocks_for(16, 600 + g, size)
                assert (await c.put_blocks(NS, k, d, wait_write_through=True)).written_through == 16
                keys += k
                data += d
            assert 0 < most[0] <= demotion.SPARE_STAGED < 640 - 64  # the old movers staged all 576
            skipped = (await c.stats())["tiers"]["dram"]["demotions_skipped"]
            assert skipped == 640 - 64 - most[0]
        finally:
            gate.set()  # (the sidecar's close waits for the writer)
        await settle(sc)
        assert pool.taken == 0
        assert set(placement(sc, keys)) <= {"dram", "ssd", "redis"}
        got = [g.tobytes() for a in range(0, 640, 16) for g in await c.get_blocks(NS, keys[a : a + 16])]
        assert got == data
        assert all(t["errors"] == 0 for t in (await c.stats())["tiers"].values())


async def test_a_burst_of_demotions_is_written_two_batches_at_a_time(tmp_path):
    """More evictions than two writer batches: the writer keeps ``DEMOTE_DEPTH`` batches in
    flight (the next one's files written while the last one waits for its fsync), never more,
    and every demoted block lands on SSD with its bytes."""
    from kvstore.movers import demotion

    size = 4096  # 64 slots in the 4 x 64 KiB slab
    cfg = tiered_config(tmp_path, **{"ssd.capacity_bytes": 400 * (size + 4096)})
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        ssd = sc.store.tiering.levels[0].tier
        real_put_many, in_flight, most = ssd.put_many, [0], [0]

        async def slow_put_many(items):
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
            try:
                await asyncio.sleep(0.2)  # long enough for the sealer to queue the next batch
                await real_put_many(items)
            finally:
                in_flight[0] -= 1

        ssd.put_many = slow_put_many
        keys, data = [], []
        for g in range(13):  # 208 blocks: 144 evicted from the 64 slots
            k, d = chain(500 + g, 16), blocks_for(16, 500 + g, size)
            await c.put_blocks(NS, k, d)
            keys += k
            data += d
        await settle(sc)
        assert most[0] == demotion.DEMOTE_DEPTH == 2
        demoted = [(k, d) for k, d, where in zip(keys, data, placement(sc, keys)) if where == "ssd"]
        assert len(demoted) == 208 - 64
        blocks = sc.store.index.namespaces[NS.root].blocks
        bufs = [memoryview(bytearray(size)) for _ in demoted]
        level = sc.store.tiering.levels[0]
        got = await real_put_many.__self__.get_many([level.ref(blocks[k]) for k, _ in demoted], bufs)
        assert all(m is not None for m in got)
        assert [bytes(b) for b in bufs] == [d for _, d in demoted]


@pytest.mark.parametrize("layout", ["files", "segments"])
async def test_deleted_ssd_blocks_show_as_recycled_bytes(tmp_path, layout):
    """Stats and /metrics say how much of the SSD directory is deleted blocks' room kept for
    reuse (files: their files; segments: their slots): the directory's block bytes (files: the
    block files; segments: the segment files) are used_bytes + recycled_bytes."""
    from prometheus_client.parser import text_string_to_metric_families

    from kvstore.stats.prometheus import render

    cfg = tiered_config(tmp_path, **{"ssd.layout": layout})
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        a, b = chain(700, 4), chain(701, 4)
        await c.put_blocks(NS, a, blocks_for(4, 700))
        await c.put_blocks(NS, b, blocks_for(4, 701))  # a goes down to SSD
        await settle(sc)
        assert placement(sc, a) == ["ssd"] * 4
        await c.delete(NS, a)
        stats = await c.stats()
        ssd = stats["tiers"]["ssd"]
        file_bytes = 4096 + PAGE if layout == "files" else PAGE  # (files: a header page + the payload)
        assert ssd["recycled_bytes"] == 4 * file_bytes
        blocks = (tmp_path / "ssd").rglob("*" if layout == "files" else "seg/*/*.seg")
        on_disk = sum(p.stat().st_size for p in blocks if p.is_file())
        assert on_disk == ssd["used_bytes"] + ssd["recycled_bytes"] == 4 * file_bytes
        body, _ = render(stats)
        fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
        assert {s.labels["tier"]: s.value for s in fams["kvstore_tier_recycled_bytes"].samples}["ssd"] == 4 * file_bytes
