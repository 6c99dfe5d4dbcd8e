"""The codec seam (kvstore.codec): a level's codec encodes what a demotion writes, the header
names it, a promotion decodes it and checks the commit's checksum over the raw bytes; a header
naming an unknown codec is an unreadable copy, never served.

A throwaway codec registered from this module (a byte-wise XOR, reversible and size-keeping)
stands for a compressing one: what the tier holds differs from the raw bytes. Real sidecar, real
SSD directory (both layouts) and redis-server, real gRPC client."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest

from kvstore import codec as codecs
from kvstore.checksum import checksum
from kvstore.client import KVStoreClient
from kvstore.errors import ChecksumMismatch
from kvstore.keys import BlockKey, NamespaceRoot
from kvstore.server.sidecar import Sidecar
from kvstore.tiers.base import BlockMeta, BlockRef, decode_header, encode_header, header_bytes
from tests.tiers.test_tiering import NS, PAGE, blocks_for, chain, placement, settle, tiered_config


class Xor:
    """Every byte XOR 0x5A: stored bytes unlike the raw ones, and back."""

    id = 200
    name = "xor-test"

    def stored_size(self, size: int) -> int:
        return size

    def encode(self, raw: memoryview) -> memoryview:
        return memoryview((np.frombuffer(raw, np.uint8) ^ 0x5A).tobytes())

    def decode(self, stored: memoryview, into: memoryview) -> None:
        np.frombuffer(into, np.uint8)[:] = np.frombuffer(stored, np.uint8) ^ 0x5A


def xor(data: bytes) -> bytes:
    return (np.frombuffer(data, np.uint8) ^ 0x5A).tobytes()


@pytest.fixture
def xor_codec() -> Iterator[Xor]:
    c = Xor()
    codecs.register(c)
    yield c
    codecs.unregister(c)


def stored_bytes(sc: Sidecar, key: bytes, redis_url: str = "") -> bytes:
    """What the tier below holds for ``key``'s payload, read from its files (or Redis's chunks)."""
    levels = sc.store.tiering.levels
    lv = next(lv for lv in levels if lv.name == "redis") if redis_url else levels[0]
    ref = BlockRef(NS.root, BlockKey(key))
    if redis_url:
        import redis as sync_redis

        r = sync_redis.Redis.from_url(redis_url)
        return b"".join(r.get(k) or b"" for k in lv.tier.chunk_keys(ref, PAGE))
    if hasattr(lv.tier, "locate"):
        path, offset, size = lv.tier.locate(ref)
    else:
        path = lv.tier.path_of(ref)
        size = PAGE
        offset = os.path.getsize(path) - size
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(size)


def meta(codec: int = 0, label: str = "tiny") -> BlockMeta:
    ref = BlockRef(NamespaceRoot(bytes(32)), BlockKey(bytes(range(32))))
    return BlockMeta(ref, b"", 4096, 1234, label, "", codec)


def test_the_header_names_the_codec_and_an_identity_header_is_the_version_2_one():
    plain, coded = encode_header(meta()), encode_header(meta(200))
    assert plain[4:6] == (2).to_bytes(2, "little")  # identity: byte for byte the header before the field
    assert coded[4:6] == (3).to_bytes(2, "little")
    assert len(plain) == header_bytes("tiny") and len(coded) == header_bytes("tiny", 200)
    assert decode_header(plain) == meta() and decode_header(coded) == meta(200)
    assert decode_header(plain).codec == codecs.IDENTITY.id


def test_an_unknown_codec_is_a_clear_error_and_a_taken_id_is_refused(xor_codec):
    with pytest.raises(codecs.UnknownCodec, match="unknown codec id 201"):
        codecs.codec_of(201)
    assert issubclass(codecs.UnknownCodec, ChecksumMismatch)  # the reads' word for an unreadable copy

    class Other(Xor):
        name = "other"

    with pytest.raises(ValueError, match=r"codec\.id 200 is taken by 'xor-test'"):
        codecs.register(Other())
    assert codecs.codec_of(200) is xor_codec


@pytest.mark.parametrize("tier", ["files", "segments", "redis"])
async def test_a_demotion_stores_encoded_bytes_and_a_promotion_returns_the_raw_ones(tmp_path, tier, xor_codec, request):
    over: dict[str, object] = {"ssd.layout": tier} if tier != "redis" else {}
    url = ""
    if tier == "redis":
        url = request.getfixturevalue("redis_clean").url
        over.update({"ssd.enabled": False, "tiering.chain": ["redis"], "redis.enabled": True, "redis.url": url})
    name = "redis" if url else "ssd"
    async with Sidecar(tiered_config(tmp_path, **over)) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        sc.store.tiering.levels[0].codec = xor_codec
        a, b = chain(40, 2), chain(41, 4)
        da = blocks_for(2, 40)
        await c.put_blocks(NS, a, da)
        await c.put_blocks(NS, b, blocks_for(4, 41))  # DRAM holds 4 slots: a goes down
        await settle(sc)
        assert placement(sc, a) == [name, name]
        on_disk = [stored_bytes(sc, k, url) for k in a]
        assert on_disk == [xor(d) for d in da] and on_disk != da  # the tier holds the encoded bytes
        got = await c.get_blocks(NS, a)
        assert [g.tobytes() for g in got] == da  # the raw bytes, their commit checksum held
        blocks = sc.store.index.namespaces[NS.root].blocks
        assert [blocks[k].checksum for k in a] == [checksum(d) for d in da]
        stats = (await c.stats())["tiers"][name]
        assert stats["promotions"] == 2 and stats["checksum_failures"] == 0


async def test_a_copy_whose_codec_is_unknown_is_a_miss_never_served(tmp_path, xor_codec):
    async with Sidecar(tiered_config(tmp_path)) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        next(lv for lv in sc.store.tiering.levels if lv.name == "ssd").codec = xor_codec
        a, b = chain(42, 2), chain(43, 4)
        da = blocks_for(2, 42)
        await c.put_blocks(NS, a, da)
        await c.put_blocks(NS, b, blocks_for(4, 43))
        await settle(sc)
        assert placement(sc, a) == ["ssd", "ssd"]
        codecs.unregister(xor_codec)  # as a sidecar that does not know the codec would read them
        got = await c.get_blocks(NS, a)
        assert got == []  # unreadable: a miss, not the stored bytes
        assert placement(sc, a) == ["gone", "gone"]
        stats = (await c.stats())["tiers"]["ssd"]
        assert (stats["misses"], stats["checksum_failures"]) == (2, 0)  # unreadable, not bytes that failed
        refs = [BlockRef(NS.root, BlockKey(k)) for k in a]
        for lv in sc.store.tiering.levels:  # the copies are gone from the tier too
            assert not any(lv.tier.path_of(r).exists() if hasattr(lv.tier, "path_of") else lv.tier.locate(r)
                           for r in refs)


async def test_a_write_through_stores_encoded_bytes(tmp_path, xor_codec, redis_clean):
    """A write-through writes a block as a demotion does, through the level's codec. (Before, it
    wrote ``Level.meta`` and the raw slot bytes: Redis held them as they are, header codec 0.)"""
    cfg = tiered_config(tmp_path, **{"ssd.enabled": False, "tiering.chain": ["redis"], "redis.enabled": True,
                                     "redis.url": redis_clean.url, "tiering.write_through": ["redis"]})
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        sc.store.tiering.levels[0].codec = xor_codec
        a, da = chain(44, 2), blocks_for(2, 44)
        await c.put_blocks(NS, a, da, wait_write_through=True)
        assert placement(sc, a) == ["dram", "dram"]  # (and Redis: written through)
        assert [stored_bytes(sc, k, redis_clean.url) for k in a] == [xor(d) for d in da]
        await c.put_blocks(NS, chain(45, 4), blocks_for(4, 45), wait_write_through=True)  # a leaves DRAM
        await settle(sc)
        assert placement(sc, a) == ["redis", "redis"]
        got = await c.get_blocks(NS, a)
        assert [g.tobytes() for g in got] == da  # decoded, the commit's checksum held


async def test_a_block_an_ssd_eviction_passes_down_is_encoded_by_the_level_below(tmp_path, xor_codec, redis_clean):
    """An SSD full passes its victims down to Redis through Redis's codec, as a demotion would write
    them. (Before, the pass-down wrote ``Level.meta`` and the raw bytes it read back.)"""
    cfg = tiered_config(tmp_path, **{"ssd.capacity_bytes": 2 * PAGE + 8192, "redis.enabled": True,
                                     "redis.url": redis_clean.url})
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        for lv in sc.store.tiering.levels:
            lv.codec = xor_codec
        chains = [chain(50 + i, 2) for i in range(4)]
        data = [blocks_for(2, 50 + i) for i in range(4)]
        for k, d in zip(chains, data):
            await c.put_blocks(NS, k, d)
            await settle(sc)
        assert placement(sc, chains[0]) == ["redis", "redis"]  # DRAM -> SSD -> Redis
        assert [stored_bytes(sc, k, redis_clean.url) for k in chains[0]] == [xor(d) for d in data[0]]
        got = await c.get_blocks(NS, chains[0])
        assert [g.tobytes() for g in got] == data[0]
        assert (await c.stats())["tiers"]["redis"]["checksum_failures"] == 0


def test_a_codec_that_changes_the_size_is_refused_at_the_seam():
    class Shrink(Xor):
        def encode(self, raw: memoryview) -> memoryview:
            return raw[:-1]

    with pytest.raises(ValueError, match="stored 4095 bytes for a block of 4096"):
        codecs.encode(Shrink(), memoryview(bytes(4096)))
