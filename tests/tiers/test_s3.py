"""S3 tier specifics: object layout, multipart, bucket creation, unreachable endpoint, restart."""

from __future__ import annotations

import pytest

from kvstore.config import Config, S3Config
from kvstore.errors import Unavailable
from kvstore.harness.servers import free_port, moto_server
from kvstore.tiers import build_tier
from kvstore.tiers.base import decode_header, header_size
from kvstore.tiers.s3 import S3Tier

MiB = 1 << 20


def buffer(n: int) -> memoryview:
    return memoryview(bytearray(n))


@pytest.fixture
async def s3(moto_clean, s3_client):
    tier = S3Tier(
        s3_client(moto_clean.url),
        bucket="kvs-specific",
        prefix="pfx",
        multipart_threshold_bytes=5 * MiB,
        part_bytes=5 * MiB,
    )
    yield tier
    await tier.close()


async def test_object_is_header_then_payload(s3, block):
    meta, data = block(1, 1000)
    await s3.put(meta, data)
    assert s3.object_key(meta.ref) == f"pfx/{meta.ref.name}"
    resp = await s3._client.get_object(Bucket="kvs-specific", Key=s3.object_key(meta.ref))
    raw = await resp["Body"].read()
    assert decode_header(raw) == meta and raw[header_size(raw):] == data


async def test_large_block_goes_up_in_parts(s3, block):
    meta, data = block(2, 12 * MiB)
    await s3.put(meta, data)
    head = await s3._client.head_object(Bucket="kvs-specific", Key=s3.object_key(meta.ref))
    assert head["ETag"].strip('"').endswith("-3")  # a multipart ETag names its part count
    into = buffer(meta.size)
    assert await s3.get(meta.ref, into) == meta and into == data


async def test_a_batch_holds_at_most_concurrency_object_bodies(moto_clean, s3_client, block, monkeypatch):
    """A body (header + payload copy) is made only once its request can go: a put of many blocks
    never holds more copies than requests in flight."""
    from kvstore.tiers import s3 as s3_module

    tier = S3Tier(s3_client(moto_clean.url), bucket="kvs-bodies", concurrency=2)
    made, sent, most = [0], [0], [0]
    real_span, real_held = s3_module._span, tier._call_held

    def span(header, data, start, end):
        made[0] += 1
        most[0] = max(most[0], made[0] - sent[0])
        return real_span(header, data, start, end)

    async def held(op, **kw):
        try:
            return await real_held(op, **kw)
        finally:
            sent[0] += op == "put_object"

    monkeypatch.setattr(s3_module, "_span", span)
    monkeypatch.setattr(tier, "_call_held", held)
    try:
        blocks = [block(40 + i, 64 * 1024) for i in range(10)]
        await tier.put_many(blocks)
        assert made[0] == sent[0] == 10 and most[0] == 2
        bufs = [buffer(64 * 1024) for _ in blocks]
        assert await tier.get_many([m.ref for m, _ in blocks], bufs) == [m for m, _ in blocks]
        assert [bytes(b) for b in bufs] == [bytes(d) for _, d in blocks]
    finally:
        await tier.close()


@pytest.mark.parametrize("sign", [False, True])
async def test_bodies_are_signed_only_when_configured(moto_clean, aws_env, block, sign):
    """By default a put sends ``x-amz-content-sha256: UNSIGNED-PAYLOAD`` (headers signed, no
    SHA-256 of the 2 MiB body); ``s3.sign_payload`` signs the body's digest. Either way the
    block round-trips."""
    import hashlib

    cfg = Config(s3=S3Config(enabled=True, endpoint_url=moto_clean.url, bucket="kvs-signing", sign_payload=sign))
    tier = build_tier("s3", cfg)
    sent: list[str] = []
    try:
        meta, data = block(50, 100_000)
        await tier.contains(meta.ref)  # opens the client (and makes the bucket)
        tier._client.meta.events.register(
            "before-send.s3.PutObject",
            lambda request, **_: sent.append(request.headers["x-amz-content-sha256"].decode()),
        )
        await tier.put(meta, data)
        body = (await tier._client.get_object(Bucket="kvs-signing", Key=tier.object_key(meta.ref)))["Body"]
        whole = await body.read()
        assert sent == [hashlib.sha256(whole).hexdigest() if sign else "UNSIGNED-PAYLOAD"]
        into = buffer(meta.size)
        assert await tier.get(meta.ref, into) == meta and into == data
    finally:
        await tier.close()


async def test_existing_bucket_is_reused(moto_clean, s3_client, block):
    meta, data = block(3, 1000)
    first = S3Tier(s3_client(moto_clean.url), bucket="reused")
    await first.put(meta, data)
    second = S3Tier(s3_client(moto_clean.url), bucket="reused")
    try:
        assert await second.contains(meta.ref)
    finally:
        await first.close()
        await second.close()


async def test_unreachable_endpoint_raises_unavailable(s3_client, block):
    tier = S3Tier(s3_client(f"http://127.0.0.1:{free_port()}", max_attempts=1, timeout_s=2), bucket="bkt")
    meta, data = block(4, 1000)
    try:
        with pytest.raises(Unavailable):
            await tier.put(meta, data)
        with pytest.raises(Unavailable):
            await tier.get(meta.ref, buffer(1000))
        with pytest.raises(Unavailable):
            await tier.contains(meta.ref)
    finally:
        await tier.close()


async def test_server_down_then_back(block, aws_env):
    with moto_server() as server:
        tier = build_tier("s3", S3Config(endpoint_url=server.url, bucket="bkt", max_attempts=1, timeout_s=2))
        meta, data = block(5, 1000)
        try:
            await tier.put(meta, data)
            server.stop()
            with pytest.raises(Unavailable):
                await tier.get(meta.ref, buffer(1000))
            with pytest.raises(Unavailable):
                await tier.put_many([(meta, data)])
            server.start()
            assert await tier.get(meta.ref, buffer(1000)) is None  # a fresh moto: no bucket, a miss
            await tier.put(meta, data)  # and the bucket is made again
            into = buffer(1000)
            assert await tier.get(meta.ref, into) == meta and into == data
        finally:
            await tier.close()


async def test_build_from_whole_config(moto_clean, aws_env, block):
    tier = build_tier("s3", Config(s3=S3Config(enabled=True, endpoint_url=moto_clean.url, bucket="cfg", concurrency=4)))
    try:
        assert isinstance(tier, S3Tier) and tier.concurrency == 4
        meta, data = block(6, 1000)
        await tier.put(meta, data)
        assert [m async for m in tier.scan()] == [meta]
    finally:
        await tier.close()
