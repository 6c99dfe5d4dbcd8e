"""A reload through the connector with checksums verified, as shipped, against the same reload
without, in the same run (CPU).

A sidecar (`kvstore serve`, its own process) holds ``--blocks`` blocks of a model shape (vLLM's
CPU layout, bf16, 16-token blocks), saved through the connector (``save_blocks``) and sealed by
the sidecar. Each round reloads them all into the engine's cache through the connector's load
(``load_blocks``: Acquire, copy into the cache by ``NumpyTransfer``, Release) once with
``verify=True`` (every slot checked against its checksum before it is copied, the hashing
overlapped with the copy: ``connector/core/verified.py``) and once with ``verify=False``, in
alternating order, the same keys into the same engine blocks (the same work and cache state but
the check). Each reload is timed on the wall clock and in this process's CPU time (every thread:
the copy, the hashing pool, gRPC; the sidecar is another process).

- ``<shape>_verified_vs_unverified``: the unverified reload's best wall time ÷ the verified one's
  (1.0: verification costs nothing; the target is ≥ 1/1.1), and ``..._median`` of the medians.
- ``<shape>_verified_vs_unverified_cpu``: the same of the CPU times (medians): the work the check
  adds. Where no core is free for the hashing (a shared machine under load) the wall ratio tends
  to this; where one is, to ``unverified ÷ (unverified + first chunk's hash)``.
- ``<shape>_verified_vs_unverified_caller_cpu``: the same of the calling thread's own CPU time
  (the copy, and any part of a chunk it had to hash itself because no pool thread had started it):
  1.0 when all the hashing ran on the pool's threads, off the copy's path.
- ``<shape>_serial_hash_ms`` (one thread hashing the whole batch: the check until #39),
  ``<shape>_hash_GBps`` (its rate), ``<shape>_copy_GBps`` (the unverified reload's bytes ÷ its
  time), ``<shape>_first_chunk_hash_ms`` (the first chunk, hashed on the pool before any copy:
  what a verified load adds by construction) and ``<shape>_hash_hidden`` (of the serial hash time,
  the share that did not show in the verified reload's wall time: (unverified + serial hash −
  verified) ÷ serial hash, medians; 1: all of it ran beside the copy, 0: none).

``notes``: the CPUs and the load average before and after.

    kvstore bench reload --json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from benchmarks.common import Result, sidecar_process
from benchmarks.transfer_shapes import SHAPES, spec_of
from connector.core.metadata import LoadSpec, SaveSpec
from connector.core.ops import load_blocks, save_blocks
from connector.core.verified import chunks
from connector.transfer import NumpyTransfer, bind_caches
from kvstore.client import SyncClient
from kvstore.keys import Namespace, prefix_keys
from kvstore.store.checksum import checksum, start_checksums

MiB = 1 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", default="llama3_8b,qwen25_05b", help="model shapes, from " + ", ".join(SHAPES))
    p.add_argument("--blocks", type=int, default=128, help="blocks per reload")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds of each (after one warm-up)")


def _sealed(client: SyncClient, ns: Namespace, keys: list[Any], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with client.acquire(ns, keys) as lease:
            if all(lease.checksums):
                return
        if time.monotonic() > deadline:
            raise SystemExit("kvstore bench reload: the sidecar did not seal the blocks' checksums")
        time.sleep(0.05)


def _shape(res: Result, shape: str, n: int, rounds: int) -> None:
    import torch

    spec = spec_of(shape, "vllm_cpu")
    bb = spec.block_bytes
    part = (spec.kv_heads, spec.block_size, 2 * spec.head_size)
    caches = [torch.randn((2 * n, *part), dtype=torch.float32).to(torch.bfloat16) for _ in range(spec.num_layers)]
    kv = bind_caches(spec, caches)
    ns = Namespace(model=f"bench-{shape}", kv_layout="vllm_cpu", dtype="bfloat16", block_size=spec.block_size)
    keys = prefix_keys(ns, list(range(n * spec.block_size)))
    page = max(32 * MiB, 1 << (bb - 1).bit_length())
    dram = (-(-n * (1 << (bb - 1).bit_length()) // page) + 2) * page
    t = NumpyTransfer()
    env = {"KVSTORE_DRAM__PAGE_BYTES": str(page)}
    with sidecar_process(dram, env=env) as sc, SyncClient(sc.grpc) as client:
        saved = save_blocks(client, ns, kv, t, SaveSpec("save", tuple(keys), tuple(range(n))))
        if saved.written != n:
            raise SystemExit(f"kvstore bench reload: {saved.written} of {n} blocks stored ({saved.failure})")
        _sealed(client, ns, keys)
        res.figure(f"{shape}_blocks", n, "blocks")
        res.figure(f"{shape}_block_bytes", bb, "B")
        load = LoadSpec("load", tuple(keys), tuple(range(n, 2 * n)), 0, spec.block_size)

        def reload(verify: bool) -> tuple[float, float, float]:
            c0, t0 = time.process_time(), time.thread_time()
            r = load_blocks(client, ns, kv, t, load, verify=verify)
            caller, cpu = time.thread_time() - t0, time.process_time() - c0
            if r.loaded != n:
                raise SystemExit(f"kvstore bench reload: {r.loaded} of {n} blocks loaded ({r.failure})")
            return r.seconds, cpu, caller

        def hashes() -> tuple[float, float]:
            """(one thread hashing the batch, the pool hashing its first chunk), seconds."""
            with client.acquire(ns, keys) as lease:
                t0 = time.perf_counter()
                for v in lease.views:
                    checksum(v)
                t1 = time.perf_counter()
                start_checksums(lease.views[: chunks(n)[0][1]])()
                return t1 - t0, time.perf_counter() - t1

        reload(True), reload(False)  # warm-up
        wall: dict[bool, list[float]] = {True: [], False: []}
        cpu: dict[bool, list[float]] = {True: [], False: []}
        caller: dict[bool, list[float]] = {True: [], False: []}
        serial, first = [], []
        for i in range(rounds):
            for verify in (True, False) if i % 2 == 0 else (False, True):
                w, c, own = reload(verify)
                wall[verify].append(w)
                cpu[verify].append(c)
                caller[verify].append(own)
            h, f = hashes()
            serial.append(h)
            first.append(f)
    _report(res, shape, n * bb, wall, cpu, serial, first)
    for verify, way in ((True, "verified"), (False, "unverified")):
        res.figure(f"{shape}_reload_{way}_caller_cpu_ms", statistics.median(caller[verify]) * 1e3, "ms")
    own = {v: statistics.median(caller[v]) for v in caller}
    res.ratio(f"{shape}_verified_vs_unverified_caller_cpu", own[False] / own[True])


def _report(res: Result, shape: str, nbytes: int, wall: dict[bool, list[float]], cpu: dict[bool, list[float]],
            serial: list[float], first: list[float]) -> None:
    med = {v: statistics.median(wall[v]) for v in wall}
    hashing = statistics.median(serial)
    res.figure(f"{shape}_reload_verified_ms", min(wall[True]) * 1e3, "ms")
    res.figure(f"{shape}_reload_unverified_ms", min(wall[False]) * 1e3, "ms")
    res.figure(f"{shape}_reload_verified_median_ms", med[True] * 1e3, "ms")
    res.figure(f"{shape}_reload_unverified_median_ms", med[False] * 1e3, "ms")
    res.figure(f"{shape}_reload_verified_cpu_ms", statistics.median(cpu[True]) * 1e3, "ms")
    res.figure(f"{shape}_reload_unverified_cpu_ms", statistics.median(cpu[False]) * 1e3, "ms")
    res.figure(f"{shape}_serial_hash_ms", min(serial) * 1e3, "ms")
    res.figure(f"{shape}_first_chunk_hash_ms", min(first) * 1e3, "ms")
    res.figure(f"{shape}_hash_GBps", nbytes / 1e9 / min(serial), "GB/s")
    res.figure(f"{shape}_copy_GBps", nbytes / 1e9 / min(wall[False]), "GB/s")
    res.figure(f"{shape}_hash_hidden", min(1.0, max(0.0, (med[False] + hashing - med[True]) / hashing)), "share")
    res.ratio(f"{shape}_verified_vs_unverified", min(wall[False]) / min(wall[True]))
    res.ratio(f"{shape}_verified_vs_unverified_median", med[False] / med[True])
    res.ratio(f"{shape}_verified_vs_unverified_cpu", statistics.median(cpu[False]) / statistics.median(cpu[True]))


def run(args: argparse.Namespace) -> dict:
    res = Result("reload")
    shapes = [s for s in args.shapes.split(",") if s]
    for s in shapes:
        if s not in SHAPES:
            raise SystemExit(f"--shapes: {s!r} is not one of {sorted(SHAPES)}")
    res.notes["device"] = "cpu"
    res.notes["cpus"] = os.cpu_count()
    res.notes["load_before"] = round(os.getloadavg()[0], 1)
    for s in shapes:
        _shape(res, s, args.blocks, args.rounds)
    res.notes["load_after"] = round(os.getloadavg()[0], 1)
    return res.as_dict()
