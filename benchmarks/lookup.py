"""Lookup of 2,048 keys against a bare gRPC echo of the same request on the same server.

The sidecar runs in its own process (`kvstore serve`); the client is this process. The keys are
all present (a full hit, the most work for the server). The echo carries the same keys, so the
request size and its parsing are the same; the ratio is echo p50 / lookup p50.

Then the blocking client (what engine connectors use) does the same lookup over each transport,
gRPC and the sidecar's Unix socket (:mod:`kvstore.local`): back to back, and after
``--idle-ms`` of idle before each call (an engine's lookup usually comes after a pause, and a
call after a pause wakes every thread on its path). ``lookup_local_p50_vs_echo`` compares the
socket's lookup with the bare gRPC echo; ``local_vs_grpc_[idle_]p50`` = gRPC p50 / socket p50.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from tqdm import tqdm

from benchmarks.common import Result, percentile, sidecar_process
from kvstore.client import KVStoreClient, SyncClient, namespace_pb
from kvstore.keys import Namespace, prefix_keys
from kvstore.v1 import kvstore_pb2 as pb


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keys", type=int, default=2048)
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--idle-ms", type=float, default=300.0, help="pause before each call of the idle rounds")
    p.add_argument("--idle-calls", type=int, default=20)


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


def _blocking(url: str, n_keys: int, calls: int, idle_calls: int, idle_s: float) -> dict[str, list[float]]:
    """SyncClient lookups over gRPC and over the local socket, interleaved; warm and after idle."""
    ns = Namespace(model="bench", kv_layout="raw", dtype="float16", block_size=16)
    keys = prefix_keys(ns, [1] * (16 * n_keys))
    out: dict[str, list[float]] = {}
    with SyncClient(url, local=False) as grpc_c, SyncClient(url) as local_c:
        clients = {"grpc": grpc_c, "local": local_c}
        for c in clients.values():
            assert c.lookup(ns, keys).matched == n_keys
        assert local_c.transport == "local", "the sidecar's local socket could not be opened"
        for _ in range(4):
            for name, c in clients.items():
                for i in range(calls // 4):
                    t = time.perf_counter()
                    c.lookup(ns, keys)
                    out.setdefault(f"sync_{name}_lookup", []).append(time.perf_counter() - t)
        for _ in tqdm(range(idle_calls), desc="idle lookups", leave=False, disable=None):
            for name, c in clients.items():
                time.sleep(idle_s)
                t = time.perf_counter()
                c.lookup(ns, keys)
                out.setdefault(f"sync_{name}_lookup_idle", []).append(time.perf_counter() - t)
    return out


def run(args: argparse.Namespace) -> dict:
    res = Result("lookup")
    with sidecar_process(64 << 20) as sc:
        lat = asyncio.run(_run(sc.grpc, args.keys, args.calls))
        lat.update(_blocking(sc.grpc, args.keys, args.calls // 4, args.idle_calls, args.idle_ms / 1000))
    for name, samples in lat.items():
        res.figure(f"{name}_p50", percentile(samples, 50) * 1e3, "ms")
        res.figure(f"{name}_p99", percentile(samples, 99) * 1e3, "ms")
        res.figure(f"{name}_calls_per_s", len(samples) / sum(samples), "calls/s")
    res.figure("keys_per_call", args.keys, "keys")
    res.ratio("lookup_p50_vs_echo", percentile(lat["echo"], 50) / percentile(lat["lookup"], 50))
    res.ratio("lookup_p99_vs_echo", percentile(lat["echo"], 99) / percentile(lat["lookup"], 99))
    res.ratio("lookup_calls_per_s_vs_echo", sum(lat["echo"]) / sum(lat["lookup"]))
    p50 = {name: percentile(samples, 50) for name, samples in lat.items()}
    res.ratio("lookup_local_p50_vs_echo", p50["echo"] / p50["sync_local_lookup"])
    res.ratio("local_vs_grpc_p50", p50["sync_grpc_lookup"] / p50["sync_local_lookup"])
    res.ratio("local_vs_grpc_idle_p50", p50["sync_grpc_lookup_idle"] / p50["sync_local_lookup_idle"])
    return res.as_dict()
