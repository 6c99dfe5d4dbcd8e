"""Lookup of 2,048 keys against a bare gRPC echo of the same request on the same server.

The sidecar runs in its own process (`kvstore serve`); the client is this process. The keys are
all present (a full hit, the most work for the server). The echo carries the same keys, so the
request size and its parsing are the same; the ratio is echo p50 / lookup p50.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from tqdm import tqdm

from benchmarks.common import Result, percentile, sidecar_process
from kvstore.client import KVStoreClient, namespace_pb
from kvstore.keys import Namespace, prefix_keys
from kvstore.v1 import kvstore_pb2 as pb


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keys", type=int, default=2048)
    p.add_argument("--calls", type=int, default=1000)


async def _measure(call, request, n: int, desc: str) -> list[float]:
    for _ in range(min(50, n)):
        await call(request)
    lat = []
    for _ in tqdm(range(n), desc=desc, leave=False, disable=None):
        t = time.perf_counter()
        await call(request)
        lat.append(time.perf_counter() - t)
    return lat


async def _run(url: str, n_keys: int, calls: int) -> dict[str, list[float]]:
    ns = Namespace(model="bench", kv_layout="raw", dtype="float16", block_size=16)
    keys = prefix_keys(ns, [1] * (16 * n_keys))
    async with KVStoreClient.from_url(url) as c:
        for i in range(0, n_keys, 512):  # store them (4 KiB each) so every lookup is a full hit
            await c.put_blocks(ns, keys[i : i + 512], [bytes(4096)] * len(keys[i : i + 512]), first_parent=keys[i - 1] if i else b"")
        stub = c._stub
        lookup_req = pb.LookupRequest(namespace=namespace_pb(ns), keys=keys)
        echo_req = pb.EchoRequest(keys=keys)
        assert (await stub.Lookup(lookup_req)).matched == n_keys
        out: dict[str, list[float]] = {"lookup": [], "echo": []}
        # Interleave rounds so that machine noise hits both alike.
        for _ in range(4):
            out["echo"] += await _measure(stub.Echo, echo_req, calls // 4, "echo")
            out["lookup"] += await _measure(stub.Lookup, lookup_req, calls // 4, "lookup")
        return out


def run(args: argparse.Namespace) -> dict:
    res = Result("lookup")
    with sidecar_process(64 << 20) as sc:
        lat = asyncio.run(_run(sc.grpc, args.keys, args.calls))
    for name, samples in lat.items():
        res.figure(f"{name}_p50", percentile(samples, 50) * 1e3, "ms")
        res.figure(f"{name}_p99", percentile(samples, 99) * 1e3, "ms")
        res.figure(f"{name}_calls_per_s", len(samples) / sum(samples), "calls/s")
    res.figure("keys_per_call", args.keys, "keys")
    res.ratio("lookup_p50_vs_echo", percentile(lat["echo"], 50) / percentile(lat["lookup"], 50))
    res.ratio("lookup_p99_vs_echo", percentile(lat["echo"], 99) / percentile(lat["lookup"], 99))
    res.ratio("lookup_calls_per_s_vs_echo", sum(lat["echo"]) / sum(lat["lookup"]))
    return res.as_dict()
