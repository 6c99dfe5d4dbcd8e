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
``[2, layers, 256 tokens, hidden]`` with the same byte count as kvstore's blocks).

* put  = ``batched_submit_put_task(keys, memory_objs, on_complete_callback)`` from memory
         objects already filled, timed until the callback has fired for every key (LMCache's
         own notion of "stored").
* get  = ``batched_get_blocking(keys)``: the chunks land in memory objects of LMCache's CPU
         allocator (``get``); ``get_copyout`` adds a copy of each into the caller's own buffer
         and the release of the memory objects, which is what kvstore's through-service get
         measures (Acquire + copy out of the DRAM slot + Release).

Figures are MiB/s, best of ``--repeat``. Ratios ``vs_lmcache[_odirect]_<op>_<tier>_<kind>`` are
LMCache time / kvstore time (above 1.0: kvstore ahead), against kvstore's tier class (``tier``;
get compared without the copy-out) and through the service (``service``; get with copy-out),
measured earlier in the same run by :mod:`benchmarks.tiers`.

Run: ``python -m benchmarks.peers.lmcache_backends [--tiers ssd,redis,redis_cluster]`` (prints the
``benchmarks.tiers`` JSON with the peer figures added), or ``kvstore bench tiers --peers --json``.
Installing LMCache here: see :mod:`benchmarks.peers`. If it cannot be imported, the figures are
absent and ``notes.lmcache`` says why (the exact error).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import numpy as np
from tqdm import tqdm

if TYPE_CHECKING:
    from benchmarks.tiers import Servers

MiB = 1 << 20
GiB = 1 << 30
CHUNK_TOKENS = 256
TIMEOUT_S = 30.0


def _import_lmcache() -> Any:
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    import torch  # noqa: F401  (LMCache's extension modules link against the installed torch)
    import lmcache

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
    def __init__(self, args: argparse.Namespace) -> None:
        from lmcache.v1.metadata import LMCacheMetadata
        import torch

        self.n, self.size, self.repeat = args.blocks, int(args.block_mib * MiB), args.repeat
        self.shape = _kv_shape(self.size)
        self.metadata = LMCacheMetadata(
            model_name="bench", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
            kv_dtype=torch.float16, kv_shape=self.shape,
        )
        rng = np.random.default_rng(0)
        self.payload = rng.integers(0, 256, self.size, dtype=np.uint8)
        self.out = [np.zeros(self.size, dtype=np.uint8) for _ in range(self.n)]
        self.figures: dict[str, dict[str, Any]] = {}
        self.failures: dict[str, list[str]] = {}
        self._hash = iter(range(1, 1 << 62))
        self.run_id = uuid.uuid4().int & 0xFFFF_FFFF

    def config(self, **kw: Any) -> Any:
        from lmcache.v1.config import LMCacheEngineConfig

        cpu_gib = (4 * self.n * self.size + 256 * MiB) / GiB  # put sources + get results, with room
        return LMCacheEngineConfig.from_defaults(chunk_size=CHUNK_TOKENS, local_cpu=False, max_local_cpu_size=cpu_gib, **kw)

    def keys(self) -> list[Any]:
        from lmcache.utils import CacheEngineKey
        import torch

        return [CacheEngineKey("bench", 1, 0, (self.run_id << 32) | next(self._hash), torch.float16) for _ in range(self.n)]

    def sources(self, cpu: Any) -> list[Any]:
        from lmcache.v1.memory_management import MemoryFormat

        objs = []
        for _ in range(self.n):
            obj = cpu.allocate(self.metadata.get_shapes(), self.metadata.get_dtypes(), MemoryFormat.KV_2LTD)
            assert obj is not None, "LMCache CPU allocator is full"
            np.frombuffer(obj.byte_array, dtype=np.uint8)[:] = self.payload
            objs.append(obj)
        return objs

    def put(self, backend: Any, keys: list[Any], objs: list[Any]) -> float:
        done = threading.Semaphore(0)
        t0 = time.perf_counter()
        backend.batched_submit_put_task(keys, objs, on_complete_callback=lambda _key: done.release())
        for _ in keys:
            if not done.acquire(timeout=TIMEOUT_S):
                raise LookupError(f"put not complete after {TIMEOUT_S:.0f} s")
        return time.perf_counter() - t0

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
        assert np.array_equal(self.out[0], self.payload)
        return t1 - t0, t2 - t0

    def measure(self, name: str, tier: str, backend: Any, cpu: Any, drop: Callable[[list[Any]], None]) -> None:
        objs = self.sources(cpu)
        best = {"put": float("inf"), "get": float("inf"), "get_copyout": float("inf")}
        with tqdm(total=self.repeat + 1, desc=f"{name} {tier}", leave=False, disable=None) as bar:
            for i in range(self.repeat + 1):  # the first round warms up threads and connections
                keys = self.keys()
                try:
                    t_put = self.put(backend, keys, objs)
                    t_get, t_copy = self.get(backend, keys)
                except LookupError as exc:  # LMCache lost chunks or hung (its log says why)
                    self.failures.setdefault(f"{name}.{tier}", []).append(f"round {i}: {exc}")
                    drop(keys)
                    bar.update()
                    if "not complete" in str(exc):
                        break  # a hung put leaves the backend stuck: stop measuring it
                    continue
                drop(keys)
                if i:
                    best["put"] = min(best["put"], t_put)
                    best["get"] = min(best["get"], t_get)
                    best["get_copyout"] = min(best["get_copyout"], t_copy)
                bar.update()
        for obj in objs:
            obj.ref_count_down()
        mib = self.n * self.size / MiB
        for op, t in best.items():
            if t != float("inf"):
                self.figures[f"{name}.{tier}.{op}"] = {"value": round(mib / t, 1), "unit": "MiB/s"}

    # ---- backends -------------------------------------------------------------------------------

    def local_disk(self, root: str, odirect: bool) -> None:
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

        with tempfile.TemporaryDirectory(prefix="lmcache-bench-", dir=root) as d:
            # LocalDiskBackend.remove() does not give back ``current_cache_size`` (0.5.6), so the
            # budget covers every round's blocks although each round's files are deleted.
            budget = (self.repeat + 3) * self.n * self.size + 64 * MiB
            cfg = self.config(
                local_disk=d, max_local_disk_size=budget / GiB,
                extra_config={"use_odirect": odirect},
            )
            cpu = LocalCPUBackend(cfg, self.metadata)
            loop = _Loop()  # one per backend: a closed backend can leave its loop's workers stuck
            disk = LocalDiskBackend(cfg, loop.loop, cpu)
            try:
                self.measure("lmcache_odirect" if odirect else "lmcache", "ssd", disk, cpu, lambda keys: [disk.remove(k) for k in keys])
            finally:
                disk.close()
                cpu.close()
                loop.close()

    def remote(self, tier: str, url: str, node: str) -> None:
        """``url`` in LMCache's form; ``node`` (redis://host:port) for deleting keys between rounds."""
        import redis

        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.remote_backend import RemoteBackend

        cfg = self.config(remote_url=url, remote_serde="naive")
        cpu = LocalCPUBackend(cfg, self.metadata)
        loop = _Loop()
        backend = RemoteBackend(cfg, self.metadata, loop.loop, cpu)
        raw: Any = redis.RedisCluster.from_url(node) if tier == "redis_cluster" else redis.Redis.from_url(node)

        def drop(keys: list[Any]) -> None:
            for k in keys:  # one key at a time: in a cluster the two keys live on different slots
                raw.delete(k.to_string() + "kv_bytes")
                raw.delete(k.to_string() + "metadata")

        try:
            self.measure("lmcache", tier, backend, cpu, drop)
        finally:
            # No backend.close(): its executor shutdown waits on worker futures it has just
            # cancelled and hangs (30 s and more here); stopping the loop ends its tasks.
            cpu.close()
            loop.close()
            raw.close()


# (LMCache backend, its tier, kvstore's tier): kvstore's defaults against each backend, and the
# SSD tier with LMCache's durability (no fsync; buffered, or O_DIRECT) against the same mode.
PAIRS = [
    ("lmcache", "ssd", "ssd"),
    ("lmcache_odirect", "ssd", "ssd"),
    ("lmcache", "ssd", "ssd_nofsync"),
    ("lmcache_odirect", "ssd", "ssd_direct_nofsync"),
    ("lmcache", "redis", "redis"),
    ("lmcache", "redis_cluster", "redis_cluster"),
]


def _compare(figures: dict[str, dict[str, Any]]) -> dict[str, float]:
    """LMCache time / kvstore time for every pair measured (above 1: kvstore ahead), named
    ``vs_<backend>_<op>_<kvstore tier>_<tier|service>``."""
    ratios: dict[str, float] = {}
    for peer, tier, ours_tier in PAIRS:
        for op in ("put", "get"):
            for kind, peer_op in (("tier", op), ("service", "get_copyout" if op == "get" else op)):
                ours = figures.get(f"{kind}.{ours_tier}.{op}.ours")
                theirs = figures.get(f"{peer}.{tier}.{peer_op}")
                if ours and theirs:
                    ratios[f"vs_{peer}_{op}_{ours_tier}_{kind}"] = round(ours["value"] / theirs["value"], 3)
    return ratios


def run_peers(args: argparse.Namespace, servers: Servers, ours: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """LMCache figures on ``servers`` (and ``--ssd-dir``), with ratios against ``ours`` (the
    kvstore figures of the same run). Blocking: call it off the event loop."""
    wanted = set(args.tiers.split(","))
    try:
        lmcache = _import_lmcache()
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend  # noqa: F401
        from lmcache.v1.storage_backend.remote_backend import RemoteBackend  # noqa: F401
    except Exception as exc:  # not installed, or its imports fail here: say exactly why
        return {"figures": {}, "ratios": {}, "notes": {"lmcache": f"not run: {type(exc).__name__}: {exc}"}}
    peer = _Peer(args)
    notes = {"lmcache": f"lmcache {getattr(lmcache, '__version__', '?')}; kv_shape {peer.shape} fp16; LocalDisk puts are not fsynced"}
    if "ssd" in wanted:
        root = args.ssd_dir or tempfile.gettempdir()
        peer.local_disk(root, odirect=False)
        peer.local_disk(root, odirect=True)
    if "redis" in wanted and servers.redis:
        peer.remote("redis", servers.redis, servers.redis)
    if "redis_cluster" in wanted and servers.redis_cluster:
        node = urlsplit(servers.redis_cluster)
        peer.remote("redis_cluster", f"redis-cluster://{node.hostname}:{node.port}", servers.redis_cluster)
    figures = peer.figures
    if peer.failures:
        notes["lmcache_failures"] = peer.failures
    return {"figures": figures, "ratios": _compare({**(ours or {}), **figures}), "notes": notes}


def main(argv: list[str] | None = None) -> None:
    import json

    from benchmarks import tiers
    from kvstore.tuning import tune_malloc

    p = tiers.parser()
    p.description = __doc__
    p.set_defaults(tiers="ssd,redis,redis_cluster", peers=True)
    args = p.parse_args(argv)
    args.peers = True
    tune_malloc()
    print(json.dumps(tiers.run(args)))


if __name__ == "__main__":
    main()
