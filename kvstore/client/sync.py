"""The blocking client of the sidecar (:class:`SyncClient`), its writes (:class:`SyncAllocation`) and
its reads (:class:`SyncLease`): the calls of :mod:`kvstore.client.aio`, blocking, for engines.

    with SyncClient("grpc://127.0.0.1:50051") as c:
        c.put_blocks(ns, keys, blocks)
        with c.acquire(ns, keys) as lease: ...

The calls run on the caller's own thread (gRPC's synchronous stub): an engine's scheduler calls
them between steps, and hopping to an event-loop thread and back cost more than the RPC when the
engine kept the GIL busy. On the sidecar's host the same messages go over its Unix socket
(:mod:`kvstore.client.local_channel`: fewer thread wake-ups per call than gRPC).
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import numpy as np
from google.protobuf.message import Message

from kvstore.client.calls import (
    DEFAULT_TIMEOUT_S,
    AllocationState,
    Call,
    Calls,
    LeaseState,
    LookupResult,
    PutResult,
    Retain,
    ShardRun,
    Transport,
    acquired_shards,
    as_uint8,
)
from kvstore.client.grpc_channel import DEFAULT_MAX_MESSAGE, GrpcChannel, open_channel
from kvstore.client.local_channel import open_local
from kvstore.client.pipeline import Pipeline, open_pipeline
from kvstore.dram.copying import copy_blocks
from kvstore.errors import KVStoreError
from kvstore.keys import Namespace
from kvstore.v1 import kvstore_pb2 as pb


class SyncClient:
    """The same calls, blocking, on gRPC's synchronous stub (thread-safe; no event loop)."""

    def __init__(
        self, url: str, *, token: str = "", root_certificates: bytes | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE, local: bool = True,
    ) -> None:
        """``local``: on the sidecar's host, send the calls over its Unix socket
        (:mod:`kvstore.client.local_channel`; the path comes from the ``Hello`` RPC, asked on first
        use). Where the socket cannot be opened the client stays on gRPC."""
        self._grpc = GrpcChannel(*open_channel(url, token, root_certificates, max_message_bytes, aio=False))
        self._transport: Transport = self._grpc
        self._requests = Calls()
        self._token = token
        self._want_local = local
        self._choosing = threading.Lock()

    @property
    def transport(self) -> str:
        """"local" or "grpc": what the calls go over (after the first call)."""
        return self._transport.kind

    def close(self) -> None:
        if self._transport is not self._grpc:
            self._transport.close()
        self._grpc.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None,
    ) -> None:
        self.close()

    def wait_ready(self, timeout: float = 10.0) -> None:
        self._grpc.wait_ready(timeout)

    def _choose_transport(self) -> None:
        """The one place the transport is chosen: ask the sidecar (over gRPC) for its local socket
        and use it where it answers; otherwise stay on gRPC for good."""
        with self._choosing:
            if not self._want_local:
                return
            hello = self._grpc.call("Hello", pb.HelloRequest(), DEFAULT_TIMEOUT_S)  # errors: as any call's
            self._want_local = False
            local = open_local(hello.local_socket, self._token) if hello.local_socket else None
            if local is not None:
                self._transport = local

    def _call(self, name: str, request: Message, timeout: float | None = DEFAULT_TIMEOUT_S) -> Any:
        if self._want_local:
            self._choose_transport()
        return self._transport.call(name, request, timeout)

    def hello(self) -> pb.HelloResponse:
        """Where the sidecar's local socket and shared-memory slab are."""
        r: pb.HelloResponse = self._call("Hello", pb.HelloRequest())
        return r

    def pipeline(self) -> Pipeline | None:
        """Calls sent now and answered later (:class:`~kvstore.client.pipeline.Pipeline`), on a
        connection of their own to the sidecar's local socket; None where this client's calls go
        over gRPC or the socket cannot be opened. The ``Hello`` it asks raises while the sidecar
        cannot be reached. The caller closes it."""
        hello = self.hello()
        if not hello.local_socket or self.transport != "local":
            return None
        return open_pipeline(hello.local_socket, self._token)

    def lookup(self, ns: Namespace, keys: Sequence[bytes], lease_ttl_ms: int = 0) -> LookupResult:
        return Calls.lookup_result(self._call("Lookup", self._requests.lookup(ns, keys, lease_ttl_ms)))

    def allocate(
        self, ns: Namespace, keys: Sequence[bytes], sizes: Sequence[int] | int, parents: Sequence[bytes] | None = None,
        *, first_parent: bytes = b"", ttl_ms: int = 0,
    ) -> SyncAllocation:
        """Reserve slots (``with``); write into :meth:`SyncAllocation.writable`, then commit."""
        return SyncAllocation(self._call, self._requests.allocate(ns, keys, sizes, parents, first_parent, ttl_ms))

    def acquire(
        self, ns: Namespace, keys: Sequence[bytes], lease_ttl_ms: int = 0, retain: Retain = (0, 0)
    ) -> SyncLease:
        """Lease the leading run of ``keys`` readable now (``with``), as zero-copy views.
        With ``retain`` (retain_ms, retain_priority) the leased run is retained (a soft pin)."""
        return SyncLease(self._call, self._requests.acquire(ns, keys, lease_ttl_ms, *retain))

    def acquire_shards(
        self, ns: Namespace, keys: Sequence[bytes], shards: Sequence[tuple[Namespace, Sequence[bytes]]],
        lease_ttl_ms: int = 0,
    ) -> list[ShardRun]:
        """Lease the leading run of blocks that every shard holds (``ns``'s ``keys`` and each of
        ``shards``: the ranks of a tensor-parallel engine), in one round trip: per shard, its own
        first, its lease and where its blocks lie. The caller releases each lease."""
        r = self._call("Acquire", self._requests.acquire(ns, keys, lease_ttl_ms, shards=shards))
        return acquired_shards(r, len(keys), len(shards))

    def release(self, lease_id: str) -> int:
        r: pb.ReleaseResponse = self._call("Release", pb.ReleaseRequest(lease_id=lease_id))
        return r.released

    def delete(self, ns: Namespace, keys: Sequence[bytes] = (), *, all_keys: bool = False) -> tuple[int, int]:
        r = self._call("Delete", self._requests.delete(ns, keys, all_keys))
        return r.deleted, r.skipped_leased

    def prefetch(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        r: pb.PrefetchResponse = self._call("Prefetch", self._requests.prefetch(ns, keys), timeout=300)
        return r.ready

    def retain(self, ns: Namespace, keys: Sequence[bytes], retain_ms: int, retain_priority: int = 0) -> int:
        """Retain the blocks of ``keys`` the sidecar holds for ``retain_ms`` (0: end their retention),
        a soft pin (docs/architecture.md); how many it holds. Past the tenant's bound: ResourceExhausted."""
        r: pb.RetainResponse = self._call("Retain", self._requests.retain(ns, keys, retain_ms, retain_priority))
        return r.retained

    def stats(self) -> dict[str, Any]:
        r: pb.StatsResponse = self._call("Stats", pb.StatsRequest())
        doc: dict[str, Any] = json.loads(r.json)
        return doc

    def report(self, decisions: Sequence[dict[str, Any]]) -> None:
        self._call("Report", Calls.report(decisions))

    def put_blocks(
        self, ns: Namespace, keys: Sequence[bytes], blocks: Sequence[Any], parents: Sequence[bytes] | None = None,
        *, first_parent: bytes = b"", checksums: bool = False, wait_write_through: bool = False,
        wait_published: bool = False, retain: Retain = (0, 0),
    ) -> PutResult:
        """:meth:`KVStoreClient.put_blocks <kvstore.client.aio.KVStoreClient.put_blocks>`, blocking."""
        arrays = as_uint8(blocks)
        with self.allocate(ns, keys, [a.size for a in arrays], parents, first_parent=first_parent) as alloc:
            copy_blocks([(view, arrays[i]) for i, view in alloc.writable()])
            stored = alloc.commit(
                checksums=checksums, wait_write_through=wait_write_through, wait_published=wait_published,
                retain=retain,
            )
        return PutResult(stored, len(keys) - stored, alloc.written_through)

    def get_blocks(self, ns: Namespace, keys: Sequence[bytes], *, verify: bool = False) -> list[np.ndarray]:
        """Copies of the leading run of ``keys`` that is readable now."""
        with self.acquire(ns, keys) as lease:
            if verify:
                lease.verify()
            return [v.copy() for v in lease.views]


class SyncAllocation(AllocationState):
    """A two-phase write in progress (``with``). Leaving without commit aborts it."""

    def __init__(self, call: Call, request: pb.AllocateRequest) -> None:
        super().__init__(request)
        self._send = call

    def __enter__(self) -> SyncAllocation:
        self._accept(self._send("Allocate", self.request), self._send)  # refused: aborted
        return self

    def commit(
        self, indices: Sequence[int] | None = None, *, checksums: bool = False, wait_write_through: bool = False,
        wait_published: bool = False, retain: Retain = (0, 0),
    ) -> int:
        """:meth:`Allocation.commit <kvstore.client.aio.Allocation.commit>`, blocking."""
        req = self._commit_request(indices, checksums, wait_write_through, wait_published, retain)
        if req is None:
            self.abort()
            return 0
        return self._committed(self._send("Commit", req))

    def abort(self) -> None:
        self._finish()
        if self.id:
            with contextlib.suppress(KVStoreError):  # already reclaimed: nothing to release
                self._send("Abort", pb.AbortRequest(allocation_id=self.id))

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None,
    ) -> None:
        if not self.done:
            self.abort()


class SyncLease(LeaseState):
    """Read lease (``with``); released on exit."""

    def __init__(self, call: Call, request: pb.AcquireRequest) -> None:
        super().__init__(request)
        self._send = call

    def __enter__(self) -> SyncLease:
        self._accept(self._send("Acquire", self.request), self._send)  # refused: released
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None,
    ) -> None:
        self.views.clear()
        if self.id:
            with contextlib.suppress(KVStoreError):  # expired already
                self._send("Release", pb.ReleaseRequest(lease_id=self.id))
