"""Every malformed or out-of-order request: the right status, a message naming the field, no
change of state, and a server that keeps serving."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import Any

import aiohttp
import grpc
import numpy as np
import pytest

from kvstore.client import KVStoreClient, namespace_pb
from kvstore.keys import Namespace, prefix_keys
from kvstore.server.sidecar import Sidecar
from kvstore.stats.counters import TIER_COUNTERS
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.conftest import small_config

Code = grpc.StatusCode
METHODS = [m.name for m in pb.DESCRIPTOR.services_by_name["KVStore"].methods]
Rejected = tuple[str, Any, grpc.StatusCode, str]  # method, request (or raw body), status, what the message names
CONTENTS = [np.full(4096, 0xA5, np.uint8), np.arange(4096, dtype=np.uint32).astype(np.uint8)]


@dataclass
class Env:
    sc: Sidecar
    channel: grpc.aio.Channel
    stub: pb_grpc.KVStoreStub
    client: KVStoreClient
    http: aiohttp.ClientSession
    ns: Namespace
    nsp: pb.Namespace
    keys: list[bytes]


@pytest.fixture
async def env(tmp_path, ns):
    cfg = small_config(tmp_path, **{"server.max_batch_blocks": 8, "server.max_message_bytes": 1 << 20})
    async with Sidecar(cfg) as sc:
        url = f"127.0.0.1:{sc.grpc_port}"
        async with (grpc.aio.insecure_channel(url) as ch, KVStoreClient.from_url(url) as client,
                    aiohttp.ClientSession() as http):
            keys = prefix_keys(ns, list(range(11 * ns.block_size)))
            # some state to protect: two committed blocks with known bytes
            assert (await client.put_blocks(ns, keys[:2], CONTENTS)).stored == 2
            yield Env(sc, ch, pb_grpc.KVStoreStub(ch), client, http, ns, namespace_pb(ns), keys)


def strict_json(text: str) -> Any:
    """json.loads that refuses NaN and Infinity, as browsers' JSON.parse does."""
    def refuse(name: str) -> None:
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


async def stats(env: Env) -> dict[str, Any]:
    async with env.http.get(f"http://127.0.0.1:{env.sc.http_port}/stats") as r:
        assert r.status == 200
        return strict_json(await r.text())


async def state(env: Env) -> dict[str, Any]:
    """What a rejected request must leave as it was: occupancy and index counts on /stats, the
    counters of lookups and writes, and the bytes of the committed blocks."""
    doc = await stats(env)
    occupancy = {t: {k: v for k, v in e.items() if k not in TIER_COUNTERS} for t, e in doc["tiers"].items()}
    blocks = await env.client.get_blocks(env.ns, env.keys[:2], verify=True)
    return {
        "occupancy": occupancy, "index": doc["index"], "slab_used": env.sc.slab.used_bytes,
        "lookups": doc["lookups"], "namespaces": doc["namespaces"], "writes": doc["writes"],
        "decisions": doc["decisions"], "blocks": [b.tobytes() for b in blocks],
    }


async def expect(env: Env, call, code: Code, field: str) -> None:
    before = await state(env)
    assert before["blocks"] == [c.tobytes() for c in CONTENTS]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value.details()
    assert field in info.value.details(), info.value.details()
    assert await state(env) == before, f"a rejected request changed state: {field}"
    await alive(env)


async def alive(env: Env) -> None:
    assert (await env.stub.Lookup(pb.LookupRequest(namespace=env.nsp, keys=env.keys[:2]))).matched == 2


def raw(env: Env, method: str, body: bytes):
    """A call whose body is ``body`` as it is, whatever the method's message."""
    return env.channel.unary_unary(f"/kvstore.v1.KVStore/{method}")(body)


async def test_health_and_reflection_are_served(env):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{env.sc.grpc_port}") as ch:
        r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="kvstore.v1.KVStore"))
        assert r.status == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        async def one():
            yield reflection_pb2.ServerReflectionRequest(list_services="")

        names = []
        async for resp in reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(one()):
            names = [s.name for s in resp.list_services_response.service]
        assert "kvstore.v1.KVStore" in names


def decision(**fields: Any) -> pb.Decision:
    good = {"namespace": "tiny-llama", "prompt_blocks": 4, "cached_blocks": 2, "loaded_blocks": 2, "tier": "dram",
            "predicted_load_s": 0.01, "predicted_recompute_s": 0.2, "actual_s": 0.012, "outcome": "loaded"}
    return pb.Decision(**{**good, **fields})


def rejected_calls(env: Env, pending: pb.AllocateResponse, aborted: pb.AllocateResponse) -> list[Rejected]:
    """Bad fields for every RPC, and for each a body that does not decode."""
    nsp, keys, slot_id = env.nsp, env.keys, pending.blocks[0].slot.slot_id
    stranger = namespace_pb(Namespace(model="never-stored", kv_layout="raw", dtype="uint8", block_size=16))
    no_such_dtype = pb.Namespace(model=nsp.model, kv_layout=nsp.kv_layout, dtype="float64", block_size=16)
    no_block_size = pb.Namespace(model=nsp.model, kv_layout=nsp.kv_layout, dtype=nsp.dtype)
    future = pb.Namespace.FromString(nsp.SerializeToString() + bytes([0x98, 0x06, 0x01]))  # a field 99
    unknown = pb.AllocateResponse(allocation_id="nope")
    bad, missing = Code.INVALID_ARGUMENT, Code.NOT_FOUND

    def lookup(namespace: pb.Namespace | None = nsp, **kw: Any) -> pb.LookupRequest:
        return pb.LookupRequest(namespace=namespace, **kw)

    def allocate(*blocks: pb.BlockSpec, namespace: pb.Namespace = nsp) -> pb.AllocateRequest:
        return pb.AllocateRequest(namespace=namespace, blocks=blocks)

    def commit(*blocks: pb.CommitBlock, alloc: pb.AllocateResponse = pending, retain_ms: int = 0) -> pb.CommitRequest:
        return pb.CommitRequest(allocation_id=alloc.allocation_id, blocks=blocks, retain_ms=retain_ms)

    def report(*decisions: pb.Decision) -> pb.ReportRequest:
        return pb.ReportRequest(decisions=decisions)

    return [
        ("Lookup", lookup(keys=[keys[0], b"short"]), bad, "keys[1]"),
        ("Lookup", lookup(), bad, "keys: empty"),
        ("Lookup", lookup(keys=[keys[0]] * 9), bad, "batch limit"),
        ("Lookup", lookup(keys=[keys[0]], lease_ttl_ms=10**9), bad, "lease_ttl_ms"),
        ("Lookup", lookup(None, keys=[keys[0]]), bad, "namespace: required"),
        ("Lookup", lookup(no_such_dtype, keys=[keys[0]]), bad, "namespace.dtype"),
        ("Lookup", lookup(no_block_size, keys=[keys[0]]), bad, "namespace.block_size"),
        ("Lookup", lookup(future, keys=[keys[0]]), bad, "unknown field number(s) [99]"),
        ("Lookup", lookup(stranger, keys=[b"short"]), bad, "keys[0]"),
        ("Allocate", allocate(pb.BlockSpec(key=b"x" * 31, size=10)), bad, "blocks[0].key"),
        ("Allocate", allocate(pb.BlockSpec(key=keys[2], parent=b"p", size=10)), bad, "blocks[0].parent"),
        ("Allocate", allocate(pb.BlockSpec(key=keys[2], size=0)), bad, "blocks[0].size"),
        ("Allocate", allocate(pb.BlockSpec(key=keys[2], size=1 << 30)), bad, "blocks[0].size"),
        ("Allocate", allocate(*[pb.BlockSpec(key=keys[2], size=10)] * 2), bad, "blocks[1].key"),
        ("Allocate", allocate(), bad, "blocks: empty"),
        ("Allocate", allocate(pb.BlockSpec(key=keys[2], size=0), namespace=stranger), bad, "blocks[0].size"),
        ("Allocate", pb.AllocateRequest(namespace=nsp, blocks=[pb.BlockSpec(key=keys[2], size=10)], ttl_ms=2**32 - 1),
         bad, "ttl_ms"),
        ("Allocate", allocate(*[pb.BlockSpec(key=k, size=65536) for k in keys[3:11]]),  # 512 KiB > the 256 KiB slab
         Code.RESOURCE_EXHAUSTED, "blocks"),
        ("Commit", commit(pb.CommitBlock(key=keys[2]), alloc=unknown), missing, "allocation_id"),
        ("Commit", pb.CommitRequest(blocks=[pb.CommitBlock(key=keys[2])]), bad, "allocation_id: required"),
        ("Commit", commit(), bad, "blocks: empty"),
        ("Commit", commit(pb.CommitBlock(key=keys[2], slot_id=slot_id + 1)), bad, "blocks[0].slot_id"),
        ("Commit", commit(pb.CommitBlock(key=keys[0], slot_id=slot_id)), bad, "blocks[0].key"),
        ("Commit", commit(*[pb.CommitBlock(key=keys[2], slot_id=slot_id)] * 2), bad, "blocks[1].slot_id"),
        ("Commit", commit(pb.CommitBlock(key=keys[2], slot_id=slot_id, has_checksum=True, checksum=12345)),
         Code.DATA_LOSS, "blocks[0].checksum"),
        ("Commit", commit(pb.CommitBlock(key=keys[2], slot_id=aborted.blocks[0].slot.slot_id), alloc=aborted),
         Code.FAILED_PRECONDITION, "already aborted"),
        ("Abort", pb.AbortRequest(), bad, "allocation_id: required"),
        ("Abort", pb.AbortRequest(allocation_id="nope"), missing, "allocation_id"),
        ("Abort", pb.AbortRequest(allocation_id=aborted.allocation_id), Code.FAILED_PRECONDITION, "already aborted"),
        ("Acquire", pb.AcquireRequest(namespace=nsp, keys=[b"x" * 33]), bad, "keys[0]"),
        ("Acquire", pb.AcquireRequest(namespace=nsp), bad, "keys: empty"),
        ("Acquire", pb.AcquireRequest(namespace=nsp, keys=[keys[0]], lease_ttl_ms=10**9), bad, "lease_ttl_ms"),
        ("Acquire", pb.AcquireRequest(keys=[keys[0]]), bad, "namespace: required"),
        ("Acquire", pb.AcquireRequest(namespace=stranger, keys=[b"x"]), bad, "keys[0]"),
        ("Release", pb.ReleaseRequest(), bad, "lease_id: required"),
        ("Release", pb.ReleaseRequest(lease_id="nope"), missing, "lease_id"),
        ("Delete", pb.DeleteRequest(namespace=nsp, keys=[b""]), bad, "keys[0]"),
        ("Delete", pb.DeleteRequest(namespace=nsp), bad, "keys: empty"),
        ("Delete", pb.DeleteRequest(namespace=nsp, keys=[keys[0]], all_keys=True), bad, "all_keys"),
        ("Delete", pb.DeleteRequest(all_keys=True), bad, "namespace: required"),
        ("Delete", pb.DeleteRequest(namespace=stranger, keys=[b"x"]), bad, "keys[0]"),
        ("Prefetch", pb.PrefetchRequest(namespace=nsp, keys=[keys[0], b"x"]), bad, "keys[1]"),
        ("Prefetch", pb.PrefetchRequest(namespace=nsp), bad, "keys: empty"),
        ("Prefetch", pb.PrefetchRequest(keys=[keys[0]]), bad, "namespace: required"),
        ("Retain", pb.RetainRequest(namespace=nsp, keys=[keys[0]], retain_ms=1000, retain_priority=4), bad,
         "retain_priority"),
        ("Retain", pb.RetainRequest(namespace=nsp, keys=[keys[0]], retain_ms=2**32 - 1), bad, "retain_ms"),
        ("Retain", pb.RetainRequest(namespace=nsp, retain_ms=1000), bad, "keys: empty"),
        ("Retain", pb.RetainRequest(keys=[keys[0]], retain_ms=1000), bad, "namespace: required"),
        ("Acquire", pb.AcquireRequest(namespace=nsp, keys=[keys[0]], retain_ms=1000, retain_priority=9), bad,
         "retain_priority"),
        ("Commit", commit(pb.CommitBlock(key=keys[2], slot_id=slot_id), retain_ms=10**9), bad, "retain_ms"),
        ("Report", report(*[decision()] * 1025), bad, "decisions: 1025 records"),
        ("Report", report(decision(predicted_load_s=math.nan)), bad, "decisions[0].predicted_load_s"),
        ("Report", report(decision(predicted_recompute_s=-1.0)), bad, "decisions[0].predicted_recompute_s"),
        ("Report", report(decision(), decision(actual_s=math.inf)), bad, "decisions[1].actual_s"),  # none is kept
        ("Report", report(decision(namespace="m" * 100_000)), bad, "decisions[0].namespace"),
        ("Report", report(decision(tier="tape")), bad, "decisions[0].tier"),
        ("Report", report(decision(outcome="won")), bad, "decisions[0].outcome"),
        ("Report", report(decision(outcome="loaded:" + "x" * 8)), bad, "decisions[0].outcome"),
        ("Report", report(decision(outcome="fallback:" + "x" * 100)), bad, "decisions[0].outcome"),
        ("Report", report(decision(outcome="bypass:teleport")), bad, "decisions[0].outcome"),  # a closed set
        ("Report", report(decision(outcome="bypass:")), bad, "decisions[0].outcome"),
        # no connector bypasses a multimodal request (its items are keyed): not a reason /stats keeps
        ("Report", report(decision(outcome="bypass:multimodal")), bad, "decisions[0].outcome"),
        ("Echo", pb.EchoRequest(payload=b"x" * (2 << 20)), Code.RESOURCE_EXHAUSTED, ""),  # over the message limit
    ] + [(m, b"\xff" * 16, bad, f"request: not a {m}Request") for m in METHODS]  # bodies that do not decode


async def test_a_rejected_call_to_any_rpc_changes_no_state(env):
    """The README's promise, for every RPC: occupancy, index counts, counters and a committed
    block's bytes are the same after each rejected call as before it."""
    def allocation(key: bytes) -> pb.AllocateRequest:
        return pb.AllocateRequest(namespace=env.nsp, blocks=[pb.BlockSpec(key=key, parent=env.keys[1], size=4096)])

    pending = await env.stub.Allocate(allocation(env.keys[2]))
    aborted = await env.stub.Allocate(allocation(prefix_keys(env.ns, [7] * env.ns.block_size)[0]))
    assert (await env.stub.Abort(pb.AbortRequest(allocation_id=aborted.allocation_id))).released == 1
    calls = rejected_calls(env, pending, aborted)
    assert {method for method, *_ in calls} == set(METHODS)
    for method, request, code, field in calls:
        call = raw(env, method, request) if isinstance(request, bytes) else getattr(env.stub, method)(request)
        await expect(env, call, code, field)
    # the pending allocation survived every rejected Commit and is still good
    commit = pb.CommitRequest(allocation_id=pending.allocation_id, blocks=[
        pb.CommitBlock(key=env.keys[2], slot_id=pending.blocks[0].slot.slot_id)])
    assert (await env.stub.Commit(commit)).committed == 1
    await expect(env, env.stub.Commit(commit), Code.FAILED_PRECONDITION, "already committed")
    await expect(env, env.stub.Abort(pb.AbortRequest(allocation_id=pending.allocation_id)),
                 Code.FAILED_PRECONDITION, "already committed")
    assert (await env.stub.Lookup(pb.LookupRequest(namespace=env.nsp, keys=env.keys[:3]))).matched == 3


async def test_undecodable_bodies_answer_invalid_argument_counted_and_logged_once(env, caplog):
    caplog.set_level(logging.DEBUG)
    for method in METHODS:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await raw(env, method, b"\xff" * 16)
        assert info.value.code() == Code.INVALID_ARGUMENT
        assert f"request: not a {method}Request" in info.value.details()
    doc = await stats(env)
    assert doc["bad_requests"] == len(METHODS)
    assert doc["errors"]["INVALID_ARGUMENT"] == len(METHODS)
    async with env.http.get(f"http://127.0.0.1:{env.sc.http_port}/metrics") as r:
        assert f"kvstore_bad_requests_total {float(len(METHODS))}" in await r.text()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], "no traceback"
    lines = [r for r in caplog.records if "undecodable" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING, [r.getMessage() for r in lines]
    await alive(env)


async def test_reported_decisions_are_kept_and_stats_stay_strict_json(env):
    await env.stub.Report(pb.ReportRequest(decisions=[
        decision(), decision(tier="ssd", outcome="fallback:checksum"), decision(tier="", outcome=""),
        decision(tier="", outcome="bypass:lora"), decision(tier="", outcome="bypass:lora"),
        decision(tier="", outcome="bypass:prompt_embeds")]))
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(grpc.aio.AioRpcError):
            await env.stub.Report(pb.ReportRequest(decisions=[decision(predicted_load_s=bad, actual_s=bad)]))
    doc = await stats(env)  # strict: a NaN would not parse
    assert doc["decisions"]["counts"] == {"loaded": 1, "fallback": 1, "unknown": 1, "bypass": 3, "total": 6}
    assert doc["decisions"]["bypasses"] == {"lora": 2, "prompt_embeds": 1}
    assert [d["outcome"] for d in doc["decisions"]["recent"]] == [
        "loaded", "fallback:checksum", "unknown", "bypass:lora", "bypass:lora", "bypass:prompt_embeds"]
    strict_json((await env.stub.Stats(pb.StatsRequest())).json)
