"""Every malformed or out-of-order request: the right status, a message naming the field, no
change of state, and a server that keeps serving."""

from __future__ import annotations

import grpc
import pytest

from kvstore.client import namespace_pb
from kvstore.keys import prefix_keys
from kvstore.sidecar import Sidecar
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.conftest import small_config

Code = grpc.StatusCode


@pytest.fixture
async def env(tmp_path, ns):
    cfg = small_config(tmp_path, **{"server.max_batch_blocks": 8, "server.max_message_bytes": 1 << 20})
    async with Sidecar(cfg) as sc:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sc.grpc_port}") as ch:
            stub = pb_grpc.KVStoreStub(ch)
            keys = prefix_keys(ns, list(range(3 * ns.block_size)))
            # some state to protect: two committed blocks
            a = await stub.Allocate(pb.AllocateRequest(namespace=namespace_pb(ns), blocks=[
                pb.BlockSpec(key=keys[0], size=4096), pb.BlockSpec(key=keys[1], parent=keys[0], size=4096)]))
            await stub.Commit(pb.CommitRequest(allocation_id=a.allocation_id, blocks=[
                pb.CommitBlock(key=b.key, slot_id=b.slot.slot_id) for b in a.blocks]))
            yield sc, stub, namespace_pb(ns), keys


def state(sc: Sidecar) -> tuple:
    return (sc.store.index.count(), sc.slab.used_bytes)


async def expect(sc, call, code: Code, field: str):
    before = state(sc)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value.details()
    assert field in info.value.details(), info.value.details()
    assert state(sc) == before, "a rejected request changed state"


async def alive(stub, nsp, keys):
    assert (await stub.Lookup(pb.LookupRequest(namespace=nsp, keys=keys))).matched == 2


async def test_wrong_key_length(env):
    sc, stub, nsp, keys = env
    await expect(sc, stub.Lookup(pb.LookupRequest(namespace=nsp, keys=[keys[0], b"short"])), Code.INVALID_ARGUMENT, "keys[1]")
    await expect(sc, stub.Allocate(pb.AllocateRequest(namespace=nsp, blocks=[pb.BlockSpec(key=b"x" * 31, size=10)])),
                 Code.INVALID_ARGUMENT, "blocks[0].key")
    await expect(sc, stub.Allocate(pb.AllocateRequest(namespace=nsp, blocks=[pb.BlockSpec(key=keys[2], parent=b"p", size=10)])),
                 Code.INVALID_ARGUMENT, "blocks[0].parent")
    await expect(sc, stub.Acquire(pb.AcquireRequest(namespace=nsp, keys=[b"x" * 33])), Code.INVALID_ARGUMENT, "keys[0]")
    await expect(sc, stub.Delete(pb.DeleteRequest(namespace=nsp, keys=[b""])), Code.INVALID_ARGUMENT, "keys[0]")
    await alive(stub, nsp, keys)


async def test_empty_and_oversized_batches(env):
    sc, stub, nsp, keys = env
    await expect(sc, stub.Lookup(pb.LookupRequest(namespace=nsp)), Code.INVALID_ARGUMENT, "keys: empty")
    await expect(sc, stub.Allocate(pb.AllocateRequest(namespace=nsp)), Code.INVALID_ARGUMENT, "blocks: empty")
    await expect(sc, stub.Delete(pb.DeleteRequest(namespace=nsp)), Code.INVALID_ARGUMENT, "keys: empty")
    await expect(sc, stub.Lookup(pb.LookupRequest(namespace=nsp, keys=[keys[0]] * 9)), Code.INVALID_ARGUMENT, "batch limit")
    await expect(sc, stub.Delete(pb.DeleteRequest(namespace=nsp, keys=[keys[0]], all_keys=True)), Code.INVALID_ARGUMENT, "all_keys")
    await alive(stub, nsp, keys)


async def test_bad_sizes_and_duplicates(env):
    sc, stub, nsp, keys = env
    await expect(sc, stub.Allocate(pb.AllocateRequest(namespace=nsp, blocks=[pb.BlockSpec(key=keys[2], size=0)])),
                 Code.INVALID_ARGUMENT, "blocks[0].size")
    await expect(sc, stub.Allocate(pb.AllocateRequest(namespace=nsp, blocks=[pb.BlockSpec(key=keys[2], size=1 << 30)])),
                 Code.INVALID_ARGUMENT, "blocks[0].size")
    await expect(sc, stub.Allocate(pb.AllocateRequest(namespace=nsp, blocks=[pb.BlockSpec(key=keys[2], size=10)] * 2)),
                 Code.INVALID_ARGUMENT, "blocks[1].key")


async def test_namespace_missing_invalid_or_with_unknown_fields(env, ns):
    sc, stub, nsp, keys = env
    await expect(sc, stub.Lookup(pb.LookupRequest(keys=[keys[0]])), Code.INVALID_ARGUMENT, "namespace: required")
    bad = pb.Namespace(); bad.CopyFrom(nsp); bad.dtype = "float64"
    await expect(sc, stub.Lookup(pb.LookupRequest(namespace=bad, keys=[keys[0]])), Code.INVALID_ARGUMENT, "namespace.dtype")
    bad.dtype = nsp.dtype; bad.block_size = 0
    await expect(sc, stub.Lookup(pb.LookupRequest(namespace=bad, keys=[keys[0]])), Code.INVALID_ARGUMENT, "namespace.block_size")
    # A field this server does not know (number 99, as a newer client might send).
    future = pb.Namespace.FromString(nsp.SerializeToString() + bytes([0x98, 0x06, 0x01]))
    await expect(sc, stub.Lookup(pb.LookupRequest(namespace=future, keys=[keys[0]])), Code.INVALID_ARGUMENT, "unknown field number(s) [99]")
    await alive(stub, nsp, keys)


async def test_commit_out_of_order(env):
    sc, stub, nsp, keys = env
    await expect(sc, stub.Commit(pb.CommitRequest(allocation_id="nope", blocks=[pb.CommitBlock(key=keys[2], slot_id=0)])),
                 Code.NOT_FOUND, "allocation_id")
    await expect(sc, stub.Commit(pb.CommitRequest(blocks=[pb.CommitBlock(key=keys[2])])), Code.INVALID_ARGUMENT, "allocation_id: required")
    a = await stub.Allocate(pb.AllocateRequest(namespace=nsp, blocks=[pb.BlockSpec(key=keys[2], parent=keys[1], size=4096)]))
    slot = a.blocks[0].slot
    # slot ids and keys must belong to this allocation
    await expect(sc, stub.Commit(pb.CommitRequest(allocation_id=a.allocation_id, blocks=[pb.CommitBlock(key=keys[2], slot_id=slot.slot_id + 1)])),
                 Code.INVALID_ARGUMENT, "blocks[0].slot_id")
    await expect(sc, stub.Commit(pb.CommitRequest(allocation_id=a.allocation_id, blocks=[pb.CommitBlock(key=keys[0], slot_id=slot.slot_id)])),
                 Code.INVALID_ARGUMENT, "blocks[0].key")
    # checksum mismatch: rejected, and the allocation can still be committed correctly
    await expect(sc, stub.Commit(pb.CommitRequest(allocation_id=a.allocation_id, blocks=[
        pb.CommitBlock(key=keys[2], slot_id=slot.slot_id, has_checksum=True, checksum=12345)])), Code.DATA_LOSS, "blocks[0].checksum")
    ok = await stub.Commit(pb.CommitRequest(allocation_id=a.allocation_id, blocks=[pb.CommitBlock(key=keys[2], slot_id=slot.slot_id)]))
    assert ok.committed == 1
    await expect(sc, stub.Commit(pb.CommitRequest(allocation_id=a.allocation_id, blocks=[pb.CommitBlock(key=keys[2], slot_id=slot.slot_id)])),
                 Code.FAILED_PRECONDITION, "already committed")
    await expect(sc, stub.Abort(pb.AbortRequest(allocation_id=a.allocation_id)), Code.FAILED_PRECONDITION, "already committed")
    assert (await stub.Lookup(pb.LookupRequest(namespace=nsp, keys=keys))).matched == 3


async def test_commit_after_abort(env, ns):
    sc, stub, nsp, keys = env
    extra = prefix_keys(ns, [7] * ns.block_size)
    a = await stub.Allocate(pb.AllocateRequest(namespace=nsp, blocks=[pb.BlockSpec(key=extra[0], size=4096)]))
    assert (await stub.Abort(pb.AbortRequest(allocation_id=a.allocation_id))).released == 1
    await expect(sc, stub.Commit(pb.CommitRequest(allocation_id=a.allocation_id, blocks=[
        pb.CommitBlock(key=extra[0], slot_id=a.blocks[0].slot.slot_id)])), Code.FAILED_PRECONDITION, "already aborted")


async def test_release_of_unknown_lease(env):
    sc, stub, nsp, keys = env
    await expect(sc, stub.Release(pb.ReleaseRequest(lease_id="nope")), Code.NOT_FOUND, "lease_id")
    await expect(sc, stub.Release(pb.ReleaseRequest()), Code.INVALID_ARGUMENT, "lease_id: required")
    await expect(sc, stub.Lookup(pb.LookupRequest(namespace=nsp, keys=[keys[0]], lease_ttl_ms=10**9)), Code.INVALID_ARGUMENT, "lease_ttl_ms")


async def test_request_over_the_message_size_limit(env):
    sc, stub, nsp, keys = env
    before = state(sc)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Echo(pb.EchoRequest(payload=b"x" * (2 << 20)))
    assert info.value.code() == Code.RESOURCE_EXHAUSTED
    assert state(sc) == before
    await alive(stub, nsp, keys)


async def test_health_and_reflection_are_served(env):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    sc, stub, nsp, keys = env
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sc.grpc_port}") as ch:
        r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="kvstore.v1.KVStore"))
        assert r.status == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        async def one():
            yield reflection_pb2.ServerReflectionRequest(list_services="")

        names = []
        async for resp in reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(one()):
            names = [s.name for s in resp.list_services_response.service]
        assert "kvstore.v1.KVStore" in names
