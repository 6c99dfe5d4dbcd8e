"""Put and get of 2 MiB blocks through the sidecar against a raw copy into shared memory.

The sidecar runs in its own process; this process is the worker, on the sidecar's host, so its
calls go over the sidecar's Unix socket (:mod:`kvstore.wire.framing`). Put = one Allocate for a
batch, a copy of every block into its slot, one Commit. Get = one Acquire, a copy of every slot
into the worker's own buffer (the engine's KV memory), one Release. The raw baseline copies the
same bytes into / out of a pre-faulted shared-memory mapping of the same size, in the same
process. Figures are reported with the sidecar's local-read verification off and on (a second
sidecar with ``dram.verify_local_reads = true``).

Every round measures the three one after another (raw, verification off, verification on),
the order rotating from round to round, so all see the same phase of the machine; each figure
is the best round (after one untimed warm-up round), as in the tiers suite.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from multiprocessing import shared_memory

import numpy as np
from tqdm import tqdm

from benchmarks.common import Result, sidecar_process
from kvstore.client import KVStoreClient
from kvstore.keys import Namespace, prefix_keys

MiB = 1 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block-mib", type=float, default=2.0)
    p.add_argument("--batch", type=int, default=32, help="blocks per Allocate/Acquire")
    p.add_argument("--rounds", type=int, default=15, help="timed rounds (after one warm-up); each figure is the best")


def _copy(dst: list[np.ndarray], src: list[np.ndarray]) -> float:
    t = time.perf_counter()
    for d, b in zip(dst, src):
        d[:] = b
    return time.perf_counter() - t


async def _ours(
    c: KVStoreClient, ns: Namespace, keys: list[bytes], blocks: list[np.ndarray], out: list[np.ndarray]
) -> tuple[float, float]:
    t = time.perf_counter()
    async with c.allocate(ns, keys, blocks[0].size) as alloc:
        for i, view in alloc.writable():
            view[:] = blocks[i]
        await alloc.commit()
    put = time.perf_counter() - t
    t = time.perf_counter()
    async with c.acquire(ns, keys) as lease:
        assert len(lease.views) == len(blocks)
        for o, v in zip(out, lease.views):
            o[:] = v
    get = time.perf_counter() - t
    await c.delete(ns, keys)
    return put, get


async def _rounds(
    urls: dict[str, str], blocks: list[np.ndarray], out: list[np.ndarray], rounds: int
) -> dict[str, dict[str, float]]:
    """Best put and get time of each side: ``raw``, and ours under every name in ``urls``."""
    size = blocks[0].size
    shm = shared_memory.SharedMemory(create=True, size=size * len(blocks))
    ns = Namespace(model="bench", kv_layout="raw", dtype="uint8", block_size=1)
    best = {name: {"put": float("inf"), "get": float("inf")} for name in ("raw", *urls)}
    try:
        mem = np.frombuffer(shm.buf, dtype=np.uint8)
        mem[::4096] = 0  # pre-fault
        slots = [mem[i * size : (i + 1) * size] for i in range(len(blocks))]
        clients = {name: KVStoreClient.from_url(url) for name, url in urls.items()}
        names = list(best)
        try:
            for r in tqdm(range(rounds + 1), desc="dram", leave=False, disable=None):
                keys = prefix_keys(ns, list(range(r * 1_000_000, r * 1_000_000 + len(blocks))))
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    if name == "raw":
                        put, get = _copy(slots, blocks), _copy(out, slots)
                    else:
                        put, get = await _ours(clients[name], ns, keys, blocks, out)
                    if r:  # the first round warms the slab's size class, connections, caches
                        best[name]["put"] = min(best[name]["put"], put)
                        best[name]["get"] = min(best[name]["get"], get)
        finally:
            for c in clients.values():
                await c.aclose()
        del mem, slots
    finally:
        shm.close()
        shm.unlink()
    return best


def run(args: argparse.Namespace) -> dict:
    size = int(args.block_mib * MiB)
    rng = np.random.default_rng(0)
    blocks = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(args.batch)]
    out = [np.empty(size, dtype=np.uint8) for _ in range(args.batch)]
    for o in out:
        o[:] = 0
    res = Result("dram")
    dram_bytes = size * args.batch * 2 + 64 * MiB
    with (
        sidecar_process(dram_bytes, env={"KVSTORE_DRAM__VERIFY_LOCAL_READS": "false"}) as off,
        sidecar_process(dram_bytes, env={"KVSTORE_DRAM__VERIFY_LOCAL_READS": "true"}) as on,
    ):
        best = asyncio.run(_rounds({"verify_off": off.grpc, "verify_on": on.grpc}, blocks, out, args.rounds))
    gb = size * args.batch / 1e9
    raw = best.pop("raw")
    res.figure("raw_put_GBps", gb / raw["put"], "GB/s")
    res.figure("raw_get_GBps", gb / raw["get"], "GB/s")
    for tag, t in best.items():
        res.figure(f"put_GBps_{tag}", gb / t["put"], "GB/s")
        res.figure(f"get_GBps_{tag}", gb / t["get"], "GB/s")
        res.ratio(f"put_vs_raw_{tag}", raw["put"] / t["put"])
        res.ratio(f"get_vs_raw_{tag}", raw["get"] / t["get"])
    res.figure("block_bytes", size, "B")
    res.figure("blocks_per_batch", args.batch, "blocks")
    res.figure("rounds", args.rounds, "rounds")
    return res.as_dict()
