"""The decode instance's hit path: an ``Acquire`` of a request's blocks and its ``Release``, as the
vLLM connector sends them, against two bare ``Echo`` round trips over the same connection.

The sidecar runs in its own process (`kvstore serve`) and holds ``--requests`` prompts of
``--blocks`` blocks of ``--block-bytes`` each (default: six requests of 25 x 64 KiB, a batch round
of `kvstore bench vllm`). One *hit* is what a P/D decode instance does per request:

* ``acquire``: the scheduler side's :class:`~connector.roles.finders.LeaseFinder` sends the
  ``Acquire`` on its :class:`~kvstore.client.Pipeline` (the sidecar's Unix socket) and reads
  the answer into the lease it hands the worker; then a ``Release`` of that lease on the same
  pipeline. Consecutive hits ask for different requests' blocks (the store counts a run touched
  twice in a row once).
* ``echo`` (the baseline): the same two round trips as ``Echo`` -- the first carrying the same
  keys (``EchoRequest.keys``), the second the lease id's length of payload.

Rounds of each take turns (``--rounds``), so the machine's noise falls on both alike. Per hit:
wall time (p50), the calling thread's CPU time (the engine's side: building the request, reading
the answer) and the sidecar process's CPU time (``/proc/<pid>/stat``, user + system: on a saturated
host a batch round's time follows CPU time, and the sidecar shares the engine's cores). Ratios are
echo / acquire (1.0: a hit costs no more than two bare round trips).

``inproc_*``: the servicer's handlers called directly in this process on an in-process sidecar
(no transport): µs per ``Acquire`` of one request's blocks answered packed (``AcquireRequest.packed``,
what the clients ask for) and, ``inproc_acquire_blocks``, with one ``AcquiredBlock`` per block (what
a client older than that field gets); per ``Release``; per ``Echo``.

    kvstore bench acquire --json
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.common import Result, percentile, process_cpu_s, sidecar_process
from connector.roles.finders import LeaseFinder
from connector.roles.pipeline import PipelineSlot
from kvstore.client import KVStoreClient, Pipeline, SyncClient, namespace_pb
from kvstore.config import load_config
from kvstore.keys import BlockKey, Namespace, prefix_keys
from kvstore.server.service import KVStoreServicer
from kvstore.server.sidecar import Sidecar
from kvstore.v1 import kvstore_pb2 as pb

NS = Namespace(model="bench", kv_layout="raw", dtype="float16", block_size=16)
TTL_MS = 30_000


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", type=int, default=25, help="blocks per request")
    p.add_argument("--block-bytes", type=int, default=65536)
    p.add_argument("--requests", type=int, default=6, help="distinct stored prompts; hits cycle over them")
    p.add_argument("--calls", type=int, default=500, help="hits per round")
    p.add_argument("--rounds", type=int, default=4, help="rounds of each series, taking turns")
    p.add_argument("--inproc-calls", type=int, default=2000, help="handler calls per in-process figure")


def prompts(n_blocks: int, requests: int) -> list[list[BlockKey]]:
    """``requests`` prompts' block keys, no two alike."""
    return [prefix_keys(NS, [r + 1] * (NS.block_size * n_blocks)) for r in range(requests)]


class Series:
    """One kind of hit: its wall times, the caller's and the sidecar's CPU."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.client_cpu = 0.0
        self.sidecar_cpu = 0.0

    def run(self, hit: Callable[[list[BlockKey]], None], keys: list[list[BlockKey]], calls: int, pid: int) -> None:
        s0, c0 = process_cpu_s(pid), time.thread_time()
        for i in range(calls):
            t = time.perf_counter()
            hit(keys[i % len(keys)])
            self.wall.append(time.perf_counter() - t)
        self.client_cpu += time.thread_time() - c0
        self.sidecar_cpu += process_cpu_s(pid) - s0


def _over_socket(args: argparse.Namespace, keys: list[list[BlockKey]]) -> dict[str, Series]:
    dram = 2 * args.requests * args.blocks * args.block_bytes + (16 << 20)
    with sidecar_process(dram) as sc, SyncClient(sc.grpc) as client:
        pid = sc.proc.pid
        for k in keys:
            client.put_blocks(NS, k, [np.full(args.block_bytes, i % 251, np.uint8) for i in range(len(k))],
                              checksums=True)
        slot = PipelineSlot(client)
        try:
            pipe = slot.get()
            if not isinstance(pipe, Pipeline):
                raise RuntimeError("the sidecar's local socket could not be opened: no pipeline to measure")
            finder = LeaseFinder(client, slot)
            echo_payload = b"x" * 32  # a lease id's length

            def acquire(k: list[BlockKey]) -> None:
                pending = finder.begin(NS, k, 0, TTL_MS)
                assert pending is not None
                found = pending.result()
                lease = found.lease
                if lease is None or len(lease.slots) != len(k):
                    raise RuntimeError(f"expected a hit of {len(k)} blocks, got {found}")
                pipe.result(pipe.send("Release", pb.ReleaseRequest(lease_id=lease.id)))

            def echo(k: list[BlockKey]) -> None:
                pipe.result(pipe.send("Echo", pb.EchoRequest(keys=k)))
                pipe.result(pipe.send("Echo", pb.EchoRequest(payload=echo_payload)))

            hits = {"echo": echo, "acquire": acquire}
            out = {name: Series() for name in hits}
            for hit in hits.values():  # warm-up
                Series().run(hit, keys, min(50, args.calls), pid)
            for _ in range(args.rounds):
                for name, hit in hits.items():
                    out[name].run(hit, keys, args.calls, pid)
            if client.stats()["index"]["leases"]:
                raise RuntimeError("the hits left leases open")
        finally:
            slot.close()
    return out


async def _in_process(args: argparse.Namespace, keys: list[list[BlockKey]]) -> dict[str, float]:
    """µs per handler call, the servicer called directly (no transport, no serialization)."""
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-") as d:
        cfg = load_config(None, {
            "data_dir": d, "server.grpc_address": "127.0.0.1:0", "server.http_address": "127.0.0.1:0",
            "server.local_socket": "off", "ssd.enabled": False,
            "dram.capacity_bytes": 2 * args.requests * args.blocks * args.block_bytes + (16 << 20),
        })
        async with Sidecar(cfg) as sc:
            async with KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}", local=False) as c:
                for k in keys:
                    await c.put_blocks(NS, k, [np.full(args.block_bytes, 7, np.uint8)] * len(k), checksums=True)
            servicer = KVStoreServicer(sc.store)
            ns = namespace_pb(NS)
            acquires = {
                name: [pb.AcquireRequest(namespace=ns, keys=k, lease_ttl_ms=TTL_MS, packed=packed) for k in keys]
                for name, packed in (("acquire", True), ("acquire_blocks", False))
            }
            echoes = [pb.EchoRequest(keys=k) for k in keys]
            ctx: Any = None  # the handlers touch their context only to fail a call
            n = args.inproc_calls
            took = {"acquire": 0.0, "acquire_blocks": 0.0, "release": 0.0, "echo": 0.0}
            for i in range(n):
                for name, requests in acquires.items():
                    t0 = time.perf_counter()
                    r = await servicer.Acquire(requests[i % len(requests)], ctx)
                    t1 = time.perf_counter()
                    await servicer.Release(pb.ReleaseRequest(lease_id=r.lease_id), ctx)
                    took[name] += t1 - t0
                    took["release"] += time.perf_counter() - t1
                t0 = time.perf_counter()
                await servicer.Echo(echoes[i % len(echoes)], ctx)
                took["echo"] += time.perf_counter() - t0
            took["release"] /= 2
            return {name: s / n * 1e6 for name, s in took.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    res = Result("acquire")
    keys = prompts(args.blocks, args.requests)
    series = _over_socket(args, keys)
    hits = args.calls * args.rounds
    for name, s in series.items():
        res.figure(f"{name}_p50", percentile(s.wall, 50) * 1e3, "ms")
        res.figure(f"{name}_p99", percentile(s.wall, 99) * 1e3, "ms")
        res.figure(f"{name}_client_cpu", s.client_cpu / hits * 1e3, "ms/hit")
        res.figure(f"{name}_sidecar_cpu", s.sidecar_cpu / hits * 1e3, "ms/hit")
    echo, acq = series["echo"], series["acquire"]
    res.ratio("acquire_p50_vs_echo", percentile(echo.wall, 50) / percentile(acq.wall, 50))
    res.ratio("acquire_client_cpu_vs_echo", echo.client_cpu / acq.client_cpu)
    if acq.sidecar_cpu > 0:  # (counted in clock ticks: a tiny run may see none)
        res.ratio("acquire_sidecar_cpu_vs_echo", echo.sidecar_cpu / acq.sidecar_cpu)
    inproc = asyncio.run(_in_process(args, keys))
    for name, us in inproc.items():
        res.figure(f"inproc_{name}", us, "us")
    res.ratio("inproc_acquire_packed_vs_blocks", inproc["acquire_blocks"] / inproc["acquire"])
    res.figure("blocks_per_request", args.blocks, "blocks")
    res.figure("hits_per_series", hits, "count")
    res.notes["hit"] = ("Acquire (LeaseFinder over the pipeline) + Release vs Echo(same keys) + Echo, "
                        f"{args.requests} distinct requests in turn, {args.rounds} rounds of each taking turns")
    return res.as_dict()
