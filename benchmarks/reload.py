"""A reload through the connector with checksums verified, as shipped, against the same reload
without, in the same run (CPU).

A sidecar (`kvstore serve`, its own process) holds ``--blocks`` blocks of a model shape (vLLM's
CPU layout, bf16, 16-token blocks), saved through the connector (``save_blocks``) and sealed by
the sidecar. Each round reloads them all into the engine's cache through the connector's load
(``load_blocks``: Acquire, copy into the cache by ``NumpyTransfer``, Release) three ways, each
first in turn, the same keys into the same engine blocks (the same work and cache state but the
check): ``verify=True`` under the shipped ``load_guard="read_only"`` (the slab is mapped
read-only in this process, so nothing is hashed: ``connector/roles/guard.py``; the guard in force
is in ``notes``), ``verify=True`` under ``load_guard="hash"`` (every slot checked against its
checksum before it is copied, the hashing overlapped with the copy:
``connector/roles/verified.py``; the check until #39), and ``verify=False``. Each reload is timed
on the wall clock and in this process's CPU time (every thread: the copy, the hashing pool,
gRPC; the sidecar is another process).

- ``<shape>_verified_vs_unverified``: the unverified reload's best wall time ÷ the verified one's
  (as shipped; 1.0: verification costs nothing; the target is ≥ 1/1.1), and ``..._median`` of
  the medians; ``<shape>_hashed_vs_unverified``: the same under ``load_guard="hash"``.
- ``<shape>_{verified,hashed}_vs_unverified_cpu``: the same of the CPU times (medians): the work
  the check adds. Where no core is free for the hashing (a shared machine under load) the hashed
  wall ratio tends to this; where one is, to ``unverified ÷ (unverified + first chunk's hash)``.
- ``<shape>_{verified,hashed}_vs_unverified_caller_cpu``: the same of the calling thread's own
  CPU time (the copy, and any part of a chunk it had to hash itself because no pool thread had
  started it): 1.0 when all the hashing ran on the pool's threads, off the copy's path.
- ``<shape>_serial_hash_ms`` (one thread hashing the whole batch: the check until the chunked
  one), ``<shape>_hash_GBps`` (its rate), ``<shape>_copy_GBps`` (the unverified reload's bytes ÷
  its time), ``<shape>_first_chunk_hash_ms`` (the first chunk, hashed on the pool before any copy:
  what a hashed load adds by construction) and ``<shape>_hash_hidden`` (of the serial hash time,
  the share that did not show in the hashed reload's wall time: (unverified + serial hash −
  hashed) ÷ serial hash, medians; 1: all of it ran beside the copy, 0: none).

``notes``: the CPUs, the load average before and after, ``<shape>_guard_in_force``.

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
from connector.roles.guard import in_force
from connector.roles.metadata import LoadSpec, SaveSpec
from connector.roles.ops import load_blocks, save_blocks
from connector.roles.verified import chunks
from connector.transfer.engines import NumpyTransfer, bind_caches
from kvstore.checksum import checksum, start_checksums
from kvstore.client import SyncClient
from kvstore.keys import Namespace, prefix_keys

MiB = 1 << 20
UNVERIFIED = "unverified"
MODES = ["read_only", "hash", UNVERIFIED]  # verify under each load_guard (connector.roles.guard), and not at all
VERIFIED = MODES[:2]
WAYS = {"read_only": "verified", "hash": "hashed", UNVERIFIED: "unverified"}  # as the figures name them


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

        def reload(mode: str) -> tuple[float, float, float]:
            verify, guard = mode != UNVERIFIED, "hash" if mode == "hash" else "read_only"
            c0, t0 = time.process_time(), time.thread_time()
            r = load_blocks(client, ns, kv, t, load, verify=verify, guard=guard)
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

        for mode in MODES:  # warm-up
            reload(mode)
        res.notes[f"{shape}_guard_in_force"] = in_force("read_only", client.hello().segment)
        wall: dict[str, list[float]] = {m: [] for m in MODES}
        cpu: dict[str, list[float]] = {m: [] for m in MODES}
        caller: dict[str, list[float]] = {m: [] for m in MODES}
        serial, first = [], []
        for i in range(rounds):
            for mode in MODES[i % len(MODES):] + MODES[: i % len(MODES)]:  # each first in turn
                w, c, own = reload(mode)
                wall[mode].append(w)
                cpu[mode].append(c)
                caller[mode].append(own)
            h, f = hashes()
            serial.append(h)
            first.append(f)
    _report(res, shape, n * bb, wall, cpu, serial, first)
    for mode in MODES:
        res.figure(f"{shape}_reload_{WAYS[mode]}_caller_cpu_ms", statistics.median(caller[mode]) * 1e3, "ms")
    own = {m: statistics.median(caller[m]) for m in caller}
    for mode in VERIFIED:
        res.ratio(f"{shape}_{WAYS[mode]}_vs_unverified_caller_cpu", own[UNVERIFIED] / own[mode])


def _report(res: Result, shape: str, nbytes: int, wall: dict[str, list[float]], cpu: dict[str, list[float]],
            serial: list[float], first: list[float]) -> None:
    med = {m: statistics.median(wall[m]) for m in wall}
    hashing = statistics.median(serial)
    for mode in MODES:
        way = WAYS[mode]
        res.figure(f"{shape}_reload_{way}_ms", min(wall[mode]) * 1e3, "ms")
        res.figure(f"{shape}_reload_{way}_median_ms", med[mode] * 1e3, "ms")
        res.figure(f"{shape}_reload_{way}_cpu_ms", statistics.median(cpu[mode]) * 1e3, "ms")
    res.figure(f"{shape}_serial_hash_ms", min(serial) * 1e3, "ms")
    res.figure(f"{shape}_first_chunk_hash_ms", min(first) * 1e3, "ms")
    res.figure(f"{shape}_hash_GBps", nbytes / 1e9 / min(serial), "GB/s")
    res.figure(f"{shape}_copy_GBps", nbytes / 1e9 / min(wall[UNVERIFIED]), "GB/s")
    res.figure(f"{shape}_hash_hidden", min(1.0, max(0.0, (med[UNVERIFIED] + hashing - med["hash"]) / hashing)),
               "share")
    for mode in VERIFIED:
        way = WAYS[mode]
        res.ratio(f"{shape}_{way}_vs_unverified", min(wall[UNVERIFIED]) / min(wall[mode]))
        res.ratio(f"{shape}_{way}_vs_unverified_median", med[UNVERIFIED] / med[mode])
        res.ratio(f"{shape}_{way}_vs_unverified_cpu",
                  statistics.median(cpu[UNVERIFIED]) / statistics.median(cpu[mode]))


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
