"""Redis tier: one module for a single node and for Redis Cluster, the redis.asyncio client injected.

Keys, for block ``ref`` under ``key_prefix`` ``P``::

    P:<ns hex 16>:{<key hex 64>}:m     encode_header(meta)
    P:<ns hex 16>:{<key hex 64>}:<i>   payload chunk i (chunk_bytes each, the last shorter)

The ``{...}`` hash tag puts every key of one block on one cluster slot, so a block's chunks are
written and read by one pipeline on one node. Writes are pipelined (chunks first, header last),
reads take one pipelined round trip per batch (headers and chunks together).

A block whose chunks are partly gone (maxmemory eviction, TTL) is a miss, not an error. A block
is ``contains``-true when its header key exists; ``get`` is the authority.
Connection failures raise :class:`~kvstore.errors.Unavailable` after redis-py's own
``Retry(ExponentialBackoff)`` gave up; the next call reconnects.
"""

from __future__ import annotations

import asyncio

from collections.abc import AsyncIterator, Sequence
from typing import Any

from redis import exceptions as rexc
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from kvstore.config import REDIS_PIPELINES, RedisConfig
from kvstore.errors import ChecksumMismatch, InvalidArgument, ResourceExhausted, Unavailable
from kvstore.tiers.base import BlockMeta, BlockRef, TierBase, decode_header, encode_header

# What "the server cannot be reached" looks like from redis-py (cluster errors included).
_UNAVAILABLE = (
    rexc.ConnectionError,
    rexc.TimeoutError,
    rexc.BusyLoadingError,
    rexc.ClusterError,
    rexc.TryAgainError,
    rexc.SlotNotCoveredError,
    OSError,
)


class _Unavailable:
    """Context manager mapping redis-py connection failures to :class:`Unavailable`."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        if isinstance(exc, _UNAVAILABLE):
            raise Unavailable(f"redis: {exc}") from exc
        if isinstance(exc, rexc.OutOfMemoryError):
            raise ResourceExhausted(f"redis: {exc}") from exc
        if isinstance(exc, rexc.RedisClusterException) and "connect" in str(exc).lower():
            raise Unavailable(f"redis cluster: {exc}") from exc
        return False


_unavailable = _Unavailable()


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous (start, end) ranges covering ``range(n)``, none empty."""
    parts = max(1, min(parts, n))
    step = -(-n // parts) if n else 0
    return [(a, min(a + step, n)) for a in range(0, n, step)] if n else []


def default_retry(retries: int = 3, base_s: float = 0.05, cap_s: float = 1.0) -> Retry:
    return Retry(ExponentialBackoff(cap=cap_s, base=base_s), retries)


class RedisTier(TierBase):
    """Blocks in Redis or Redis Cluster through an injected ``redis.asyncio`` client."""

    name = "redis"

    def __init__(
        self,
        client: Redis | RedisCluster,
        *,
        key_prefix: str = "kvstore",
        chunk_bytes: int = 1 << 20,
        ttl_s: int = 0,
        pipelines: int = REDIS_PIPELINES,
    ) -> None:
        self.client = client
        self.key_prefix = key_prefix
        self.chunk_bytes = chunk_bytes
        self.ttl_s = ttl_s or None
        self.cluster = isinstance(client, RedisCluster)
        self.pipelines = pipelines

    @classmethod
    def from_config(cls, cfg: RedisConfig) -> RedisTier:
        kwargs: dict[str, Any] = dict(
            retry=default_retry(cfg.retries, cfg.backoff_base_s, cfg.backoff_cap_s),
            socket_timeout=cfg.socket_timeout_s,
            socket_connect_timeout=cfg.socket_timeout_s,
            max_connections=cfg.max_connections,
        )
        client: Redis | RedisCluster
        if cfg.cluster:
            client = RedisCluster.from_url(cfg.url, **kwargs)
        else:
            client = Redis.from_url(cfg.url, retry_on_error=[rexc.ConnectionError, rexc.TimeoutError], **kwargs)
        return cls(client, key_prefix=cfg.key_prefix, chunk_bytes=cfg.chunk_bytes, ttl_s=cfg.ttl_s, pipelines=cfg.pipelines)

    # ---- keys -----------------------------------------------------------------------------

    def _base(self, ref: BlockRef) -> str:
        return f"{self.key_prefix}:{ref.ns.hex()[:16]}:{{{ref.key.hex()}}}"

    def header_key(self, ref: BlockRef) -> str:
        return self._base(ref) + ":m"

    def chunk_keys(self, ref: BlockRef, size: int) -> list[str]:
        base = self._base(ref)
        return [f"{base}:{i}" for i in range(self.n_chunks(size))]

    def n_chunks(self, size: int) -> int:
        return max(1, -(-size // self.chunk_bytes))

    def _pipeline(self) -> Any:
        return self.client.pipeline(transaction=False) if not self.cluster else self.client.pipeline()

    # ---- Tier -----------------------------------------------------------------------------

    async def contains(self, ref: BlockRef) -> bool:
        return (await self.contains_many([ref]))[0]

    async def contains_many(self, refs: Sequence[BlockRef]) -> list[bool]:
        if not refs:
            return []
        with _unavailable:
            pipe = self._pipeline()
            for r in refs:
                pipe.exists(self.header_key(r))
            return [bool(n) for n in await pipe.execute()]

    async def get(self, ref: BlockRef, into: memoryview) -> BlockMeta | None:
        return (await self.get_many([ref], [into]))[0]

    async def get_many(self, refs: Sequence[BlockRef], into: Sequence[memoryview]) -> list[BlockMeta | None]:
        """A few pipelines on separate pooled connections, run concurrently (one connection is a
        single stream the server answers serially)."""
        groups = _split(len(refs), self.pipelines)
        parts = await asyncio.gather(*(self._get_group(refs[a:b], into[a:b]) for a, b in groups))
        return [m for part in parts for m in part]

    async def _get_group(self, refs: Sequence[BlockRef], into: Sequence[memoryview]) -> list[BlockMeta | None]:
        """One pipelined round trip: each block's header and the chunks its buffer could hold
        (``into`` is at least the block's size, so that covers every chunk of the block)."""
        if not refs:
            return []
        with _unavailable:
            pipe = self._pipeline()
            for r, buf in zip(refs, into):
                pipe.get(self.header_key(r))
                for k in self.chunk_keys(r, len(buf)):
                    pipe.get(k)
            replies = await pipe.execute()
        out: list[BlockMeta | None] = []
        pos = 0
        for r, buf in zip(refs, into):
            n_max = self.n_chunks(len(buf))
            head, parts, pos = replies[pos], replies[pos + 1 : pos + 1 + n_max], pos + 1 + n_max
            out.append(None if head is None else self._assemble(r, decode_header(head), parts, buf))
        return out

    def _assemble(self, ref: BlockRef, meta: BlockMeta, parts: list[bytes | None], buf: memoryview) -> BlockMeta | None:
        if meta.ref != ref:
            raise ChecksumMismatch(f"redis header for {ref.name} names {meta.ref.name}")
        if meta.size > len(buf):
            raise InvalidArgument(f"buffer of {len(buf)} bytes for a block of {meta.size}")
        parts = parts[: self.n_chunks(meta.size)]
        if any(p is None for p in parts) or sum(len(p) for p in parts) != meta.size:  # type: ignore[arg-type]
            return None  # partly evicted or expired: a miss
        off = 0
        for p in parts:
            buf[off : off + len(p)] = p  # type: ignore[arg-type]
            off += len(p)  # type: ignore[arg-type]
        return meta

    async def _headers(self, refs: Sequence[BlockRef]) -> list[BlockMeta | None]:
        if not refs:
            return []
        with _unavailable:
            pipe = self._pipeline()
            for r in refs:
                pipe.get(self.header_key(r))
            raw = await pipe.execute()
        metas: list[BlockMeta | None] = []
        for r, h in zip(refs, raw):
            if h is None:
                metas.append(None)
                continue
            meta = decode_header(h)
            if meta.ref != r:
                raise ChecksumMismatch(f"redis header for {r.name} names {meta.ref.name}")
            metas.append(meta)
        return metas

    async def put(self, meta: BlockMeta, data: memoryview) -> None:
        await self.put_many([(meta, data)])

    async def put_many(self, items: Sequence[tuple[BlockMeta, memoryview]]) -> None:
        await asyncio.gather(*(self._put_group(items[a:b]) for a, b in _split(len(items), self.pipelines)))

    async def _put_group(self, items: Sequence[tuple[BlockMeta, memoryview]]) -> None:
        if not items:
            return
        with _unavailable:
            pipe = self._pipeline()
            for meta, data in items:
                if len(data) != meta.size:
                    raise InvalidArgument(f"block {meta.ref.name}: {len(data)} bytes, header says {meta.size}")
                step = self.chunk_bytes
                for i, k in enumerate(self.chunk_keys(meta.ref, meta.size)):
                    pipe.set(k, data[i * step : (i + 1) * step], ex=self.ttl_s)
                pipe.set(self.header_key(meta.ref), encode_header(meta), ex=self.ttl_s)  # last: visible once whole
            await pipe.execute()

    async def delete(self, ref: BlockRef) -> None:
        await self.delete_many([ref])

    async def delete_many(self, refs: Sequence[BlockRef]) -> None:
        try:
            metas = await self._headers(refs)
        except ChecksumMismatch:
            metas = [None] * len(refs)
        if not refs:
            return
        with _unavailable:
            pipe = self._pipeline()
            for r, m in zip(refs, metas):
                pipe.delete(self.header_key(r))  # first: the block stops being visible
                for k in self.chunk_keys(r, m.size) if m is not None else ():
                    pipe.delete(k)
            await pipe.execute()

    async def close(self) -> None:
        await self.client.aclose()

    async def scan(self) -> AsyncIterator[BlockMeta]:
        """Headers of every block under ``key_prefix``, via SCAN on every node of a cluster."""
        batch: list[str] = []
        with _unavailable:
            async for key in self.client.scan_iter(match=f"{self.key_prefix}:*:m", count=1000):
                batch.append(key)
                if len(batch) >= 512:
                    for meta in await self._decode_keys(batch):
                        yield meta
                    batch = []
            for meta in await self._decode_keys(batch):
                yield meta

    async def _decode_keys(self, keys: list[str | bytes]) -> list[BlockMeta]:
        if not keys:
            return []
        pipe = self._pipeline()
        for k in keys:
            pipe.get(k)
        metas = []
        for raw in await pipe.execute():
            if raw is None:
                continue  # deleted or evicted since SCAN saw it
            try:
                metas.append(decode_header(raw))
            except (ChecksumMismatch, ValueError):
                continue
        return metas
