"""Put and get of 2 MiB blocks through the sidecar against a raw copy into shared memory.

The sidecar runs in its own process; this process is the worker, on the sidecar's host, so its
calls go over the sidecar's Unix socket (:mod:`kvstore.local`). Put = one Allocate for a
batch, a copy of every block into its slot, one Commit. Get = one Acquire, a copy of every slot
into the worker's own buffer (the engine's KV memory), one Release. The raw baseline copies the
same bytes into / out of a pre-faulted shared-memory mapping of the same size, in the same
process, in the same run. Figures are reported with the sidecar's local-read verification off
and on (a second sidecar with ``dram.verify_local_reads = true``).
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
    p.add_argument("--rounds", type=int, default=8)


def _copy_rounds(mem: np.ndarray, blocks: list[np.ndarray], out: list[np.ndarray], rounds: int) -> tuple[float, float]:
    size = blocks[0].size
    slots = [mem[i * size : (i + 1) * size] for i in range(len(blocks))]
    put = get = 0.0
    for _ in range(rounds):
        t = time.perf_counter()
        for s, b in zip(slots, blocks):
            s[:] = b
        put += time.perf_counter() - t
        t = time.perf_counter()
        for o, s in zip(out, slots):
            o[:] = s
        get += time.perf_counter() - t
    return put, get


def _raw(blocks: list[np.ndarray], out: list[np.ndarray], rounds: int) -> tuple[float, float]:
    shm = shared_memory.SharedMemory(create=True, size=blocks[0].size * len(blocks))
    try:
        mem = np.frombuffer(shm.buf, dtype=np.uint8)
        mem[::4096] = 0  # pre-fault
        result = _copy_rounds(mem, blocks, out, rounds)
        del mem
        return result
    finally:
        shm.close()
        shm.unlink()


async def _ours(url: str, blocks: list[np.ndarray], out: list[np.ndarray], rounds: int) -> tuple[float, float]:
    ns = Namespace(model="bench", kv_layout="raw", dtype="uint8", block_size=1)
    put = get = 0.0
    async with KVStoreClient.from_url(url) as c:
        for r in tqdm(range(rounds + 1), desc="dram", leave=False, disable=None):
            keys = prefix_keys(ns, list(range(r * 1_000_000, r * 1_000_000 + len(blocks))))
            t = time.perf_counter()
            async with c.allocate(ns, keys, blocks[0].size) as alloc:
                for i, view in alloc.writable():
                    view[:] = blocks[i]
                await alloc.commit()
            dt_put = time.perf_counter() - t
            t = time.perf_counter()
            async with c.acquire(ns, keys) as lease:
                assert len(lease.views) == len(blocks)
                for o, v in zip(out, lease.views):
                    o[:] = v
            dt_get = time.perf_counter() - t
            if r:  # the first round warms the slab's size class
                put += dt_put
                get += dt_get
            await c.delete(ns, keys)
    return put, get


def run(args: argparse.Namespace) -> dict:
    size = int(args.block_mib * MiB)
    rng = np.random.default_rng(0)
    blocks = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(args.batch)]
    out = [np.empty(size, dtype=np.uint8) for _ in range(args.batch)]
    for o in out:
        o[:] = 0
    total = size * args.batch * args.rounds
    res = Result("dram")
    dram_bytes = size * args.batch * 2 + 64 * MiB
    raw_put, raw_get = _raw(blocks, out, args.rounds)
    results = {}
    for verify in (False, True):
        env = {"KVSTORE_DRAM__VERIFY_LOCAL_READS": "true" if verify else "false"}
        with sidecar_process(dram_bytes, env=env) as sc:
            results[verify] = asyncio.run(_ours(sc.grpc, blocks, out, args.rounds))
    raw_put2, raw_get2 = _raw(blocks, out, args.rounds)  # baseline measured before and after
    raw_put, raw_get = min(raw_put, raw_put2), min(raw_get, raw_get2)
    gb = total / 1e9
    res.figure("raw_put_GBps", gb / raw_put, "GB/s")
    res.figure("raw_get_GBps", gb / raw_get, "GB/s")
    for verify, (put, get) in results.items():
        tag = "verify_on" if verify else "verify_off"
        res.figure(f"put_GBps_{tag}", gb / put, "GB/s")
        res.figure(f"get_GBps_{tag}", gb / get, "GB/s")
        res.ratio(f"put_vs_raw_{tag}", raw_put / put)
        res.ratio(f"get_vs_raw_{tag}", raw_get / get)
    res.figure("block_bytes", size, "B")
    res.figure("blocks_per_batch", args.batch, "blocks")
    return res.as_dict()
