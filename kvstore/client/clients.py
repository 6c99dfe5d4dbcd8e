"""Clients for the sidecar: async (:class:`KVStoreClient`) and blocking (:class:`SyncClient`).

    async with KVStoreClient.from_url("grpc://127.0.0.1:50051") as c:
        await c.put_blocks(ns, keys, blocks)           # allocate -> copy into slots -> commit
        async with c.acquire(ns, keys) as lease:       # zero-copy read-only views of the slots
            use(lease.views)                           # released on exit
        r = await c.lookup(ns, keys)

    with SyncClient("grpc://127.0.0.1:50051") as c:    # the same calls, blocking; for engines
        with c.acquire(ns, keys) as lease: ...

Block bytes go through the shared-memory slab, attached once per process; only control
messages cross gRPC. Every gRPC error comes back as a :mod:`kvstore.errors` exception.

Both clients build the same requests and read the same responses (:class:`_Wire`,
:class:`_AllocationState`, :class:`_LeaseState`); they differ only in how a call is made. The
blocking client uses gRPC's synchronous stub on the caller's own thread: an engine's scheduler
calls it between steps, and hopping to an event-loop thread and back cost more than the RPC
when the engine kept the GIL busy. On the sidecar's host it sends the same messages over the
sidecar's Unix socket instead (:mod:`kvstore.client.local_channel`: fewer thread wake-ups per call than gRPC).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import grpc
import numpy as np

from kvstore.client.local_channel import AsyncLocalChannel, LocalChannel
from kvstore.dram.copying import copy_blocks, copy_blocks_async
from kvstore.dram.slab import attach
from kvstore.errors import KVStoreError, from_status_code
from kvstore.keys import Namespace
from kvstore.store.checksum import checksum
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

log = logging.getLogger("kvstore.client")

_TIER_NAMES = {pb.TIER_DRAM: "dram", pb.TIER_SSD: "ssd", pb.TIER_REDIS: "redis", pb.TIER_S3: "s3"}
DEFAULT_MAX_MESSAGE = 64 << 20
DEFAULT_TIMEOUT_S = 30.0


def namespace_pb(ns: Namespace) -> pb.Namespace:
    return pb.Namespace(
        model=ns.model, revision=ns.revision, kv_layout=ns.kv_layout, dtype=ns.dtype, block_size=ns.block_size,
        rank=ns.rank, world_size=ns.world_size, adapter=ns.adapter, cache_salt=ns.cache_salt,
    )


@dataclass(slots=True, frozen=True)
class LookupResult:
    matched: int
    blocks: list[tuple[str, int]]  # (tier, size) per matched block
    lease_id: str | None


@dataclass(slots=True, frozen=True)
class SlotRef:
    """Where a block's bytes lie in the sidecar's shared memory (``attach(segment)[offset:offset + length]``)."""

    segment: str
    offset: int
    length: int


@dataclass(slots=True, frozen=True)
class PutResult:
    stored: int
    present: int
    written_through: int = 0  # with wait_write_through: blocks every write-through tier holds


# --- channels ------------------------------------------------------------------------------------


class _Token(grpc.AuthMetadataPlugin):
    def __init__(self, token: str) -> None:
        self._token = token

    def __call__(self, context: grpc.AuthMetadataContext, callback: grpc.AuthMetadataPluginCallback) -> None:
        callback((("authorization", f"Bearer {self._token}"),), None)


def _channel(url: str, token: str, root_certificates: bytes | None, max_message_bytes: int, aio: bool) -> tuple[Any, tuple]:
    """A channel for grpc://host:port, grpcs://host:port, host:port or unix:/path, and the
    metadata every call must carry."""
    tls = url.startswith("grpcs://")
    target = url.split("://", 1)[1] if url.startswith(("grpc://", "grpcs://")) else url
    options = [("grpc.max_receive_message_length", max_message_bytes), ("grpc.max_send_message_length", max_message_bytes)]
    mod = grpc.aio if aio else grpc
    if tls or root_certificates:
        creds = grpc.ssl_channel_credentials(root_certificates)
        if token:  # over TLS the token travels as call credentials
            creds = grpc.composite_channel_credentials(creds, grpc.metadata_call_credentials(_Token(token)))
        return mod.secure_channel(target, creds, options=options), ()
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    return mod.insecure_channel(target, options=options), metadata


# --- what both clients send and read -------------------------------------------------------------


class _Wire:
    """Request builders and response readers shared by the async and the blocking client."""

    def __init__(self) -> None:
        self._ns_cache: dict[Namespace, pb.Namespace] = {}

    def ns(self, ns: Namespace) -> pb.Namespace:
        msg = self._ns_cache.get(ns)
        if msg is None:
            msg = self._ns_cache[ns] = namespace_pb(ns)
        return msg

    def lookup(self, ns: Namespace, keys: Sequence[bytes], lease_ttl_ms: int) -> pb.LookupRequest:
        return pb.LookupRequest(namespace=self.ns(ns), keys=keys, lease_ttl_ms=lease_ttl_ms)

    @staticmethod
    def lookup_result(r: pb.LookupResponse) -> LookupResult:
        sizes = [r.uniform_size] * r.matched if r.uniform_size else r.sizes
        return LookupResult(r.matched, [(_TIER_NAMES.get(t, "unknown"), s) for t, s in zip(r.tiers, sizes)], r.lease_id or None)

    def allocate(
        self, ns: Namespace, keys: Sequence[bytes], sizes: Sequence[int] | int, parents: Sequence[bytes] | None,
        first_parent: bytes, ttl_ms: int,
    ) -> pb.AllocateRequest:
        if isinstance(sizes, int):
            sizes = [sizes] * len(keys)
        if parents is None:  # a chain: each block's parent is the key before it
            parents = [first_parent, *keys[:-1]] if keys else []
        return pb.AllocateRequest(
            namespace=self.ns(ns),
            blocks=[pb.BlockSpec(key=k, parent=p or b"", size=s) for k, p, s in zip(keys, parents, sizes)],
            ttl_ms=ttl_ms,
        )

    def acquire(self, ns: Namespace, keys: Sequence[bytes], lease_ttl_ms: int) -> pb.AcquireRequest:
        return pb.AcquireRequest(namespace=self.ns(ns), keys=keys, lease_ttl_ms=lease_ttl_ms)

    def delete(self, ns: Namespace, keys: Sequence[bytes], all_keys: bool) -> pb.DeleteRequest:
        return pb.DeleteRequest(namespace=self.ns(ns), keys=keys, all_keys=all_keys)

    def prefetch(self, ns: Namespace, keys: Sequence[bytes]) -> pb.PrefetchRequest:
        return pb.PrefetchRequest(namespace=self.ns(ns), keys=keys)

    @staticmethod
    def report(decisions: Sequence[dict[str, Any]]) -> pb.ReportRequest:
        return pb.ReportRequest(decisions=[pb.Decision(**d) for d in decisions])


def _as_uint8(blocks: Sequence[Any]) -> list[np.ndarray]:
    return [np.frombuffer(memoryview(b).cast("B"), dtype=np.uint8) for b in blocks]


@dataclass(slots=True)
class _Slot:
    key: bytes
    present: bool
    view: np.ndarray | None
    slot_id: int
    ref: SlotRef | None = None


class _AllocationState:
    """A two-phase write: the slots handed out, and the Commit that makes them visible."""

    def __init__(self, request: pb.AllocateRequest) -> None:
        self.request = request
        self.id = ""
        self.slots: list[_Slot] = []
        self.checksums: dict[int, int] = {}  # index in the request -> checksum sent with the Commit
        self.written_through = 0  # after commit(wait_write_through=True): blocks in every write-through tier
        self.done = False

    def _fill(self, r: pb.AllocateResponse) -> None:
        self.id = r.allocation_id
        for b in r.blocks:
            if b.present:
                self.slots.append(_Slot(b.key, True, None, 0))
            else:
                sd = b.slot
                seg, off, n = sd.segment, sd.offset, sd.length
                self.slots.append(_Slot(b.key, False, attach(seg)[off : off + n], sd.slot_id, SlotRef(seg, off, n)))

    def writable(self) -> Iterator[tuple[int, np.ndarray]]:
        """(index in the request, writable uint8 view) for every block that needs its bytes."""
        for i, s in enumerate(self.slots):
            if not s.present:
                yield i, s.view  # type: ignore[misc]

    def slot_refs(self) -> dict[int, SlotRef]:
        """Where each block that needs its bytes lies, by index in the request."""
        return {i: s.ref for i, s in enumerate(self.slots) if s.ref is not None}

    def _commit_request(self, indices: Sequence[int] | None, checksums: bool, wait_write_through: bool) -> pb.CommitRequest | None:
        chosen = [i for i, s in enumerate(self.slots) if not s.present] if indices is None else list(indices)
        blocks = []
        for i in chosen:
            s = self.slots[i]
            cb = pb.CommitBlock(key=s.key, slot_id=s.slot_id)
            if checksums:
                cb.has_checksum = True
                cb.checksum = self.checksums[i] = checksum(s.view)  # type: ignore[arg-type]
            blocks.append(cb)
        self.done = True
        return pb.CommitRequest(allocation_id=self.id, blocks=blocks, wait_write_through=wait_write_through) if blocks else None

    def _committed(self, resp: pb.CommitResponse) -> int:
        self.written_through = resp.written_through
        return resp.committed


class _LeaseState:
    """Read lease on the leading run of the requested keys, as zero-copy read-only views."""

    def __init__(self, request: pb.AcquireRequest) -> None:
        self.request = request
        self.id = ""
        self.keys: list[bytes] = []
        self.views: list[np.ndarray] = []
        self.checksums: list[int] = []
        self.slots: list[SlotRef] = []  # where the views lie: another process can map them while the lease holds

    def _fill(self, r: pb.AcquireResponse) -> None:
        self.id = r.lease_id
        for b in r.blocks:
            sd = b.slot
            seg, off, n = sd.segment, sd.offset, sd.length
            self.slots.append(SlotRef(seg, off, n))
            view = attach(seg)[off : off + n]
            view.flags.writeable = False
            self.keys.append(b.key)
            self.views.append(view)
            self.checksums.append(b.checksum)

    def verify(self) -> int:
        """Check every view against its checksum; truncate at the first bad block. Returns the
        number of good blocks. Blocks the server has not sealed yet (checksum 0) pass."""
        for i, (v, c) in enumerate(zip(self.views, self.checksums)):
            if c and checksum(v) != c:
                del self.views[i:], self.keys[i:], self.checksums[i:], self.slots[i:]
                return i
        return len(self.views)


# --- async ---------------------------------------------------------------------------------------


async def _usable(channel: AsyncLocalChannel) -> AsyncLocalChannel | None:
    """``channel`` once a Hello went through it, else None (closed)."""
    try:
        await channel.call("Hello", pb.HelloRequest())
    except KVStoreError as exc:  # another host or container: the path is not ours to open
        log.info("local socket %s not usable (%s); using gRPC", channel.path, exc)
        await channel.aclose()
        return None
    return channel


class KVStoreClient:
    def __init__(
        self, channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...] = (), *, token: str = "", local: bool = True,
    ) -> None:
        """``local``: on the sidecar's host, send the calls over its Unix socket, as
        :class:`SyncClient` does (an Allocate or Commit of 32 blocks: 0.6-0.8 ms there against
        1.5-1.7 ms over gRPC). Where the socket cannot be opened the client stays on gRPC."""
        self._channel = channel
        self._stub = pb_grpc.KVStoreStub(channel)
        self._metadata = metadata
        self._wire = _Wire()
        self._token = token
        self._want_local = local
        self._local: AsyncLocalChannel | None = None
        self._local_lock: asyncio.Lock | None = None

    @classmethod
    def from_url(
        cls, url: str, *, token: str = "", root_certificates: bytes | None = None, max_message_bytes: int = DEFAULT_MAX_MESSAGE,
        local: bool = True,
    ) -> KVStoreClient:
        return cls(*_channel(url, token, root_certificates, max_message_bytes, aio=True), token=token, local=local)

    @property
    def transport(self) -> str:
        """"local" or "grpc": what the calls go over (after the first call)."""
        return "local" if self._local is not None else "grpc"

    async def aclose(self) -> None:
        if self._local is not None:
            await self._local.aclose()
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

    async def _grpc_call(self, name: str, request: Any, timeout: float | None) -> Any:
        try:
            return await getattr(self._stub, name)(request, metadata=self._metadata, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise from_status_code(exc.code(), exc.details() or exc.code().name) from None

    async def _open_local(self) -> None:
        """Ask the sidecar for its local socket and open it; on failure stay on gRPC for good."""
        if self._local_lock is None:
            self._local_lock = asyncio.Lock()
        async with self._local_lock:
            if not self._want_local:
                return
            hello = await self._grpc_call("Hello", pb.HelloRequest(), DEFAULT_TIMEOUT_S)  # errors: as any call's
            self._want_local = False
            self._local = await _usable(AsyncLocalChannel(hello.local_socket, token=self._token)) if hello.local_socket else None

    async def _call(self, name: str, request: Any, timeout: float | None = DEFAULT_TIMEOUT_S) -> Any:
        if self._want_local:
            await self._open_local()
        if self._local is not None:
            return await self._local.call(name, request, timeout)
        return await self._grpc_call(name, request, timeout)

    async def lookup(self, ns: Namespace, keys: Sequence[bytes], lease_ttl_ms: int = 0) -> LookupResult:
        return _Wire.lookup_result(await self._call("Lookup", self._wire.lookup(ns, keys, lease_ttl_ms)))

    def allocate(
        self, ns: Namespace, keys: Sequence[bytes], sizes: Sequence[int] | int, parents: Sequence[bytes] | None = None,
        *, first_parent: bytes = b"", ttl_ms: int = 0,
    ) -> Allocation:
        """Reserve slots (``async with``); write into :meth:`Allocation.writable`, then commit."""
        return Allocation(self, self._wire.allocate(ns, keys, sizes, parents, first_parent, ttl_ms))

    def acquire(self, ns: Namespace, keys: Sequence[bytes], lease_ttl_ms: int = 0) -> Lease:
        """Lease the leading run of ``keys`` readable now (``async with``), as zero-copy views."""
        return Lease(self, self._wire.acquire(ns, keys, lease_ttl_ms))

    async def release(self, lease_id: str) -> int:
        return (await self._call("Release", pb.ReleaseRequest(lease_id=lease_id))).released

    async def delete(self, ns: Namespace, keys: Sequence[bytes] = (), *, all_keys: bool = False) -> tuple[int, int]:
        r = await self._call("Delete", self._wire.delete(ns, keys, all_keys))
        return r.deleted, r.skipped_leased

    async def prefetch(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        return (await self._call("Prefetch", self._wire.prefetch(ns, keys), timeout=300)).ready

    async def stats(self) -> dict[str, Any]:
        return json.loads((await self._call("Stats", pb.StatsRequest())).json)

    async def report(self, decisions: Sequence[dict[str, Any]]) -> None:
        await self._call("Report", _Wire.report(decisions))

    async def put_blocks(
        self, ns: Namespace, keys: Sequence[bytes], blocks: Sequence[Any], parents: Sequence[bytes] | None = None,
        *, first_parent: bytes = b"", checksums: bool = False, wait_write_through: bool = False,
    ) -> PutResult:
        """Store whole blocks (anything with the buffer protocol), copied into the slots on
        two threads when large (:mod:`kvstore.dram.copying`). Aborts on any failure. With
        ``wait_write_through``, returns once the write-through tiers hold them too."""
        arrays = _as_uint8(blocks)
        async with self.allocate(ns, keys, [a.size for a in arrays], parents, first_parent=first_parent) as alloc:
            await copy_blocks_async([(view, arrays[i]) for i, view in alloc.writable()])
            stored = await alloc.commit(checksums=checksums, wait_write_through=wait_write_through)
        return PutResult(stored, len(keys) - stored, alloc.written_through)

    async def get_blocks(self, ns: Namespace, keys: Sequence[bytes], *, verify: bool = False) -> list[np.ndarray]:
        """Copies of the leading run of ``keys`` that is readable now."""
        async with self.acquire(ns, keys) as lease:
            if verify:
                lease.verify()
            return [v.copy() for v in lease.views]


class Allocation(_AllocationState):
    """A two-phase write in progress (``async with``). Leaving without commit aborts it."""

    def __init__(self, client: KVStoreClient, request: pb.AllocateRequest) -> None:
        super().__init__(request)
        self._client = client

    async def __aenter__(self) -> Allocation:
        self._fill(await self._client._call("Allocate", self.request))
        return self

    async def commit(self, indices: Sequence[int] | None = None, *, checksums: bool = False, wait_write_through: bool = False) -> int:
        """Make the written blocks visible (all of them, or those at ``indices``). With
        ``wait_write_through``, return once the write-through tiers hold them too; how many
        reached every such tier is then in ``written_through``."""
        req = self._commit_request(indices, checksums, wait_write_through)
        if req is None:
            await self.abort()
            return 0
        return self._committed(await self._client._call("Commit", req))

    async def abort(self) -> None:
        self.done = True
        if self.id:
            try:
                await self._client._call("Abort", pb.AbortRequest(allocation_id=self.id))
            except KVStoreError:
                pass  # already reclaimed: nothing to release

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if not self.done:
            await self.abort()


class Lease(_LeaseState):
    """Read lease (``async with``); released on exit."""

    def __init__(self, client: KVStoreClient, request: pb.AcquireRequest) -> None:
        super().__init__(request)
        self._client = client

    async def __aenter__(self) -> Lease:
        self._fill(await self._client._call("Acquire", self.request))
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.views.clear()
        if self.id:
            try:
                await self._client.release(self.id)
            except KVStoreError:
                pass  # expired already


# --- blocking ------------------------------------------------------------------------------------


class SyncClient:
    """The same calls, blocking, on gRPC's synchronous stub (thread-safe; no event loop)."""

    def __init__(
        self, url: str, *, token: str = "", root_certificates: bytes | None = None, max_message_bytes: int = DEFAULT_MAX_MESSAGE,
        local: bool = True,
    ) -> None:
        """``local``: on the sidecar's host, send the calls over its Unix socket
        (:mod:`kvstore.client.local_channel`; the path comes from the ``Hello`` RPC, asked on first use). Where
        the socket cannot be opened the client stays on gRPC."""
        self._channel, self._metadata = _channel(url, token, root_certificates, max_message_bytes, aio=False)
        self._stub = pb_grpc.KVStoreStub(self._channel)
        self._wire = _Wire()
        self._token = token
        self._want_local = local
        self._local: LocalChannel | None = None
        self._local_lock = threading.Lock()

    @property
    def transport(self) -> str:
        """"local" or "grpc": what the calls go over (after the first call)."""
        return "local" if self._local is not None else "grpc"

    def _grpc_call(self, name: str, request: Any, timeout: float | None) -> Any:
        try:
            return getattr(self._stub, name)(request, metadata=self._metadata, timeout=timeout)
        except grpc.RpcError as exc:
            code = exc.code()  # type: ignore[attr-defined]
            raise from_status_code(code, exc.details() or code.name) from None  # type: ignore[attr-defined]

    def _open_local(self) -> None:
        """Ask the sidecar for its local socket and open it; on failure stay on gRPC for good."""
        with self._local_lock:
            if not self._want_local:
                return
            hello = self._grpc_call("Hello", pb.HelloRequest(), DEFAULT_TIMEOUT_S)  # errors: as any call's
            self._want_local = False
            if not hello.local_socket:
                return
            channel = LocalChannel(hello.local_socket, token=self._token)
            try:
                channel.call("Hello", pb.HelloRequest())
            except KVStoreError as exc:  # another host or container: the path is not ours to open
                log.info("local socket %s not usable (%s); using gRPC", hello.local_socket, exc)
                channel.close()
                return
            self._local = channel

    def _call(self, name: str, request: Any, timeout: float | None = DEFAULT_TIMEOUT_S) -> Any:
        if self._want_local:
            self._open_local()
        if self._local is not None:
            return self._local.call(name, request, timeout)
        return self._grpc_call(name, request, timeout)

    def hello(self) -> pb.HelloResponse:
        """Where the sidecar's local socket and shared-memory slab are."""
        return self._call("Hello", pb.HelloRequest())

    def wait_ready(self, timeout: float = 10.0) -> None:
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise from_status_code(grpc.StatusCode.UNAVAILABLE, f"sidecar not reachable within {timeout}s") from None

    def lookup(self, ns: Namespace, keys: Sequence[bytes], lease_ttl_ms: int = 0) -> LookupResult:
        return _Wire.lookup_result(self._call("Lookup", self._wire.lookup(ns, keys, lease_ttl_ms)))

    def allocate(
        self, ns: Namespace, keys: Sequence[bytes], sizes: Sequence[int] | int, parents: Sequence[bytes] | None = None,
        *, first_parent: bytes = b"", ttl_ms: int = 0,
    ) -> SyncAllocation:
        return SyncAllocation(self, self._wire.allocate(ns, keys, sizes, parents, first_parent, ttl_ms))

    def acquire(self, ns: Namespace, keys: Sequence[bytes], lease_ttl_ms: int = 0) -> SyncLease:
        return SyncLease(self, self._wire.acquire(ns, keys, lease_ttl_ms))

    def release(self, lease_id: str) -> int:
        return self._call("Release", pb.ReleaseRequest(lease_id=lease_id)).released

    def delete(self, ns: Namespace, keys: Sequence[bytes] = (), *, all_keys: bool = False) -> tuple[int, int]:
        r = self._call("Delete", self._wire.delete(ns, keys, all_keys))
        return r.deleted, r.skipped_leased

    def prefetch(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        return self._call("Prefetch", self._wire.prefetch(ns, keys), timeout=300).ready

    def stats(self) -> dict[str, Any]:
        return json.loads(self._call("Stats", pb.StatsRequest()).json)

    def report(self, decisions: Sequence[dict[str, Any]]) -> None:
        self._call("Report", _Wire.report(decisions))

    def put_blocks(
        self, ns: Namespace, keys: Sequence[bytes], blocks: Sequence[Any], parents: Sequence[bytes] | None = None,
        *, first_parent: bytes = b"", checksums: bool = False, wait_write_through: bool = False,
    ) -> PutResult:
        arrays = _as_uint8(blocks)
        with self.allocate(ns, keys, [a.size for a in arrays], parents, first_parent=first_parent) as alloc:
            copy_blocks([(view, arrays[i]) for i, view in alloc.writable()])
            stored = alloc.commit(checksums=checksums, wait_write_through=wait_write_through)
        return PutResult(stored, len(keys) - stored, alloc.written_through)

    def get_blocks(self, ns: Namespace, keys: Sequence[bytes], *, verify: bool = False) -> list[np.ndarray]:
        with self.acquire(ns, keys) as lease:
            if verify:
                lease.verify()
            return [v.copy() for v in lease.views]

    def close(self) -> None:
        if self._local is not None:
            self._local.close()
        self._channel.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SyncAllocation(_AllocationState):
    def __init__(self, client: SyncClient, request: pb.AllocateRequest) -> None:
        super().__init__(request)
        self._client = client

    def __enter__(self) -> SyncAllocation:
        self._fill(self._client._call("Allocate", self.request))
        return self

    def commit(self, indices: Sequence[int] | None = None, *, checksums: bool = False, wait_write_through: bool = False) -> int:
        req = self._commit_request(indices, checksums, wait_write_through)
        if req is None:
            self.abort()
            return 0
        return self._committed(self._client._call("Commit", req))

    def abort(self) -> None:
        self.done = True
        if self.id:
            try:
                self._client._call("Abort", pb.AbortRequest(allocation_id=self.id))
            except KVStoreError:
                pass

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if not self.done:
            self.abort()


class SyncLease(_LeaseState):
    def __init__(self, client: SyncClient, request: pb.AcquireRequest) -> None:
        super().__init__(request)
        self._client = client

    def __enter__(self) -> SyncLease:
        self._fill(self._client._call("Acquire", self.request))
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.views.clear()
        if self.id:
            try:
                self._client.release(self.id)
            except KVStoreError:
                pass
