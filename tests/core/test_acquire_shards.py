"""A sharded Acquire (``AcquireRequest.shards``: the tensor-parallel ranks of one engine, each its
own namespace and keys): every shard's run is cut to the shortest, each shard is leased on its own,
nothing stays leased when one shard has nothing; bad input is refused whole, naming the field,
before anything is leased; an answer whose shards disagree is refused by the client."""

from __future__ import annotations

import dataclasses

import grpc
import numpy as np
import pytest

from kvstore.client import KVStoreClient, namespace_pb
from kvstore.client.calls import acquired_shards
from kvstore.errors import KVStoreError
from kvstore.keys import Namespace, prefix_keys
from kvstore.server.sidecar import Sidecar
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

TOKENS = list(range(16 * 5))


def ranks(ns: Namespace, n: int = 3) -> list[Namespace]:
    return [dataclasses.replace(ns, rank=r, world_size=n) for r in range(n)]


def shards_of(nss: list[Namespace]) -> list[pb.Shard]:
    return [pb.Shard(namespace=namespace_pb(n), keys=prefix_keys(n, TOKENS)) for n in nss]


async def put(client: KVStoreClient, ns: Namespace, n: int) -> list[np.ndarray]:
    blocks = [np.full(4096, ns.rank * 16 + i + 1, np.uint8) for i in range(n)]
    await client.put_blocks(ns, prefix_keys(ns, TOKENS)[:n], blocks, checksums=True)
    return blocks


@pytest.mark.parametrize("packed", [True, False])
async def test_every_shard_is_cut_to_the_shortest_run_and_leased_on_its_own(
    sidecar: Sidecar, client: KVStoreClient, ns: Namespace, packed: bool,
) -> None:
    nss = ranks(ns)
    stored = [await put(client, n, k) for n, k in zip(nss, (5, 2, 4))]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}") as ch:
        stub = pb_grpc.KVStoreStub(ch)
        r = await stub.Acquire(pb.AcquireRequest(namespace=namespace_pb(nss[0]), keys=prefix_keys(nss[0], TOKENS),
                                                 shards=shards_of(nss[1:]), packed=packed))
        runs = acquired_shards(r, 5, 2)
        assert [len(run.slots) for run in runs] == [2, 2, 2]
        assert len({run.lease_id for run in runs}) == 3 and all(run.lease_id for run in runs)
        assert sidecar.store.index.count()["leases"] == 3
        for run, blocks in zip(runs, stored):
            seen = [bytes(memoryview(sidecar.store.slab.buf)[s.offset : s.offset + s.length]) for s in run.slots]
            assert seen == [b.tobytes() for b in blocks[:2]]
        for run in runs:
            await stub.Release(pb.ReleaseRequest(lease_id=run.lease_id))
    assert sidecar.store.index.count()["leases"] == 0


async def test_a_shard_without_the_first_block_leaves_nothing_leased(
    sidecar: Sidecar, client: KVStoreClient, ns: Namespace,
) -> None:
    nss = ranks(ns)
    await put(client, nss[0], 5)
    await put(client, nss[1], 5)  # rank 2 has nothing
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}") as ch:
        r = await pb_grpc.KVStoreStub(ch).Acquire(pb.AcquireRequest(
            namespace=namespace_pb(nss[0]), keys=prefix_keys(nss[0], TOKENS), shards=shards_of(nss[1:]), packed=True))
    assert [(run.lease_id, run.slots) for run in acquired_shards(r, 5, 2)] == [("", [])] * 3
    assert sidecar.store.index.count()["leases"] == 0


def _bad(ns: Namespace, case: str) -> pb.AcquireRequest:
    nss = ranks(ns)
    shards = shards_of(nss[1:])
    if case == "keys":
        del shards[1].keys[-1]
    elif case == "namespace":
        shards[0].namespace.dtype = "float99"
    elif case == "missing":
        shards[1].ClearField("namespace")
    elif case == "many":
        shards = shards_of([dataclasses.replace(ns, rank=r, world_size=80) for r in range(1, 66)])
    return pb.AcquireRequest(namespace=namespace_pb(nss[0]), keys=prefix_keys(nss[0], TOKENS), shards=shards,
                             packed=True)


@pytest.mark.parametrize(("case", "message"), [
    ("keys", "shards[1].keys: 4 keys, expected 5"),
    ("namespace", "shards[0].namespace.dtype: 'float99' is not one of"),
    ("missing", "shards[1].namespace: required"),
    ("many", "shards: 65 shards exceed the limit of 64"),
])
async def test_bad_shards_are_refused_whole_before_anything_is_leased(
    sidecar: Sidecar, client: KVStoreClient, ns: Namespace, case: str, message: str,
) -> None:
    for n in ranks(ns):
        await put(client, n, 5)
    acquires = sidecar.store.stats.reads["acquires"]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pb_grpc.KVStoreStub(ch).Acquire(_bad(ns, case))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    assert sidecar.store.index.count()["leases"] == 0
    assert sidecar.store.stats.reads["acquires"] == acquires  # nothing was acquired


@pytest.mark.parametrize(("answer", "field"), [
    (pb.AcquireResponse(lease_id="a", segment="/s", offsets=[0], lengths=[1], checksums=[1]),
     "shards has 0 entries for 1 shards asked"),
    (pb.AcquireResponse(lease_id="a", segment="/s", offsets=[0], lengths=[1], checksums=[1],
                        shards=[pb.AcquireResponse(lease_id="b")]),
     "shards[0] has a run of 0 blocks, the request's 1"),
])
def test_an_answer_whose_shards_disagree_is_refused(answer: pb.AcquireResponse, field: str) -> None:
    with pytest.raises(KVStoreError, match=field.replace("[", r"\[").replace("]", r"\]")):
        acquired_shards(answer, 2, 1)
