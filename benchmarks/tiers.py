"""Tier throughput against the raw client on the same server, in the same run.

For each tier: put then get of N blocks (2 MiB by default) through the tier class (``put_many`` /
``get_many`` into preallocated buffers) and through the raw client:

* ssd    raw file I/O with the same durability (O_DIRECT + one directory fsync where the tier
         uses O_DIRECT, else buffered writes + fdatasync of every file + directory fsync)
* redis  raw redis-py pipelined SET/GET of the same value size (single node, and cluster)
* s3     raw aioboto3 put_object/get_object with the same concurrency and client config

Figures are MiB/s (best of ``--repeat``); ratios are ours/raw (higher is better, 1.0 = parity).
Servers come from :mod:`kvstore.testing.servers`. Run: ``python -m benchmarks.tiers``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import mmap
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from kvstore.checksum import checksum
from kvstore.tiers.base import BlockMeta, BlockRef

MiB = 1 << 20


def _blocks(n: int, size: int) -> tuple[list[tuple[BlockMeta, memoryview]], mmap.mmap]:
    payload = mmap.mmap(-1, size)  # page-aligned: raw O_DIRECT can write it as is
    payload[:] = os.urandom(size)
    view = memoryview(payload)
    digest = checksum(view)
    ns = b"B" * 32
    return [(BlockMeta(BlockRef(ns, i.to_bytes(32, "big")), b"", size, digest, "bench"), view) for i in range(n)], payload


async def _timed(fn: Callable[[], Awaitable[Any]]) -> float:
    t0 = time.perf_counter()
    await fn()
    return time.perf_counter() - t0


async def _nothing() -> None:
    return None


async def _best_interleaved(repeat: int, ours: Callable, raw: Callable, reset: Callable = _nothing) -> tuple[float, float]:
    """Best time of each, alternating ours and raw so both see the same noise (shared 2-core box).
    ``reset`` runs untimed before every run (e.g. so that writes go to fresh names)."""
    t_ours = t_raw = float("inf")
    for i in range(repeat):
        order = [("ours", ours), ("raw", raw)] if i % 2 == 0 else [("raw", raw), ("ours", ours)]
        for which, fn in order:
            await reset()
            t = await _timed(fn)
            if which == "ours":
                t_ours = min(t_ours, t)
            else:
                t_raw = min(t_raw, t)
    return t_ours, t_raw


class _Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.n, self.size, self.repeat = args.blocks, int(args.block_mib * MiB), args.repeat
        self.items, self._payload = _blocks(self.n, self.size)
        self.bufs = [memoryview(bytearray(self.size)) for _ in range(self.n)]
        self.figures: dict[str, dict[str, Any]] = {}
        self.ratios: dict[str, float] = {}

    async def compare(self, tier_name: str, op: str, ours: Callable, raw: Callable, reset: Callable = _nothing) -> None:
        mib = self.n * self.size / MiB
        t_ours, t_raw = await _best_interleaved(self.repeat, ours, raw, reset)
        self.figures[f"{tier_name}.{op}.ours"] = {"value": round(mib / t_ours, 1), "unit": "MiB/s"}
        self.figures[f"{tier_name}.{op}.raw"] = {"value": round(mib / t_raw, 1), "unit": "MiB/s"}
        self.ratios[f"{tier_name}.{op}"] = round(t_raw / t_ours, 3)

    async def tier_vs_raw(self, tier_name: str, tier: Any, raw_put: Callable, raw_get: Callable, reset: Callable = _nothing) -> None:
        refs = [m.ref for m, _ in self.items]

        async def ours_get() -> None:
            got = await tier.get_many(refs, self.bufs)
            assert all(g is not None for g in got)

        await self.compare(tier_name, "put", lambda: tier.put_many(self.items), raw_put, reset)
        await tier.put_many(self.items)  # both hold every block again (reset may have run last)
        await raw_put()
        await self.compare(tier_name, "get", ours_get, raw_get)
        await tier.close()

    # ---- ssd ------------------------------------------------------------------------------

    async def ssd(self, root: Path) -> None:
        from kvstore.tiers.ssd import SsdTier

        tier = SsdTier(root / "tier", 4 * self.n * self.size + 64 * MiB)
        raw_dir = root / "raw"
        raw_dir.mkdir()
        direct = tier.direct_io
        paths = [raw_dir / f"{i}.bin" for i in range(self.n)]

        def put() -> None:
            fds = []
            flags = os.O_CREAT | os.O_WRONLY | os.O_TRUNC | (os.O_DIRECT if direct else 0)
            for p, (_, data) in zip(paths, self.items):
                fd = os.open(p, flags, 0o644)
                fds.append(fd)
                done = 0
                while done < len(data):
                    done += os.write(fd, data[done:])
            for fd in fds:
                if not direct:
                    os.fdatasync(fd)
                os.close(fd)
            dfd = os.open(raw_dir, os.O_RDONLY | os.O_DIRECTORY)
            os.fsync(dfd)
            os.close(dfd)

        def get() -> None:
            for p, buf in zip(paths, self.bufs):
                fd = os.open(p, os.O_RDONLY)
                try:
                    assert os.preadv(fd, [buf], 0) == len(buf)
                finally:
                    os.close(fd)

        async def fresh() -> None:  # new blocks get new names: time writes, not replacing old files
            await tier.delete_many([m.ref for m, _ in self.items])
            for p in paths:
                p.unlink(missing_ok=True)

        self.figures["ssd.direct_io"] = {"value": int(direct), "unit": "bool"}
        await self.tier_vs_raw("ssd", tier, lambda: asyncio.to_thread(put), lambda: asyncio.to_thread(get), fresh)

    # ---- redis ----------------------------------------------------------------------------

    async def redis(self, name: str, url: str, cluster: bool) -> None:
        from redis.asyncio import Redis
        from redis.asyncio.cluster import RedisCluster

        from kvstore.config import RedisConfig
        from kvstore.tiers.redis import RedisTier

        tier = RedisTier.from_config(RedisConfig(url=url, cluster=cluster))
        raw = RedisCluster.from_url(url) if cluster else Redis.from_url(url)
        keys = [f"raw:{{{i}}}" for i in range(self.n)]

        async def put() -> None:
            pipe = raw.pipeline() if cluster else raw.pipeline(transaction=False)
            for k, (_, data) in zip(keys, self.items):
                pipe.set(k, data)
            await pipe.execute()

        async def get() -> None:
            pipe = raw.pipeline() if cluster else raw.pipeline(transaction=False)
            for k in keys:
                pipe.get(k)
            assert all(v is not None for v in await pipe.execute())

        try:
            await self.tier_vs_raw(name, tier, put, get)
        finally:
            await raw.aclose()

    # ---- s3 -------------------------------------------------------------------------------

    async def s3(self, url: str, concurrency: int) -> None:
        import aioboto3

        from kvstore.testing.servers import MOTO_CREDENTIALS
        from kvstore.tiers.s3 import S3Tier, client_config

        def client() -> Any:
            return aioboto3.Session().client(
                "s3", endpoint_url=url, region_name="us-east-1", config=client_config(concurrency), **MOTO_CREDENTIALS
            )

        tier = S3Tier(client, bucket="bench", concurrency=concurrency)
        await tier.contains(self.items[0][0].ref)  # creates the bucket
        sem = asyncio.Semaphore(concurrency)
        async with client() as raw:

            async def put_one(i: int, data: memoryview) -> None:
                async with sem:
                    await raw.put_object(Bucket="bench", Key=f"raw/{i}", Body=bytes(data))

            async def get_one(i: int) -> None:
                async with sem:
                    resp = await raw.get_object(Bucket="bench", Key=f"raw/{i}")
                    async with resp["Body"] as body:
                        await body.read()

            async def put() -> None:
                await asyncio.gather(*(put_one(i, d) for i, (_, d) in enumerate(self.items)))

            async def get() -> None:
                await asyncio.gather(*(get_one(i) for i in range(self.n)))

            await self.tier_vs_raw("s3", tier, put, get)


async def _run(args: argparse.Namespace) -> dict:
    from kvstore.testing.servers import moto_server, redis_cluster, redis_server

    bench = _Bench(args)
    wanted = set(args.tiers.split(","))
    with contextlib.ExitStack() as stack:
        if "ssd" in wanted:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvstore-bench-", dir=args.ssd_dir)))
            await bench.ssd(root)
        if "redis" in wanted:
            server = stack.enter_context(redis_server())
            await bench.redis("redis", server.url, cluster=False)
        if "redis_cluster" in wanted:
            cluster = stack.enter_context(redis_cluster(3))
            await bench.redis("redis_cluster", cluster.url, cluster=True)
        if "s3" in wanted:
            moto = stack.enter_context(moto_server())
            await bench.s3(moto.url, args.s3_concurrency)
    bench.figures["block_bytes"] = {"value": bench.size, "unit": "bytes"}
    bench.figures["blocks"] = {"value": bench.n, "unit": "count"}
    return {"suite": "tiers", "figures": bench.figures, "ratios": bench.ratios}


def run(args: argparse.Namespace) -> dict:
    return asyncio.run(_run(args))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The suite's options (also used by ``kvstore bench tiers``)."""
    p.add_argument("--blocks", type=int, default=32, help="blocks per put/get batch")
    p.add_argument("--block-mib", type=float, default=2.0, help="block size in MiB")
    p.add_argument("--repeat", type=int, default=5, help="runs per measurement; the best counts")
    p.add_argument("--tiers", default="ssd,redis,redis_cluster,s3", help="comma-separated subset")
    p.add_argument("--s3-concurrency", type=int, default=8)
    p.add_argument("--ssd-dir", default=None, help="directory on the filesystem to test (default: $TMPDIR)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


def main(argv: list[str] | None = None) -> None:
    print(json.dumps(run(parser().parse_args(argv))))


if __name__ == "__main__":
    main()
