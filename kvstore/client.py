"""Async client for the sidecar, and a thin sync bridge for engines.

    async with KVStoreClient.from_url("grpc://127.0.0.1:50051") as c:
        await c.put_blocks(ns, keys, blocks)           # allocate -> copy into slots -> commit
        async with c.acquire(ns, keys) as lease:       # zero-copy read-only views of the slots
            use(lease.views)                           # released on exit
        r = await c.lookup(ns, keys)

Block bytes go through the shared-memory slab, attached once per process; only control
messages cross gRPC. Every gRPC error comes back as a :mod:`kvstore.errors` exception.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypeVar

import grpc
import numpy as np

from kvstore.checksum import checksum
from kvstore.errors import KVStoreError, from_status_code
from kvstore.keys import Namespace
from kvstore.slab import attach
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

T = TypeVar("T")
_TIER_NAMES = {pb.TIER_DRAM: "dram", pb.TIER_SSD: "ssd", pb.TIER_REDIS: "redis", pb.TIER_S3: "s3"}
DEFAULT_MAX_MESSAGE = 64 << 20


def namespace_pb(ns: Namespace) -> pb.Namespace:
    return pb.Namespace(
        model=ns.model, revision=ns.revision, kv_layout=ns.kv_layout, dtype=ns.dtype, block_size=ns.block_size,
        rank=ns.rank, world_size=ns.world_size, adapter=ns.adapter, cache_salt=ns.cache_salt,
    )


def _target(url: str) -> tuple[str, bool]:
    """(grpc target, tls) from grpc://host:port, grpcs://host:port, host:port or unix:/path."""
    if url.startswith("grpcs://"):
        return url[len("grpcs://") :], True
    if url.startswith("grpc://"):
        return url[len("grpc://") :], False
    return url, False


def _chain(keys: Sequence[bytes], first_parent: bytes) -> list[bytes]:
    return [first_parent, *keys[:-1]] if keys else []


@dataclass(slots=True, frozen=True)
class LookupResult:
    matched: int
    blocks: list[tuple[str, int]]  # (tier, size) per matched block
    lease_id: str | None


@dataclass(slots=True, frozen=True)
class PutResult:
    stored: int
    present: int


class _Token(grpc.AuthMetadataPlugin):
    def __init__(self, token: str) -> None:
        self._token = token

    def __call__(self, context: grpc.AuthMetadataContext, callback: grpc.AuthMetadataPluginCallback) -> None:
        callback((("authorization", f"Bearer {self._token}"),), None)


class KVStoreClient:
    def __init__(self, channel: grpc.aio.Channel, *, token: str = "", metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self._channel = channel
        self._stub = pb_grpc.KVStoreStub(channel)
        self._metadata = metadata or ((("authorization", f"Bearer {token}"),) if token else ())
        self._ns_cache: dict[Namespace, pb.Namespace] = {}

    @classmethod
    def from_url(
        cls, url: str, *, token: str = "", root_certificates: bytes | None = None, max_message_bytes: int = DEFAULT_MAX_MESSAGE
    ) -> KVStoreClient:
        target, tls = _target(url)
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        if tls or root_certificates:
            creds = grpc.ssl_channel_credentials(root_certificates)
            if token:
                creds = grpc.composite_channel_credentials(creds, grpc.metadata_call_credentials(_Token(token)))
                token = ""
            channel = grpc.aio.secure_channel(target, creds, options=options)
        else:
            channel = grpc.aio.insecure_channel(target, options=options)
        return cls(channel, token=token)

    async def aclose(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> KVStoreClient:
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    async def wait_ready(self, timeout: float = 10.0) -> None:
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout)
        except asyncio.TimeoutError:
            raise from_status_code(grpc.StatusCode.UNAVAILABLE, f"sidecar not reachable within {timeout}s") from None

    # --- plumbing -------------------------------------------------------------------------

    def _ns(self, ns: Namespace) -> pb.Namespace:
        msg = self._ns_cache.get(ns)
        if msg is None:
            msg = self._ns_cache[ns] = namespace_pb(ns)
        return msg

    async def _call(self, method: Any, request: Any, timeout: float | None = 30.0) -> Any:
        try:
            return await method(request, metadata=self._metadata, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise from_status_code(exc.code(), exc.details() or exc.code().name) from None

    # --- control plane ----------------------------------------------------------------------

    async def lookup(self, ns: Namespace, keys: Sequence[bytes], lease_ttl_ms: int = 0) -> LookupResult:
        r = await self._call(self._stub.Lookup, pb.LookupRequest(namespace=self._ns(ns), keys=keys, lease_ttl_ms=lease_ttl_ms))
        return LookupResult(r.matched, [(_TIER_NAMES.get(t, "unknown"), s) for t, s in zip(r.tiers, r.sizes)], r.lease_id or None)

    def allocate(
        self,
        ns: Namespace,
        keys: Sequence[bytes],
        sizes: Sequence[int] | int,
        parents: Sequence[bytes] | None = None,
        *,
        first_parent: bytes = b"",
        ttl_ms: int = 0,
    ) -> Allocation:
        """Reserve slots (``async with``); write into :meth:`Allocation.writable`, then commit."""
        if isinstance(sizes, int):
            sizes = [sizes] * len(keys)
        parents = list(parents) if parents is not None else _chain(keys, first_parent)
        req = pb.AllocateRequest(
            namespace=self._ns(ns),
            blocks=[pb.BlockSpec(key=k, parent=p, size=s) for k, p, s in zip(keys, parents, sizes)],
            ttl_ms=ttl_ms,
        )
        return Allocation(self, req)

    def acquire(self, ns: Namespace, keys: Sequence[bytes], lease_ttl_ms: int = 0) -> Lease:
        """Lease the leading run of ``keys`` readable now (``async with``), as zero-copy views."""
        return Lease(self, pb.AcquireRequest(namespace=self._ns(ns), keys=keys, lease_ttl_ms=lease_ttl_ms))

    async def release(self, lease_id: str) -> int:
        return (await self._call(self._stub.Release, pb.ReleaseRequest(lease_id=lease_id))).released

    async def delete(self, ns: Namespace, keys: Sequence[bytes] = (), *, all_keys: bool = False) -> tuple[int, int]:
        r = await self._call(self._stub.Delete, pb.DeleteRequest(namespace=self._ns(ns), keys=keys, all_keys=all_keys))
        return r.deleted, r.skipped_leased

    async def prefetch(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        return (await self._call(self._stub.Prefetch, pb.PrefetchRequest(namespace=self._ns(ns), keys=keys), timeout=300)).ready

    async def stats(self) -> dict[str, Any]:
        import json

        return json.loads((await self._call(self._stub.Stats, pb.StatsRequest())).json)

    async def report(self, decisions: Sequence[dict[str, Any]]) -> None:
        await self._call(self._stub.Report, pb.ReportRequest(decisions=[pb.Decision(**d) for d in decisions]))

    # --- convenience: whole-block copies ----------------------------------------------------------

    async def put_blocks(
        self,
        ns: Namespace,
        keys: Sequence[bytes],
        blocks: Sequence[Any],
        parents: Sequence[bytes] | None = None,
        *,
        first_parent: bytes = b"",
        checksums: bool = False,
    ) -> PutResult:
        """Store whole blocks (anything with the buffer protocol). Aborts on any failure."""
        arrays = [np.frombuffer(memoryview(b).cast("B"), dtype=np.uint8) for b in blocks]
        async with self.allocate(ns, keys, [a.size for a in arrays], parents, first_parent=first_parent) as alloc:
            for i, view in alloc.writable():
                view[:] = arrays[i]
            stored = await alloc.commit(checksums=checksums)
        return PutResult(stored, len(keys) - stored)

    async def get_blocks(self, ns: Namespace, keys: Sequence[bytes], *, verify: bool = False) -> list[np.ndarray]:
        """Copies of the leading run of ``keys`` that is readable now."""
        async with self.acquire(ns, keys) as lease:
            if verify:
                lease.verify()
            return [v.copy() for v in lease.views]


@dataclass(slots=True)
class _Slot:
    key: bytes
    present: bool
    view: np.ndarray | None
    slot_id: int


class Allocation:
    """A two-phase write in progress. Leaving the ``async with`` without commit aborts it."""

    def __init__(self, client: KVStoreClient, request: pb.AllocateRequest) -> None:
        self._client = client
        self._request = request
        self.id = ""
        self.slots: list[_Slot] = []
        self._done = False

    async def __aenter__(self) -> Allocation:
        r = await self._client._call(self._client._stub.Allocate, self._request)
        self.id = r.allocation_id
        for b in r.blocks:
            if b.present:
                self.slots.append(_Slot(b.key, True, None, 0))
            else:
                mem = attach(b.slot.segment)
                self.slots.append(_Slot(b.key, False, mem[b.slot.offset : b.slot.offset + b.slot.length], b.slot.slot_id))
        return self

    def writable(self) -> Iterator[tuple[int, np.ndarray]]:
        """(index in the request, writable uint8 view) for every block that needs its bytes."""
        for i, s in enumerate(self.slots):
            if not s.present:
                yield i, s.view  # type: ignore[misc]

    async def commit(self, indices: Sequence[int] | None = None, *, checksums: bool = False) -> int:
        """Make the written blocks visible (all of them, or those at ``indices``)."""
        chosen = [i for i, s in enumerate(self.slots) if not s.present] if indices is None else list(indices)
        blocks = []
        for i in chosen:
            s = self.slots[i]
            cb = pb.CommitBlock(key=s.key, slot_id=s.slot_id)
            if checksums:
                cb.has_checksum = True
                cb.checksum = checksum(s.view)  # type: ignore[arg-type]
            blocks.append(cb)
        self._done = True
        if not blocks:
            await self.abort()
            return 0
        r = await self._client._call(self._client._stub.Commit, pb.CommitRequest(allocation_id=self.id, blocks=blocks))
        return r.committed

    async def abort(self) -> None:
        self._done = True
        if self.id:
            try:
                await self._client._call(self._client._stub.Abort, pb.AbortRequest(allocation_id=self.id))
            except KVStoreError:
                pass  # already reclaimed: nothing to release

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if not self._done:
            await self.abort()


@dataclass(slots=True)
class Lease:
    """Read lease on the leading run of the requested keys; released on ``async with`` exit."""

    _client: KVStoreClient
    _request: pb.AcquireRequest
    id: str = ""
    keys: list[bytes] = field(default_factory=list)
    views: list[np.ndarray] = field(default_factory=list)
    checksums: list[int] = field(default_factory=list)

    async def __aenter__(self) -> Lease:
        r = await self._client._call(self._client._stub.Acquire, self._request)
        self.id = r.lease_id
        for b in r.blocks:
            mem = attach(b.slot.segment)
            view = mem[b.slot.offset : b.slot.offset + b.slot.length]
            view.flags.writeable = False
            self.keys.append(b.key)
            self.views.append(view)
            self.checksums.append(b.checksum)
        return self

    def verify(self) -> int:
        """Check every view against its checksum; truncate at the first bad block. Returns the
        number of good blocks. Blocks the server has not sealed yet (checksum 0) pass."""
        for i, (v, c) in enumerate(zip(self.views, self.checksums)):
            if c and checksum(v) != c:
                del self.views[i:], self.keys[i:], self.checksums[i:]
                return i
        return len(self.views)

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.views.clear()
        if self.id:
            try:
                await self._client.release(self.id)
            except KVStoreError:
                pass  # expired already


# --- thin sync bridge ---------------------------------------------------------------------------


class SyncClient:
    """Blocking facade for engines that are not async: one event-loop thread per client."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvstore-client", daemon=True)
        self._thread.start()
        self.aio: KVStoreClient = self._run(self._make(url, kwargs))

    @staticmethod
    async def _make(url: str, kwargs: dict[str, Any]) -> KVStoreClient:
        return KVStoreClient.from_url(url, **kwargs)

    def _run(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)  # type: ignore[arg-type]

    def submit(self, coro: Awaitable[T]) -> Any:
        """Schedule ``coro`` on the client's loop; returns a concurrent.futures.Future."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]

    def lookup(self, ns: Namespace, keys: Sequence[bytes], lease_ttl_ms: int = 0) -> LookupResult:
        return self._run(self.aio.lookup(ns, keys, lease_ttl_ms))

    def put_blocks(self, ns: Namespace, keys: Sequence[bytes], blocks: Sequence[Any], **kw: Any) -> PutResult:
        return self._run(self.aio.put_blocks(ns, keys, blocks, **kw))

    def get_blocks(self, ns: Namespace, keys: Sequence[bytes], **kw: Any) -> list[np.ndarray]:
        return self._run(self.aio.get_blocks(ns, keys, **kw))

    def allocate(self, ns: Namespace, keys: Sequence[bytes], sizes: Sequence[int] | int, **kw: Any) -> SyncAllocation:
        return SyncAllocation(self, self.aio.allocate(ns, keys, sizes, **kw))

    def acquire(self, ns: Namespace, keys: Sequence[bytes], lease_ttl_ms: int = 0) -> SyncLease:
        return SyncLease(self, self.aio.acquire(ns, keys, lease_ttl_ms))

    def release(self, lease_id: str) -> int:
        return self._run(self.aio.release(lease_id))

    def delete(self, ns: Namespace, keys: Sequence[bytes] = (), *, all_keys: bool = False) -> tuple[int, int]:
        return self._run(self.aio.delete(ns, keys, all_keys=all_keys))

    def prefetch(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        return self._run(self.aio.prefetch(ns, keys))

    def stats(self) -> dict[str, Any]:
        return self._run(self.aio.stats())

    def report(self, decisions: Sequence[dict[str, Any]]) -> None:
        self._run(self.aio.report(decisions))

    def wait_ready(self, timeout: float = 10.0) -> None:
        self._run(self.aio.wait_ready(timeout))

    def close(self) -> None:
        if self._loop.is_running():
            self._run(self.aio.aclose())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        self._loop.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SyncAllocation:
    def __init__(self, bridge: SyncClient, alloc: Allocation) -> None:
        self._bridge, self._alloc = bridge, alloc

    def __enter__(self) -> SyncAllocation:
        self._bridge._run(self._alloc.__aenter__())
        return self

    @property
    def id(self) -> str:
        return self._alloc.id

    def writable(self) -> Iterator[tuple[int, np.ndarray]]:
        return self._alloc.writable()

    def commit(self, indices: Sequence[int] | None = None, *, checksums: bool = False) -> int:
        return self._bridge._run(self._alloc.commit(indices, checksums=checksums))

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self._bridge._run(self._alloc.__aexit__(et, e, tb))


class SyncLease:
    def __init__(self, bridge: SyncClient, lease: Lease) -> None:
        self._bridge, self._lease = bridge, lease

    def __enter__(self) -> Lease:
        return self._bridge._run(self._lease.__aenter__())

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self._bridge._run(self._lease.__aexit__(et, e, tb))
