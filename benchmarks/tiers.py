"""Tier throughput against the raw client on the same server, in the same run.

Two measurements per tier (ssd, redis, redis_cluster, s3), each against the raw client on the
same server, interleaved with it (ours, raw, raw, ours, ...; with ``--peers`` LMCache's backend
joins the rotation) so all see the same noise and the same phase of the machine; every timed
round starts after an untimed ``os.sync()``:

* ``tier``     put then get of N distinct blocks (2 MiB by default) through the tier class
               (``put_many`` / ``get_many`` into preallocated page-aligned buffers).
* ``service``  put and get through a running sidecar (``kvstore serve`` subprocess, configured
               with env overrides: chain = [that tier], the tier enabled, a DRAM slab of exactly N
               slots). The worker is this process (KVStoreClient, shared-memory slots, calls over
               the sidecar's Unix socket).

               ssd (demotion; SSD is never written through): DRAM is first filled with N blocks F;
               "put" = ``put_blocks`` (Allocate + copy + Commit) of ``--ssd-stream`` R batches of N new blocks
               A1..AR one after the other, each evicting the batch before it (F, A1, ...) to the
               SSD tier, timed until ``/stats`` (the Stats RPC) shows ``tiers.ssd.bytes_in`` grew
               by R x N blocks (polled every 0.5 ms): the sustained rate at which the service
               absorbs blocks once DRAM is full, against raw writes of the same R x N blocks.
               (R = 1 is a single burst: mostly the latency of its first eviction.) A1..AR are
               then deleted (untimed) so F lives only on SSD.
               redis, redis_cluster, s3 (write-through): "put" = ``put_blocks`` of N blocks A
               into an empty DRAM with ``wait_write_through`` (the reply comes once the tier
               holds them).
               Before each of these puts, as before each raw put, the raw values are deleted
               (untimed), so both follow the server freeing N blocks.
               Then (untimed) N other blocks evict A from DRAM and are deleted again, so A lives
               only in the remote tier.
               "get" = one Acquire of the N blocks that are only in the tier (the sidecar promotes
               them: read into DRAM slots, checksum verified) + a copy of every slot into this
               process's own buffers + Release.

Raw baselines (the same values, the same server, the same concurrency as the tier):

* ssd    raw file I/O with the same durability (O_DIRECT + one directory fsync where the tier
         uses O_DIRECT, else buffered writes + fdatasync of every file + directory fsync), the
         files written and read on the tier's ``io_threads`` threads; reads are buffered
         ``preadv`` into preallocated buffers. ``ssd`` (the file layout, ``ssd.layout = "files"``,
         deleted files recycled) against raw writes over the last put's files, ``ssd_fresh``
         (put only; the file layout with recycling off) against raw writes of new files,
         ``ssd_segments`` (the default layout: the slots the last put freed overwritten) against
         the same raw writes over the last put's files. The service (the sidecar's default layout,
         or ``KVSTORE_SSD__LAYOUT`` in the environment) against a raw stream over its files.
* redis  raw redis-py pipelined SET/GET of the same value size (single node, and cluster), as
         many pipelines at once, each on its own connection, as the tier sends (``pipelines``,
         cut by node), the values copied into preallocated buffers
* s3     raw aioboto3 put_object/get_object with the same concurrency and client config, the
         bodies copied into preallocated buffers

Single-stream figures (one thread, one pipeline per node: ``tier.<tier>.<op>.raw_single_stream``)
are measured in the same rounds beside them, for reference: never a ratio.

Every get, ours and raw, ends with the bytes in buffers the caller owns: the engine's KV memory
in real use (a raw client's ``bytes`` still has to be copied there, as a lease's slots do).

Figures are MiB/s (best of ``--repeat``); ratios are raw time / our time (higher is better,
1.0 = parity): ``tier_{put,get}_<tier>``, ``tier_put_ssd_fresh`` and ``service_{put,get}_<tier>``. For Redis also the
server memory per block byte each side's keys take (``tier.<tier>.memory.*``, ``MEMORY USAGE``
summed) and ``memory_<tier>`` = raw's / ours. Servers come from
:mod:`kvstore.harness.servers` unless their addresses are given (``--redis-url``,
``--redis-cluster-url``, ``--s3-endpoint``). ``--peers`` adds LMCache 0.5.6's storage backends
on the same servers (see :mod:`benchmarks.peers`). Run: ``python -m benchmarks.tiers`` or
``kvstore bench tiers --json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from benchmarks.common import pages
from kvstore.checksum import checksum
from kvstore.tiers.base import BlockMeta, BlockRef
from kvstore.util.threads import split

MiB = 1 << 20
MIN_DRAM = 64 * 1024  # dram.capacity_bytes lower bound
POLL_S = 0.0005
SERVICE_TIMEOUT_S = 120.0
SINGLE = "raw_single_stream"  # the raw client on one thread / one pipeline: a figure beside the ratio, never one


def _blocks(n: int, size: int) -> list[tuple[BlockMeta, memoryview]]:
    """N distinct blocks of random bytes, each starting on a page of one mapping (raw O_DIRECT
    writes them as they are). Distinct, as an engine's KV blocks are: N sends of one 2 MiB
    buffer read it from the CPU cache, N blocks come from memory (measured here: 22 ms against
    33 ms for a put of 32 x 2 MiB to Redis)."""
    views, payload = pages(n, size)
    payload[:] = np.random.default_rng().integers(0, 256, len(payload), dtype=np.uint8).tobytes()
    ns = b"B" * 32
    return [
        (BlockMeta(BlockRef(ns, i.to_bytes(32, "big")), b"", size, checksum(v), "bench"), v)
        for i, v in enumerate(views)
    ]


async def _timed(fn: Callable[[], Awaitable[Any]]) -> float:
    t0 = time.perf_counter()
    await fn()
    return time.perf_counter() - t0


async def _nothing() -> None:
    return None


async def _settled() -> None:
    """Write back every dirty page first (untimed): the kernel's background writeback of what an
    earlier round left in the page cache (the unsynced modes write GiBs over a run) must not land
    in the next round's time, whichever side that is."""
    await asyncio.to_thread(os.sync)


def _drop_page_cache(dirs: Sequence[Path]) -> None:
    """Every file under ``dirs`` out of the page cache (written back first: a dirty page stays),
    so that the next read of it goes to the device, buffered or O_DIRECT alike."""
    os.sync()
    for d in dirs:
        for parent, _, names in os.walk(d):
            for name in names:
                try:
                    fd = os.open(os.path.join(parent, name), os.O_RDONLY)
                except FileNotFoundError:
                    continue
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def _bar(total: int, desc: str) -> tqdm:
    return tqdm(total=total, desc=desc, leave=False, disable=None)


@dataclass
class Raw:
    """The raw client's put and get of the same N values on the same server; ``reset`` runs
    untimed before every put (so that writes go to fresh names)."""

    put: Callable[[], Awaitable[Any]]
    get: Callable[[], Awaitable[Any]]
    reset: Callable[[], Awaitable[Any]] = _nothing
    cleanup: Callable[[], Awaitable[Any]] = _nothing
    keys: list[str] = field(default_factory=list)  # (Redis) the keys a put stores
    streams: int = 1  # threads or pipelines (connections) it runs at once


@dataclass
class Servers:
    """Addresses of the servers under test (started here or given on the command line)."""

    redis: str | None = None
    redis_cluster: str | None = None
    s3: str | None = None
    s3_credentials: dict[str, str] | None = None  # None: botocore's usual chain


class _Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.n, self.size, self.repeat = args.blocks, int(args.block_mib * MiB), args.repeat
        self.ssd_stream = args.ssd_stream
        self.items = _blocks(self.n, self.size)
        self.peers: Any = None  # benchmarks.peers.lmcache_backends.Peers with --peers
        if args.peers:
            from benchmarks.peers.lmcache_backends import Peers

            self.peers = Peers(args, [d for _, d in self.items])
        self.s3_concurrency, self.s3_bucket = args.s3_concurrency, args.s3_bucket
        self.run_id = uuid.uuid4().hex[:8]  # key prefix: safe on shared, given servers
        self.bufs = pages(self.n, self.size)[0]  # gets land in page-aligned buffers, as in slab slots
        self.figures: dict[str, dict[str, Any]] = {}
        self.ratios: dict[str, float] = {}
        self.notes: dict[str, Any] = {}

    @property
    def mib(self) -> float:
        return self.n * self.size / MiB

    def record(
        self, kind: str, tier_name: str, op: str, t_ours: float, t_raw: float, batches: int = 1,
        single: float | None = None,
    ) -> None:
        """The ratio against the raw client at the tier's concurrency; ``single``: the time of the
        raw client on one stream (a figure only)."""
        mib = batches * self.mib
        self.figures[f"{kind}.{tier_name}.{op}.ours"] = {"value": round(mib / t_ours, 1), "unit": "MiB/s"}
        self.figures[f"{kind}.{tier_name}.{op}.raw"] = {"value": round(mib / t_raw, 1), "unit": "MiB/s"}
        if single is not None:
            self.figures[f"{kind}.{tier_name}.{op}.{SINGLE}"] = {"value": round(mib / single, 1), "unit": "MiB/s"}
        self.ratios[f"{kind}_{op}_{tier_name}"] = round(t_raw / t_ours, 3)

    async def interleaved(
        self, desc: str, runs: dict[str, Callable[[], Awaitable[Any]]], reset: Callable = _nothing
    ) -> dict[str, float]:
        """Best time of each run, their order rotating every round (ours, raw, ... then raw, ...,
        ours) so all see the same noise of this shared 2-core box and its phases; ``reset`` and a
        :func:`_settled` run untimed before each."""
        best = dict.fromkeys(runs, float("inf"))
        names = list(runs)
        with _bar(len(names) * self.repeat, desc) as bar:
            for i in range(self.repeat):
                k = i % len(names)
                for name in names[k:] + names[:k]:
                    await reset()
                    await _settled()
                    best[name] = min(best[name], await _timed(runs[name]))
                    bar.update()
        return best

    def peer_backends(self, tier_name: str, url: str | None, service: bool = False) -> Any:
        """The LMCache backends that join this tier's rounds (none without ``--peers``)."""
        return self.peers.backends(tier_name, url, service) if self.peers else contextlib.nullcontext([])

    # ---- tier class vs raw --------------------------------------------------------------------

    async def tier_vs_raw(
        self, tier_name: str, tier: Any, raw: Raw, url: str | None = None, *, single: Raw | None = None,
        get: bool = True, cold: Sequence[Path] = (),
    ) -> None:
        """``url``: the tier's server, for the peers (``--peers``) that join the same rounds;
        ``single``: the raw client on one stream (one thread, one pipeline), measured in the same
        rounds for its figures only (``tier.<tier>.<op>.raw_single_stream``), never a ratio;
        ``get``: also the get; ``cold``: directories whose files leave the page cache before every
        get (each side's files, the peers' too), so that every side reads from the device."""
        refs = [m.ref for m, _ in self.items]
        raws = {"raw": raw, **({SINGLE: single} if single else {})}
        self.notes.setdefault("raw_streams", {})[tier_name] = {k: r.streams for k, r in raws.items()}

        async def ours_get() -> None:
            got = await tier.get_many(refs, self.bufs)
            assert all(g is not None for g in got)

        try:
            with self.peer_backends(tier_name, url) as peers:

                async def fresh() -> None:  # new blocks under the old names: deleted first, as by an eviction
                    await tier.delete_many(refs)
                    for r in raws.values():
                        await r.reset()
                    for p in peers:
                        await asyncio.to_thread(p.drop)

                async def every_side_holds_every_block() -> None:
                    await fresh()
                    await tier.put_many(self.items)
                    for r in raws.values():
                        await r.put()

                def runs(op: str, ours: Callable[[], Awaitable[Any]]) -> dict[str, Callable[[], Awaitable[Any]]]:
                    # (the peers keep their own figures)
                    peer_runs = {p.label: lambda p=p: asyncio.to_thread(getattr(p, op)) for p in peers}
                    return {"ours": ours, **{k: getattr(r, op) for k, r in raws.items()}, **peer_runs}

                # (untimed) every side's files exist once: an overwriting side overwrites from the first round on
                await every_side_holds_every_block()
                put = runs("put", lambda: tier.put_many(self.items))
                best = await self.interleaved(f"tier {tier_name} put", put, fresh)
                self.record("tier", tier_name, "put", best["ours"], best["raw"], single=best.get(SINGLE))
                if get:
                    await every_side_holds_every_block()
                    for p in peers:
                        await asyncio.to_thread(p.put, False)
                    if raw.keys:
                        await self.redis_memory(tier_name, tier, raw, peers)
                    dirs = [*cold, *(p.files_dir for p in peers if p.files_dir)]
                    drop = (lambda: asyncio.to_thread(_drop_page_cache, dirs)) if cold else _nothing
                    best = await self.interleaved(f"tier {tier_name} get", runs("get", ours_get), drop)
                    self.record("tier", tier_name, "get", best["ours"], best["raw"], single=best.get(SINGLE))
                await tier.delete_many(refs)
        finally:
            await tier.close()

    async def redis_memory(self, tier_name: str, tier: Any, raw: Raw, peers: list[Any]) -> None:
        """Redis memory per byte of the blocks each side stores (the sum of ``MEMORY USAGE`` over
        its keys, every side holding all N blocks): ``tier.<tier>.memory.{ours,raw,<peer>}``, and
        ``memory_<tier>`` = raw's / ours (above 1: kvstore stores the same blocks in less)."""
        keys = {
            "ours": [k for m, _ in self.items for k in (tier.header_key(m.ref), *tier.chunk_keys(m.ref, m.size))],
            "raw": raw.keys,
        }
        keys.update({p.label: p.stored_keys() for p in peers if p.keys is not None})
        per_byte = {}
        for name, names in keys.items():
            used = sum([await tier.client.memory_usage(k) or 0 for k in names])
            per_byte[name] = used / (self.n * self.size)
            self.figures[f"tier.{tier_name}.memory.{name}"] = {
                "value": round(per_byte[name], 4),
                "unit": "bytes per block byte",
            }
        self.ratios[f"memory_{tier_name}"] = round(per_byte["raw"] / per_byte["ours"], 3)
        for p in peers:
            if p.label in per_byte:
                self.ratios[f"vs_{p.label.split('.')[0]}_memory_{tier_name}_tier"] = round(
                    per_byte[p.label] / per_byte["ours"], 3
                )

    # ---- through the service vs raw -------------------------------------------------------------

    async def service_vs_raw(
        self, tier_name: str, env: dict[str, str], raw: Raw, raw_put: Raw | None = None, url: str | None = None
    ) -> None:
        """``raw_put``: the raw client whose put is the baseline for the service's put (the ssd
        stream writes R batches), default ``raw``; ``url``: the tier's server, for the peers
        that join the same rounds."""
        from benchmarks.common import sidecar_process
        from kvstore.client import KVStoreClient
        from kvstore.keys import Namespace, prefix_keys

        put_raw = raw_put or raw
        label = "ssd" if tier_name == "ssd" else ("s3" if tier_name == "s3" else "redis")
        page = max(4096, 1 << (self.size - 1).bit_length())  # one slot per page: exactly N slots
        if self.n * page < MIN_DRAM:
            raise ValueError(
                f"service benchmark: {self.n} blocks of {self.size} bytes is under the 64 KiB DRAM minimum"
            )
        env = {
            **env,
            "KVSTORE_TIERING__CHAIN": json.dumps([label]),
            "KVSTORE_DRAM__PAGE_BYTES": str(page),
            "KVSTORE_DRAM__MIN_SLOT_BYTES": str(min(page, 4096)),
        }
        demote = tier_name == "ssd"
        if not demote:
            env["KVSTORE_TIERING__WRITE_THROUGH"] = json.dumps([label])
        ns = Namespace(model=f"bench-{self.run_id}", kv_layout="raw", dtype="uint8", block_size=1)
        blocks = [np.frombuffer(d, dtype=np.uint8) for _, d in self.items]
        out = [np.frombuffer(v, dtype=np.uint8) for v in pages(self.n, self.size)[0]]  # the worker's own buffers
        counter = iter(range(1, 1 << 30))
        nbytes = self.n * self.size

        with (
            sidecar_process(self.n * page, env=env) as sc,
            self.peer_backends(tier_name, url, service=True) as peers,
        ):
            async with KVStoreClient.from_url(sc.grpc) as c:

                def fresh_keys() -> list[bytes]:
                    base = next(counter) * 10_000_000
                    return prefix_keys(ns, list(range(base, base + self.n)))

                async def bytes_in() -> int:
                    return (await c.stats())["tiers"][label]["bytes_in"]

                async def until_bytes_in(target: int) -> None:
                    deadline = time.perf_counter() + SERVICE_TIMEOUT_S
                    while await bytes_in() < target:
                        if time.perf_counter() > deadline:
                            raise TimeoutError(
                                f"{tier_name}: blocks did not reach the tier; sidecar log:\n{sc.logs()[-4000:]}"
                            )
                        await asyncio.sleep(POLL_S)

                async def put(keys: list[bytes], wait_write_through: bool = False) -> None:
                    r = await c.put_blocks(ns, keys, blocks, wait_write_through=wait_write_through)
                    assert r.stored == self.n, f"{tier_name}: {r.stored} of {self.n} blocks stored"
                    assert r.written_through == (self.n if wait_write_through else 0), (
                        f"{tier_name}: write-through failed"
                    )

                async def get(keys: list[bytes]) -> None:
                    async with c.acquire(ns, keys) as lease:
                        assert len(lease.views) == self.n, (
                            f"{tier_name}: {len(lease.views)} of {self.n} blocks readable"
                        )
                        for o, v in zip(out, lease.views):
                            o[:] = v

                async def round_() -> tuple[float, float]:
                    """One put and one get through the service, untimed set-up around them."""
                    if demote:
                        tier_keys = fresh_keys()
                        await put(tier_keys)  # DRAM full of the blocks the timed puts will evict
                        stream = [fresh_keys() for _ in range(self.ssd_stream)]
                        start = await bytes_in()
                        t0 = time.perf_counter()
                        for a in stream:
                            await put(a)
                        await until_bytes_in(start + len(stream) * nbytes)
                        t_put = time.perf_counter() - t0
                        for a in stream:  # frees the slots the promotion will use
                            await c.delete(ns, a)
                    else:
                        tier_keys = fresh_keys()
                        t0 = time.perf_counter()
                        await put(tier_keys, wait_write_through=True)
                        t_put = time.perf_counter() - t0
                        other = fresh_keys()
                        await put(other, wait_write_through=True)  # evicts tier_keys from DRAM (already in the tier)
                        await c.delete(ns, other)
                    lookup = await c.lookup(ns, tier_keys)
                    assert lookup.matched == self.n and all(t == label for t, _ in lookup.blocks), lookup.blocks[:3]
                    t0 = time.perf_counter()
                    await get(tier_keys)
                    t_get = time.perf_counter() - t0
                    assert all(np.array_equal(o, b) for o, b in zip(out, blocks))
                    await c.delete(ns, tier_keys)
                    return t_put, t_get

                await round_()  # warm-up: slab pages, connections, thread pools
                await put_raw.reset()  # and the raw side's (an overwriting raw put then has its files)
                await put_raw.put()
                best = {"put": [float("inf"), float("inf")], "get": [float("inf"), float("inf")]}
                names = ["ours", "raw", *peers]  # (a peer keeps its own figures)
                with _bar(len(names) * self.repeat, f"service {tier_name}") as bar:
                    for i in range(self.repeat):
                        k = i % len(names)
                        for which in names[k:] + names[:k]:
                            await _settled()
                            # the raw values go first, before every timed put: each follows the
                            # server freeing N blocks (Redis reuses that memory; a put into memory
                            # the server never had pays its page faults)
                            await put_raw.reset()
                            if not isinstance(which, str):
                                await asyncio.to_thread(which.put)
                                await asyncio.to_thread(which.get)
                                await asyncio.to_thread(which.drop)
                                bar.update()
                                continue
                            if which == "ours":
                                t_put, t_get = await round_()
                                j = 0
                            else:
                                t_put = await _timed(put_raw.put)
                                if put_raw is not raw:
                                    await put_raw.reset()
                                    await raw.reset()
                                    await raw.put()  # (untimed) the values the raw get reads
                                t_get = await _timed(raw.get)
                                j = 1
                            best["put"][j] = min(best["put"][j], t_put)
                            best["get"][j] = min(best["get"][j], t_get)
                            bar.update()
                for op, (t_ours, t_raw) in best.items():
                    self.record(
                        "service", tier_name, op, t_ours, t_raw, self.ssd_stream if demote and op == "put" else 1
                    )

    # ---- raw clients ----------------------------------------------------------------------------

    def raw_ssd(
        self, raw_dir: Path, direct: bool, threads: int, *, batches: int = 1, sync: bool = True, overwrite: bool = False
    ) -> Raw:
        """Raw file I/O of the N blocks (``batches`` times over, for a put) on ``threads`` threads,
        as the tier spreads a batch over its ``io_threads``: a put writes one file per task, then
        (``sync``, buffered) fdatasyncs each file and (``sync``) fsyncs the directory once, as the
        tier does (else nothing is synced); a get reads one contiguous share of the files per
        thread. ``overwrite``: every put writes over the last put's files in place (the tier
        overwrites the recycled files of deleted blocks so); else ``reset`` unlinks them and
        every put makes new files."""
        raw_dir.mkdir()
        paths = [raw_dir / f"{i}.bin" for i in range(batches * self.n)]
        data = [d for _, d in self.items] * batches
        flags = os.O_CREAT | os.O_WRONLY | (0 if overwrite else os.O_TRUNC) | (os.O_DIRECT if direct else 0)
        pool = ThreadPoolExecutor(threads, thread_name_prefix="raw-ssd")

        def write(i: int) -> int:
            fd = os.open(paths[i], flags, 0o644)
            try:
                done = 0
                while done < len(data[i]):
                    done += os.write(fd, data[i][done:])
            except BaseException:
                os.close(fd)
                raise
            return fd

        def put() -> None:
            fds = list(pool.map(write, range(len(paths))))
            for fd in fds:
                if sync and not direct:
                    os.fdatasync(fd)
                os.close(fd)
            if sync:
                dfd = os.open(raw_dir, os.O_RDONLY | os.O_DIRECTORY)
                os.fsync(dfd)
                os.close(dfd)

        def read(part: tuple[int, int]) -> None:
            for p, buf in zip(paths[part[0] : part[1]], self.bufs[part[0] : part[1]]):
                fd = os.open(p, os.O_RDONLY)
                try:
                    assert os.preadv(fd, [buf], 0) == len(buf)
                finally:
                    os.close(fd)

        def get() -> None:
            list(pool.map(read, split(self.n, threads)))

        async def reset() -> None:
            if not overwrite:
                for p in paths:
                    p.unlink(missing_ok=True)

        async def cleanup() -> None:
            pool.shutdown()

        return Raw(lambda: asyncio.to_thread(put), lambda: asyncio.to_thread(get), reset, cleanup, streams=threads)

    async def raw_redis(self, url: str, cluster: bool, pipelines: int, tag: str = "raw") -> Raw:
        """Pipelined SET / GET of the N values with redis-py, as ``pipelines`` pipelines at once,
        each on its own connection, cut as the tier cuts a batch: by node (a cluster's slot map),
        then ``pipelines`` // nodes contiguous groups per node (at least one)."""
        from redis.asyncio import Redis
        from redis.asyncio.cluster import RedisCluster

        raw = RedisCluster.from_url(url) if cluster else Redis.from_url(url)
        keys = [f"kvstore-bench-{self.run_id}:{tag}:{{{i}}}" for i in range(self.n)]
        by_node: dict[str, list[int]] = {"": list(range(self.n))}
        if isinstance(raw, RedisCluster):
            await raw.initialize()
            by_node = {}
            for i, k in enumerate(keys):
                by_node.setdefault(getattr(raw.get_node_from_key(k), "name", ""), []).append(i)
        per_node = max(1, pipelines // len(by_node))
        groups = [idx[a:b] for idx in by_node.values() for a, b in split(len(idx), per_node)]

        def pipeline() -> Any:
            return raw.pipeline() if cluster else raw.pipeline(transaction=False)

        async def put_group(ix: list[int]) -> None:
            pipe = pipeline()
            for i in ix:
                pipe.set(keys[i], self.items[i][1])
            await pipe.execute()

        async def get_group(ix: list[int]) -> None:
            pipe = pipeline()
            for i in ix:
                pipe.get(keys[i])
            for i, value in zip(ix, await pipe.execute(), strict=True):
                self.bufs[i][:] = value  # into the caller's buffers, as every get here ends

        async def put() -> None:
            await asyncio.gather(*(put_group(ix) for ix in groups))

        async def get() -> None:
            await asyncio.gather(*(get_group(ix) for ix in groups))

        async def reset() -> None:  # fresh names, as the tier's puts get
            pipe = pipeline()
            for k in keys:
                pipe.delete(k)
            await pipe.execute()

        async def cleanup() -> None:
            await reset()
            await raw.aclose()

        return Raw(put, get, reset, cleanup, keys, len(groups))

    async def raw_s3(self, stack: contextlib.AsyncExitStack, client: Callable[[], Any]) -> Raw:
        raw = await stack.enter_async_context(client())
        sem = asyncio.Semaphore(self.s3_concurrency)
        prefix = f"kvstore-bench-{self.run_id}/raw"

        async def put_one(i: int, data: memoryview) -> None:
            async with sem:
                await raw.put_object(Bucket=self.s3_bucket, Key=f"{prefix}/{i}", Body=bytes(data))

        async def get_one(i: int) -> None:
            async with sem:
                resp = await raw.get_object(Bucket=self.s3_bucket, Key=f"{prefix}/{i}")
                async with resp["Body"] as body:
                    self.bufs[i][:] = await body.read()  # into the caller's buffers, as every get here ends

        async def put() -> None:
            await asyncio.gather(*(put_one(i, d) for i, (_, d) in enumerate(self.items)))

        async def get() -> None:
            await asyncio.gather(*(get_one(i) for i in range(self.n)))

        async def cleanup() -> None:
            await raw.delete_objects(
                Bucket=self.s3_bucket, Delete={"Objects": [{"Key": f"{prefix}/{i}"} for i in range(self.n)]}
            )

        return Raw(put, get, _nothing, cleanup, streams=self.s3_concurrency)

    # ---- per tier -------------------------------------------------------------------------------

    async def ssd(self, root: Path, service: bool) -> None:
        """The tier with its defaults (deleted files recycled) against raw writes over existing
        files; the tier without recycling against raw writes of new files (put only); with
        ``--peers``, the unsynced modes on new files, as LMCache's LocalDisk writes them."""
        from kvstore.tiers.file_io import DiskSettings
        from kvstore.tiers.segments.tier import SegmentTier
        from kvstore.tiers.ssd import SsdTier

        capacity = 4 * self.n * self.size + 64 * MiB
        tier = SsdTier(root / "tier", capacity)
        direct, threads = tier.direct_io, tier.io_threads
        self.figures["ssd.direct_io"] = {"value": int(direct), "unit": "bool"}
        self.notes["ssd"] = {
            "threads": f"raw file I/O on the tier's io_threads ({threads}); {SINGLE}: one thread",
            "ssd": "put: both sides overwrite the files of the last put (the tier, ssd.layout = files, its recycled"
                   " files)",
            "ssd_segments": "the default layout (segments): the tier overwrites the slots the last put's blocks freed,"
                            " raw its files as for ssd",
            "ssd_fresh": "put: both sides write new files (the tier with recycling off)",
            "get": "buffered reads on both sides; ssd_direct_nofsync: every side's files dropped from the page cache"
                   " first",
        }
        raw = self.raw_ssd(root / "raw", direct, threads, overwrite=True)
        single = self.raw_ssd(root / "raw-single", direct, 1, overwrite=True)
        fresh = self.raw_ssd(root / "raw-fresh", direct, threads)
        fresh_single = self.raw_ssd(root / "raw-fresh-single", direct, 1)
        raws = [raw, single, fresh, fresh_single]
        try:
            await self.tier_vs_raw("ssd", tier, raw, single=single)
            self.figures["tier.ssd.files_reused"] = {"value": tier._free.reused, "unit": "count"}
            # the default layout (ssd.layout = "segments"): deleted blocks' slots overwritten by the next puts
            await self.tier_vs_raw("ssd_segments", SegmentTier(root / "tier-segments", capacity), raw, single=single)
            no_recycling = SsdTier(root / "tier-fresh", capacity, recycle_bytes=0)
            await self.tier_vs_raw("ssd_fresh", no_recycling, fresh, single=fresh_single, get=False)
            self.figures["tier.ssd_fresh.files_reused"] = {"value": no_recycling._free.reused, "unit": "count"}
            if self.peers:  # LMCache's LocalDisk never fsyncs, and writes new files: the tier so, in its two modes
                for name, want_direct in (("ssd_nofsync", False), ("ssd_direct_nofsync", True)):
                    disk = DiskSettings(direct_io=want_direct, fsync=False)
                    like = SsdTier(root / name, capacity, disk, recycle_bytes=0)
                    like_raw = self.raw_ssd(root / f"raw-{name}", like.direct_io, threads, sync=False)
                    raws.append(like_raw)
                    cold = [like.root, root / f"raw-{name}"] if want_direct else []
                    await self.tier_vs_raw(name, like, like_raw, cold=cold)
            if service:  # the sidecar recycles by default: the raw stream overwrites its files too
                env = {
                    "KVSTORE_SSD__ENABLED": "true",
                    "KVSTORE_SSD__PATH": str(root / "service"),
                    "KVSTORE_SSD__CAPACITY_BYTES": str(capacity),
                }
                stream = self.raw_ssd(root / "raw-stream", direct, threads, batches=self.ssd_stream, overwrite=True)
                raws.append(stream)
                await self.service_vs_raw("ssd", env, raw, stream)
        finally:
            for r in raws:
                await r.cleanup()

    async def redis(self, name: str, url: str, cluster: bool, service: bool) -> None:
        from kvstore.config import RedisConfig
        from kvstore.tiers.redis import RedisTier

        prefix = f"kvstore-bench-{self.run_id}"
        tier = RedisTier.from_config(RedisConfig(url=url, cluster=cluster, key_prefix=prefix + ":tier"))
        self.notes.setdefault("redis", f"raw redis-py on the tier's pipelines ({tier.pipelines}, cut by node as the"
                              f" tier cuts them); {SINGLE}: one pipeline per node")
        raw = await self.raw_redis(url, cluster, tier.pipelines)
        single = await self.raw_redis(url, cluster, 1, tag="raw1")
        try:
            await self.tier_vs_raw(name, tier, raw, url, single=single)
            if service:
                env = {
                    "KVSTORE_REDIS__ENABLED": "true",
                    "KVSTORE_REDIS__URL": url,
                    "KVSTORE_REDIS__CLUSTER": "true" if cluster else "false",
                    "KVSTORE_REDIS__KEY_PREFIX": prefix + ":service",
                }
                await self.service_vs_raw(name, env, raw, url=url)
        finally:
            await raw.cleanup()
            await single.cleanup()

    async def s3(self, url: str, credentials: dict[str, str] | None, service: bool) -> None:
        import aioboto3

        from kvstore.tiers.s3 import S3Tier, client_config

        creds = credentials or {}

        def client() -> Any:
            return aioboto3.Session().client(
                "s3", endpoint_url=url, region_name="us-east-1", config=client_config(self.s3_concurrency), **creds
            )

        prefix = f"kvstore-bench-{self.run_id}"
        tier = S3Tier(client, bucket=self.s3_bucket, prefix=prefix + "/tier", concurrency=self.s3_concurrency)
        await tier.contains(self.items[0][0].ref)  # creates the bucket
        async with contextlib.AsyncExitStack() as stack:
            raw = await self.raw_s3(stack, client)
            try:
                await self.tier_vs_raw("s3", tier, raw)
                if service:
                    env = {
                        "KVSTORE_S3__ENABLED": "true",
                        "KVSTORE_S3__ENDPOINT_URL": url,
                        "KVSTORE_S3__BUCKET": self.s3_bucket,
                        "KVSTORE_S3__PREFIX": prefix + "/service",
                        "KVSTORE_S3__CONCURRENCY": str(self.s3_concurrency),
                    }
                    if credentials:
                        env.update({k.upper(): v for k, v in credentials.items()})
                    await self.service_vs_raw("s3", env, raw)
            finally:
                await raw.cleanup()


@contextlib.contextmanager
def servers(args: argparse.Namespace, wanted: set[str]) -> Any:
    """The servers the run needs: the given addresses, or fresh ones on free loopback ports."""
    from kvstore.harness.servers import (
        MOTO_CREDENTIALS,
        moto_server,
        redis_cluster,
        redis_server,
    )

    with contextlib.ExitStack() as stack:
        out = Servers()
        if "redis" in wanted:
            out.redis = args.redis_url or stack.enter_context(redis_server()).url
        if "redis_cluster" in wanted:
            out.redis_cluster = args.redis_cluster_url or stack.enter_context(redis_cluster(3)).url
        if "s3" in wanted:
            if args.s3_endpoint:
                out.s3 = args.s3_endpoint
            else:
                out.s3 = stack.enter_context(moto_server()).url
                out.s3_credentials = MOTO_CREDENTIALS
        yield out


async def _run(args: argparse.Namespace) -> dict:
    bench = _Bench(args)
    wanted = set(args.tiers.split(","))
    unknown = wanted - {"ssd", "redis", "redis_cluster", "s3"}
    if unknown:
        raise SystemExit(f"--tiers: unknown tier(s) {sorted(unknown)}")
    service = not args.no_service
    with servers(args, wanted) as srv, contextlib.ExitStack() as stack:
        if "ssd" in wanted:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvstore-bench-", dir=args.ssd_dir)))
            await bench.ssd(root, service)
        if srv.redis:
            await bench.redis("redis", srv.redis, False, service)
        if srv.redis_cluster:
            await bench.redis("redis_cluster", srv.redis_cluster, True, service)
        if srv.s3:
            await bench.s3(srv.s3, srv.s3_credentials, service)
        if bench.peers:
            peer = bench.peers.result(bench.figures)
            bench.figures.update(peer["figures"])
            bench.ratios.update(peer["ratios"])
            bench.notes.update(peer["notes"])
    bench.figures["block_bytes"] = {"value": bench.size, "unit": "bytes"}
    bench.figures["blocks"] = {"value": bench.n, "unit": "count"}
    result: dict[str, Any] = {"suite": "tiers", "figures": bench.figures, "ratios": bench.ratios}
    if bench.notes:
        result["notes"] = bench.notes
    return result


def run(args: argparse.Namespace) -> dict:
    return asyncio.run(_run(args))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The suite's options (also used by ``kvstore bench tiers``)."""
    p.add_argument("--blocks", type=int, default=32, help="blocks per put/get batch")
    p.add_argument("--block-mib", type=float, default=2.0, help="block size in MiB")
    p.add_argument("--repeat", type=int, default=5, help="runs per measurement; the best counts")
    p.add_argument("--tiers", default="ssd,redis,redis_cluster,s3", help="comma-separated subset")
    p.add_argument("--s3-concurrency", type=int, default=8)
    p.add_argument("--s3-bucket", default="bench")
    p.add_argument(
        "--ssd-stream", type=int, default=4, help="batches per timed service put to SSD (the eviction stream)"
    )
    p.add_argument("--ssd-dir", default=None, help="directory on the filesystem to test (default: $TMPDIR)")
    p.add_argument("--redis-url", default=None, help="use this Redis (redis://host:port/db) instead of starting one")
    p.add_argument(
        "--redis-cluster-url", default=None, help="any node of an existing Redis Cluster (redis://host:port)"
    )
    p.add_argument(
        "--s3-endpoint",
        default=None,
        help="an existing S3 endpoint (http://host:port); credentials from the environment",
    )
    p.add_argument("--no-service", action="store_true", help="only the tier classes, not through a sidecar")
    p.add_argument(
        "--peers", action="store_true", help="also LMCache 0.5.6's LocalDisk and Redis backends (benchmarks.peers)"
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


def main(argv: list[str] | None = None) -> None:
    from kvstore.util.tuning import tune_malloc

    tune_malloc()
    print(json.dumps(run(parser().parse_args(argv))))


if __name__ == "__main__":
    main()
