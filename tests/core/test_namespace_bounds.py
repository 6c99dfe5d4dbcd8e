"""Namespace text fields are bounded: a long one is refused with INVALID_ARGUMENT naming the field.

Unbounded, a 60,000-character model made every SSD block file 64 KiB (the label is kept in each
block's header), and the SSD tier, which counted 8 KiB a block, wedged for every namespace."""

from __future__ import annotations

import grpc
import pytest

from kvstore.client import namespace_pb
from kvstore.errors import InvalidArgument
from kvstore.keys import TEXT_FIELD_MAX, Namespace, prefix_keys
from kvstore.server.sidecar import Sidecar
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.conftest import small_config

NS = Namespace(model="m", kv_layout="raw", dtype="uint8", block_size=16)
FIELDS = ["model", "revision", "adapter", "cache_salt"]


@pytest.fixture
async def env(tmp_path):
    ssd = {"ssd.enabled": True, "ssd.path": str(tmp_path / "ssd"), "ssd.capacity_bytes": 1 << 20}
    cfg = small_config(tmp_path, **ssd)
    async with Sidecar(cfg) as sc, grpc.aio.insecure_channel(f"127.0.0.1:{sc.grpc_port}") as ch:
        stub = pb_grpc.KVStoreStub(ch)
        keys = prefix_keys(NS, [1] * NS.block_size)
        spec = pb.BlockSpec(key=keys[0], size=4096)
        alloc = await stub.Allocate(pb.AllocateRequest(namespace=namespace_pb(NS), blocks=[spec]))
        await stub.Commit(pb.CommitRequest(allocation_id=alloc.allocation_id, blocks=[
            pb.CommitBlock(key=keys[0], slot_id=alloc.blocks[0].slot.slot_id)]))
        yield sc, stub, keys


def with_field(name: str, n: int) -> pb.Namespace:
    msg = namespace_pb(NS)
    setattr(msg, name, "x" * n)
    return msg


@pytest.mark.parametrize("name", FIELDS)
async def test_a_field_over_the_limit_is_refused_naming_it_and_one_at_it_is_stored(env, name):
    sc, stub, keys = env
    before = (sc.store.index.count(), sc.slab.used_bytes, len(sc.store.index.namespaces))
    key = prefix_keys(NS, [2] * NS.block_size)[0]
    spec = pb.BlockSpec(key=key, size=4096)
    calls = [
        stub.Lookup(pb.LookupRequest(namespace=with_field(name, 60_000), keys=[key])),
        stub.Allocate(pb.AllocateRequest(namespace=with_field(name, TEXT_FIELD_MAX + 1), blocks=[spec])),
    ]
    for call, n in zip(calls, [60_000, TEXT_FIELD_MAX + 1]):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == f"namespace.{name}: {n} characters exceed the limit of {TEXT_FIELD_MAX}"
    assert (sc.store.index.count(), sc.slab.used_bytes, len(sc.store.index.namespaces)) == before
    assert (await stub.Lookup(pb.LookupRequest(namespace=namespace_pb(NS), keys=keys))).matched == 1  # still serving

    at_limit = namespace_pb(NS)
    setattr(at_limit, name, "é" * TEXT_FIELD_MAX)  # characters, not bytes: 512 bytes of UTF-8
    alloc = await stub.Allocate(pb.AllocateRequest(namespace=at_limit, blocks=[spec]))
    await stub.Commit(pb.CommitRequest(allocation_id=alloc.allocation_id, blocks=[
        pb.CommitBlock(key=key, slot_id=alloc.blocks[0].slot.slot_id)]))
    assert (await stub.Lookup(pb.LookupRequest(namespace=at_limit, keys=[key]))).matched == 1


def test_the_client_side_namespace_refuses_the_same():
    with pytest.raises(InvalidArgument) as info:
        Namespace(model="m", kv_layout="raw", dtype="uint8", block_size=16, adapter="a" * 300)
    assert str(info.value) == f"namespace.adapter: 300 characters exceed the limit of {TEXT_FIELD_MAX}"
