"""Retention at the cost of a heap: a write's time and ``/healthz``'s with 0, 10 k and 100 k
retained blocks, each against the same sidecar work with none retained, in the same run.

Per level, a fresh sidecar (`kvstore serve`, its own process) gets a slab of ``--blocks`` blocks of
``--block-bytes`` (default 100,000 of 4 KiB: 391 MiB) and one tenant fills it: the first N blocks
retained (the oldest, an LRU's first victims), the rest not. Then another tenant writes
``--writes`` one-block prompts, each evicting one block (an unretained one while there is any: at
100 k, retained ones), half of them with a hint of their own (a bound is set, so each hinted
commit checks it), and a ``GET /healthz`` follows each write. The figures are p50s and maxima in
ms; each ratio is the 0-retained level's p50 over this level's (1.0: as fast as with nothing
retained; 0.5: twice as slow). 66d9839 walked every retained block on each eviction and summed every
retained block on each hinted call: seconds a write at 100 k.

The tenants' bounds are set to the slab (``tenants.dram_retained_bytes``) and the total bound is
off (``tenants.retained_fraction`` 1): the bench measures what retention costs, not what it refuses.

    kvstore bench retention --json
"""

from __future__ import annotations

import argparse
import time
import urllib.request

import numpy as np

from benchmarks.common import Result, percentile, sidecar_process
from kvstore.client import SyncClient
from kvstore.keys import Namespace, prefix_keys

MINUTE = 60_000


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", type=int, default=100_000, help="the slab's blocks, all filled")
    p.add_argument("--block-bytes", type=int, default=4096)
    p.add_argument("--levels", default="0,10000,100000", help="retained blocks per level (the first: the baseline)")
    p.add_argument("--writes", type=int, default=200, help="one-block writes per level")
    p.add_argument("--batch", type=int, default=2000, help="blocks per fill call")


def ns(salt: str) -> Namespace:
    return Namespace(model="bench", kv_layout="raw", dtype="uint8", block_size=16, cache_salt=salt)


def level(args: argparse.Namespace, retained: int) -> tuple[list[float], list[float], int]:
    """One sidecar's write and /healthz times (s) with ``retained`` blocks retained; how many
    blocks it held retained at the end."""
    size, page = args.block_bytes, 1 << 20
    slab = -(-args.blocks * size // page) * page  # whole pages: every slot of them filled
    n = slab // size
    env = {"KVSTORE_TENANTS__DRAM_RETAINED_BYTES": str(slab), "KVSTORE_TENANTS__RETAINED_FRACTION": "1",
           "KVSTORE_DRAM__PAGE_BYTES": str(page), "KVSTORE_DRAM__MIN_SLOT_BYTES": str(size)}
    filler, writer = ns("filler"), ns("writer")
    data = np.zeros((args.batch, size), np.uint8)
    with sidecar_process(slab, env=env) as sc, SyncClient(sc.grpc) as c:
        retained = min(retained, n)
        for first, end, hint in ((0, retained, 10 * MINUTE), (retained, n, 0)):  # the retained ones oldest
            for start in range(first, end, args.batch):  # unrelated one-block prompts: each block a leaf
                count = min(args.batch, end - start)
                keys = [prefix_keys(filler, [start + i] * 16)[0] for i in range(count)]
                c.put_blocks(filler, keys, list(data[:count]), parents=[b""] * count, retain=(hint, 0))
        url = f"http://{sc.http}/healthz"
        writes, probes = [], []
        for w in range(args.writes):
            key = prefix_keys(writer, [10_000_000 + w] * 16)[0]
            t = time.perf_counter()
            c.put_blocks(writer, [key], [data[0]], retain=(MINUTE if w % 2 else 0, 0))
            writes.append(time.perf_counter() - t)
            t = time.perf_counter()
            with urllib.request.urlopen(url, timeout=60) as r:
                r.read()
            probes.append(time.perf_counter() - t)
        held = int(c.stats()["retained"]["blocks"])
    return writes, probes, held


def run(args: argparse.Namespace) -> dict[str, object]:
    res = Result("retention")
    levels = [int(x) for x in args.levels.split(",")]
    base_w = base_h = 0.0
    for i, n in enumerate(levels):
        writes, probes, held = level(args, n)
        w, h = percentile(writes, 50) * 1000, percentile(probes, 50) * 1000
        res.figure(f"write_p50_{n}_retained", w, "ms")
        res.figure(f"healthz_p50_{n}_retained", h, "ms")
        res.figure(f"write_max_{n}_retained", max(writes) * 1000, "ms")
        res.figure(f"healthz_max_{n}_retained", max(probes) * 1000, "ms")
        res.figure(f"retained_blocks_held_{n}", held, "blocks")
        if i == 0:
            base_w, base_h = w, h
        res.ratio(f"write_{n}_vs_{levels[0]}_retained", base_w / w)
        res.ratio(f"healthz_{n}_vs_{levels[0]}_retained", base_h / h)
    return res.as_dict()
