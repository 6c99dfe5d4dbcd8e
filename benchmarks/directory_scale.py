"""The cluster directory's cost at scale: Redis memory per block record, publish / unpublish rates,
and the latency of a prompt's lookup, through :class:`kvstore.cluster.directory.Directory` itself.

Two real redis-servers (``kvstore.harness.servers.redis_server``, no persistence), the second a
twin for the raw baseline, and, unless ``--no-cluster``, two 3-master Redis Clusters
(``redis_cluster(3)``) the same way. On each:

1. **Publish, one holder, against raw.** ``--blocks`` records from node ``node-000`` through
   ``Directory.publish`` in batches of ``--batch`` (one pipeline in flight, as the node's
   publisher sends them) and, batch for batch in turn with it, raw redis-py (the same async
   client) pipelines of ``HSET key node record`` of exactly the same keys, field and 25-byte
   values (pre-built: no key building, no packing) on the twin. Both write new keys, so taking
   turns puts the machine's noise on both alike while memory and server CPU stay apart.
   ``INFO memory`` ``used_memory`` before and after: bytes per block.
2. **A replica.** A second node id publishes every 10th block (a second field in the same hash):
   bytes per extra holder field.
3. **Updates, by pipeline size.** For each of ``--batch-sizes`` (the publisher's batches are
   whatever changed in ``publish_interval_ms``), ``--update-blocks`` re-publications of blocks
   already held (a placement change: HSET of an existing field), raw and through the Directory
   in turn; the best of ``--repeat`` rounds.
4. **Find.** ``Directory.find`` of ``--find-keys`` consecutive stored keys (one pipeline of
   HGETALL, the lookup's "keys after the local run"; about one key in ten has two holders),
   ``--find-calls`` calls, in turn with the same find of keys nobody holds (a prompt no node has
   seen: the usual lookup miss) and a raw pipeline of the same HGETALLs; then a few
   ``--big-find-keys`` finds (a long prompt that misses locally from its first block).
5. **Unpublish.** ``Directory.publish([], removes)`` (HDEL) of the replica fields, then of every
   block of node ``node-000`` (each HDEL removes the hash's last field: Redis drops the key), in
   turn with raw HDEL on the twin. Memory must come back to where it started.
6. **The cluster's ghost** (the ``g:`` keys), on the emptied deployment, unless ``--ghost-blocks 0``:
   ghosts (use count :data:`GHOST_USES`, ``PX`` :data:`GHOST_TTL_MS`) left for ``--ghost-share``
   of ``--ghost-blocks`` blocks, by the same raw commands on both sides (``used_memory`` before
   and after, and ``MEMORY USAGE``: bytes per ghost key). Then those blocks published as new on
   the node (``fresh``: their ghosts read and deleted, :data:`~kvstore.cluster.directory.TAKE`
   on one Redis, ``GETDEL`` on a Redis Cluster) through ``Directory.publish``, in turn with raw
   redis-py sending the same commands to the twin (HSET, then the same TAKE call or GETDELs) and
   with a plain publish (no ghost read) of as many other new blocks on the same deployment;
   then their removes with counts (``uses``: :data:`~kvstore.cluster.directory.LEAVE` on one
   Redis, ``SET PX`` on a Redis Cluster), in turn with raw (HDEL, then the same) and with plain
   removes (HDEL) of the other blocks. Two steps share a deployment here, so each call's server
   CPU is read around it (``INFO``, off the clock).
7. **Redis's own ceiling** (single server only): ``redis-benchmark``, the C client, sending
   directory-shaped HSET and HGETALL, pipelined and not.

Beside the client-side rates (on this machine the Python client, not Redis, is the bottleneck),
each phase reports redis-server's own CPU per command (``INFO cpu`` user + sys, summed over the
cluster's masters): the figure that sizes a directory shard, since a real directory is shared
by many clients on other hosts.

    python3 -m benchmarks.directory_scale --blocks 1000000 --json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import gc
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import redis
from redis.asyncio import Redis, RedisCluster

from benchmarks.common import Result, percentile
from kvstore.cluster.cluster_key import MAC_BYTES
from kvstore.cluster.directory import LEAVE, ROOT_BYTES, TAKE, Directory, Record
from kvstore.config import ClusterConfig
from kvstore.harness.servers import redis_cluster, redis_server
from kvstore.store.books.index import DRAM

PREFIX = "kvstore"  # ClusterConfig.key_prefix's default
NODE_A, NODE_B = "node-000", "node-001"  # node ids; a real one defaults to the host name (often longer)
BLOCK_BYTES = 2 << 20
REDIS_BENCHMARK = shutil.which("redis-benchmark") or "/usr/bin/redis-benchmark"
REPLICA_EVERY = 10  # node B holds every 10th block of node A's
GHOST_USES = 3  # the use count every ghost of the ghost phase carries
GHOST_TTL_MS = round(1000 * ClusterConfig.model_fields["ghost_ttl_s"].default)  # the sidecar's: outlives the phase


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", type=int, default=1_000_000, help="block records one node publishes")
    p.add_argument("--batch", type=int, default=1024, help="records per publish pipeline for the fill")
    p.add_argument("--batch-sizes", default="256,1024,4096", help="pipeline sizes of the update phase")
    p.add_argument("--update-blocks", type=int, default=50_000, help="re-publications per pipeline size per round")
    p.add_argument("--repeat", type=int, default=2, help="rounds of the update phase; the best counts")
    p.add_argument("--find-keys", type=int, default=64, help="keys per find")
    p.add_argument("--find-calls", type=int, default=1000)
    p.add_argument("--big-find-keys", type=int, default=2048, help="keys per find of the long-prompt case")
    p.add_argument("--big-find-calls", type=int, default=30)
    p.add_argument(
        "--cluster-blocks", type=int, default=500_000,
        help="block records on the clusters (at most --blocks): 167k keys a master, the same hash-table load as 1 M",
    )
    p.add_argument("--ghost-blocks", type=int, default=40_000,
                   help="blocks of the ghost phase (as many again for its plain publish; about 20 s in all "
                        "with the clusters'); 0: no ghost phase")
    p.add_argument("--ghost-share", type=float, default=1.0,
                   help="share of the ghost phase's new blocks that find a ghost (0 to 1; the rest find none)")
    p.add_argument("--no-cluster", action="store_true", help="only the single-node Redis")
    p.add_argument("--no-redis-benchmark", action="store_true", help="skip the redis-benchmark (C client) ceiling")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON document (else a table)")


def _log(msg: str) -> None:
    print(f"[directory_scale {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- the data ------------------------------------------------------------------------------------


@dataclass
class Blocks:
    root: bytes
    keys: list[bytes]  # 32-byte block keys
    records: list[Record]
    missing: list[bytes]  # keys nobody publishes

    @staticmethod
    def make(n: int, n_missing: int, seed: int) -> Blocks:
        rng = np.random.default_rng(seed)
        root = rng.bytes(ROOT_BYTES)
        raw = rng.bytes(32 * (n + n_missing))
        keys = [raw[32 * i : 32 * i + 32] for i in range(n + n_missing)]
        sums = rng.integers(1, 2**63, size=n, dtype=np.int64).tolist()
        incarnation = time.time_ns() // 1_000_000
        records = [Record(incarnation, DRAM, BLOCK_BYTES, c) for c in sums]
        return Blocks(root, keys[:n], records, keys[n:])


def _chunks(n: int, size: int) -> list[range]:
    return [range(i, min(n, i + size)) for i in range(0, n, size)]


# --- Redis-side figures ----------------------------------------------------------------------------


class Servers:
    """Plain sync clients to every master, for INFO (never timed)."""

    def __init__(self, ports: Sequence[int]) -> None:
        self.admins = [redis.Redis(host="127.0.0.1", port=p) for p in ports]

    def memory(self) -> int:
        return sum(int(a.info("memory")["used_memory"]) for a in self.admins)

    def rss(self) -> int:
        return sum(int(a.info("memory")["used_memory_rss"]) for a in self.admins)

    def cpu(self) -> float:
        total = 0.0
        for a in self.admins:
            info = a.info("cpu")
            total += float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
        return total

    def cpu_read_cost(self) -> float:
        """What one :meth:`cpu` read adds to the difference of two (``INFO`` is a command too, about
        15 us a master here): the median over back-to-back reads."""
        reads = [self.cpu() for _ in range(21)]
        return statistics.median(b - a for a, b in itertools.pairwise(reads))

    def keys(self) -> int:
        return sum(int(a.dbsize()) for a in self.admins)

    def flush(self) -> None:
        for a in self.admins:
            a.flushall(asynchronous=False)

    def sample_usage(self, keys: Sequence[bytes]) -> float:
        """Mean MEMORY USAGE of ``keys`` (each asked of the master that holds it)."""
        sizes = []
        for k in keys:
            for a in self.admins:
                try:
                    v = a.memory_usage(k, samples=0)
                except redis.ResponseError:  # MOVED: another master's
                    continue
                if v is not None:
                    sizes.append(int(v))
                    break
        return statistics.fmean(sizes) if sizes else 0.0

    def close(self) -> None:
        for a in self.admins:
            a.close()


async def _settle(servers: Servers) -> int:
    """used_memory once the server has freed what a pipeline left behind (query buffers)."""
    await asyncio.sleep(0.2)
    gc.collect()
    return servers.memory()


@dataclass
class Timed:
    seconds: float
    server_cpu_s: float
    ops: int
    client_cpu_s: float = 0.0  # this process's CPU time (the Python client's own cost, less exposed to noise)

    @property
    def rate(self) -> float:
        return self.ops / self.seconds

    @property
    def server_us_per_op(self) -> float:
        return self.server_cpu_s / self.ops * 1e6

    @property
    def client_us_per_op(self) -> float:
        return self.client_cpu_s / self.ops * 1e6


# --- the operations ----------------------------------------------------------------------------------


Puts = list[tuple[bytes, bytes, Record]]
Cmds = list[tuple[bytes, bytes]]


def _puts(b: Blocks, idx: Sequence[int]) -> Puts:
    """What the node's publisher hands ``Directory.publish``: (root, key, record)."""
    return [(b.root, b.keys[i], b.records[i]) for i in idx]


def raw_commands(d: Directory, b: Blocks, idx: Sequence[int]) -> Cmds:
    """(key, packed record) exactly as the directory writes them (built before the clock starts)."""
    return [(d.key(b.root, b.keys[i]), d.value(b.root, b.keys[i], d.node, b.records[i])) for i in idx]


async def raw_hset(client: Redis | RedisCluster, field: bytes, cmds: Cmds) -> None:
    pipe = client.pipeline(transaction=False)
    for key, value in cmds:
        pipe.hset(key, field, value)
    await pipe.execute()


async def raw_hdel(client: Redis | RedisCluster, field: bytes, cmds: Cmds) -> None:
    pipe = client.pipeline(transaction=False)
    for key, _ in cmds:
        pipe.hdel(key, field)
    await pipe.execute()


async def raw_publish(
    client: Redis | RedisCluster, field: bytes, puts: Sequence[tuple[bytes, bytes]] = (),
    removes: Sequence[tuple[bytes, bytes]] = (), taken: Sequence[bytes] = (), left: Sequence[bytes] = (),
) -> None:
    """In one pipeline, the Redis commands ``Directory.publish`` sends with ghosts on: HSET of
    ``puts`` and HDEL of ``removes`` ((key, packed record) as :func:`raw_commands` builds them),
    then the ghosts ``taken`` read and deleted and ``left`` set (:data:`GHOST_USES`,
    ``PX`` :data:`GHOST_TTL_MS`): one :data:`TAKE` and one :data:`LEAVE` call, the directory's
    own script text, on one Redis; a ``GETDEL`` and a ``SET PX`` per key on a Redis Cluster.
    Each through ``execute_command``, redis-py's leanest path and the directory's (its ``set()``
    alone spends about 3 us more a call on checking options)."""
    pipe = client.pipeline(transaction=False)
    for key, value in puts:
        pipe.execute_command("HSET", key, field, value)
    for key, _ in removes:
        pipe.execute_command("HDEL", key, field)
    if isinstance(client, RedisCluster):
        for key in taken:
            pipe.execute_command("GETDEL", key)
        for key in left:
            pipe.execute_command("SET", key, GHOST_USES, "PX", GHOST_TTL_MS)
    else:
        if taken:
            pipe.execute_command("EVAL", TAKE, len(taken), *taken)
        if left:
            pipe.execute_command("EVAL", LEAVE, len(left), *left, GHOST_TTL_MS, len(left), *[GHOST_USES] * len(left))
    await pipe.execute()


async def raw_hgetall(client: Redis | RedisCluster, keys: Sequence[bytes]) -> list[Any]:
    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.hgetall(k)
    return list(await pipe.execute())


Step = Callable[[int], Awaitable[Any]]


def _publish_step(d: Directory, batches: Sequence[Puts]) -> Step:
    return lambda i: d.publish(batches[i], [])


def _hset_step(client: Redis | RedisCluster, field: bytes, batches: Sequence[Cmds]) -> Step:
    return lambda i: raw_hset(client, field, batches[i])


async def interleaved(
    steps: dict[str, Step], calls: int, warmup: int = 0, cpu: dict[str, float] | None = None,
    servers: dict[str, Servers] | None = None, server_cpu: dict[str, float] | None = None,
) -> dict[str, list[float]]:
    """Call each step ``calls`` times, the steps taking turns (their order rotating from one call
    to the next), so that the machine's noise falls on all alike; seconds per call, per step.
    ``cpu`` gets each step's total CPU time of this process; with ``servers`` (each step's),
    ``server_cpu`` gets each step's server CPU, read around each of its calls (``INFO``, off the
    clock), less what a read itself costs (:meth:`Servers.cpu_read_cost`)."""
    names = list(steps)
    for i in range(warmup):
        for name in names:
            await steps[name](i)
    out: dict[str, list[float]] = {name: [] for name in names}
    used = dict.fromkeys(names, 0.0)
    on_server = dict.fromkeys(names, 0.0)
    read_cost = {name: srv.cpu_read_cost() for name, srv in (servers or {}).items()}
    for i in range(calls):
        for j in range(len(names)):
            name = names[(i + j) % len(names)]
            before = servers[name].cpu() if servers else 0.0
            c, t = time.process_time(), time.perf_counter()
            await steps[name](i)
            out[name].append(time.perf_counter() - t)
            used[name] += time.process_time() - c
            if servers:
                on_server[name] += servers[name].cpu() - before - read_cost[name]
    if cpu is not None:
        cpu.update(used)
    if server_cpu is not None and servers:
        server_cpu.update(on_server)
    return out


async def timed_interleaved(
    steps: dict[str, tuple[Step, Servers]], calls: int, ops: int, per_call: bool = False
) -> dict[str, Timed]:
    """:func:`interleaved`, with each step's servers' CPU: over the whole run (each step on its
    own deployment) or, ``per_call``, read around each call (steps that share a deployment)."""
    start = {name: srv.cpu() for name, (_, srv) in steps.items()}
    client: dict[str, float] = {}
    server: dict[str, float] = {}
    lat = await interleaved({name: step for name, (step, _) in steps.items()}, calls, cpu=client,
                            servers={name: srv for name, (_, srv) in steps.items()} if per_call else None,
                            server_cpu=server)
    if not per_call:
        server = {name: srv.cpu() - start[name] for name, (_, srv) in steps.items()}
    return {name: Timed(sum(lat[name]), server[name], ops, client[name]) for name in steps}


# --- one deployment (single Redis or Redis Cluster) -----------------------------------------------------


@dataclass
class Deployment:
    servers: Servers
    connect: Callable[[], Redis | RedisCluster]


async def measure(tag: str, dep: Deployment, twin: Deployment, b: Blocks, n: int, args: argparse.Namespace,
                  res: Result) -> None:
    """Every phase on ``dep``; the raw fill and raw unpublish on ``twin``, a deployment like it,
    chunk for chunk in turn with the Directory's (both write new keys: memory and CPU stay apart)."""
    servers = dep.servers
    client_a, client_b, client_raw = dep.connect(), dep.connect(), twin.connect()
    da, db = Directory(client_a, PREFIX, NODE_A), Directory(client_b, PREFIX, NODE_B)
    field_a = NODE_A.encode()
    fill = _chunks(n, args.batch)

    # warm-up: connections, the cluster client's slot map, the interpreter's caches
    warm = _chunks(min(n, 20_000), args.batch)
    for idx in warm:
        await da.publish(_puts(b, idx), [])
        await db.publish(_puts(b, idx), [])
        await raw_hset(client_raw, field_a, raw_commands(da, b, idx))
    servers.flush()
    twin.servers.flush()
    base, twin_base = await _settle(servers), await _settle(twin.servers)
    base_rss = servers.rss()
    res.figure(f"{tag}_used_memory_empty", base, "bytes")

    # 1-2. the fill: Directory.publish on dep, raw HSET of the same on twin, batch by batch in turn
    _log(f"{tag}: fill of {n} records, Directory.publish and raw HSET in turn")
    puts = [_puts(b, idx) for idx in fill]
    raw_fill = [raw_commands(da, b, idx) for idx in fill]
    t = await timed_interleaved({
        "dir": (lambda i: da.publish(puts[i], []), servers),
        "raw": (lambda i: raw_hset(client_raw, field_a, raw_fill[i]), twin.servers),
    }, len(fill), n)
    pub, raw = t["dir"], t["raw"]
    one = await _settle(servers)
    raw_mem = await _settle(twin.servers) - twin_base
    assert servers.keys() == n and twin.servers.keys() == n, (servers.keys(), twin.servers.keys(), n)
    sample = b.keys[:: max(1, n // 1000)][:1000]
    res.figure(f"{tag}_publish_records_per_s", pub.rate, "records/s")
    res.figure(f"{tag}_raw_hset_records_per_s", raw.rate, "records/s")
    res.ratio(f"{tag}_publish_vs_raw_redis", pub.rate / raw.rate)
    res.figure(f"{tag}_publish_server_us_per_hset", pub.server_us_per_op, "us")
    res.figure(f"{tag}_raw_server_us_per_hset", raw.server_us_per_op, "us")
    res.figure(f"{tag}_publish_client_cpu_us_per_record", pub.client_us_per_op, "us")
    res.figure(f"{tag}_raw_client_cpu_us_per_record", raw.client_us_per_op, "us")
    res.figure(f"{tag}_used_memory_one_holder", one, "bytes")
    res.figure(f"{tag}_bytes_per_block", (one - base) / n, "bytes")
    res.figure(f"{tag}_raw_bytes_per_block", raw_mem / n, "bytes")
    res.figure(f"{tag}_rss_bytes_per_block", (servers.rss() - base_rss) / n, "bytes")
    res.figure(f"{tag}_memory_usage_sampled_one_holder", servers.sample_usage([da.key(b.root, k) for k in sample]),
               "bytes")

    # 3. a second holder for every 10th block
    replicas = list(range(0, n, REPLICA_EVERY))
    rep_batches = [_puts(b, idx) for idx in _chunks_of(replicas, args.batch)]
    _log(f"{tag}: a second node publishes {len(replicas)} of them")
    cpu, t0 = servers.cpu(), time.perf_counter()
    for p in rep_batches:
        await db.publish(p, [])
    rep = Timed(time.perf_counter() - t0, servers.cpu() - cpu, len(replicas))
    two = await _settle(servers)
    res.figure(f"{tag}_bytes_per_replica_field", (two - one) / len(replicas), "bytes")
    res.figure(f"{tag}_replica_publish_records_per_s", rep.rate, "records/s")
    res.figure(f"{tag}_memory_usage_sampled_two_holders",
               servers.sample_usage([da.key(b.root, b.keys[i]) for i in replicas[:1000]]), "bytes")

    # 4. updates (HSET of a field already there) by pipeline size, raw and Directory in turn on dep
    upd = min(n, args.update_blocks)
    for size in (int(s) for s in args.batch_sizes.split(",")):
        batches = _chunks(upd, size)
        ups = [_puts(b, idx) for idx in batches]
        raws = [raw_commands(da, b, idx) for idx in batches]
        best: dict[str, Timed] = {}
        for _ in range(args.repeat):
            t = await timed_interleaved({
                "dir": (_publish_step(da, ups), servers),
                "raw": (_hset_step(client_a, field_a, raws), servers),
            }, len(batches), upd)
            for name, tm in t.items():
                if name not in best or tm.rate > best[name].rate:
                    best[name] = tm
        # (both steps run on dep here, so each one's server CPU is of both: halved, it is their mean)
        res.figure(f"{tag}_update_b{size}_records_per_s", best["dir"].rate, "records/s")
        res.figure(f"{tag}_update_b{size}_raw_records_per_s", best["raw"].rate, "records/s")
        res.figure(f"{tag}_update_b{size}_server_us_per_hset", best["dir"].server_us_per_op / 2, "us")
        res.figure(f"{tag}_update_b{size}_client_cpu_us_per_record", best["dir"].client_us_per_op, "us")
        res.ratio(f"{tag}_update_b{size}_vs_raw_redis", best["dir"].rate / best["raw"].rate)
        _log(f"{tag}: updates in pipelines of {size}: {best['dir'].rate:,.0f}/s (raw {best['raw'].rate:,.0f}/s)")

    # 5. find: present keys, absent keys, raw HGETALL of the present ones, in turn
    k, calls = args.find_keys, args.find_calls
    starts = np.random.default_rng(args.seed + 1).integers(0, n - k, size=calls + 50).tolist()
    got = await da.find(b.root, b.keys[starts[0] : starts[0] + k])
    assert all(got) and len(got) == k, "find: a published key came back empty"
    assert sum(len(h) == 2 for h in got) > 0 or k < REPLICA_EVERY * 2
    miss_keys = b.missing
    assert not any(await da.find(b.root, miss_keys[:k]))
    raw_keys = [[da.key(b.root, key) for key in b.keys[s : s + k]] for s in starts]
    n_miss = len(miss_keys) - k
    cpu = servers.cpu()
    client: dict[str, float] = {}
    lat = await interleaved({
        "find": lambda i: da.find(b.root, b.keys[starts[i] : starts[i] + k]),
        "find_miss": lambda i: da.find(b.root, miss_keys[(i * k) % n_miss :][:k]),
        "raw_hgetall": lambda i: raw_hgetall(client_a, raw_keys[i]),
    }, calls, warmup=50, cpu=client)
    find_cpu_us = (servers.cpu() - cpu) / (3 * (calls + 50) * k) * 1e6
    big = args.big_find_keys
    big_lat = await interleaved({f"find_{big}": lambda i: da.find(b.root, b.keys[starts[i] % (n - big) :][:big])},
                                args.big_find_calls, warmup=3)
    lat.update(big_lat)
    for name, samples in lat.items():
        keys = big if name == f"find_{big}" else k
        res.figure(f"{tag}_{name}_p50", percentile(samples, 50) * 1e3, "ms")
        res.figure(f"{tag}_{name}_p99", percentile(samples, 99) * 1e3, "ms")
        res.figure(f"{tag}_{name}_keys_per_s", keys * len(samples) / sum(samples), "keys/s")
    res.figure(f"{tag}_find_server_us_per_hgetall", find_cpu_us, "us")
    res.figure(f"{tag}_find_client_cpu_us_per_key", client["find"] / (calls * k) * 1e6, "us")
    res.figure(f"{tag}_raw_hgetall_client_cpu_us_per_key", client["raw_hgetall"] / (calls * k) * 1e6, "us")
    res.ratio(f"{tag}_find_p50_vs_raw_redis", percentile(lat["raw_hgetall"], 50) / percentile(lat["find"], 50))
    _log(f"{tag}: find of {k} keys p50 {percentile(lat['find'], 50) * 1e3:.3f} ms")

    # 6. unpublish: the replica fields (the hash keeps a field), then every record (the key goes),
    # the latter in turn with raw HDEL of the twin's keys
    _log(f"{tag}: HDEL of {len(replicas)} replica fields, then of all {n} records (raw HDEL in turn)")
    removes = [[(b.root, b.keys[i]) for i in idx] for idx in _chunks_of(replicas, args.batch)]
    cpu, t0 = servers.cpu(), time.perf_counter()
    for r in removes:
        await db.publish([], r)
    hdel_b = Timed(time.perf_counter() - t0, servers.cpu() - cpu, len(replicas))
    removes = [[(b.root, b.keys[i]) for i in idx] for idx in fill]
    t = await timed_interleaved({
        "dir": (lambda i: da.publish([], removes[i]), servers),
        "raw": (lambda i: raw_hdel(client_raw, field_a, raw_fill[i]), twin.servers),
    }, len(fill), n)
    end = await _settle(servers)
    assert servers.keys() == 0 and twin.servers.keys() == 0, (servers.keys(), twin.servers.keys())
    res.figure(f"{tag}_hdel_field_records_per_s", hdel_b.rate, "records/s")
    res.figure(f"{tag}_hdel_records_per_s", t["dir"].rate, "records/s")
    res.figure(f"{tag}_raw_hdel_records_per_s", t["raw"].rate, "records/s")
    res.ratio(f"{tag}_hdel_vs_raw_redis", t["dir"].rate / t["raw"].rate)
    res.figure(f"{tag}_hdel_server_us_per_op", t["dir"].server_us_per_op, "us")
    res.figure(f"{tag}_hdel_client_cpu_us_per_record", t["dir"].client_us_per_op, "us")
    res.figure(f"{tag}_used_memory_left_after_unpublish", end - base, "bytes")

    # the cluster's ghost (the module's 6.)
    if args.ghost_blocks > 0:
        await measure_ghosts(tag, dep, twin, client_a, client_raw, args, res)
    for c in (client_a, client_b, client_raw):
        await c.aclose()


async def measure_ghosts(tag: str, dep: Deployment, twin: Deployment, client: Redis | RedisCluster,
                         client_raw: Redis | RedisCluster, args: argparse.Namespace, res: Result) -> None:
    """The ghost phase (the module's 6.) on ``dep`` and, raw, ``twin``, both emptied first and
    after: ``--ghost-blocks`` new blocks (the ghosts of ``--ghost-share`` of them left
    beforehand), and as many others for the plain publish, in pipelines of ``--batch``."""
    g, servers = args.ghost_blocks, dep.servers
    b = Blocks.make(2 * g, 0, args.seed + 2)
    d = Directory(client, PREFIX, NODE_A, GHOST_TTL_MS)
    field = NODE_A.encode()
    batches = _chunks(g, args.batch)
    others = [range(idx.start + g, idx.stop + g) for idx in batches]  # the plain side's blocks
    ghost_keys = [[d.ghost_key(b.root, b.keys[i]) for i in idx] for idx in batches]
    share = args.ghost_share
    with_ghost = [d.ghost_key(b.root, b.keys[i]) for i in range(g) if int((i + 1) * share) > int(i * share)]
    servers.flush()
    twin.servers.flush()
    base = await _settle(servers)
    _log(f"{tag}: ghosts of {len(with_ghost)} blocks, the same on both sides")
    for keys in _chunks_of(with_ghost, args.batch):  # (the same commands on both sides)
        await raw_publish(client, field, left=keys)
        await raw_publish(client_raw, field, left=keys)
    assert servers.keys() == twin.servers.keys() == len(with_ghost), (servers.keys(), len(with_ghost))
    if with_ghost:
        res.figure(f"{tag}_bytes_per_ghost_key", (await _settle(servers) - base) / len(with_ghost), "bytes")
        res.figure(f"{tag}_memory_usage_sampled_ghost_key", servers.sample_usage(with_ghost[:1000]), "bytes")

    _log(f"{tag}: {g} new blocks, {len(with_ghost)} with a ghost: Directory.publish, raw, plain publish in turn")
    puts, others_puts = [_puts(b, idx) for idx in batches], [_puts(b, idx) for idx in others]
    fresh = [[True] * len(idx) for idx in batches]
    raw = [raw_commands(d, b, idx) for idx in batches]
    t = await timed_interleaved({
        "ghost": (lambda i: d.publish(puts[i], [], fresh=fresh[i]), servers),
        "raw": (lambda i: raw_publish(client_raw, field, raw[i], taken=ghost_keys[i]), twin.servers),
        "plain": (lambda i: d.publish(others_puts[i], []), servers),
    }, len(batches), g, per_call=True)
    assert servers.keys() == 2 * g and twin.servers.keys() == g, "a ghost was left unread"
    _ghost_figures(res, f"{tag}_ghost_publish", t)

    _log(f"{tag}: their removes with counts: Directory.publish, raw, plain removes in turn")
    removes = [[(b.root, b.keys[i]) for i in idx] for idx in batches]
    others_removes = [[(b.root, b.keys[i]) for i in idx] for idx in others]
    uses = [[GHOST_USES] * len(idx) for idx in batches]
    t = await timed_interleaved({
        "ghost": (lambda i: d.publish([], removes[i], uses=uses[i], ttl_ms=GHOST_TTL_MS), servers),
        "raw": (lambda i: raw_publish(client_raw, field, removes=raw[i], left=ghost_keys[i]), twin.servers),
        "plain": (lambda i: d.publish([], others_removes[i]), servers),
    }, len(batches), g, per_call=True)
    assert servers.keys() == twin.servers.keys() == g, "a record left, or a ghost not written"
    _ghost_figures(res, f"{tag}_ghost_remove", t)
    servers.flush()
    twin.servers.flush()


def _ghost_figures(res: Result, name: str, t: dict[str, Timed]) -> None:
    """The figures of one ghost step (publish or remove): rates, server and client CPU per
    record, each side's; the ratios to raw and to plain."""
    for side, suffix in (("ghost", ""), ("raw", "_raw"), ("plain", "_plain")):
        res.figure(f"{name}{suffix}_records_per_s", t[side].rate, "records/s")
        res.figure(f"{name}{suffix}_server_us_per_record", t[side].server_us_per_op, "us")
        res.figure(f"{name}{suffix}_client_cpu_us_per_record", t[side].client_us_per_op, "us")
    res.ratio(f"{name}_vs_raw_redis", t["ghost"].rate / t["raw"].rate)
    res.ratio(f"{name}_vs_plain", t["ghost"].rate / t["plain"].rate)
    _log(f"{name}: {t['ghost'].rate:,.0f}/s (raw {t['raw'].rate:,.0f}/s, plain {t['plain'].rate:,.0f}/s)")


def redis_benchmark(port: int, servers: Servers, n: int, res: Result) -> None:
    """redis-server's own ceiling on this machine, with the C ``redis-benchmark`` as the client (it
    shares the 2 cores): HSET then HGETALL of directory-shaped keys (58 B, field ``node-000``, a
    25-byte value) over ``n`` random keys, 4 connections with pipelines of 64; then HGETALL one
    command per round trip from 16 connections, what each shard of a large Redis Cluster sees
    when a lookup's keys spread over more shards than it has keys."""
    key = f"{PREFIX}:d:" + "x" * (ROOT_BYTES + 32 - 12) + "__rand_int__"  # 12 digits: 58 B as the directory's
    runs = (
        ("hset", 4, 64, n, ["HSET", key, NODE_A, "v" * 25]),
        ("hgetall", 4, 64, n, ["HGETALL", key]),
        ("hgetall_unpipelined", 16, 1, max(1, n // 5), ["HGETALL", key]),
    )
    for name, clients, pipeline, count, cmd in runs:
        cpu = servers.cpu()
        out = subprocess.run(
            [REDIS_BENCHMARK, "-h", "127.0.0.1", "-p", str(port), "-n", str(count), "-r", str(n),
             "-c", str(clients), "-P", str(pipeline), "--csv", *cmd],
            capture_output=True, text=True, timeout=300, check=True,
        )
        used = servers.cpu() - cpu
        row = next(csv.reader(out.stdout.strip().splitlines()[-1:]))
        res.figure(f"redis_benchmark_{name}_ops_per_s", float(row[1]), "ops/s")
        res.figure(f"redis_benchmark_{name}_server_us_per_op", used / count * 1e6, "us")
        _log(f"redis-benchmark {name}: {float(row[1]):,.0f} ops/s, server {used / count * 1e6:.2f} us/op")
    servers.flush()


T = TypeVar("T")


def _chunks_of(items: Sequence[T], size: int) -> list[Sequence[T]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


async def _single(b: Blocks, n: int, args: argparse.Namespace, res: Result) -> None:
    with redis_server() as server, redis_server() as twin:
        servers, twins = Servers([server.port]), Servers([twin.port])
        res.notes["redis_version"] = servers.admins[0].info("server")["redis_version"]
        res.notes["hash_max_listpack_entries"] = servers.admins[0].config_get("hash-max-listpack-entries")
        try:
            await measure(
                "redis",
                Deployment(servers, lambda: Redis.from_url(server.url, decode_responses=False)),
                Deployment(twins, lambda: Redis.from_url(twin.url, decode_responses=False)),
                b, n, args, res,
            )
            if shutil.which(REDIS_BENCHMARK) and not args.no_redis_benchmark:
                redis_benchmark(server.port, servers, n, res)
        finally:
            servers.close()
            twins.close()


async def _cluster(b: Blocks, n: int, args: argparse.Namespace, res: Result) -> None:
    with redis_cluster(3) as cluster, redis_cluster(3) as twin:
        servers, twins = Servers(cluster.ports), Servers(twin.ports)
        try:
            await measure(
                "cluster3",
                Deployment(servers, lambda: RedisCluster.from_url(cluster.url, decode_responses=False)),
                Deployment(twins, lambda: RedisCluster.from_url(twin.url, decode_responses=False)),
                b, n, args, res,
            )
        finally:
            servers.close()
            twins.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    if not 0 <= args.ghost_share <= 1:
        raise SystemExit(f"--ghost-share {args.ghost_share}: a share, 0 to 1")
    res = Result("directory_scale")
    started = time.perf_counter()
    res.notes["machine"] = _machine()
    n = args.blocks
    n_cluster = min(n, args.cluster_blocks)
    b = Blocks.make(n, max(args.find_keys * 64, args.big_find_keys), args.seed)
    key_len = len(PREFIX) + 3 + ROOT_BYTES + 32
    res.notes["layout"] = (
        f"key {key_len} B ('{PREFIX}:d:' + 16 B root + 32 B block key), field = node id "
        f"('{NODE_A}', {len(NODE_A)} B), value = sealed Record, {1 + len(b.records[0].pack()) + MAC_BYTES} B"
    )
    res.notes["workload"] = (
        f"{n} blocks from one node, fill pipelines of {args.batch}; a second node holds every {REPLICA_EVERY}th; "
        f"updates {args.update_blocks} per pipeline size {args.batch_sizes}, best of {args.repeat}; finds of "
        f"{args.find_keys} keys x {args.find_calls} (present, then absent), {args.big_find_keys} keys x "
        f"{args.big_find_calls}; ghost phase {args.ghost_blocks} blocks, {args.ghost_share:g} with a ghost "
        f"(count {GHOST_USES}, PX {GHOST_TTL_MS})"
    )
    asyncio.run(_single(b, n, args, res))
    if not args.no_cluster:
        asyncio.run(_cluster(b, n_cluster, args, res))
        res.notes["cluster_blocks"] = n_cluster
    res.notes["load_average_at_end"] = os.getloadavg()
    res.figure("runtime", time.perf_counter() - started, "s")
    return res.as_dict()


def _machine() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {"cpus": os.cpu_count(), "cpu_model": model, "load_average_at_start": os.getloadavg(),
            "python": sys.version.split()[0], "redis_py": redis.__version__}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    out = run(args)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    for name, f in out["figures"].items():
        print(f"{name:48} {f['value']:>16,.3f} {f['unit']}")
    for name, v in out["ratios"].items():
        print(f"{name:48} {v:>16.4f}")


if __name__ == "__main__":
    main()
