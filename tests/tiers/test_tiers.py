"""Behaviour every tier shares, run against ssd, redis, redis cluster and s3 (real servers)."""

from __future__ import annotations

import pytest

from kvstore.checksum import checksum
from kvstore.tiers.base import BlockRef, Recoverable, Tier
from kvstore.tiers.verify import verified_get

SMALL = 3000
MULTI_CHUNK = 200 * 1024 + 17  # > 3 Redis chunks of 64 KiB in the tests
MULTIPART = 11 * 1024 * 1024 + 5  # 3 S3 parts of 5 MiB


def buffer(n: int) -> memoryview:
    return memoryview(bytearray(n))


async def test_is_a_tier(tier):
    assert isinstance(tier, Tier)
    assert isinstance(tier, Recoverable)


@pytest.mark.parametrize("size", [SMALL, MULTI_CHUNK, MULTIPART])
async def test_round_trip(tier, block, size):
    meta, data = block(1, size, parent=b"P" * 32)
    await tier.put(meta, data)
    assert await tier.contains(meta.ref)
    into = buffer(size + 100)  # a larger buffer is allowed; only size bytes are written
    got = await tier.get(meta.ref, into)
    assert got == meta
    assert into[:size] == data
    assert bytes(into[size:]) == bytes(100)


async def test_missing_block(tier, block):
    meta, _ = block(2, SMALL)
    assert not await tier.contains(meta.ref)
    assert await tier.get(meta.ref, buffer(SMALL)) is None
    await tier.delete(meta.ref)  # deleting what is not there is fine
    assert await tier.contains_many([]) == []


async def test_delete(tier, block):
    meta, data = block(3, MULTI_CHUNK)
    await tier.put(meta, data)
    await tier.delete(meta.ref)
    assert not await tier.contains(meta.ref)
    assert await tier.get(meta.ref, buffer(MULTI_CHUNK)) is None


async def test_overwrite(tier, block):
    meta, data = block(4, MULTI_CHUNK)
    await tier.put(meta, data)
    await tier.put(meta, data)
    into = buffer(MULTI_CHUNK)
    assert await tier.get(meta.ref, into) == meta
    assert into == data


async def test_batch_forms(tier, block):
    blocks = [block(10 + i, SMALL * (i + 1)) for i in range(6)]
    await tier.put_many(blocks)
    missing = BlockRef(b"N" * 32, b"\x99" * 32)
    refs = [m.ref for m, _ in blocks]
    assert await tier.contains_many([*refs, missing]) == [True] * 6 + [False]

    bufs = [buffer(m.size) for m, _ in blocks] + [buffer(16)]
    got = await tier.get_many([*refs, missing], bufs)
    assert got == [m for m, _ in blocks] + [None]
    for (_, data), buf in zip(blocks, bufs):
        assert buf == data

    await tier.delete_many(refs[:3])
    assert await tier.contains_many(refs) == [False] * 3 + [True] * 3


async def test_namespaces_are_separate(tier, block):
    a, data = block(20, SMALL, ns=b"A" * 32)
    b = type(a)(BlockRef(b"B" * 32, a.ref.key), a.parent, a.size, a.checksum, a.label)
    await tier.put(a, data)
    assert await tier.contains_many([a.ref, b.ref]) == [True, False]


async def test_scan_after_restart(tier_env, block):
    tier = tier_env.new()
    blocks = [block(30 + i, SMALL + i, parent=bytes([i]) * 32) for i in range(5)]
    await tier.put_many(blocks)
    await tier.close()

    reopened = tier_env.new()
    found = [m async for m in reopened.scan()]
    assert sorted(found, key=lambda m: m.ref.key) == sorted((m for m, _ in blocks), key=lambda m: m.ref.key)
    into = buffer(blocks[2][0].size)
    assert await reopened.get(blocks[2][0].ref, into) == blocks[2][0]
    assert into == blocks[2][1]


async def test_corruption_is_returned_as_is_and_verified_get_drops_it(tier_env, block):
    tier = tier_env.new()
    meta, data = block(40, MULTI_CHUNK)
    good, good_data = block(41, MULTI_CHUNK)
    await tier.put_many([(meta, data), (good, good_data)])
    await tier_env.corrupt(tier, meta.ref)

    into = buffer(meta.size)
    got = await tier.get(meta.ref, into)
    assert got == meta  # the tier does not judge checksums
    assert into != data
    assert checksum(into) != got.checksum

    assert await verified_get(tier, meta.ref, buffer(meta.size), meta.checksum) is None
    assert not await tier.contains(meta.ref)  # the bad copy is gone

    into = buffer(good.size)
    assert await verified_get(tier, good.ref, into, good.checksum) == good
    assert into == good_data
    assert await verified_get(tier, good.ref, buffer(good.size), good.checksum ^ 1) is None  # index disagrees
    assert not await tier.contains(good.ref)
    assert await verified_get(tier, good.ref, buffer(good.size), good.checksum) is None  # a plain miss
