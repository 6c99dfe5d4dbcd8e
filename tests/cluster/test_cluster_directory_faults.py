"""Faults in the cluster directory's Redis (issue 29): members entries no node can read, ``d:``
keys of the wrong type, records of dead incarnations and forgotten members. Real sidecars (in
process, and ``kvstore serve`` subprocesses where a signal or a process limit is part of the
case) and a real redis-server (and a Redis Cluster where the code differs)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio
from aiohttp import ClientSession

from kvstore.client import SyncClient
from kvstore.cluster import directory as directory_module
from kvstore.cluster.directory import SCAN_START, Directory, Record
from kvstore.cluster.sweep import Sweeper
from kvstore.config import Config
from kvstore.errors import FailedPrecondition, Unavailable
from kvstore.harness.servers import RedisServer, redis_cluster, redis_server
from kvstore.harness.sidecar import ServeProcess
from kvstore.keys import Namespace
from kvstore.server.sidecar import DataDirLock, Sidecar
from tests.cluster.nodes import TOKEN, blocks, client_of, keys_for, node_config, serve_args, serve_env

WAIT_S = 30.0


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)


def settle(predicate: Callable[[], bool], timeout: float) -> bool:
    """Wait up to ``timeout`` for ``predicate``, asserting nothing: whether it came true."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


async def until(predicate: Callable[[], Any], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        await asyncio.sleep(0.05)


def heartbeats(c: SyncClient) -> int:
    return int(c.stats()["cluster"]["heartbeats"])


def readyz(http: str) -> int:
    try:
        with urllib.request.urlopen(f"http://{http}/readyz", timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def prefix_of(tmp_path: Path) -> str:
    return f"f{os.getpid()}x{abs(hash(tmp_path)) % 10**8}"


# --- members entries no node can read (issue 29, case 3 and a bullet of case 10) -----------------------


def test_an_undecodable_members_entry_stops_no_heartbeat_and_a_sigterm_still_cleans_up(
    serve_process: Callable[..., ServeProcess], tmp_path: Path, directory: RedisServer, ns: Namespace
) -> None:
    """8dc5782: one non-UTF-8 field killed every node's heartbeat task for good (lookups of A's
    blocks went to 0 after the lease, a new node failed to start, SIGTERM exited 1 without leaving
    the cluster or unlinking the slab)."""
    prefix = prefix_of(tmp_path)
    a = serve_process(serve_args(tmp_path, "a"), serve_env(directory, "a", prefix))
    b = serve_process(serve_args(tmp_path, "b"), serve_env(directory, "b", prefix))
    keys, data = keys_for(ns, 4), blocks(4)
    r = redis.Redis.from_url(directory.url)
    members = f"{prefix}:members"
    with SyncClient(a.grpc) as ca, SyncClient(b.grpc) as cb:
        ca.put_blocks(ns, keys, data, wait_published=True)
        wait_for(lambda: cb.lookup(ns, keys).matched == 4, "B finds A's blocks")
        r.hset(members, b"\xff\xfe", b"127.0.0.1:1|1|99999999999999")  # the entry
        r.hset(members, b"junk", b"not|an|entry")  # UTF-8, not one
        before = {id(c): heartbeats(c) for c in (ca, cb)}
        # well past a lease (1 s): every node's heartbeat goes on
        wait_for(lambda: all(heartbeats(c) >= before[id(c)] + 15 for c in (ca, cb)), "the heartbeats go on")
        found = cb.lookup(ns, keys)
        assert found.matched == 4 and [t for t, _ in found.blocks] == ["peer"] * 4
        assert cb.stats()["cluster"]["members_unreadable"] >= 2
        assert readyz(a.http) == 200 and readyz(b.http) == 200
        c = serve_process(serve_args(tmp_path, "c"), serve_env(directory, "c", prefix))  # a new node starts
        with SyncClient(c.grpc) as cc:
            wait_for(lambda: cc.lookup(ns, keys).matched == 4, "the new node finds A's blocks")
            assert [bytes(x) for x in cc.get_blocks(ns, keys, verify=True)] == [bytes(d) for d in data]
        # nobody renews an entry nobody reads: gone once it has outlasted a lease
        wait_for(lambda: not r.hexists(members, b"\xff\xfe") and not r.hexists(members, b"junk"),
                 "the unreadable entries are deleted")
        segment = a.ready["segment"]
        assert a.stop(signal.SIGTERM) == 0
    assert not os.path.exists(f"/dev/shm/{segment}"), "the slab must be unlinked"
    assert not r.hexists(members, "a"), "A left the cluster"
    assert not [k for k in r.scan_iter(f"{prefix}:d:*".encode()) if r.hexists(k, "a")], "A's records went with it"
    r.close()


async def test_thousands_of_unparsable_members_entries_are_forgotten_after_a_lease(
    tmp_path: Path, directory: RedisServer
) -> None:
    """8dc5782: entries without an expiry the heartbeat script could read were kept for ever
    (200 k of them slowed heartbeats to 0.33/s). A long directory deadline: a FORGET that Redis
    ran but whose answer came past a loaded host's 2 s deadline is not counted (it failed once so)."""
    cfg = node_config(tmp_path, "a", directory, **{"cluster.directory_timeout_s": 30.0})
    members = f"{cfg.cluster.key_prefix}:members"
    r = redis.asyncio.Redis.from_url(directory.url)
    try:
        async with r.pipeline(transaction=False) as pipe:
            for i in range(5000):
                pipe.hset(members, f"bad{i}".encode() + (b"\xff" if i % 2 else b""), b"x" * (i % 7))
            await pipe.execute()
        async with Sidecar(cfg) as a:
            assert a.cluster is not None
            await until(lambda: _hlen_is(r, members, 1), "only A's own entry is left")
            assert a.store.stats.cluster["members_forgotten"] == 5000
            assert a.store.stats.cluster["members_unreadable"] == 5000
    finally:
        await r.aclose()


async def _hlen_is(r: Any, key: str, n: int) -> bool:
    return bool(await r.hlen(key) == n)


async def test_readyz_reports_a_background_task_that_cannot_run_and_its_loop_goes_on(
    tmp_path: Path, directory: RedisServer
) -> None:
    """8dc5782: an unexpected error ended the heartbeat task silently and /readyz said ready."""
    async with Sidecar(node_config(tmp_path, "a", directory)) as a, ClientSession() as http:
        node = a.cluster
        assert node is not None
        real = node.directory.heartbeat

        async def broken(*args: Any, **kw: Any) -> Any:
            raise RuntimeError("a bug")

        async def status() -> tuple[int, dict[str, Any]]:
            async with http.get(f"http://127.0.0.1:{a.http_port}/readyz") as resp:
                return resp.status, await resp.json()

        async def failing() -> bool:
            code, body = await status()
            return code == 503 and "RuntimeError: a bug" in body["failing"].get("kvstore-cluster-heartbeat", "")

        node.directory.heartbeat = broken  # type: ignore[method-assign]
        await until(failing, "/readyz names the failing heartbeat")
        assert a.store.stats.errors["task:kvstore-cluster-heartbeat"] >= 1
        node.directory.heartbeat = real  # type: ignore[method-assign]
        beats = node.stats["heartbeats"]

        async def recovered() -> bool:
            return (await status())[0] == 200 and node.stats["heartbeats"] > beats

        await until(recovered, "the heartbeat runs again and /readyz is ready")


async def test_a_stop_completes_when_a_background_task_died(tmp_path: Path, directory: RedisServer) -> None:
    """8dc5782: cancel_and_wait re-raised a dead task's error into the stop, which ended there."""
    a = await Sidecar(node_config(tmp_path, "a", directory)).start()

    async def dies() -> None:
        raise RuntimeError("died")

    dead = asyncio.create_task(dies())
    await asyncio.wait([dead])
    a._tasks.append(dead)  # a background task that died of an unexpected error
    assert a.cluster is not None
    members, node = a.cluster.directory.members_key, a.cluster.node
    segment = a.slab.name if a.slab else ""
    await a.stop()
    r = redis.asyncio.Redis.from_url(directory.url)
    try:
        assert not await r.hexists(members, node), "left the cluster"
    finally:
        await r.aclose()
    assert not os.path.exists(f"/dev/shm/{segment}"), "the slab is unlinked"
    lock = DataDirLock(a.data_dir)  # released: another sidecar may take the directory
    lock.acquire()
    lock.release()


# --- a d: key of another type (issue 29, case 7), on one Redis and on a Redis Cluster ----------------


@dataclass
class AnyDirectory:
    server: RedisServer  # the redis-server, or the first node of the Redis Cluster
    clustered: bool

    def config(self, tmp_path: Path, name: str, **extra: Any) -> Config:
        return node_config(tmp_path, name, self.server, **{"cluster.directory_cluster": self.clustered, **extra})

    def client(self) -> redis.asyncio.Redis | redis.asyncio.RedisCluster:
        cls = redis.asyncio.RedisCluster if self.clustered else redis.asyncio.Redis
        return cls.from_url(self.server.url)


@pytest.fixture(scope="module", params=["redis", "redis-cluster"])
def any_directory(request: pytest.FixtureRequest) -> Iterator[AnyDirectory]:
    if request.param == "redis":
        with redis_server() as server:
            yield AnyDirectory(server, False)
    else:
        with redis_cluster(3) as cluster:
            yield AnyDirectory(cluster.nodes[0], True)


def d_key(sc: Sidecar, ns: Namespace, key: bytes) -> bytes:
    """The directory key of ``key``, spelled out: ``{prefix}:d:`` + root[:16] + key."""
    return f"{sc.config.cluster.key_prefix}:d:".encode() + ns.root[:16] + key


async def sees(sc: Sidecar, node: str) -> bool:
    return sc.cluster is not None and node in {m.node for m in sc.cluster.live_members()}


async def test_a_d_key_of_another_type_is_that_keys_miss_and_wait_published_says_so(
    tmp_path: Path, any_directory: AnyDirectory, ns: Namespace
) -> None:
    """8dc5782: the SET key failed A's whole publish pipeline on every pass (A re-published all
    its records every heartbeat and found B's blocks in 4 of 129 lookups), Commit(wait_published)
    answered success without publishing, and a lookup that met the key turned B's cluster
    lookups off."""
    keys, data = keys_for(ns, 4, seed=7), blocks(4, seed=7)
    others, other_data = keys_for(ns, 4, seed=8), blocks(4, seed=8)
    r = any_directory.client()
    try:
        async with Sidecar(any_directory.config(tmp_path, "a")) as a, \
                Sidecar(any_directory.config(tmp_path, "b")) as b:
            await until(lambda: sees(a, "b"), "A sees B")
            await until(lambda: sees(b, "a"), "B sees A")
            await r.set(d_key(a, ns, keys[2]), b"not a hash")
            async with client_of(a) as ca, client_of(b) as cb:
                with pytest.raises(FailedPrecondition, match=r"wait_published: .*refused the records of 1 of the 4"):
                    await ca.put_blocks(ns, keys, data, wait_published=True)
                await ca.put_blocks(ns, others, other_data, wait_published=True)  # the publisher is not wedged
                await cb.put_blocks(ns, keys_for(ns, 2, seed=9), blocks(2, seed=9), wait_published=True)
                assert (await cb.lookup(ns, others)).matched == 4
                found = await cb.lookup(ns, keys)  # the blocks before the bad key: found; from it on: a miss
                assert found.matched == 2 and [t for t, _ in found.blocks] == ["peer"] * 2
                assert (await ca.lookup(ns, keys_for(ns, 2, seed=9))).matched == 2
                assert (await cb.lookup(ns, others)).matched == 4  # B's lookups stayed on
                published = a.store.stats.cluster["records_published"]
                beats = a.store.stats.cluster["heartbeats"]
                await until(lambda: _past(a, beats + 3), "three more heartbeats of A")
                # no re-publish of everything each heartbeat: nothing new to write, nothing written
                assert a.store.stats.cluster["records_published"] == published
            for sc in (a, b):
                assert sc.store.stats.cluster["directory_errors"] == 0
                assert sc.cluster is not None and sc.cluster.active
            assert a.store.stats.cluster["directory_key_errors"] >= 1  # its refused record
            assert b.store.stats.cluster["directory_key_errors"] >= 1  # its lookup that met the key
    finally:
        await r.aclose()


async def _past(sc: Sidecar, beats: int) -> bool:
    return bool(sc.store.stats.cluster["heartbeats"] >= beats)


async def test_a_members_key_of_another_type_is_deleted_by_the_next_heartbeat_and_the_cluster_heals(
    tmp_path: Path, any_directory: AnyDirectory, ns: Namespace, caplog: pytest.LogCaptureFixture
) -> None:
    """8dc5782: ``SET {prefix}:members x`` failed every node's heartbeat with WRONGTYPE for good,
    logged as "cluster directory unreachable", and lookups of peers' blocks fell to 0. Now the
    heartbeat deletes a members key of another type and writes the hash anew (a directory writer
    could delete it anyway): a key error, counted and told as one; every node joins again."""
    keys, data = keys_for(ns, 4, seed=62), blocks(4, seed=62)
    r = any_directory.client()
    try:
        async with Sidecar(any_directory.config(tmp_path, "a")) as a, \
                Sidecar(any_directory.config(tmp_path, "b")) as b:
            assert a.cluster is not None
            members = a.cluster.directory.members_key
            await until(lambda: sees(b, "a"), "B sees A")
            async with client_of(a) as ca, client_of(b) as cb:
                await ca.put_blocks(ns, keys, data, wait_published=True)
                await r.set(members, b"x")
                await until(lambda: _type_is(r, members, b"hash"), "the members key is a hash again")
                beats = {sc: sc.store.stats.cluster["heartbeats"] for sc in (a, b)}
                await until(lambda: _past(a, beats[a] + 3), "three more heartbeats of A")
                await until(lambda: _past(b, beats[b] + 3), "three more heartbeats of B")
                await until(lambda: sees(b, "a"), "B sees A again")
                found = await cb.lookup(ns, keys)
                assert found.matched == 4 and [t for t, _ in found.blocks] == ["peer"] * 4
            assert sum(sc.store.stats.cluster["directory_key_errors"] for sc in (a, b)) >= 1
            for sc in (a, b):
                assert sc.store.stats.cluster["directory_errors"] == 0
        assert "the members key" in caplog.text and "not a hash" in caplog.text
        assert "unreachable" not in caplog.text
    finally:
        await r.aclose()


async def _type_is(r: Any, key: str, kind: bytes) -> bool:
    return bool(await r.type(key) == kind)


async def test_wait_published_is_an_error_while_the_directory_is_down(tmp_path: Path, ns: Namespace) -> None:
    """8dc5782: Commit(wait_published=true) answered success at once with the directory down."""
    with redis_server() as server:
        async with Sidecar(node_config(tmp_path, "a", server)) as a, client_of(a) as ca:
            server.stop()
            await until(lambda: _down(a), "A finds the directory down")
            with pytest.raises(Unavailable, match="wait_published: the cluster directory was not written"):
                await ca.put_blocks(ns, keys_for(ns, 2), blocks(2), wait_published=True)
            assert (await ca.lookup(ns, keys_for(ns, 2))).matched == 2  # committed here all the same
            server.start()
            await until(lambda: _up(a), "A finds the directory back")
            await ca.put_blocks(ns, keys_for(ns, 2, seed=1), blocks(2, seed=1), wait_published=True)


async def _down(sc: Sidecar) -> bool:
    return sc.cluster is not None and not sc.cluster.active


async def _up(sc: Sidecar) -> bool:
    return sc.cluster is not None and sc.cluster.active


# --- records of dead incarnations and of nodes gone (issue 29, case 8) ---------------------------------


async def _records_of(url: str, prefix: str, node: str) -> list[Record]:
    """Every record of ``node`` in the directory, read (and checked) as a node of the cluster reads them."""
    d = Directory(redis.asyncio.Redis.from_url(url), prefix, "reader", token=TOKEN)
    out: list[Record] = []
    try:
        cursor, first = SCAN_START, True
        while first or cursor != SCAN_START:
            first = False
            cursor, keys = await d.scan_keys(cursor, 1000)
            pending = [(k, 0) for k in keys]
            while pending:
                pieces = await d.read_fields(pending)
                out += [p.holders[node] for p in pieces if node in p.holders]
                pending = [(p.key, p.cursor) for p in pieces if p.cursor]
    finally:
        await d.close()
    return out


def records_of(url: str, prefix: str, node: str) -> list[Record]:
    return asyncio.run(_records_of(url, prefix, node))


def test_a_killed_and_restarted_nodes_old_records_are_swept(
    serve_process: Callable[..., ServeProcess], tmp_path: Path, directory: RedisServer, ns: Namespace
) -> None:
    """8dc5782: after kill -9 and a restart with the same node_id, the old life's records stayed
    (450 of 500 after three rounds of lookups); nothing else ever deleted them."""
    prefix = prefix_of(tmp_path)
    env = serve_env(directory, "a", prefix)
    a = serve_process(serve_args(tmp_path, "a"), env)
    prompts = [keys_for(ns, 4, seed=s) for s in range(20, 26)]
    with SyncClient(a.grpc) as ca:
        for s, keys in enumerate(prompts):
            ca.put_blocks(ns, keys, blocks(4, seed=s), wait_published=True)
    old = records_of(directory.url, prefix, "a")
    assert len(old) == 24 and len({rec.incarnation for rec in old}) == 1
    a.stop(signal.SIGKILL)  # no leave: every record stays behind
    again = serve_process(serve_args(tmp_path, "a"), env)
    with SyncClient(again.grpc) as ca:
        ca.put_blocks(ns, prompts[0], blocks(4, seed=0), wait_published=True)  # held again, in the new life
    wait_for(lambda: len(records_of(directory.url, prefix, "a")) == 4, "only the new life's 4 records are left", 60)
    assert {rec.incarnation for rec in records_of(directory.url, prefix, "a")} != {old[0].incarnation}
    with SyncClient(again.grpc) as ca:
        assert ca.stats()["cluster"]["sweep_forgotten"] >= 20  # (and those of prompts[0] swept before the put)
    assert again.stop(signal.SIGTERM) == 0


async def test_records_of_a_node_gone_are_swept_on_a_redis_and_a_redis_cluster(
    tmp_path: Path, any_directory: AnyDirectory, ns: Namespace
) -> None:
    """8dc5782: a node gone for good (its member entry forgotten, or never there) left all its
    records for ever. Namespaces and keys spread over the cluster's slots; the walk crosses every
    primary."""
    async with Sidecar(any_directory.config(tmp_path, "a")) as a:
        assert a.cluster is not None
        gone = Directory(any_directory.client(), a.config.cluster.key_prefix, "gone", token=TOKEN)
        kept = Directory(any_directory.client(), a.config.cluster.key_prefix, "reader", token=TOKEN)
        try:
            roots = [Namespace(model=f"m{i}", kv_layout="raw", dtype="float16", block_size=16).root for i in range(3)]
            record = Record(1, 1, 8192, 7)
            puts = [(root, bytes([i, j]) * 16, record) for i, root in enumerate(roots) for j in range(40)]
            await gone.publish(puts, [])
            async with client_of(a) as ca:  # a live node's records stay
                await ca.put_blocks(ns, keys_for(ns, 4, seed=30), blocks(4, seed=30), wait_published=True)

            async def swept() -> bool:
                found = await gone.find(roots[0], [k for _, k, _ in puts[:40]])
                return not any(f for f in found) and a.store.stats.cluster["sweep_forgotten"] == 120

            await until(swept, "the gone node's 120 records are deleted")
            assert [f.get("a") is not None for f in await kept.find(ns.root, keys_for(ns, 4, seed=30))] == [True] * 4
            assert a.store.stats.cluster["sweep_walks"] >= 1
        finally:
            await gone.close()
            await kept.close()


async def test_a_lookup_deletes_every_void_record_it_meets_not_only_the_first(
    tmp_path: Path, directory: RedisServer, ns: Namespace
) -> None:
    """8dc5782: find() marked void records only up to the first key without a live holder, and
    never those of a node missing from the members. (No sweep here: the lookups alone.)"""
    no_sweep = {"cluster.sweep_keys_per_s": 0}
    async with Sidecar(node_config(tmp_path, "a", directory, **no_sweep)) as a, \
            Sidecar(node_config(tmp_path, "b", directory, **no_sweep)) as b:
        assert a.cluster is not None and b.cluster is not None
        keys = keys_for(ns, 10, seed=40)
        past = Record(a.cluster.incarnation - 10, 1, 8192, 7)  # a's past life
        await a.cluster.directory.publish([(ns.root, k, past) for k in keys[:5]], [])
        gone = Directory(redis.asyncio.Redis.from_url(directory.url), a.config.cluster.key_prefix, "gone", token=TOKEN)
        try:
            await gone.publish([(ns.root, k, Record(1, 1, 8192, 7)) for k in keys[5:]], [])
            async with client_of(b) as cb:

                async def cleaned() -> bool:
                    assert (await cb.lookup(ns, keys)).matched == 0
                    await b.cluster.flush()  # type: ignore[union-attr]
                    return not any(await gone.find(ns.root, keys))

                await until(cleaned, "every void record the lookups met is deleted")
        finally:
            await gone.close()


# --- forged fields piled into d: keys (issue 29 follow-up) -------------------------------------------

FORGED = b"\x02" + bytes(41)  # a sealed record's shape (version byte, record, MAC), its MAC wrong
FEW = 500  # FIELDS_MAX in these tests: the piles are a few thousand fields, not hundreds of thousands


async def _pile(r: Any, key: bytes, n: int) -> None:
    """``n`` forged fields in ``key``, HSET in pieces: what a directory writer without the token can do."""
    for i in range(0, n, 1000):
        await r.hset(key, mapping={f"forged{j}".encode(): FORGED for j in range(i, min(n, i + 1000))})


async def test_a_lookup_reads_no_d_key_of_thousands_of_forged_fields_and_the_directory_stays_up(
    tmp_path: Path, any_directory: AnyDirectory, ns: Namespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """8dc5782: a lookup read (HGETALL) and checked every field of every key it met: 200 k forged
    fields in each of a prompt's keys took 2 s, timed out and marked the directory down. Now a key
    with more than FIELDS_MAX fields is not read: that key's miss, counted; the directory stays up."""
    monkeypatch.setattr(directory_module, "FIELDS_MAX", FEW, raising=False)  # (8dc5782 has none)
    no_sweep = {"cluster.sweep_keys_per_s": 0}
    keys, data = keys_for(ns, 4, seed=60), blocks(4, seed=60)
    r = any_directory.client()
    try:
        async with Sidecar(any_directory.config(tmp_path, "a", **no_sweep)) as a, \
                Sidecar(any_directory.config(tmp_path, "b", **no_sweep)) as b:
            await until(lambda: sees(b, "a"), "B sees A")
            async with client_of(a) as ca, client_of(b) as cb:
                await ca.put_blocks(ns, keys, data, wait_published=True)
                fat = d_key(a, ns, keys[2])
                await _pile(r, fat, 3000)
                found = await cb.lookup(ns, keys)  # the blocks before the fat key: found; from it on: a miss
                assert found.matched == 2 and [t for t, _ in found.blocks] == ["peer"] * 2
                stats = b.store.stats.cluster
                assert stats["directory_keys_oversized"] == 1
                assert stats["records_rejected"] == 0  # not one forged field was read
                assert stats["directory_errors"] == 0 and b.cluster is not None and b.cluster.active
                await r.hdel(fat, *[f"forged{j}".encode() for j in range(3000)])
                assert (await cb.lookup(ns, keys)).matched == 4
    finally:
        await r.aclose()


async def test_the_sweep_deletes_forged_fields_and_keeps_the_real_records(
    tmp_path: Path, any_directory: AnyDirectory, ns: Namespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """8dc5782: forged fields were rejected by every read and deleted by none: the sweep re-read
    (HGETALL) every one of them at every walk of every node, for ever (400 k in one key stalled a
    node's loop 0.7 s a walk). Now the sweep deletes the fields whose MAC fails from a key with
    more fields than any block's holders; lookups then read the key again. A lone field whose MAC
    fails (a node given another token writes one a key) is left alone."""
    monkeypatch.setattr(directory_module, "FIELDS_MAX", FEW, raising=False)  # (8dc5782 has none)
    keys, data = keys_for(ns, 4, seed=61), blocks(4, seed=61)
    r = any_directory.client()
    try:
        async with Sidecar(any_directory.config(tmp_path, "a", **{"cluster.sweep_keys_per_s": 0})) as a, \
                client_of(a) as ca:
            await ca.put_blocks(ns, keys, data, wait_published=True)
            held, stray = d_key(a, ns, keys[1]), d_key(a, ns, b"\xf0" * 32)
            await _pile(r, held, 3000)
            await _pile(r, stray, 3000)
            lone = d_key(a, ns, keys[2])
            await r.hset(lone, b"other", FORGED)
            async with Sidecar(any_directory.config(tmp_path, "b")) as b, client_of(b) as cb:  # B sweeps

                async def cleaned() -> bool:
                    return bool(await r.hlen(held) == 1 and not await r.exists(stray))

                await until(cleaned, "the sweep deleted every forged field")
                walks = b.store.stats.cluster["sweep_walks"]
                await until(lambda: _walked(b, walks + 2), "two more walks of B's sweep")
                assert await r.hget(lone, b"other") == FORGED
                assert b.store.stats.cluster["sweep_forged_forgotten"] == 6000
                assert b.store.stats.cluster["directory_errors"] == 0
                assert (await cb.lookup(ns, keys)).matched == 4
                got = await cb.get_blocks(ns, keys, verify=True)
                assert [bytes(x) for x in got] == [bytes(d) for d in data]
    finally:
        await r.aclose()


async def _walked(sc: Sidecar, walks: int) -> bool:
    return bool(sc.store.stats.cluster["sweep_walks"] >= walks)


async def test_a_sweep_pass_reads_a_bounded_piece_of_a_fat_key_and_deletes_by_compare(
    tmp_path: Path, directory: RedisServer
) -> None:
    """8dc5782: a pass read each key whole (HGETALL) and deleted no forged field. Now a pass reads
    at most about keys_per_pass x FIELDS_PER_KEY fields (HSCAN pieces) and goes on where it left
    off at the next, while the walk goes on over the other keys (their void records go long before
    the pile); a field is deleted only while it holds the value read."""
    prefix = prefix_of(tmp_path)
    r = redis.asyncio.Redis.from_url(directory.url)
    d = Directory(redis.asyncio.Redis.from_url(directory.url), prefix, "reader", token=TOKEN)
    gone = Directory(redis.asyncio.Redis.from_url(directory.url), prefix, "gone", token=TOKEN)
    try:
        fat = f"{prefix}:d:".encode() + b"F" * 48
        await _pile(r, fat, 3000)
        root = b"R" * 16
        await gone.publish([(root, bytes([i]) * 32, Record(1, 1, 8192, 7)) for i in range(30)], [])
        stats: Counter[str] = Counter()
        sweeper = Sweeper(d, lambda node, rec: node == "gone", stats, keys_per_pass=10)
        for _ in range(10):  # until the walk reaches the pile (a SCAN gives about 10 of the 31 keys a pass)
            await sweeper.step()
            if stats["sweep_forged_forgotten"]:
                break
        first = stats["sweep_forged_forgotten"]
        assert 0 < first < 3000 and await r.hlen(fat) == 3000 - first  # a piece of it, not the whole
        for _ in range(200):
            if stats["sweep_forgotten"] == 30:
                break
            await sweeper.step()
        assert stats["sweep_forgotten"] == 30 and await r.hlen(fat) > 1000  # the walk did not wait for the pile
        for _ in range(200):
            if not await r.exists(fat):
                break
            await sweeper.step()
        assert stats["sweep_forged_forgotten"] == 3000 and not await r.exists(fat)
        assert stats["sweep_walks"] >= 1
        await r.hset(fat, b"x", FORGED)  # rewritten since it was read: stays
        assert await d.forget_fields([(fat, b"x", FORGED[:-1] + b"\x01")]) == 0 and await r.hexists(fat, b"x")
        assert await d.forget_fields([(fat, b"x", FORGED)]) == 1
    finally:
        await d.close()
        await gone.close()
        await r.aclose()


async def test_a_sweep_pass_past_its_deadline_says_so_in_its_log_line(
    tmp_path: Path, directory: RedisServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """8dc5782: a sweep pass that ran out of time logged "cluster directory sweep failed (tried
    again next pass): " and nothing after it (a TimeoutError's message is empty)."""
    async with Sidecar(node_config(tmp_path, "a", directory, **{"cluster.directory_timeout_s": 0.2})) as a:
        assert a.cluster is not None

        async def stuck(*args: Any, **kw: Any) -> Any:
            await asyncio.sleep(3600)

        monkeypatch.setattr(a.cluster.directory, "scan_keys", stuck, raising=False)
        monkeypatch.setattr(a.cluster.directory, "scan", stuck, raising=False)  # (8dc5782's)

        async def told() -> bool:
            return "sweep failed" in caplog.text

        await until(told, "the sweep's deadline is logged")
        assert "sweep failed (tried again next pass): no answer within cluster.directory_timeout_s (0.2 s)" \
            in caplog.text


# --- the peer listener out of file descriptors (issue 29, case 5) ---------------------------------------

NOFILE = 256
LIMITED = ("-c", "import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_NOFILE, "
           f"({NOFILE}, {NOFILE})); sys.argv = ['kvstore', 'serve', *sys.argv[1:]]; "
           "runpy.run_module('kvstore', run_name='__main__')")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_the_peer_listener_serves_again_after_the_process_ran_out_of_descriptors(
    serve_process: Callable[..., ServeProcess], tmp_path: Path, directory: RedisServer, ns: Namespace
) -> None:
    """8dc5782: with nofile 256, idle connections to the sidecar's ports ran it out of
    descriptors; an accept on the peer port then failed with EMFILE and ended the peer accept loop
    for good: once the connections were closed, fetches from that node got 0 blocks while it kept
    advertising them."""
    prefix = prefix_of(tmp_path)
    a = serve_process(serve_args(tmp_path, "a"), serve_env(directory, "a", prefix), entry=LIMITED)
    b = serve_process(serve_args(tmp_path, "b"), serve_env(directory, "b", prefix))
    keys, data = keys_for(ns, 4, seed=50), blocks(4, seed=50)
    pid = a.proc.pid
    peer_host, _, peer_port = a.ready["peer"].rpartition(":")
    with SyncClient(a.grpc) as ca:
        ca.put_blocks(ns, keys, data, wait_published=True)
    idle: list[socket.socket] = []
    try:
        targets = [a.http, a.grpc] * 200
        for target in targets:  # idle connections that send nothing, until the process is out of descriptors
            host, _, port = target.rpartition(":")
            idle.append(socket.create_connection((host, int(port)), timeout=5))
            if len(idle) % 50 == 0 and open_fds(pid) >= NOFILE - 2:
                break
        wait_for(lambda: open_fds(pid) >= NOFILE - 2, f"the sidecar holds ~{NOFILE} descriptors")
        for _ in range(4):  # peers knock while it has none left: their accepts fail with EMFILE
            idle.append(socket.create_connection((peer_host, int(peer_port)), timeout=5))
        # (not an assertion: 8dc5782 logs nothing here, its accept loop just ends)
        settle(lambda: "peer data path: accept failed" in a.logs(), 5.0)
    finally:
        for s in idle:
            s.close()
    wait_for(lambda: open_fds(pid) < NOFILE // 2, "the sidecar's descriptors are freed")
    with SyncClient(b.grpc) as cb:
        wait_for(lambda: cb.lookup(ns, keys).matched == 4, "B finds A's blocks")
        got = cb.get_blocks(ns, keys, verify=True)  # fetched from A over its peer listener
        assert [bytes(x) for x in got] == [bytes(d) for d in data]
        assert cb.stats()["cluster"]["blocks_fetched"] == 4
    assert "peer data path: accept failed" in a.logs()  # it did run out (EMFILE), and came back
    assert a.stop(signal.SIGTERM) == 0
