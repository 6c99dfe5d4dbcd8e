"""LMCache 0.5.6's storage backends against kvstore, same payloads, same servers, same run.

What runs (CPU only, no engine): LMCache's ``LocalCPUBackend`` as the allocator of memory
objects (as in LMCache itself), and on top of it

* ``LocalDiskBackend`` on a directory of the same filesystem as kvstore's SSD tier, twice: with
  LMCache's defaults (buffered writes, **no fsync**: a put is "done" once the bytes are in the
  page cache) and with ``extra_config.use_odirect = true`` (O_DIRECT writes and reads, still no
  fsync of the file or directory). kvstore's SSD tier writes with O_DIRECT and fsyncs the
  directory once per batch, so its put is durable; LMCache's is not.
* ``RemoteBackend`` with ``remote_url = redis://...`` (``RedisConnector``: one SET of the whole
  value plus one of its metadata per chunk, up to 150 connections) and
  ``redis-cluster://...`` (``RedisClusterConnector``), on the same redis-server / cluster as
  kvstore's Redis tier, ``remote_serde = naive``.

Payload: N chunks (``--blocks``) of ``--block-mib`` MiB each (fp16 KV of shape
``[2, layers, 256 tokens, hidden]`` with the same byte count as kvstore's blocks), chunk i
filled from kvstore's block i: the same N distinct blocks every contender sends.

* put  = ``batched_submit_put_task(keys, memory_objs, on_complete_callback)`` from memory
         objects already filled, timed until the callback has fired for every key (LMCache's
         own notion of "stored"); ``put_copyin`` adds the copy of the payload into the memory
         objects first, which is what kvstore's through-service put measures (Allocate + the
         worker's copy into the DRAM slots + Commit).
* get  = ``batched_get_blocking(keys)``: the chunks land in memory objects of LMCache's CPU
         allocator (``get``); ``get_copyout`` adds a copy of each into the caller's own buffer
         and the release of the memory objects, which is what kvstore's through-service get
         measures (Acquire + copy out of the DRAM slot + Release).

Like for like on the disk: LocalDisk writes every put to new files (and deletes them), so the
kvstore tiers it is compared with write new files too (``ssd_nofsync`` / ``ssd_direct_nofsync``
with recycling off; kvstore's durable default as ``ssd_fresh``). LocalDisk's O_DIRECT get reads
the device every time while kvstore reads buffered: in the ``ssd_direct_nofsync`` rounds every
side's files (LMCache's, kvstore's, the raw client's) are dropped from the page cache
(``posix_fadvise(DONTNEED)``, after a sync) before each get, so all three read the device. The
buffered LocalDisk get and kvstore's are both page-cache reads.

Each backend is measured in the rounds of the kvstore tier it is like for like with (LocalDisk
buffered with ``ssd_nofsync``, LocalDisk O_DIRECT with ``ssd_direct_nofsync``, RemoteBackend with
``redis`` / ``redis_cluster``): :meth:`benchmarks.tiers._Bench.tier_vs_raw` rotates kvstore's tier,
the raw client and LMCache through each round, so all three see the same phase of this VM. (Its
disk and memory have phases: O_DIRECT writes ran at ~550 MiB/s, and at ~1,800 MiB/s for a few
seconds after any process had touched and freed a few GiB, as LMCache's CPU allocator does. When
LMCache ran after kvstore, that alone made its O_DIRECT put look 2-3x faster.)

Figures are MiB/s, best of ``--repeat``. Ratios ``vs_lmcache[_odirect]_<op>_<tier>_<kind>`` are
LMCache time / kvstore time (above 1.0: kvstore ahead), against kvstore's tier class (``tier``;
get compared without the copy-out) and through the service (``service``; put with copy-in, get
with copy-out; LMCache's Redis backends join the service's rounds too; there is no SSD service
comparison, as the service's SSD put is a demotion stream, not a put of N blocks).

Run: ``kvstore bench tiers --peers --json`` (or ``python -m benchmarks.tiers --peers``; the
``benchmarks.tiers`` JSON with the peer figures added). This module imports nothing of
``benchmarks.tiers``: that suite imports it (one way, no circle).
Installing LMCache here: see :mod:`benchmarks.peers`. If it cannot be imported, the figures are
absent and ``notes.lmcache`` says why (the exact error).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from benchmarks.common import pages

MiB = 1 << 20
GiB = 1 << 30
CHUNK_TOKENS = 256
TIMEOUT_S = 30.0


def _import_lmcache() -> Any:
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    import lmcache
    import torch  # noqa: F401  (LMCache's extension modules link against the installed torch)

    return lmcache


def _kv_shape(size: int) -> tuple[int, int, int, int, int]:
    """(layers, 2, tokens, kv heads, head dim) of fp16 whose bytes are ``size``."""
    per_layer_unit = 2 * CHUNK_TOKENS * 2  # K and V, 256 tokens, 2 bytes
    layers = 16 if size % (16 * per_layer_unit) == 0 else 1
    if size % (layers * per_layer_unit):
        raise ValueError(f"block size {size} is not a multiple of {per_layer_unit} bytes (fp16 KV of 256 tokens)")
    return (layers, 2, CHUNK_TOKENS, 1, size // (layers * per_layer_unit))


class _Loop:
    """The asyncio loop LMCache's backends submit their I/O to, on its own thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="lmcache-loop", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class _Peer:
    def __init__(self, args: argparse.Namespace, payloads: Sequence[memoryview]) -> None:
        import torch
        from lmcache.v1.metadata import LMCacheMetadata

        self.n, self.size, self.repeat = args.blocks, int(args.block_mib * MiB), args.repeat
        self.shape = _kv_shape(self.size)
        self.metadata = LMCacheMetadata(
            model_name="bench", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
            kv_dtype=torch.float16, kv_shape=self.shape,
        )
        self.payloads = [np.frombuffer(p, dtype=np.uint8) for p in payloads]  # kvstore's blocks, one per chunk
        self.out = [
            np.frombuffer(v, dtype=np.uint8) for v in pages(self.n, self.size)[0]
        ]  # as kvstore's service get copies into
        self.figures: dict[str, dict[str, Any]] = {}
        self.failures: dict[str, list[str]] = {}
        self._hash = iter(range(1, 1 << 62))
        self.run_id = uuid.uuid4().int & 0xFFFF_FFFF

    def config(self, **kw: Any) -> Any:
        from lmcache.v1.config import LMCacheEngineConfig

        cpu_gib = (4 * self.n * self.size + 256 * MiB) / GiB  # put sources + get results, with room
        return LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK_TOKENS, local_cpu=False, max_local_cpu_size=cpu_gib, **kw
        )

    def keys(self) -> list[Any]:
        import torch
        from lmcache.utils import CacheEngineKey

        return [
            CacheEngineKey("bench", 1, 0, (self.run_id << 32) | next(self._hash), torch.float16) for _ in range(self.n)
        ]

    def sources(self, cpu: Any) -> list[Any]:
        from lmcache.v1.memory_management import MemoryFormat

        objs = []
        for _ in self.payloads:  # (filled by every put, the untimed warm-up first)
            obj = cpu.allocate(self.metadata.get_shapes(), self.metadata.get_dtypes(), MemoryFormat.KV_2LTD)
            assert obj is not None, "LMCache CPU allocator is full"
            objs.append(obj)
        return objs

    def put(self, backend: Any, keys: list[Any], objs: list[Any]) -> tuple[float, float]:
        """(put of the filled memory objects, copy of the payload into them + put)."""
        done = threading.Semaphore(0)
        t0 = time.perf_counter()
        for obj, payload in zip(
            objs, self.payloads
        ):  # the engine's KV copied into LMCache's memory objects, as a worker fills kvstore's slots
            np.frombuffer(obj.byte_array, dtype=np.uint8)[:] = payload
        t1 = time.perf_counter()
        backend.batched_submit_put_task(keys, objs, on_complete_callback=lambda _key: done.release())
        for _ in keys:
            if not done.acquire(timeout=TIMEOUT_S):
                raise LookupError(f"put not complete after {TIMEOUT_S:.0f} s")
        t2 = time.perf_counter()
        return t2 - t1, t2 - t0

    def get(self, backend: Any, keys: list[Any]) -> tuple[float, float]:
        """(get into LMCache's memory objects, get + copy into our buffers + release)."""
        t0 = time.perf_counter()
        objs = backend.batched_get_blocking(keys)
        t1 = time.perf_counter()
        missing = sum(o is None for o in objs)
        if missing:
            for obj in objs:
                if obj is not None:
                    obj.ref_count_down()
            raise LookupError(f"{missing} of {len(objs)} chunks missing after a completed put")
        for o, obj in zip(self.out, objs):
            o[:] = np.frombuffer(obj.byte_array, dtype=np.uint8)
            obj.ref_count_down()
        t2 = time.perf_counter()
        assert all(np.array_equal(o, p) for o, p in zip(self.out, self.payloads))
        return t1 - t0, t2 - t0

    # ---- backends -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def local_disk(self, root: str, odirect: bool, ops: tuple[str, ...]) -> Iterator[Backend]:
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

        with tempfile.TemporaryDirectory(prefix="lmcache-bench-", dir=root) as d:
            # LocalDiskBackend.remove() does not give back ``current_cache_size`` (0.5.6), so the
            # budget covers every round's blocks although each round's files are deleted.
            budget = (3 * self.repeat + 3) * self.n * self.size + 64 * MiB
            cfg = self.config(
                local_disk=d, max_local_disk_size=budget / GiB,
                extra_config={"use_odirect": odirect},
            )
            cpu = LocalCPUBackend(cfg, self.metadata)
            loop = _Loop()  # one per backend: a closed backend can leave its loop's workers stuck
            disk = LocalDiskBackend(cfg, loop.loop, cpu)
            try:
                with self.measured(
                    "lmcache_odirect" if odirect else "lmcache",
                    "ssd",
                    disk,
                    cpu,
                    lambda keys: [disk.remove(k) for k in keys],
                    ops,
                ) as b:
                    b.files_dir = d  # (its files leave the page cache with kvstore's before a cold get)
                    yield b
            finally:
                disk.close()
                cpu.close()
                loop.close()

    @contextlib.contextmanager
    def remote(self, tier: str, url: str, node: str, ops: tuple[str, ...]) -> Iterator[Backend]:
        """``url`` in LMCache's form; ``node`` (redis://host:port) for deleting keys between rounds."""
        import redis
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.remote_backend import RemoteBackend

        cfg = self.config(remote_url=url, remote_serde="naive")
        cpu = LocalCPUBackend(cfg, self.metadata)
        loop = _Loop()
        backend = RemoteBackend(cfg, self.metadata, loop.loop, cpu)
        raw: Any = redis.RedisCluster.from_url(node) if tier == "redis_cluster" else redis.Redis.from_url(node)

        def names(keys: list[Any]) -> list[str]:
            """The Redis keys RedisConnector stores for ``keys``: payload and metadata of each."""
            return [k.to_string() + suffix for k in keys for suffix in ("kv_bytes", "metadata")]

        def drop(keys: list[Any]) -> None:
            for name in names(keys):  # one key at a time: in a cluster the two keys live on different slots
                raw.delete(name)

        try:
            with self.measured("lmcache", tier, backend, cpu, drop, ops, names) as b:
                yield b
        finally:
            # No backend.close(): its executor shutdown waits on worker futures it has just
            # cancelled and hangs (30 s and more here); stopping the loop ends its tasks.
            cpu.close()
            loop.close()
            raw.close()

    @contextlib.contextmanager
    def measured(
        self, name: str, tier: str, backend: Any, cpu: Any, drop: Callable[[list[Any]], None], ops: tuple[str, ...],
        names: Callable[[list[Any]], list[str]] | None = None,
    ) -> Iterator[Backend]:
        """A :class:`Backend` for the caller's rounds (after one untimed round that warms up
        threads and connections); its best figures of ``ops`` are recorded when the caller is done.
        ``names``: the Redis keys LMCache stores for its keys (remote backends)."""
        b = Backend(self, f"{name}.{tier}", backend, self.sources(cpu), drop, names)
        try:
            b.put(record=False)
            b.get(record=False)
            b.drop()
            yield b
        finally:
            b.drop()
            for obj in b.objs:
                obj.ref_count_down()
            mib = self.n * self.size / MiB
            for op in ops:
                if b.best[op] != float("inf"):
                    self.figures[f"{b.label}.{op}"] = {"value": round(mib / b.best[op], 1), "unit": "MiB/s"}
            self.failures.setdefault(b.label, []).extend(b.errors)


class Backend:
    """One LMCache backend, driven round by round by the benchmark of the kvstore tier it is
    compared with (:meth:`benchmarks.tiers._Bench.tier_vs_raw` puts it in the same interleaved
    rotation as the tier and the raw client, so all three see the same phase of this VM). Every
    call blocks: run it off the event loop."""

    def __init__(
        self, peer: _Peer, label: str, backend: Any, objs: list[Any], drop: Callable[[list[Any]], None],
        names: Callable[[list[Any]], list[str]] | None = None,
    ) -> None:
        self.peer, self.label, self.backend, self.objs, self._drop, self._names = (
            peer,
            label,
            backend,
            objs,
            drop,
            names,
        )
        self.best = dict.fromkeys(("put", "put_copyin", "get", "get_copyout"), float("inf"))
        self.errors: list[str] = []
        self.stuck = False  # a put that never completed leaves the backend stuck: stop driving it
        self.keys: list[Any] | None = None
        self.files_dir: str | None = None  # (LocalDisk) where its files are

    def _failed(self, exc: LookupError) -> None:
        self.errors.append(f"round {len(self.errors)}: {exc}")  # LMCache lost chunks or hung (its log says why)
        self.stuck = self.stuck or "not complete" in str(exc)
        self.drop()

    def put(self, record: bool = True) -> None:
        """Put the N chunks under new keys (the last put's keys are dropped first)."""
        if self.stuck:
            return
        self.drop()
        self.keys = self.peer.keys()
        self._measure(("put", "put_copyin"), lambda: self.peer.put(self.backend, self.keys, self.objs), record)

    def get(self, record: bool = True) -> None:
        """Get the last put's chunks (into LMCache's memory objects, then copied out)."""
        if not self.stuck and self.keys is not None:
            self._measure(("get", "get_copyout"), lambda: self.peer.get(self.backend, self.keys), record)

    def _measure(self, ops: tuple[str, str], call: Callable[[], tuple[float, float]], record: bool) -> None:
        """Run ``call`` (which returns the times of ``ops``); keep the best of each, or note a failure."""
        try:
            times = call()
        except LookupError as exc:
            self._failed(exc)
            return
        if record:
            for op, t in zip(ops, times):
                self.best[op] = min(self.best[op], t)

    def stored_keys(self) -> list[str]:
        """The Redis keys of the last put (remote backends only)."""
        assert self._names is not None and self.keys is not None
        return self._names(self.keys)

    def drop(self) -> None:
        if self.keys is not None:
            self._drop(self.keys)
            self.keys = None


# (LMCache backend, its tier, kvstore's tier, the ops compared): kvstore's defaults against each
# backend, and the SSD tier with LMCache's durability (no fsync; buffered, or O_DIRECT) against the
# same mode. LocalDisk writes every put to new files: kvstore's default put is compared as
# ``ssd_fresh`` (its recycling off), the unsynced modes run with recycling off.
PAIRS = [
    ("lmcache", "ssd", "ssd", ("get",)),  # (both buffered; LMCache's O_DIRECT get is compared cold only)
    ("lmcache", "ssd", "ssd_fresh", ("put",)),
    ("lmcache_odirect", "ssd", "ssd_fresh", ("put",)),
    ("lmcache", "ssd", "ssd_nofsync", ("put", "get")),
    ("lmcache_odirect", "ssd", "ssd_direct_nofsync", ("put", "get")),
    ("lmcache", "redis", "redis", ("put", "get")),
    ("lmcache", "redis_cluster", "redis_cluster", ("put", "get")),
]


def _compare(figures: dict[str, dict[str, Any]]) -> dict[str, float]:
    """LMCache time / kvstore time for every pair measured (above 1: kvstore ahead), named
    ``vs_<backend>_<op>_<kvstore tier>_<tier|service>``."""
    ratios: dict[str, float] = {}
    for peer, tier, ours_tier, ops in PAIRS:
        for op in ops:
            for kind, peer_op in (("tier", op), ("service", f"{op}_copyout" if op == "get" else f"{op}_copyin")):
                ours = figures.get(f"{kind}.{ours_tier}.{op}.ours")
                theirs = figures.get(f"{peer}.{tier}.{peer_op}")
                if ours and theirs:
                    ratios[f"vs_{peer}_{op}_{ours_tier}_{kind}"] = round(ours["value"] / theirs["value"], 3)
    return ratios


class Peers:
    """LMCache's backends for :mod:`benchmarks.tiers`: each opened beside the kvstore tier it is
    compared with, like for like (``ssd_nofsync``: LocalDisk buffered; ``ssd_direct_nofsync``:
    LocalDisk with O_DIRECT; ``redis`` / ``redis_cluster``: RemoteBackend on the same server)."""

    def __init__(self, args: argparse.Namespace, payloads: Sequence[memoryview]) -> None:
        """``payloads``: kvstore's N blocks, the bytes every LMCache chunk is filled from."""
        self.args = args
        self.peer: _Peer | None = None
        try:
            lmcache = _import_lmcache()
            from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend  # noqa: F401
            from lmcache.v1.storage_backend.remote_backend import RemoteBackend  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - not installed, or its imports fail here: say exactly why
            self.note = f"not run: {type(exc).__name__}: {exc}"
            return
        self.peer = _Peer(args, payloads)
        self.note = (
            f"lmcache {getattr(lmcache, '__version__', '?')}; kv_shape {self.peer.shape} fp16; "
            "LocalDisk puts are not fsynced"
        )

    @contextlib.contextmanager
    def backends(self, tier: str, url: str | None = None, service: bool = False) -> Iterator[list[Backend]]:
        """The LMCache backends to measure in the rounds of kvstore's ``tier`` (``url``: its
        Redis server or any node of its cluster): in the tier class's rounds (put, get), or with
        ``service`` in the service's rounds (put with copy-in, get with copy-out; Redis only: the
        service's SSD put is a demotion stream, not a put of N blocks)."""
        ops = ("put_copyin", "get_copyout") if service else ("put", "get")
        with contextlib.ExitStack() as stack:
            opened: list[Backend] = []
            if self.peer is not None:
                root = self.args.ssd_dir or tempfile.gettempdir()
                if tier in ("ssd_nofsync", "ssd_direct_nofsync") and not service:
                    opened.append(stack.enter_context(self.peer.local_disk(root, tier == "ssd_direct_nofsync", ops)))
                elif tier == "redis" and url:
                    opened.append(stack.enter_context(self.peer.remote("redis", url, url, ops)))
                elif tier == "redis_cluster" and url:
                    node = urlsplit(url)
                    opened.append(
                        stack.enter_context(
                            self.peer.remote("redis_cluster", f"redis-cluster://{node.hostname}:{node.port}", url, ops)
                        )
                    )
            yield opened

    def result(self, ours: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """LMCache's figures, and their ratios against ``ours`` (kvstore's figures of the run)."""
        notes: dict[str, Any] = {"lmcache": self.note}
        if self.peer is None:
            return {"figures": {}, "ratios": {}, "notes": notes}
        failures = {k: v for k, v in self.peer.failures.items() if v}
        if failures:
            notes["lmcache_failures"] = failures
        return {"figures": self.peer.figures, "ratios": _compare({**ours, **self.peer.figures}), "notes": notes}

