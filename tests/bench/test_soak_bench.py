"""Smoke test: ``benchmarks.soak`` runs a short soak end to end (two client processes, a Redis kill
and a sidecar kill) and returns its JSON shape, with no corrupt read and no lost durable block.
No timed assertions. Also: the pieces it relies on (block content, the verifier, the slow-Redis
proxy), and regression tests of the product bugs the soak found (``in_threads`` leaving failures
unretrieved; a Delete racing a demotion into the SSD: the room it releases and the copies
it dooms, ``kvstore.movers.removal.Removal``)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks import soak
from kvstore.harness.servers import free_port, redis_server


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--json", action="store_true")
    soak.add_arguments(p)
    return p.parse_args(["--json", *argv])


def test_soak_shape_no_corrupt_read_no_lost_durable_block() -> None:
    args = _args("--minutes", "0.5", "--processes", "2", "--clients", "4", "--faults", "redis_kill,sidecar_kill")
    result = soak.run(args)
    json.dumps(result)  # as the CLI prints it
    assert result["suite"] == "soak"
    assert result["corrupt_reads"] == 0, result["clients"]["corrupt_examples"]
    assert result["lost_durable_blocks"] == 0, result["durable_checks"]
    assert result["figures"]["corrupt_reads"]["value"] == 0
    assert result["figures"]["lost_durable_blocks"]["value"] == 0
    assert result["sidecar"]["crashes"] == [], result["sidecar"]["crashes"]
    assert result["clients"]["crashes"] == [], result["clients"]["crashes"]
    # the faults ran, and a durable check after the sidecar kill looked at blocks acknowledged durable
    injected = {e["fault"] for e in result["faults"]}
    assert {"redis_kill", "sidecar_kill"} <= injected
    after_kill = [c for c in result["durable_checks"] if c["when"].startswith("after sidecar_kill")]
    assert after_kill and after_kill[0]["durable_blocks"] > 0, result["durable_checks"]
    assert result["figures"]["reads_verified_blocks"]["value"] > 0
    assert isinstance(result["errors"], dict)
    assert len(result["buckets"]) == 10
    for bk in result["buckets"]:
        for key in ("ops_per_s", "mib_per_s", "p99_ms", "put_p99_ms", "get_p99_ms", "errors", "rss_mib", "fds",
                    "rss_anon_mib", "rss_shmem_mib", "faults", "tiers", "fd_kinds", "sidecar_incarnations",
                    "sidecar_cpu_ms_per_op", "sidecar_cores", "other_jobs_cores"):
            assert key in bk, key
    # the sidecar's CPU per op is read from its own process: every op costs it some
    assert all(bk["sidecar_cpu_ms_per_op"] > 0 for bk in result["buckets"] if bk["sidecar_cpu_ms_per_op"] is not None)
    assert sum(bk["sidecar_cpu_ms_per_op"] is not None for bk in result["buckets"]) >= 5
    for name in ("corrupt_reads_zero", "lost_durable_blocks_zero", "no_unexpected_sidecar_exit",
                 "throughput_last_vs_baseline", "rss_flat", "fds_flat"):
        assert "met" in result["targets"][name], name
    assert result["sidecar"]["final_exit_code"] == 0  # the last sidecar shut down cleanly
    assert not [line for line in Path("/proc/mounts").read_text().splitlines() if "kvstore-soak" in line]


def test_block_content_is_a_function_of_its_key_and_a_wrong_byte_is_caught() -> None:
    keys = soak.chain_keys("run", 0, 1, 2, 3)
    assert len(set(keys)) == 3 and all(len(k) == 32 for k in keys)
    assert keys == soak.chain_keys("run", 0, 1, 2, 3) != soak.chain_keys("run", 0, 1, 3, 3)
    size = 4096
    blocks = [np.frombuffer(soak.content(k, size), np.uint8).copy() for k in keys]
    assert soak.content(keys[0], size) != soak.content(keys[1], size)
    assert soak.bad_blocks(keys, blocks, size) == []
    assert soak.bad_blocks(keys, blocks[:1], size) == []  # a leading run (a miss after it) is no corruption
    blocks[1][100] ^= 1
    assert soak.bad_blocks(keys, blocks, size) == [1]
    assert soak.bad_blocks(keys, [blocks[2], blocks[0]], size) == [0, 1]  # another key's bytes
    assert soak.bad_blocks(keys, [blocks[0][:-1]], size) == [0]  # short


def _ping(port: int) -> float:
    t = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"PING\r\n")
        assert s.recv(64) == b"+PONG\r\n"
    return time.perf_counter() - t


def test_delay_proxy_forwards_and_delays() -> None:
    with redis_server() as r:
        proxy = soak.DelayProxy(r.port, free_port())
        proxy.start()
        try:
            _ping(proxy.port)
            proxy.delay_s = 0.05
            assert _ping(proxy.port) >= 0.1  # a lower bound: each direction waits at least delay_s
            proxy.delay_s = 0.0
            r.stop()  # upstream gone: the proxy closes the client's connection
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
                s.sendall(b"PING\r\n")
                assert s.recv(64) == b""
            r.start()
            _ping(proxy.port)
            assert proxy.connections >= 3
        finally:
            proxy.stop()


async def test_in_threads_retrieves_every_failure(caplog: pytest.LogCaptureFixture) -> None:
    from kvstore.util.threads import in_threads

    def boom() -> None:
        raise ConnectionResetError("redis closed the connection")

    caplog.set_level(logging.ERROR, logger="asyncio")
    with ThreadPoolExecutor(2) as pool, pytest.raises(ConnectionResetError):
        await in_threads(pool, [boom, boom])
    await asyncio.sleep(0)
    gc.collect()
    assert "exception was never retrieved" not in caplog.text


async def test_a_delete_in_flight_does_not_fail_a_demotion_into_the_room_it_frees(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # asserted out here, once the sidecar and its client are gone: a failing assertion's traceback
    # must not hold the channel (grpc.aio's poller lives while a channel object does)
    errors, gone, deleted = await _delete_during_a_demotion(tmp_path, monkeypatch)
    assert errors == 0
    assert gone == [deleted]  # every other block is still somewhere: DRAM or the SSD


async def _delete_during_a_demotion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[int, list[bytes], bytes]:
    """The SSD exactly full; a Delete of one of its blocks whose file goes slowly (a thread hop on a
    busy host); meanwhile a put evicts one DRAM block to the SSD. Returns the SSD tier's errors,
    the blocks no tier holds afterwards, and the deleted one."""
    from kvstore.client import KVStoreClient
    from kvstore.keys import prefix_keys
    from kvstore.server.sidecar import Sidecar
    from kvstore.store.books.index import TOP_LABEL
    from kvstore.tiers.ssd import SsdTier, file_bytes
    from tests.conftest import small_config

    ns = soak.NS
    size = 4096
    capacity = 8 * file_bytes(size, ns.label)
    cfg = small_config(tmp_path, **{"ssd.enabled": True, "ssd.capacity_bytes": capacity, "tiering.chain": ["ssd"]})

    def key(i: int) -> bytes:
        return prefix_keys(ns, [i + 1] * ns.block_size)[0]

    def where(sc: Sidecar, k: bytes) -> str:
        b = sc.store.index.namespaces[ns.root].blocks.get(k)
        return "gone" if b is None else TOP_LABEL[b.tiers]

    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        ssd = next(lv for lv in sc.store.tiering.levels if lv.name == "ssd")
        i = 0
        while ssd.used < capacity:  # one block at a time until the SSD is exactly full
            await c.put_blocks(ns, [key(i)], [np.full(size, i % 251, np.uint8)])
            await sc.store.tiering.flush()
            i += 1
        assert ssd.used == ssd.tier.used_bytes == capacity
        victim = next(k for k in map(key, range(i)) if where(sc, k) == "ssd")
        unlink = SsdTier.remove_batch

        def slow_unlink(self: SsdTier, refs: list[Any]) -> None:
            time.sleep(0.3)
            unlink(self, refs)

        monkeypatch.setattr(SsdTier, "remove_batch", slow_unlink)
        deleting = asyncio.ensure_future(c.delete(ns, [victim]))
        await asyncio.sleep(0.05)  # the Delete has unplaced its block; its file is still there
        await c.put_blocks(ns, [key(i)], [np.full(size, 7, np.uint8)])  # evicts one DRAM block to the SSD
        await sc.store.tiering.flush()
        await deleting
        errors = int(sc.store.stats.tiers["ssd"]["errors"])
        gone = [k for k in map(key, range(i + 1)) if where(sc, k) == "gone"]
    return errors, gone, victim


@pytest.mark.parametrize("layout", ["files", "segments"])
async def test_a_block_deleted_while_its_demotion_is_written_stays_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    orphans, resurrected = await _delete_during_a_demotion_write(tmp_path, monkeypatch, layout)
    assert orphans == 0  # the SSD holds no file of a block the index does not place there
    assert resurrected == 0  # and a restarted sidecar does not bring the deleted block back


async def _delete_during_a_demotion_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str = "files"
) -> tuple[int, int]:
    from kvstore.client import KVStoreClient
    from kvstore.keys import prefix_keys
    from kvstore.server.sidecar import Sidecar
    from kvstore.tiers.base import BlockRef
    from kvstore.tiers.segments.tier import SegmentTier
    from kvstore.tiers.ssd import SsdTier
    from tests.conftest import small_config

    ns = soak.NS
    size = 4096
    cfg = small_config(tmp_path, **{"ssd.enabled": True, "tiering.chain": ["ssd"], "ssd.layout": layout})
    tier_class: Any = SsdTier if layout == "files" else SegmentTier
    keys = [prefix_keys(ns, [i + 1] * ns.block_size)[0] for i in range(80)]
    write = tier_class.write_batch
    writing = asyncio.Event()
    loop = asyncio.get_running_loop()

    def slow_write(self: Any, items: Any) -> None:  # a busy host: the batch's files land late
        loop.call_soon_threadsafe(writing.set)
        time.sleep(0.3)
        write(self, items)

    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        monkeypatch.setattr(tier_class, "write_batch", slow_write)
        i = 0
        while not writing.is_set():  # fill DRAM until the first demotion batch is being written
            await c.put_blocks(ns, [keys[i]], [np.full(size, i, np.uint8)])
            i += 1
            await asyncio.sleep(0.01)
        root = sc.store.index.namespaces[ns.root]
        ssd = next(lv for lv in sc.store.tiering.levels if lv.name == "ssd")
        in_flight = [k for k in keys[:i] if (b := root.blocks.get(k)) is not None and b in ssd.held]
        await c.delete(ns, in_flight)  # while their files are being written
        await sc.store.tiering.flush()
        refs = [BlockRef(ns.root, k) for k in in_flight]
        if layout == "files":
            orphans = sum(1 for r in refs if ssd.tier.path_of(r).exists())
        else:  # the segment log names no slot of theirs
            orphans = sum(1 for r in refs if ssd.tier.locate(r) is not None)
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        resurrected = sum([(await c.lookup(ns, [k])).matched for k in in_flight])
    return orphans, resurrected
