"""Real servers for the tier tests: session-scoped processes, function-scoped cleanup.

``tier_env`` is parametrized over every tier (ssd, redis single node, redis cluster, s3) and
gives a factory for tier objects over the same storage (so a test can "restart" the sidecar by
building a new one) and a way to corrupt a stored block behind the tier's back.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aioboto3
import pytest
import redis
import redis.asyncio
import redis.asyncio.cluster

from kvstore.checksum import checksum
from kvstore.harness.servers import (
    MOTO_CREDENTIALS,
    MotoServer,
    RedisCluster,
    RedisServer,
    moto_server,
    redis_cluster,
    redis_server,
)
from kvstore.tiers.base import BlockMeta, BlockRef
from kvstore.tiers.redis import RedisTier
from kvstore.tiers.s3 import S3Tier, client_config
from kvstore.tiers.segments.tier import SegmentTier
from kvstore.tiers.ssd import SsdTier

CHUNK = 64 * 1024  # small Redis chunks so modest blocks span several
MULTIPART = 5 * 1024 * 1024  # the S3 minimum part size


@pytest.fixture(scope="session")
def redis_single() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster3() -> Iterator[RedisCluster]:
    with redis_cluster(3) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def moto() -> Iterator[MotoServer]:
    with moto_server() as server:
        yield server


@pytest.fixture
def redis_clean(redis_single: RedisServer) -> Iterator[RedisServer]:
    redis_single.start()  # in case a fault test left it down
    redis.Redis(port=redis_single.port).flushall()
    yield redis_single


@pytest.fixture
def cluster_clean(redis_cluster3: RedisCluster) -> Iterator[RedisCluster]:
    for port in redis_cluster3.ports:
        redis.Redis(port=port).flushall()
    yield redis_cluster3


@pytest.fixture
def moto_clean(moto: MotoServer) -> Iterator[MotoServer]:
    moto.reset()
    yield moto


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in MOTO_CREDENTIALS.items():
        monkeypatch.setenv(k.upper(), v)


def make_s3_client(url: str, concurrency: int = 8, max_attempts: int = 3, timeout_s: float = 10.0) -> Callable[[], Any]:
    """A factory of aioboto3 S3 clients pointed at ``url`` (what S3Tier takes)."""
    return lambda: aioboto3.Session().client(
        "s3", endpoint_url=url, region_name="us-east-1",
        config=client_config(concurrency, max_attempts, timeout_s), **MOTO_CREDENTIALS,
    )


@pytest.fixture(name="s3_client")
def s3_client_fixture() -> Callable[..., Callable[[], Any]]:
    return make_s3_client


@dataclass
class TierEnv:
    kind: str
    make: Callable[[], Any]  # a new tier object over the same storage
    corrupt: Callable[[Any, BlockRef], Awaitable[None]]  # flip payload bytes behind the tier's back
    opened: list[Any] = field(default_factory=list)

    def new(self) -> Any:
        tier = self.make()
        self.opened.append(tier)
        return tier


async def _corrupt_ssd(tier: SsdTier, ref: BlockRef) -> None:
    path = tier.path_of(ref)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # last payload byte
    path.write_bytes(raw)


async def _corrupt_segments(tier: SegmentTier, ref: BlockRef) -> None:
    where = tier.locate(ref)
    assert where is not None
    path, offset, size = where
    with path.open("r+b") as f:  # the slot's last payload byte
        f.seek(offset + size - 1)
        last = f.read(1)[0]
        f.seek(offset + size - 1)
        f.write(bytes([last ^ 0xFF]))


async def _corrupt_redis(tier: RedisTier, ref: BlockRef) -> None:
    key = tier.chunk_keys(ref, CHUNK)[0]
    old = await tier.client.getrange(key, 5, 5)
    await tier.client.setrange(key, 5, bytes([old[0] ^ 0xFF]))


async def _corrupt_s3(tier: S3Tier, ref: BlockRef) -> None:
    await tier._ensure()
    key = tier.object_key(ref)
    resp = await tier._client.get_object(Bucket=tier.bucket, Key=key)
    body = bytearray(await resp["Body"].read())
    body[-1] ^= 0xFF
    await tier._client.put_object(Bucket=tier.bucket, Key=key, Body=bytes(body))  # overwritten in place


@pytest.fixture(params=["ssd", "ssd_segments", "redis", "redis_py", "redis_cluster", "s3"])
async def tier_env(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """``redis`` moves block bytes on the direct path (kvstore.wire.resp), ``redis_py`` through
    redis-py (``direct_io=False``); the cluster uses the direct path."""
    kind = request.param
    if kind == "ssd":
        env = TierEnv(kind, lambda: SsdTier(tmp_path / "ssd", 1 << 30), _corrupt_ssd)
    elif kind == "ssd_segments":
        env = TierEnv(kind, lambda: SegmentTier(tmp_path / "ssd", 1 << 30), _corrupt_segments)
    elif kind in ("redis", "redis_py"):
        server = request.getfixturevalue("redis_clean")
        direct = kind == "redis"
        env = TierEnv(
            kind,
            lambda: RedisTier(redis.asyncio.Redis.from_url(server.url), chunk_bytes=CHUNK, direct_io=direct),
            _corrupt_redis,
        )
    elif kind == "redis_cluster":
        cluster = request.getfixturevalue("cluster_clean")
        env = TierEnv(
            kind,
            lambda: RedisTier(redis.asyncio.cluster.RedisCluster.from_url(cluster.url), chunk_bytes=CHUNK),
            _corrupt_redis,
        )
    else:
        server = request.getfixturevalue("moto_clean")
        env = TierEnv(
            kind,
            lambda: S3Tier(
                make_s3_client(server.url), bucket="kvs-test", multipart_threshold_bytes=MULTIPART, part_bytes=MULTIPART
            ),
            _corrupt_s3,
        )
    yield env
    for tier in env.opened:
        await tier.close()


@pytest.fixture
async def tier(tier_env: TierEnv) -> Any:
    return tier_env.new()


def make_block(i: int, size: int, ns: bytes = b"N" * 32, parent: bytes = b"") -> tuple[BlockMeta, memoryview]:
    """A deterministic block (its bytes depend on ``i``): its meta and its bytes."""
    pattern = bytes((j * 7 + i) & 0xFF for j in range(251))
    data = memoryview((pattern * (size // 251 + 1))[:size])
    return BlockMeta(BlockRef(ns, i.to_bytes(4, "big") * 8), parent, size, checksum(data), f"test-{i}"), data


@pytest.fixture(name="block")
def block_fixture() -> Callable[..., tuple[BlockMeta, memoryview]]:
    return make_block
