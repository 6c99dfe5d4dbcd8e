"""KV-aware routing: the Route RPC and GET/POST /route on a sidecar of a two-node cluster."""

from __future__ import annotations

import json

import aiohttp
import grpc
import pytest

from kvstore.keys import Namespace
from kvstore.server.sidecar import Sidecar
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.cluster.nodes import blocks, client_of, keys_for

NS = pb.Namespace(model="tiny-llama", kv_layout="raw", dtype="float16", block_size=16)


async def route(sc: Sidecar, keys: list[bytes], loads: dict[str, float] | None = None) -> list[pb.RouteNode]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sc.grpc_port}") as ch:
        r = await pb_grpc.KVStoreStub(ch).Route(pb.RouteRequest(namespace=NS, keys=keys, loads=loads or {}))
    return list(r.nodes)


async def test_route_ranks_the_node_holding_the_longest_prefix_first(
    pair: tuple[Sidecar, Sidecar], ns: Namespace
) -> None:
    a, b = pair
    keys = keys_for(ns, 6, seed=20)
    async with client_of(a) as ca, client_of(b) as cb:
        await ca.put_blocks(ns, keys[:4], blocks(4, seed=20), wait_published=True)
        await cb.put_blocks(ns, keys[:1], blocks(1, seed=20), wait_published=True)
    nodes = await route(b, keys)  # asked on B: the answer is the cluster's
    assert [(n.node, n.prefix, n.dram, n.peer) for n in nodes] == [("a", 4, 4, 0), ("b", 4, 1, 3)]
    assert nodes[0].score == 4.0 and nodes[1].score == 1.0 + 3 * 0.5
    # A far over the mean load: the cap ranks it after B
    busy = await route(b, keys, {"a": 10.0, "b": 0.0})
    assert [n.node for n in busy] == ["b", "a"] and busy[1].load == 10.0


async def test_http_route_takes_token_ids_or_keys(pair: tuple[Sidecar, Sidecar], ns: Namespace) -> None:
    a, b = pair
    tokens = list(range(20 * 1000, 20 * 1000 + 6 * 16))  # the tokens keys_for(ns, 6, seed=20) keys
    keys = keys_for(ns, 6, seed=20)
    async with client_of(a) as ca:
        await ca.put_blocks(ns, keys[:3], blocks(3, seed=20), wait_published=True)
    namespace = {"model": ns.model, "kvLayout": ns.kv_layout, "dtype": ns.dtype, "blockSize": ns.block_size}
    async with aiohttp.ClientSession() as http:
        url = f"http://127.0.0.1:{b.http_port}/route"
        async with http.post(url, json={"namespace": namespace, "tokens": tokens}) as r:
            assert r.status == 200
            doc = await r.json()
        assert [(n["node"], n["prefix"], n["dram"]) for n in doc["nodes"]] == [("a", 3, 3), ("b", 3, 0)]
        q = json.dumps({"namespace": namespace, "keys": [k.hex() for k in keys]})
        async with http.get(url, params={"q": q}) as r:
            assert (await r.json())["nodes"][0]["node"] == "a"
        for bad, field in (({"namespace": namespace}, "keys"), ({"namespace": namespace, "keys": ["zz"]}, "keys"),
                           ({"keys": [keys[0].hex()]}, "namespace"),
                           ({"namespace": namespace, "tokens": [-1]}, "tokens")):
            async with http.post(url, json=bad) as r:
                assert r.status == 400
                assert (await r.json())["error"].startswith(field), bad


@pytest.mark.parametrize("loads", [{"a": float("nan")}, {"a": -1.0}])
async def test_route_rejects_bad_loads(pair: tuple[Sidecar, Sidecar], ns: Namespace, loads: dict[str, float]) -> None:
    a, _ = pair
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await route(a, keys_for(ns, 2, seed=21), loads)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "loads['a']" in (e.value.details() or "")
