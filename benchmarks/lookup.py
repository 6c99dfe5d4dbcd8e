"""Lookup of 2,048-key requests against an Echo of the same requests, on the same server and
transport.

The sidecar runs in its own process (`kvstore serve`); the client is this process. The store
holds ``--chains`` prefix chains of ``--keys`` blocks each. Every call sends a different request
from the one before it, cycling through a mix of three kinds, one per chain each:

* ``full``    every key of a stored chain (a full hit: every key probed, a policy update of the
              whole run);
* ``partial`` the first half of a stored chain, then keys never stored (a partial hit: the run's
              policy update, and the keys checked, as for every request that is not a full hit);
* ``miss``    keys never stored (the first probe misses; the keys are checked).

Distinct consecutive requests matter: the store counts a run touched twice in a row once (a hot
prefix), so one request repeated would skip the policy update of every call after the first.
The echo carries the same keys in the same order (``EchoRequest.keys``), so request sizes and
parsing match; ratios are echo p50 / lookup p50 (above 1: the lookup is faster than a bare echo).

* ``lookup_p50_vs_echo`` (and p99, calls/s): the async client over gRPC, both calls on the stub;
  per kind: ``lookup_<kind>_p50_vs_echo``.
* The blocking client (what engine connectors use), over gRPC and over the sidecar's Unix socket
  (:mod:`kvstore.wire.framing`), each with a lookup and an echo over the same transport:
  ``lookup_local_p50_vs_echo`` (socket lookup vs socket echo), ``lookup_sync_grpc_p50_vs_echo``
  (gRPC lookup vs gRPC echo); and ``local_vs_grpc_[idle_]p50`` = gRPC lookup p50 / socket lookup
  p50, back to back and after ``--idle-ms`` of idle before each call (an engine's lookup usually
  comes after a pause, and a call after a pause wakes every thread on its path).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from tqdm import tqdm

from benchmarks.common import Result, percentile, sidecar_process
from kvstore.client import KVStoreClient, SyncClient, namespace_pb
from kvstore.keys import BlockKey, Namespace, prefix_keys
from kvstore.v1 import kvstore_pb2 as pb

NS = Namespace(model="bench", kv_layout="raw", dtype="float16", block_size=16)
BLOCK_BYTES = 4096
KINDS = ("full", "partial", "miss")
STORE_BATCH = 512


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keys", type=int, default=2048, help="keys per request")
    p.add_argument("--chains", type=int, default=4, help="stored chains; requests cycle over chains x kinds")
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--idle-ms", type=float, default=300.0, help="pause before each call of the idle rounds")
    p.add_argument("--idle-calls", type=int, default=20)


class Requests:
    """The request mix: (kind, keys) for each chain and kind, in an order where no two
    consecutive requests are the same (kinds rotate, chains too)."""

    def __init__(self, n_keys: int, chains: int) -> None:
        bs = NS.block_size
        self.n_keys, self.chains = n_keys, chains
        self.stored = [prefix_keys(NS, [c + 1] * (bs * n_keys)) for c in range(chains)]
        half = n_keys // 2
        self.mix: list[tuple[str, list[BlockKey]]] = []
        for c in range(chains):
            self.mix.append(("full", self.stored[c]))
            partial = [c + 1] * (bs * half) + [1000 + c] * (bs * (n_keys - half))  # diverges at block ``half``
            self.mix.append(("partial", prefix_keys(NS, partial)))
            self.mix.append(("miss", prefix_keys(NS, [2000 + c] * (bs * n_keys))))
        # kind i of chain (i + k) % chains: consecutive requests differ in kind and in chain
        self.mix = [self.mix[3 * ((i + k) % chains) + i] for k in range(chains) for i in range(3)]

    def matched(self, kind: str) -> int:
        return {"full": self.n_keys, "partial": self.n_keys // 2, "miss": 0}[kind]

    def cycle(self, n: int) -> list[tuple[str, list[BlockKey]]]:
        return list(itertools.islice(itertools.cycle(self.mix), n))


Samples = dict[str, list[tuple[str, float]]]  # series -> (kind, seconds) per call


async def _store(c: KVStoreClient, reqs: Requests) -> None:
    for keys in reqs.stored:
        for i in range(0, len(keys), STORE_BATCH):
            part = keys[i : i + STORE_BATCH]
            await c.put_blocks(NS, part, [bytes(BLOCK_BYTES)] * len(part), first_parent=keys[i - 1] if i else b"")


async def _measure(
    call: Callable[[Any], Awaitable[Any]], requests: Sequence[tuple[str, Any]], desc: str
) -> list[tuple[str, float]]:
    for _, r in requests[: min(50, len(requests))]:  # warm-up
        await call(r)
    out = []
    for kind, r in tqdm(requests, desc=desc, leave=False, disable=None):
        t = time.perf_counter()
        await call(r)
        out.append((kind, time.perf_counter() - t))
    return out


async def _async_grpc(url: str, reqs: Requests, calls: int) -> Samples:
    async with KVStoreClient.from_url(url) as c:
        await _store(c, reqs)
        stub = c._grpc.stub
        ns_pb = namespace_pb(NS)
        for kind, keys in reqs.mix:
            assert (await stub.Lookup(pb.LookupRequest(namespace=ns_pb, keys=keys))).matched == reqs.matched(kind), kind
        mix = reqs.cycle(calls // 4)
        lookups = [(kind, pb.LookupRequest(namespace=ns_pb, keys=keys)) for kind, keys in mix]
        echoes = [(kind, pb.EchoRequest(keys=keys)) for kind, keys in mix]
        out: Samples = {"lookup": [], "echo": []}
        for _ in range(4):  # rounds interleaved, so that machine noise hits both alike
            out["echo"] += await _measure(stub.Echo, echoes, "echo")
            out["lookup"] += await _measure(stub.Lookup, lookups, "lookup")
        return out


def _blocking(url: str, reqs: Requests, calls: int, idle_calls: int, idle_s: float) -> Samples:
    """SyncClient lookups and echoes over gRPC and over the local socket, interleaved; lookups
    back to back and after idle. Each call builds its request from the keys, as a lookup does."""
    out: Samples = {}
    with SyncClient(url, local=False) as grpc_c, SyncClient(url) as local_c:
        clients = {"grpc": grpc_c, "local": local_c}
        for c in clients.values():
            for kind, keys in reqs.mix:
                assert c.lookup(NS, keys).matched == reqs.matched(kind), kind
        assert local_c.transport == "local", "the sidecar's local socket could not be opened"
        ops: dict[str, Callable[[SyncClient, list[BlockKey]], Any]] = {
            "lookup": lambda c, keys: c.lookup(NS, keys),
            "echo": lambda c, keys: c._call("Echo", pb.EchoRequest(keys=keys)),  # the same transport as its lookup
        }
        mix = reqs.cycle(calls // 4)
        for _ in range(4):
            for name, c in clients.items():
                for op, call in ops.items():
                    series = out.setdefault(f"sync_{name}_{op}", [])
                    for kind, keys in mix:
                        t = time.perf_counter()
                        call(c, keys)
                        series.append((kind, time.perf_counter() - t))
        for kind, keys in tqdm(reqs.cycle(idle_calls), desc="idle lookups", leave=False, disable=None):
            for name, c in clients.items():
                time.sleep(idle_s)
                t = time.perf_counter()
                c.lookup(NS, keys)
                out.setdefault(f"sync_{name}_lookup_idle", []).append((kind, time.perf_counter() - t))
    return out


def _p50(samples: list[tuple[str, float]], kind: str | None = None) -> float:
    return percentile([s for k, s in samples if kind is None or k == kind], 50)


def run(args: argparse.Namespace) -> dict:
    res = Result("lookup")
    reqs = Requests(args.keys, args.chains)
    dram = 2 * args.chains * args.keys * BLOCK_BYTES + (16 << 20)
    with sidecar_process(dram) as sc:
        lat = asyncio.run(_async_grpc(sc.grpc, reqs, args.calls))
        lat.update(_blocking(sc.grpc, reqs, args.calls // 4, args.idle_calls, args.idle_ms / 1000))
    for name, samples in lat.items():
        seconds = [s for _, s in samples]
        res.figure(f"{name}_p50", percentile(seconds, 50) * 1e3, "ms")
        res.figure(f"{name}_p99", percentile(seconds, 99) * 1e3, "ms")
        res.figure(f"{name}_calls_per_s", len(seconds) / sum(seconds), "calls/s")
        if not name.endswith("_idle"):
            for kind in KINDS:
                res.figure(f"{name}_{kind}_p50", _p50(samples, kind) * 1e3, "ms")
    res.figure("keys_per_call", args.keys, "keys")
    res.figure("distinct_requests", len(reqs.mix), "count")
    echo, lookup = lat["echo"], lat["lookup"]
    res.ratio("lookup_p50_vs_echo", _p50(echo) / _p50(lookup))
    res.ratio("lookup_p99_vs_echo", percentile([s for _, s in echo], 99) / percentile([s for _, s in lookup], 99))
    res.ratio("lookup_calls_per_s_vs_echo", sum(s for _, s in echo) / sum(s for _, s in lookup))
    for kind in KINDS:
        res.ratio(f"lookup_{kind}_p50_vs_echo", _p50(echo, kind) / _p50(lookup, kind))
    res.ratio("lookup_local_p50_vs_echo", _p50(lat["sync_local_echo"]) / _p50(lat["sync_local_lookup"]))
    res.ratio("lookup_sync_grpc_p50_vs_echo", _p50(lat["sync_grpc_echo"]) / _p50(lat["sync_grpc_lookup"]))
    res.ratio("local_vs_grpc_p50", _p50(lat["sync_grpc_lookup"]) / _p50(lat["sync_local_lookup"]))
    res.ratio("local_vs_grpc_idle_p50", _p50(lat["sync_grpc_lookup_idle"]) / _p50(lat["sync_local_lookup_idle"]))
    res.notes["mix"] = (f"{args.chains} chains x (full hit, half hit, miss) of {args.keys} keys, no request twice"
                        " in a row; echoes carry the same keys over the same transport")
    return res.as_dict()
