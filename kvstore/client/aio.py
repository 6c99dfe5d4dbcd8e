"""The asyncio client of the sidecar (:class:`KVStoreClient`), its writes (:class:`Allocation`) and
its reads (:class:`Lease`).

    async with KVStoreClient.from_url("grpc://127.0.0.1:50051") as c:
        await c.put_blocks(ns, keys, blocks)           # allocate -> copy into slots -> commit
        async with c.acquire(ns, keys) as lease:       # zero-copy read-only views of the slots
            use(lease.views)                           # released on exit
        r = await c.lookup(ns, keys)

Block bytes go through the shared-memory slab, attached once per process; only control messages
cross the transport: gRPC, or on the sidecar's host its Unix socket
(:mod:`kvstore.client.local_channel`), chosen on the first call. Every error comes back as a
:mod:`kvstore.errors` exception. The blocking twin is :mod:`kvstore.client.sync`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import Message

from kvstore.client.calls import (
    DEFAULT_TIMEOUT_S,
    AllocationState,
    AsyncCall,
    AsyncTransport,
    Calls,
    LeaseState,
    LookupResult,
    PutResult,
    Retain,
    ShardRun,
    acquired_shards,
    as_uint8,
)
from kvstore.client.grpc_channel import DEFAULT_MAX_MESSAGE, AsyncGrpcChannel, Metadata, open_channel
from kvstore.client.local_channel import open_local_async
from kvstore.client.pipeline import AsyncPipeline
from kvstore.dram.copying import copy_blocks_async
from kvstore.errors import KVStoreError
from kvstore.keys import Namespace
from kvstore.v1 import kvstore_pb2 as pb


class KVStoreClient:
    def __init__(
        self, channel: grpc.aio.Channel, metadata: Metadata = (), *, token: str = "", local: bool = True,
    ) -> None:
        """``local``: on the sidecar's host, send the calls over its Unix socket, as
        :class:`~kvstore.client.sync.SyncClient` does (an Allocate or Commit of 32 blocks: 0.6-0.8 ms
        there against 1.5-1.7 ms over gRPC). Where the socket cannot be opened the client stays on gRPC."""
        self._grpc = AsyncGrpcChannel(channel, metadata)
        self._transport: AsyncTransport = self._grpc
        self._requests = Calls()
        self._token = token
        self._want_local = local
        self._choosing: asyncio.Lock | None = None  # made on first use, in the caller's event loop

    @classmethod
    def from_url(
        cls, url: str, *, token: str = "", root_certificates: bytes | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE, local: bool = True,
    ) -> KVStoreClient:
        return cls(*open_channel(url, token, root_certificates, max_message_bytes, aio=True), token=token, local=local)

    @property
    def transport(self) -> str:
        """"local" or "grpc": what the calls go over (after the first call)."""
        return self._transport.kind

    async def aclose(self) -> None:
        if self._transport is not self._grpc:
            await self._transport.aclose()
        await self._grpc.aclose()

    async def __aenter__(self) -> KVStoreClient:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def wait_ready(self, timeout: float = 10.0) -> None:
        await self._grpc.wait_ready(timeout)

    async def _choose_transport(self) -> None:
        """The one place the transport is chosen: ask the sidecar (over gRPC) for its local socket
        and use it where it answers; otherwise stay on gRPC for good."""
        if self._choosing is None:
            self._choosing = asyncio.Lock()
        async with self._choosing:
            if not self._want_local:
                return
            hello = await self._grpc.call("Hello", pb.HelloRequest(), DEFAULT_TIMEOUT_S)  # errors: as any call's
            self._want_local = False
            local = await open_local_async(hello.local_socket, self._token) if hello.local_socket else None
            if local is not None:
                self._transport = local

    async def _call(self, name: str, request: Message, timeout: float | None = DEFAULT_TIMEOUT_S) -> Any:
        if self._want_local:
            await self._choose_transport()
        return await self._transport.call(name, request, timeout)

    async def hello(self) -> pb.HelloResponse:
        """Where the sidecar's local socket and shared-memory slab are."""
        r: pb.HelloResponse = await self._call("Hello", pb.HelloRequest())
        return r

    async def pipeline(self) -> AsyncPipeline:
        """Calls sent now and answered later (:class:`~kvstore.client.pipeline.AsyncPipeline`), on
        this client's transport, chosen first (the blocking client's :meth:`SyncClient.pipeline
        <kvstore.client.sync.SyncClient.pipeline>`; on asyncio any transport has calls in flight
        at once, so there is always one)."""
        if self._want_local:
            await self._choose_transport()
        return AsyncPipeline(self._call)

    async def lookup(self, ns: Namespace, keys: Sequence[bytes], lease_ttl_ms: int = 0) -> LookupResult:
        return Calls.lookup_result(await self._call("Lookup", self._requests.lookup(ns, keys, lease_ttl_ms)))

    def allocate(
        self, ns: Namespace, keys: Sequence[bytes], sizes: Sequence[int] | int, parents: Sequence[bytes] | None = None,
        *, first_parent: bytes = b"", ttl_ms: int = 0,
    ) -> Allocation:
        """Reserve slots (``async with``); write into :meth:`Allocation.writable`, then commit."""
        return Allocation(self._call, self._requests.allocate(ns, keys, sizes, parents, first_parent, ttl_ms))

    def acquire(self, ns: Namespace, keys: Sequence[bytes], lease_ttl_ms: int = 0, retain: Retain = (0, 0)) -> Lease:
        """Lease the leading run of ``keys`` readable now (``async with``), as zero-copy views.
        With ``retain`` (retain_ms, retain_priority) the leased run is retained (a soft pin)."""
        return Lease(self._call, self._requests.acquire(ns, keys, lease_ttl_ms, *retain))

    async def acquire_shards(
        self, ns: Namespace, keys: Sequence[bytes], shards: Sequence[tuple[Namespace, Sequence[bytes]]],
        lease_ttl_ms: int = 0,
    ) -> list[ShardRun]:
        """Lease the leading run of blocks that every shard holds (``ns``'s ``keys`` and each of
        ``shards``: the ranks of a tensor-parallel engine), in one round trip: per shard, its own
        first, its lease and where its blocks lie. The caller releases each lease."""
        r = await self._call("Acquire", self._requests.acquire(ns, keys, lease_ttl_ms, shards=shards))
        return acquired_shards(r, len(keys), len(shards))

    async def release(self, lease_id: str) -> int:
        r: pb.ReleaseResponse = await self._call("Release", pb.ReleaseRequest(lease_id=lease_id))
        return r.released

    async def delete(self, ns: Namespace, keys: Sequence[bytes] = (), *, all_keys: bool = False) -> tuple[int, int]:
        r = await self._call("Delete", self._requests.delete(ns, keys, all_keys))
        return r.deleted, r.skipped_leased

    async def prefetch(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        r: pb.PrefetchResponse = await self._call("Prefetch", self._requests.prefetch(ns, keys), timeout=300)
        return r.ready

    async def retain(self, ns: Namespace, keys: Sequence[bytes], retain_ms: int, retain_priority: int = 0) -> int:
        """Retain the blocks of ``keys`` the sidecar holds for ``retain_ms`` (0: end their retention),
        a soft pin (docs/architecture.md); how many it holds. Past the tenant's bound: ResourceExhausted."""
        r: pb.RetainResponse = await self._call("Retain", self._requests.retain(ns, keys, retain_ms, retain_priority))
        return r.retained

    async def stats(self) -> dict[str, Any]:
        r: pb.StatsResponse = await self._call("Stats", pb.StatsRequest())
        doc: dict[str, Any] = json.loads(r.json)
        return doc

    async def report(self, decisions: Sequence[dict[str, Any]]) -> None:
        await self._call("Report", Calls.report(decisions))

    async def put_blocks(
        self, ns: Namespace, keys: Sequence[bytes], blocks: Sequence[Any], parents: Sequence[bytes] | None = None,
        *, first_parent: bytes = b"", checksums: bool = False, wait_write_through: bool = False,
        wait_published: bool = False, retain: Retain = (0, 0),
    ) -> PutResult:
        """Store whole blocks (anything with the buffer protocol), copied into the slots on
        two threads when large (:mod:`kvstore.dram.copying`). Aborts on any failure. With
        ``wait_write_through``, returns once the write-through tiers hold them too; with
        ``wait_published``, once the cluster directory lists them (every node finds them)."""
        arrays = as_uint8(blocks)
        async with self.allocate(ns, keys, [a.size for a in arrays], parents, first_parent=first_parent) as alloc:
            await copy_blocks_async([(view, arrays[i]) for i, view in alloc.writable()])
            stored = await alloc.commit(
                checksums=checksums, wait_write_through=wait_write_through, wait_published=wait_published,
                retain=retain,
            )
        return PutResult(stored, len(keys) - stored, alloc.written_through)

    async def get_blocks(self, ns: Namespace, keys: Sequence[bytes], *, verify: bool = False) -> list[np.ndarray]:
        """Copies of the leading run of ``keys`` that is readable now."""
        async with self.acquire(ns, keys) as lease:
            if verify:
                lease.verify()
            return [v.copy() for v in lease.views]


class Allocation(AllocationState):
    """A two-phase write in progress (``async with``). Leaving without commit aborts it."""

    def __init__(self, call: AsyncCall, request: pb.AllocateRequest) -> None:
        super().__init__(request)
        self._send = call

    async def __aenter__(self) -> Allocation:
        await self._accept_async(await self._send("Allocate", self.request), self._send)  # refused: aborted
        return self

    async def commit(
        self, indices: Sequence[int] | None = None, *, checksums: bool = False, wait_write_through: bool = False,
        wait_published: bool = False, retain: Retain = (0, 0),
    ) -> int:
        """Make the written blocks visible (all of them, or those at ``indices``). With
        ``wait_write_through``, return once the write-through tiers hold them too; how many
        reached every such tier is then in ``written_through``. With ``wait_published``, return
        once the cluster directory lists them, so every node of the cluster finds them."""
        req = self._commit_request(indices, checksums, wait_write_through, wait_published, retain)
        if req is None:
            await self.abort()
            return 0
        return self._committed(await self._send("Commit", req))

    async def abort(self) -> None:
        self._finish()
        if self.id:
            with contextlib.suppress(KVStoreError):  # already reclaimed: nothing to release
                await self._send("Abort", pb.AbortRequest(allocation_id=self.id))

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None,
    ) -> None:
        if not self.done:
            await self.abort()


class Lease(LeaseState):
    """Read lease (``async with``); released on exit."""

    def __init__(self, call: AsyncCall, request: pb.AcquireRequest) -> None:
        super().__init__(request)
        self._send = call

    async def __aenter__(self) -> Lease:
        await self._accept_async(await self._send("Acquire", self.request), self._send)  # refused: released
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None,
    ) -> None:
        self.views.clear()
        if self.id:
            with contextlib.suppress(KVStoreError):  # expired already
                await self._send("Release", pb.ReleaseRequest(lease_id=self.id))
