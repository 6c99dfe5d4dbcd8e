"""The harness of tests/core/test_fuzz.py: a real sidecar on its own event-loop thread, clients that
drive it from the test's thread (blocking and asyncio, gRPC and the local socket), a fingerprint of
the store's state for "a rejected call changes nothing", and the reference model of the stateful test.

Nothing is mocked: the sidecar is :class:`kvstore.server.sidecar.Sidecar` with its gRPC server and
local socket, the clients are :class:`~kvstore.client.SyncClient` and
:class:`~kvstore.client.KVStoreClient`. The test's thread never touches the store directly while a
call is in flight; what it reads of the store (the fingerprint, :func:`tests.support.audit.audit`)
runs on the sidecar's loop thread, between two of its steps, so it sees one consistent state.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import xxhash

from kvstore.client import KVStoreClient, SyncClient
from kvstore.client.calls import AllocationState, LeaseState, LookupResult
from kvstore.config import Config
from kvstore.keys import Namespace
from kvstore.server.sidecar import Sidecar
from kvstore.store.block_store import BlockStore
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.framing import read_frame
from tests.core.raw_frames import send_frame
from tests.support.audit import audit

T = TypeVar("T")
CALL_TIMEOUT_S = 60.0  # a call that takes longer is a server that stopped answering


# --- the sidecar's thread -------------------------------------------------------------------------


class ServerThread:
    """A :class:`Sidecar` on an event loop of its own thread, so that blocking clients can call it
    from the test's thread. :meth:`on_loop` runs a function there (atomic with respect to the store)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self.sidecar = Sidecar(config)
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="fuzz-sidecar", daemon=True)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def serve() -> None:
            self._stop = asyncio.Event()
            try:
                await self.sidecar.start()
            except BaseException as exc:
                self._error = exc
                self._ready.set()
                raise
            self._ready.set()
            try:
                await self._stop.wait()
            finally:
                await self.sidecar.stop()

        try:
            self.loop.run_until_complete(serve())
        except BaseException:  # noqa: BLE001 - kept in self._error for the test's thread
            pass
        finally:
            self.loop.close()

    def start(self) -> ServerThread:
        self._thread.start()
        self._ready.wait(60)
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        if self._stop is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)

    @property
    def store(self) -> BlockStore:
        return self.sidecar.store

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.sidecar.grpc_port}"

    @property
    def local_path(self) -> str:
        local = self.sidecar._local
        assert local is not None, "the fuzz sidecar serves its local socket"
        return str(local.path)

    def run(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Run the coroutine ``make()`` on the sidecar's loop; its result."""
        return asyncio.run_coroutine_threadsafe(make(), self.loop).result(CALL_TIMEOUT_S)

    def on_loop(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the sidecar's loop thread, between two of its steps."""

        async def call() -> T:
            return fn()

        return self.run(call)

    def audit(self, *, quiescent: bool = False) -> list[str]:
        return self.on_loop(lambda: audit(self.store, quiescent=quiescent))

    def fingerprint(self, *, flush: bool = True) -> Fingerprint:
        """The store's state once the movers in flight are done (nothing moves in the background
        after that until the next request)."""

        async def take() -> Fingerprint:
            if flush:
                await self.store.tiering.flush()
            return fingerprint(self.store)

        return self.run(take)

    def settle(self, until: float = 0.0) -> None:
        """Wait until ``until`` (a time.monotonic() value: the last short TTL has run out), then reap
        what expired and let the movers finish: what the background would do, done now."""
        delay = until - time.monotonic()
        if delay > 0:
            time.sleep(delay + 0.002)

        async def settle() -> None:
            self.store.reap()
            await self.store.tiering.flush()

        self.run(settle)

    def reset(self) -> None:
        """Back to an empty store (after a failed example): every lease released, every allocation
        aborted, every namespace deleted, the movers done."""

        async def reset() -> None:
            store = self.store
            for lease_id in list(store.index.leases):
                store.release(lease_id)
            for alloc_id in list(store.index.allocations):
                store.abort(alloc_id)
            await store.tiering.flush()
            for ns in list(store.index.namespaces.values()):
                await store.delete(ns, [], True)
            await store.tiering.flush()

        self.run(reset)


class ClientLoop:
    """An event loop on its own thread for the asyncio clients (their channels live on it)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fuzz-clients", daemon=True)
        self._thread.start()

    def run(self, aw: Awaitable[T]) -> T:
        async def wrap() -> T:
            return await aw

        return asyncio.run_coroutine_threadsafe(wrap(), self.loop).result(CALL_TIMEOUT_S)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


# --- what a rejected call must leave as it was ----------------------------------------------------

Fingerprint = dict[str, Any]
IGNORED_TIER_COUNTERS = ("errors", "checksum_failures")  # a rejected Commit counts its checksum failure


def fingerprint(store: BlockStore) -> Fingerprint:
    """Everything a request may change, as plain values: every block's metadata, the allocations,
    the leases, the closed allocations, the slab's books and bytes and free epoch, the policy's
    size, the levels below DRAM, and the counters of lookups, reads, writes and decisions (not the
    error counters: a rejected call counts itself). Checksums are apart (``sealed``): the sealer
    fills them in the background, and :func:`changes` allows that."""
    index = store.index
    blocks: dict[tuple[bytes, bytes], tuple[Any, ...]] = {}
    sealed: dict[tuple[bytes, bytes], int] = {}
    for root, ns in index.namespaces.items():
        for key, b in ns.blocks.items():
            blocks[(bytes(root), key)] = (
                b.state.name, b.tiers, b.size, b.parent, b.depth, b.slot.slot_id if b.slot is not None else None,
                b.leases, b.moving, b.replica, key in ns.visible,
            )
            if b.checksum is not None:
                sealed[(bytes(root), key)] = b.checksum
    slab = store.slab
    stats = store.stats
    levels = {
        lv.name: (lv.used, store.tiering.queued[lv][1], lv.down, sorted((b.key, n) for b, n in lv.held.items()))
        for lv in getattr(store.tiering, "levels", [])
    }
    return {
        "blocks": blocks,
        "sealed": sealed,
        "namespaces": sorted(
            (bytes(r), e.label, len(e.blocks), len(e.visible), sorted(e.visible_sizes.items()))
            for r, e in index.namespaces.items()
        ),
        "allocations": {
            a.id: (bytes(a.ns.root), sorted((sid, b.key) for sid, b in a.blocks.items()), a.deadline)
            for a in index.allocations.values()
        },
        "leases": {le.id: ([b.key for b in le.blocks], le.deadline) for le in index.leases.values()},
        "closed": list(store._closed_allocations.items()),
        "slab": (slab.occupancy(), int(slab._epoch[0]), xxhash.xxh3_64_intdigest(slab.buf)),
        "policy": len(store.space.policy),
        "levels": levels,
        "stats": {
            "lookups": stats.lookups.as_dict(),
            "per_namespace": {k: v.as_dict() for k, v in stats.per_namespace.items()},
            # (+= 0 leaves a key in a Counter: the reaper's "leases_expired" every pass; only counts differ)
            "writes": _counts(stats.writes),
            "reads": _counts(stats.reads),
            "decisions": _counts(stats.decisions),
            "recent_decisions": len(stats.recent_decisions),
            "tiers": {t: _counts(c, IGNORED_TIER_COUNTERS) for t, c in stats.tiers.items()},
        },
    }


def _counts(counter: Counter[str], ignored: tuple[str, ...] = ()) -> dict[str, int]:
    return {k: v for k, v in counter.items() if v and k not in ignored}


def changes(before: Fingerprint, after: Fingerprint) -> list[str]:
    """What differs between two fingerprints; a block sealed meanwhile (checksum None -> its value)
    is no change."""
    out = []
    for k in before:
        if k == "sealed" or before[k] == after[k]:
            continue
        if isinstance(before[k], dict) and isinstance(after[k], dict):
            for sub in sorted(set(before[k]) | set(after[k]), key=repr):
                if before[k].get(sub) != after[k].get(sub):
                    out.append(f"{k}[{sub!r}]: {before[k].get(sub)!r} -> {after[k].get(sub)!r}")
        else:
            out.append(f"{k}: {before[k]!r} -> {after[k]!r}")
    for key, c in before["sealed"].items():
        if after["sealed"].get(key) != c:
            out.append(f"checksum of {key[1].hex()[:16]}: {c:#x} -> {after['sealed'].get(key)!r}")
    return out


# --- the local socket, by hand --------------------------------------------------------------------


class RawLocal:
    """A connection to the sidecar's local socket that sends any bytes as a request's body (the
    framing of :mod:`tests.core.raw_frames`), reopened when the sidecar closed it (a frame over its
    limit). Answers are read whole (:func:`kvstore.wire.framing.read_frame`: a socket with a timeout
    is non-blocking underneath, where ``MSG_WAITALL`` may return part of a long answer)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._sock: socket.socket | None = None

    def _connect(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(CALL_TIMEOUT_S)
        s.connect(self.path)
        send_frame(s, "", b"")
        status, _ = read_frame(s)
        assert status == 0, f"hello refused: {status}"
        return s

    def call(self, method: str, body: bytes) -> tuple[int, bytes]:
        """(status, payload); status -1: the sidecar closed the connection without an answer."""
        if self._sock is None:
            self._sock = self._connect()
        with contextlib.suppress(OSError):  # refused on its length before all was sent (EPIPE): the answer waits
            send_frame(self._sock, method, body)
        try:
            status, payload = read_frame(self._sock)
        except OSError:  # (ConnectionResetError: closed)
            status, payload = -1, b""
        if status in (-1, 8):  # closed, or RESOURCE_EXHAUSTED (a frame over the limit: closed after it)
            self.close()
        return status, payload

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


# --- the clients of the stateful test -------------------------------------------------------------


class Driver:
    """One client of the stateful test, blocking whatever it is: a :class:`SyncClient` called on
    this thread, or a :class:`KVStoreClient` run on the :class:`ClientLoop`. Errors come back as
    :mod:`kvstore.errors` exceptions either way."""

    def __init__(self, name: str, client: SyncClient | KVStoreClient, loop: ClientLoop | None = None) -> None:
        self.name = name
        self.client = client
        self.loop = loop

    def __repr__(self) -> str:
        return self.name

    def _do(self, result: Any) -> Any:
        return self.loop.run(result) if self.loop is not None else result

    def lookup(self, ns: Namespace, keys: Sequence[bytes], lease_ttl_ms: int = 0) -> LookupResult:
        return self._do(self.client.lookup(ns, keys, lease_ttl_ms))  # type: ignore[no-any-return]

    def allocate(
        self, ns: Namespace, keys: Sequence[bytes], sizes: Sequence[int], first_parent: bytes, ttl_ms: int,
        parents: Sequence[bytes] | None = None,
    ) -> AllocationState:
        """Allocate ``keys`` as a chain after ``first_parent``, or with the ``parents`` given."""
        handle = self.client.allocate(ns, keys, sizes, parents, first_parent=first_parent, ttl_ms=ttl_ms)
        if isinstance(self.client, SyncClient):
            return handle.__enter__()  # type: ignore[union-attr,no-any-return]
        return self._do(handle.__aenter__())  # type: ignore[union-attr,no-any-return]

    def commit(self, handle: AllocationState, indices: Sequence[int], checksums: bool) -> int:
        return self._do(handle.commit(list(indices), checksums=checksums))  # type: ignore[attr-defined,no-any-return]

    def acquire(self, ns: Namespace, keys: Sequence[bytes], lease_ttl_ms: int = 0) -> LeaseState:
        handle = self.client.acquire(ns, keys, lease_ttl_ms)
        if isinstance(self.client, SyncClient):
            return handle.__enter__()  # type: ignore[union-attr,no-any-return]
        return self._do(handle.__aenter__())  # type: ignore[union-attr,no-any-return]

    def release(self, lease_id: str) -> int:
        return self._do(self.client.release(lease_id))  # type: ignore[no-any-return]

    def delete(self, ns: Namespace, keys: Sequence[bytes] = (), all_keys: bool = False) -> tuple[int, int]:
        return self._do(self.client.delete(ns, keys, all_keys=all_keys))  # type: ignore[no-any-return]

    def prefetch(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        return self._do(self.client.prefetch(ns, keys))  # type: ignore[no-any-return]

    def call(self, name: str, request: Any) -> Any:
        """A request message as it is (the rejected calls the public calls would not build)."""
        return self._do(self.client._call(name, request))

    def abort(self, alloc_id: str) -> int:
        """Abort, raising what the sidecar answers (the clients' own abort swallows errors)."""
        r: pb.AbortResponse = self.call("Abort", pb.AbortRequest(allocation_id=alloc_id))
        return r.released


def make_drivers(url: str, loop: ClientLoop) -> list[Driver]:
    """Four clients: blocking and asyncio, each over the local socket and over gRPC."""

    async def aio(local: bool) -> KVStoreClient:
        return KVStoreClient.from_url(url, local=local)

    return [
        Driver("sync-local", SyncClient(url)),
        Driver("sync-grpc", SyncClient(url, local=False)),
        Driver("aio-local", loop.run(aio(True)), loop),
        Driver("aio-grpc", loop.run(aio(False)), loop),
    ]


def close_drivers(drivers: list[Driver]) -> None:
    for d in drivers:
        if isinstance(d.client, SyncClient):
            d.client.close()
        elif d.loop is not None:
            d.loop.run(d.client.aclose())


# --- the reference model --------------------------------------------------------------------------


def content(seed: int, size: int) -> bytes:
    """The bytes of the ``seed``-th write of a block: distinct for every write."""
    return hashlib.shake_128(seed.to_bytes(8, "little")).digest(size)


@dataclass
class Stored:
    """A committed block as the model knows it: its bytes, and whether it is surely still stored
    (no request that may evict has run since its commit). Unsurely, a read may miss it; it may
    never return other bytes."""

    data: bytes
    surely: bool = True


@dataclass
class Write:
    """An open allocation: who made it, its keys, the request's indices that got slots, what was
    written into them. A short one (a TTL of a few ms) may be reclaimed by the reaper at any time."""

    driver: Driver
    handle: AllocationState
    ns: int
    keys: list[bytes]
    new: list[int]
    short: bool
    deadline: float
    data: dict[int, bytes] = field(default_factory=dict)
    reclaimed: bool = False  # known: another allocation got a slot for one of its keys

    @property
    def id(self) -> str:
        return self.handle.id

    def pages(self, page_bytes: int) -> set[int]:
        return {s.ref.offset // page_bytes for s in self.handle.slots if s.ref is not None}


@dataclass
class Held:
    """A live lease: from an Acquire (views of the slots, in DRAM) or a Lookup (anywhere)."""

    driver: Driver
    lease_id: str
    ns: int
    keys: list[bytes]
    short: bool
    deadline: float
    views: list[np.ndarray] | None = None  # Acquire's
    data: list[bytes] = field(default_factory=list)  # what the views must hold while it lives
    offsets: list[int] = field(default_factory=list)


@dataclass
class Model:
    """What the store must hold, as far as the test can know."""

    stored: dict[tuple[int, bytes], Stored] = field(default_factory=dict)
    writes: list[Write] = field(default_factory=list)
    leases: list[Held] = field(default_factory=list)
    closed: dict[str, str] = field(default_factory=dict)  # allocation id -> committed | aborted
    released: list[str] = field(default_factory=list)  # lease ids released
    seed: int = 0

    def next_seed(self) -> int:
        self.seed += 1
        return self.seed

    # --- what the model knows of a key --------------------------------------------------------

    def leased(self, ns: int, key: bytes, *, surely: bool) -> bool:
        return any(h.ns == ns and key in h.keys and (not h.short or not surely) for h in self.leases)

    def in_dram_leased(self, ns: int, key: bytes) -> bool:
        return any(h.ns == ns and key in h.keys and not h.short and h.views is not None for h in self.leases)

    def allocated(self, ns: int, key: bytes, *, surely: bool) -> bool:
        """Surely (or maybe: a short allocation the reaper may have taken) ALLOCATED under ``key``."""
        for w in self.writes:
            if w.ns != ns or w.reclaimed or (surely and w.short):
                continue
            if any(w.keys[i] == key for i in w.new):
                return True
        return False

    def pinned(self, ns: int, key: bytes, *, surely: bool) -> bool:
        return self.leased(ns, key, surely=surely) or self.allocated(ns, key, surely=surely)

    def committed_surely(self, ns: int, key: bytes) -> bool:
        """Surely a visible block under ``key`` now."""
        s = self.stored.get((ns, key))
        return s is not None and (s.surely or self.leased(ns, key, surely=True))

    def present(self, ns: int, key: bytes, *, surely: bool) -> bool:
        """Surely (or maybe) a block in the index under ``key``: committed or allocated."""
        if surely:
            return self.committed_surely(ns, key) or self.allocated(ns, key, surely=True)
        return (ns, key) in self.stored or self.allocated(ns, key, surely=False)

    def may_have_evicted(self) -> None:
        """A request that may evict ran: what is not pinned may be gone from DRAM (and so, for
        the model, from the store)."""
        for (ns, key), s in self.stored.items():
            if s.surely and not self.pinned(ns, key, surely=True):
                s.surely = False

    def short_deadline(self) -> float:
        """When the last short allocation or lease runs out (0: none is live)."""
        return max([w.deadline for w in self.writes if w.short] + [h.deadline for h in self.leases if h.short],
                   default=0.0)

    def settled(self) -> None:
        """Every short allocation was reclaimed and every short lease expired (ServerThread.settle)."""
        for w in [w for w in self.writes if w.short]:
            self.writes.remove(w)
        for h in [h for h in self.leases if h.short]:
            self.leases.remove(h)

