"""A reload through the connector with checksums verified, as shipped, against the same reload
without, in the same run (CPU).

A sidecar (`kvstore serve`, its own process) holds ``--blocks`` blocks of a model shape (vLLM's
CPU layout, bf16, 16-token blocks), saved through the connector (``save_blocks``) and sealed by
the sidecar. Each round reloads them all into the engine's cache through the connector's load
(``load_blocks``: Acquire, copy into the cache by ``NumpyTransfer``, Release) once with
``verify=True`` (every slot checked against its checksum before it is copied, the hashing
overlapped with the copy: ``connector/core/verified.py``) and once with ``verify=False``, in
alternating order; each figure is the best round. ``<shape>_verified_vs_unverified`` = the
unverified reload's time ÷ the verified one's (1.0: verification costs nothing; the target is
≥ 1/1.1). ``<shape>_serial_hash_ms`` is what one thread hashing the batch before the copy (the
check until #39) would have added.

    kvstore bench reload --json
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from benchmarks.common import Result, sidecar_process
from benchmarks.transfer_shapes import SHAPES, spec_of
from connector.core.metadata import LoadSpec, SaveSpec
from connector.core.ops import load_blocks, save_blocks
from connector.transfer import NumpyTransfer, bind_caches
from kvstore.client import SyncClient
from kvstore.keys import Namespace, prefix_keys
from kvstore.store.checksum import checksum

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
        load = LoadSpec("load", tuple(keys), tuple(range(n, 2 * n)), 0, spec.block_size)

        def reload(verify: bool) -> float:
            r = load_blocks(client, ns, kv, t, load, verify=verify)
            if r.loaded != n:
                raise SystemExit(f"kvstore bench reload: {r.loaded} of {n} blocks loaded ({r.failure})")
            return r.seconds

        def serial_hash() -> float:
            with client.acquire(ns, keys) as lease:
                t0 = time.perf_counter()
                for v in lease.views:
                    checksum(v)
                return time.perf_counter() - t0

        reload(True), reload(False)  # warm-up
        best = {True: float("inf"), False: float("inf")}
        hashing = float("inf")
        for i in range(rounds):
            for verify in (True, False) if i % 2 == 0 else (False, True):
                best[verify] = min(best[verify], reload(verify))
            hashing = min(hashing, serial_hash())
    res.figure(f"{shape}_blocks", n, "blocks")
    res.figure(f"{shape}_block_bytes", bb, "B")
    res.figure(f"{shape}_reload_verified_ms", best[True] * 1e3, "ms")
    res.figure(f"{shape}_reload_unverified_ms", best[False] * 1e3, "ms")
    res.figure(f"{shape}_serial_hash_ms", hashing * 1e3, "ms")
    res.ratio(f"{shape}_verified_vs_unverified", best[False] / best[True])


def run(args: argparse.Namespace) -> dict:
    res = Result("reload")
    shapes = [s for s in args.shapes.split(",") if s]
    for s in shapes:
        if s not in SHAPES:
            raise SystemExit(f"--shapes: {s!r} is not one of {sorted(SHAPES)}")
    res.notes["device"] = "cpu"
    for s in shapes:
        _shape(res, s, args.blocks, args.rounds)
    return res.as_dict()
