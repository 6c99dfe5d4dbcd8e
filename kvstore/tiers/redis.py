"""Redis tier: one module for a single node and for Redis Cluster, the redis.asyncio client injected.

Keys, for block ``ref`` under ``key_prefix`` ``P``::

    P:<ns hex 16>:{<key hex 64>}:m     encode_header(meta)
    P:<ns hex 16>:{<key hex 64>}:<i>   payload chunk i (stride bytes each, the last shorter)

A chunk carries ``stride = chunk_bytes - VALUE_SLACK`` bytes of the block, so that Redis stores it
in exactly ``chunk_bytes`` (a jemalloc size class when that is a power of two): Redis adds a few
bytes to every value it allocates (the string header, and the CRLF while the value is being
read), and a value of exactly 2 MiB lands in the next class up, 2.5 MiB. Measured with
``MEMORY USAGE``: 2,621,488 bytes for a 2 MiB value, 2,097,200 for one of 2 MiB - 64. A 2 MiB
block is then one full chunk and a 64-byte one: 20% less Redis memory per block, and puts that
cost the server less (per put of 32 x 2 MiB: 28.5-39.5 ms of redis-server CPU and 2,200-5,400
page faults, against 34-48.5 ms and 3,700-7,200 with 2 MiB chunks).

The ``{...}`` hash tag puts every key of one block on one cluster slot, so a block's chunks are
written and read by one pipeline on one node. Writes are pipelined, each block's SETs (chunks,
then header) in a MULTI/EXEC of its own: a put cut short (the process killed, the connection lost,
an OOM reply) stores nothing of that block, so no chunk is left behind without a header. Reads
take one pipelined round trip per batch (headers and chunks together).

Block bytes travel on :mod:`kvstore.wire.resp` (``direct_io``, the default): pipelines on raw
sockets in worker threads that receive chunks straight into the caller's buffers and hash each
block as it lands. Everything else, and every batch that meets a cluster redirect, goes through
redis-py. A client that redis-py connects in ways that path does not follow (TLS, a Unix socket,
a credential provider) keeps all its traffic on redis-py.

A block whose chunks are partly gone (maxmemory eviction, TTL) is a miss, not an error. A block
is ``contains``-true when its header key exists; ``get`` is the authority.
Connection failures raise :class:`~kvstore.errors.Unavailable` after redis-py's own
``Retry(ExponentialBackoff)`` gave up; the next call reconnects.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from redis import exceptions as rexc
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from kvstore.checksum import checksum
from kvstore.config import REDIS_CHUNK_BYTES, REDIS_PIPELINES, TIER_IN_FLIGHT, RedisConfig
from kvstore.errors import (
    ChecksumMismatch,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from kvstore.tiers.base import (
    BlockMeta,
    BlockRef,
    HashedRead,
    TierBase,
    decode_header,
    encode_header,
    with_hashes,
)
from kvstore.util.threads import in_threads, split
from kvstore.wire import resp
from kvstore.wire.resp_pipe import tcp_settings

T = TypeVar("T")

STRAY_RUN = 8  # chunk keys per DEL when a block's header does not say how many it has
VALUE_SLACK = 64  # bytes of a chunk's allocation left to Redis's own overhead (at least 12 are used)

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

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        """Raises the mapped error; any other exception goes on as it is (never swallowed)."""
        if isinstance(exc, _UNAVAILABLE):
            raise Unavailable(f"redis: {exc}") from exc
        if isinstance(exc, rexc.OutOfMemoryError):
            raise ResourceExhausted(f"redis: {exc}") from exc
        if isinstance(exc, rexc.RedisClusterException) and "connect" in str(exc).lower():
            raise Unavailable(f"redis cluster: {exc}") from exc


_unavailable = _Unavailable()


class _Redirected(Exception):
    """A MOVED or ASK reply on the direct path: redis-py follows it and refreshes the slot map."""


def _check_replies(replies: Sequence[resp.Reply]) -> None:
    """Raise for the first error reply, as the tier's callers expect from redis-py. A command
    refused inside MULTI (MOVED, OOM) replies before the EXECABORT that follows it, so that is
    the one raised; EXEC's own replies are looked into."""
    for r in replies:
        if isinstance(r, list):
            _check_replies(r)
        if not isinstance(r, resp.ErrorReply):
            continue
        if r.code in ("MOVED", "ASK"):
            raise _Redirected(r.message)
        if r.code in ("LOADING", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN"):
            raise Unavailable(f"redis: {r.message}")
        if r.code == "OOM":
            raise ResourceExhausted(f"redis: {r.message}")
        raise rexc.ResponseError(r.message)


def _length(reply: Any) -> int | None:
    """A chunk reply's length: a bulk read into its buffer (direct path) or a ``bytes``
    (redis-py); None for a missing key or one too long for its buffer."""
    if isinstance(reply, int):
        return reply
    return len(reply) if isinstance(reply, (bytes, bytearray)) else None


def pool_size(cfg: RedisConfig, direct_io: bool) -> int:
    """Connections a single Redis's redis-py pool holds at most: one per request the movers keep in
    flight to the tier (``TIER_IN_FLIGHT``), which with ``direct_io`` (the tier's direct path in use)
    sends a pipeline at a time through redis-py (exists, headers, deletes), ``pipelines`` at a time
    when block bytes go through redis-py too; never more than ``max_connections``. At that size the
    pool makes a caller wait for a connection (each call holds one only as long as its own timeouts
    and retries allow). Deletes are not among the movers' requests in flight: a pool that opened a
    connection per caller grew with every burst of them and kept it (a Redis restart under 32
    clients' deletes took the soak's sidecar from 24 to 33 redis-py connections, for good)."""
    return min(cfg.max_connections, TIER_IN_FLIGHT * (1 if direct_io else cfg.pipelines))


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
        chunk_bytes: int = REDIS_CHUNK_BYTES,
        ttl_s: int = 0,
        pipelines: int = REDIS_PIPELINES,
        direct_io: bool = True,
    ) -> None:
        self.client = client
        self.key_prefix = key_prefix
        self.chunk_bytes = chunk_bytes
        self.stride = chunk_bytes - VALUE_SLACK  # block bytes per chunk
        self.ttl_s = ttl_s or None
        self.cluster = isinstance(client, RedisCluster)
        self.pipelines = pipelines
        self._direct = tcp_settings(client) if direct_io else None
        self._pools: dict[tuple[str, int], resp.Pool] = {}
        self._threads = ThreadPoolExecutor(2 * pipelines, thread_name_prefix="kvstore-redis") if self._direct else None

    @property
    def direct_io(self) -> bool:
        """Whether block bytes travel on the direct path (:mod:`kvstore.wire.resp`)."""
        return self._direct is not None

    @classmethod
    def from_config(cls, cfg: RedisConfig) -> RedisTier:
        kwargs: dict[str, Any] = dict(
            retry=default_retry(cfg.retries, cfg.backoff_base_s, cfg.backoff_cap_s),
            socket_timeout=cfg.socket_timeout_s,
            socket_connect_timeout=cfg.socket_timeout_s,
        )
        client: Redis | RedisCluster
        if cfg.cluster:
            client = RedisCluster.from_url(cfg.url, max_connections=cfg.max_connections, **kwargs)
        else:
            client = Redis.from_pool(BlockingConnectionPool.from_url(
                cfg.url, max_connections=cfg.max_connections, timeout=None,
                retry_on_error=[rexc.ConnectionError, rexc.TimeoutError], **kwargs,
            ))
        tier = cls(
            client, key_prefix=cfg.key_prefix, chunk_bytes=cfg.chunk_bytes, ttl_s=cfg.ttl_s,
            pipelines=cfg.pipelines, direct_io=cfg.direct_io,
        )
        if isinstance(client, Redis):
            client.connection_pool.max_connections = pool_size(cfg, tier.direct_io)
        return tier

    # ---- keys -----------------------------------------------------------------------------

    def _base(self, ref: BlockRef) -> str:
        return f"{self.key_prefix}:{ref.ns.hex()[:16]}:{{{ref.key.hex()}}}"

    def header_key(self, ref: BlockRef) -> str:
        return self._base(ref) + ":m"

    def chunk_keys(self, ref: BlockRef, size: int) -> list[str]:
        return self._chunk_keys(ref, 0, self.n_chunks(size))

    def _chunk_keys(self, ref: BlockRef, first: int, end: int) -> list[str]:
        base = self._base(ref)
        return [f"{base}:{i}" for i in range(first, end)]

    def n_chunks(self, size: int) -> int:
        return max(1, -(-size // self.stride))

    def _pipeline(self) -> Any:
        return self.client.pipeline(transaction=False) if not self.cluster else self.client.pipeline()

    def _check(self, ref: BlockRef, meta: BlockMeta, room: int | None = None) -> BlockMeta:
        if meta.ref != ref:
            raise ChecksumMismatch(f"redis header for {ref.name} names {meta.ref.name}")
        if room is not None and meta.size > room:
            raise InvalidArgument(f"buffer of {room} bytes for a block of {meta.size}")
        return meta

    def _chunk_lengths(self, size: int) -> list[int]:
        step = self.stride
        return [min(step, size - i * step) for i in range(self.n_chunks(size))]

    # ---- the commands of a read and of a write (both paths send these) -----------------------

    def _gets(self, refs: Sequence[BlockRef], into: Sequence[memoryview]) -> list[tuple[str, memoryview | None]]:
        """The GETs that read ``refs`` into ``into``: each block's header key (no destination),
        then its chunk keys, each with the slice of the buffer it lands in. ``into`` is at least
        the block's size, so that covers every chunk of the block."""
        step = self.stride
        gets: list[tuple[str, memoryview | None]] = []
        for r, buf in zip(refs, into):
            gets.append((self.header_key(r), None))
            gets += [(k, buf[i * step : (i + 1) * step]) for i, k in enumerate(self.chunk_keys(r, len(buf)))]
        return gets

    def _blocks(
        self, refs: Sequence[BlockRef], into: Sequence[memoryview], replies: Sequence[Any]
    ) -> Iterator[tuple[BlockMeta | None, memoryview, list[Any]]]:
        """Each block's header, buffer and chunk replies, from the replies to :meth:`_gets`. The
        header is None when the block is gone or partly evicted or expired (a chunk missing or
        of the wrong length): a miss."""
        pos = 0
        for r, buf in zip(refs, into):
            n_max = self.n_chunks(len(buf))
            head, parts, pos = replies[pos], list(replies[pos + 1 : pos + 1 + n_max]), pos + 1 + n_max
            meta = None if head is None else self._check(r, decode_header(head), len(buf))
            if meta is not None:
                parts = parts[: self.n_chunks(meta.size)]
                if [_length(p) for p in parts] != self._chunk_lengths(meta.size):
                    meta = None
            yield meta, buf, parts

    def _sets(self, meta: BlockMeta, data: memoryview) -> list[tuple[str, bytes | memoryview]]:
        """The SETs that store one block, in one transaction: its chunks, then its header."""
        step = self.stride
        sets: list[tuple[str, bytes | memoryview]] = [
            (k, data[i * step : (i + 1) * step]) for i, k in enumerate(self.chunk_keys(meta.ref, meta.size))
        ]
        sets.append((self.header_key(meta.ref), encode_header(meta)))
        return sets

    # ---- the direct path --------------------------------------------------------------------

    async def _direct_groups(self, refs: Sequence[BlockRef]) -> list[tuple[resp.Pool, list[int]]]:
        """Indices of ``refs`` per pipeline: by node (a cluster's slot map), then split so that
        about ``pipelines`` run at once."""
        assert self._direct is not None
        by_node: dict[tuple[str, int], list[int]] = {}
        client = self.client
        if isinstance(client, RedisCluster):  # self.cluster
            await client.initialize()  # a no-op once the slot map is known
            for i, r in enumerate(refs):
                node = client.get_node_from_key(self.header_key(r))
                assert node is not None  # None only for a replica; an uncovered slot raises SlotNotCoveredError
                by_node.setdefault((node.host, int(node.port)), []).append(i)
        else:
            kw = client.connection_pool.connection_kwargs
            by_node[(kw.get("host", "localhost"), int(kw.get("port", 6379)))] = list(range(len(refs)))
        per_node = max(1, self.pipelines // max(1, len(by_node)))
        groups = []
        for addr, idx in by_node.items():
            pool = self._pools.get(addr)
            if pool is None:
                pool = self._pools[addr] = resp.Pool(resp.Endpoint(*addr, **self._direct))
            groups += [(pool, idx[a:b]) for a, b in split(len(idx), per_node)]
        return groups

    async def _per_pipeline(
        self, refs: Sequence[BlockRef], run: Callable[[resp.Pool, list[int]], T]
    ) -> tuple[list[list[int]], list[T]]:
        """``run(pool, indices)`` for each pipeline of :meth:`_direct_groups`, on the tier's
        threads; the indices of each group and what each run returned. Raises ``_Redirected``
        when a reply says MOVED or ASK (the caller hands the batch to redis-py)."""
        assert self._threads is not None  # made with the direct path
        with _unavailable:
            groups = await self._direct_groups(refs)
            parts = await in_threads(self._threads, [functools.partial(run, pool, idx) for pool, idx in groups])
        return [idx for _, idx in groups], parts

    def _read_direct(
        self, pool: resp.Pool, refs: Sequence[BlockRef], into: Sequence[memoryview], hashed: bool
    ) -> list[tuple[BlockMeta | None, int | None]]:
        """(thread) One pipeline: the chunks received at their offsets in each buffer, then (with
        ``hashed``) each block hashed while the next replies arrive elsewhere."""
        gets = self._gets(refs, into)
        replies = pool.execute([(b"GET", k.encode()) for k, _ in gets], [dest for _, dest in gets])
        _check_replies(replies)
        return [
            (meta, checksum(buf[: meta.size]) if hashed and meta is not None else None)
            for meta, buf, _ in self._blocks(refs, into, replies)
        ]

    def _write_direct(self, pool: resp.Pool, items: Sequence[tuple[BlockMeta, memoryview]]) -> None:
        """(thread) One pipeline of SETs sent from the caller's buffers, a MULTI/EXEC per block."""
        ex = (b"EX", str(self.ttl_s).encode()) if self.ttl_s else ()
        commands: list[resp.Command] = []
        for meta, data in items:
            commands.append((b"MULTI",))
            commands += [(b"SET", k.encode(), v, *ex) for k, v in self._sets(meta, data)]
            commands.append((b"EXEC",))
        _check_replies(pool.execute(commands))

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
        got = await self._get_direct(refs, into, hashed=False)
        return [m for m, _ in got] if got is not None else await self._get_many_redis_py(refs, into)

    async def get_many_hashed(self, refs: Sequence[BlockRef], into: Sequence[memoryview]) -> list[HashedRead]:
        got = await self._get_direct(refs, into, hashed=True)
        return got if got is not None else await with_hashes(await self._get_many_redis_py(refs, into), into)

    async def _get_direct(
        self, refs: Sequence[BlockRef], into: Sequence[memoryview], hashed: bool
    ) -> list[tuple[BlockMeta | None, int | None]] | None:
        """The read on the direct path; None where redis-py must do it (no direct path, a redirect)."""
        if self._direct is None or not refs:
            return None
        try:
            groups, parts = await self._per_pipeline(
                refs, lambda p, ix: self._read_direct(p, [refs[i] for i in ix], [into[i] for i in ix], hashed)
            )
        except _Redirected:
            return None  # redis-py follows it
        out: list[tuple[BlockMeta | None, int | None]] = [(None, None)] * len(refs)
        for idx, part in zip(groups, parts):
            for i, got in zip(idx, part):
                out[i] = got
        return out

    async def _get_many_redis_py(self, refs: Sequence[BlockRef], into: Sequence[memoryview]) -> list[BlockMeta | None]:
        """A few pipelines on separate pooled connections, run concurrently (one connection is a
        single stream the server answers serially)."""
        groups = split(len(refs), self.pipelines)
        parts = await asyncio.gather(*(self._get_group(refs[a:b], into[a:b]) for a, b in groups))
        return [m for part in parts for m in part]

    async def _get_group(self, refs: Sequence[BlockRef], into: Sequence[memoryview]) -> list[BlockMeta | None]:
        """One pipelined round trip of :meth:`_gets`; the reply objects copied into the buffers."""
        if not refs:
            return []
        with _unavailable:
            pipe = self._pipeline()
            for k, _ in self._gets(refs, into):
                pipe.get(k)
            replies = await pipe.execute()
        out: list[BlockMeta | None] = []
        for meta, buf, parts in self._blocks(refs, into, replies):
            if meta is not None:
                off = 0
                for p in parts:
                    buf[off : off + len(p)] = p
                    off += len(p)
            out.append(meta)
        return out

    async def _headers(self, refs: Sequence[BlockRef]) -> list[BlockMeta | None]:
        """Each block's header; None where it is gone or unreadable (corrupted, or naming
        another block)."""
        if not refs:
            return []
        with _unavailable:
            pipe = self._pipeline()
            for r in refs:
                pipe.get(self.header_key(r))
            raw = await pipe.execute()
        out: list[BlockMeta | None] = []
        for r, h in zip(refs, raw):
            try:
                out.append(None if h is None else self._check(r, decode_header(h)))
            except ChecksumMismatch:
                out.append(None)
        return out

    async def put(self, meta: BlockMeta, data: memoryview) -> None:
        await self.put_many([(meta, data)])

    async def put_many(self, items: Sequence[tuple[BlockMeta, memoryview]]) -> None:
        for meta, data in items:  # before anything is sent
            if len(data) != meta.size:
                raise InvalidArgument(f"block {meta.ref.name}: {len(data)} bytes, header says {meta.size}")
        if self._direct is not None and items:
            try:
                await self._per_pipeline(
                    [m.ref for m, _ in items], lambda p, ix: self._write_direct(p, [items[i] for i in ix])
                )
                return
            except _Redirected:
                pass  # redis-py follows it; rewriting the same values is harmless
        await asyncio.gather(*(self._put_group(items[a:b]) for a, b in split(len(items), self.pipelines)))

    async def _put_group(self, items: Sequence[tuple[BlockMeta, memoryview]]) -> None:
        """One block after another, each a transaction (one slot: its keys share a hash tag)."""
        for meta, data in items:
            with _unavailable:
                pipe = self.client.pipeline(transaction=True)
                for k, v in self._sets(meta, data):
                    pipe.set(k, v, ex=self.ttl_s)
                await pipe.execute()

    async def delete(self, ref: BlockRef) -> None:
        await self.delete_many([ref])

    async def delete_many(self, refs: Sequence[BlockRef]) -> None:
        if not refs:
            return
        metas = await self._headers(refs)
        with _unavailable:
            pipe = self._pipeline()
            for r, m in zip(refs, metas):
                pipe.delete(self.header_key(r))  # first: the block stops being visible
                for k in self.chunk_keys(r, m.size) if m is not None else ():
                    pipe.delete(k)
            await pipe.execute()
            await self._delete_stray_chunks([r for r, m in zip(refs, metas) if m is None])

    async def _delete_stray_chunks(self, refs: Sequence[BlockRef]) -> None:
        """The chunks of blocks whose header gave no size (gone: a header evicted or expired by
        Redis on its own, or a put cut short by a version that wrote without MULTI; or
        unreadable). A block's chunks are numbered from 0
        without gaps, so they are deleted ``STRAY_RUN`` at a time (one multi-key DEL per block:
        its keys share a slot) until a DEL removes fewer: usually one pipelined round trip. (A
        block of more than 8 chunks that Redis's own eviction left with a gap keeps the chunks
        past the gap; like any key, they go by eviction or TTL.)"""
        start = 0
        while refs:
            pipe = self._pipeline()
            for r in refs:
                pipe.delete(*self._chunk_keys(r, start, start + STRAY_RUN))
            removed = await pipe.execute()
            refs = [r for r, n in zip(refs, removed) if n == STRAY_RUN]
            start += STRAY_RUN

    async def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        if self._threads is not None:
            self._threads.shutdown(wait=False)
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

    async def _decode_keys(self, keys: Sequence[str | bytes]) -> list[BlockMeta]:
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
