"""What both clients send and read, whatever carries it: request builders, results, and the state of
an allocation or a lease. Also the shape of a transport: one ``call(name, request, timeout)``.

The async client (:mod:`kvstore.client.aio`) and the blocking one (:mod:`kvstore.client.sync`) build
the same requests and read the same responses from here; they differ only in how a call is made.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, Protocol, SupportsIndex, TypeVar, overload

import numpy as np
from google.protobuf.message import Message

from kvstore.checksum import checksum
from kvstore.dram.protect import ReadOnlyMapping, Run
from kvstore.dram.slab import attach, read_only
from kvstore.errors import FailedPrecondition, KVStoreError
from kvstore.keys import Namespace
from kvstore.tier_table import PROTO_NAMES
from kvstore.v1 import kvstore_pb2 as pb

_TIER_NAMES = PROTO_NAMES  # a Lookup's tier value -> its name (kvstore/tier_table.py; "peer" too)
DEFAULT_TIMEOUT_S = 30.0
# A retention hint (retain_ms, retain_priority 0..3): kvstore/store/books/retention.py; (0, 0): none.
Retain = tuple[int, int]

# A client's call on its chosen transport, with the default timeout: what its allocations and leases send.
Call = Callable[[str, Message], Any]
AsyncCall = Callable[[str, Message], Awaitable[Any]]


class Transport(Protocol):
    """What the blocking client sends its calls over: gRPC or the sidecar's local socket."""

    kind: str  # "grpc" or "local"

    def call(self, name: str, request: Message, timeout: float | None = None) -> Any: ...

    def close(self) -> None: ...


class AsyncTransport(Protocol):
    """What the async client sends its calls over: gRPC or the sidecar's local socket."""

    kind: str  # "grpc" or "local"

    async def call(self, name: str, request: Message, timeout: float | None = None) -> Any: ...

    async def aclose(self) -> None: ...


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


class SlotRef(NamedTuple):
    """Where a block's bytes lie in the sidecar's shared memory (``attach(segment)[offset:offset + length]``).
    (A named tuple: an Acquire's answer makes one per block, at half a frozen dataclass's cost.)"""

    segment: str
    offset: int
    length: int


def acquired(r: pb.AcquireResponse, asked: int) -> tuple[list[SlotRef], list[int]]:
    """Where an Acquire's run lies and each block's checksum, from the packed answer or from one
    ``AcquiredBlock`` per block (a server older than ``AcquireRequest.packed``). ``asked``: keys in
    the request. A packed answer whose arrays disagree raises, naming the field."""
    if r.blocks:
        return [SlotRef(b.slot.segment, b.slot.offset, b.slot.length) for b in r.blocks], [b.checksum for b in r.blocks]
    n = len(r.offsets)
    for field, got in (("lengths", len(r.lengths)), ("checksums", len(r.checksums))):
        if got != n:
            raise KVStoreError(f"Acquire answer: {field} has {got} entries for {n} offsets")
    if n > asked:
        raise KVStoreError(f"Acquire answer: offsets has {n} entries for {asked} keys asked")
    if n and not r.segment:
        raise KVStoreError("Acquire answer: segment: empty with blocks in the run")
    seg = r.segment
    return [SlotRef(seg, o, length) for o, length in zip(r.offsets, r.lengths)], list(r.checksums)


class ShardRun(NamedTuple):
    """One shard's part of a sharded Acquire's answer: its lease, where its run lies, checksums."""

    lease_id: str
    slots: list[SlotRef]
    checksums: list[int]


def acquired_shards(r: pb.AcquireResponse, asked: int, shards: int) -> list[ShardRun]:
    """A sharded Acquire's answer (``AcquireRequest.shards``), the request's own shard first, then
    one per further shard, every run as long (checked: an answer that disagrees raises, naming the
    field). ``shards``: further shards asked for."""
    if len(r.shards) != shards:
        raise KVStoreError(f"Acquire answer: shards has {len(r.shards)} entries for {shards} shards asked")
    runs = [ShardRun(a.lease_id, *acquired(a, asked)) for a in (r, *r.shards)]
    n = len(runs[0].slots)
    for i, run in enumerate(runs[1:]):
        if len(run.slots) != n:
            raise KVStoreError(f"Acquire answer: shards[{i}] has a run of {len(run.slots)} blocks, the request's {n}")
    return runs


class SlotFields(NamedTuple):
    """How an answer names a slot's fields in an error: ``offset.format(i)``, ``length.format(i)``."""

    answer: str
    offset: str
    length: str


ACQUIRE_FIELDS = SlotFields("Acquire answer", "offsets[{}]", "lengths[{}]")
ALLOCATE_FIELDS = SlotFields("Allocate answer", "blocks[{}].slot.offset", "blocks[{}].slot.length")


class SlotViews(list[np.ndarray]):
    """Views of slots (a plain list of them), with what a transfer needs of each known without
    touching it: its start address and length (``addresses``, ``lengths``: int64 arrays) and
    whether the views are writable. A slice is a :class:`SlotViews` too."""

    def __init__(self, views: list[np.ndarray], addresses: np.ndarray, lengths: np.ndarray, writable: bool) -> None:
        super().__init__(views)
        self.addresses, self.lengths, self.writable = addresses, lengths, writable

    @overload
    def __getitem__(self, i: SupportsIndex) -> np.ndarray: ...

    @overload
    def __getitem__(self, i: slice) -> SlotViews: ...

    def __getitem__(self, i: SupportsIndex | slice) -> np.ndarray | SlotViews:
        if isinstance(i, slice):
            return SlotViews(list.__getitem__(self, i), self.addresses[i], self.lengths[i], self.writable)
        return list.__getitem__(self, i)

    def __delitem__(self, i: SupportsIndex | slice) -> None:
        list.__delitem__(self, i)
        at = i if isinstance(i, slice) else i.__index__()
        self.addresses, self.lengths = np.delete(self.addresses, at), np.delete(self.lengths, at)

    def clear(self) -> None:
        list.clear(self)
        self.addresses, self.lengths = self.addresses[:0], self.lengths[:0]


def mapped_views(
    slots: Sequence[SlotRef], fields: SlotFields = ACQUIRE_FIELDS, *, writable: bool = False,
    at: Sequence[int] | None = None,
) -> SlotViews:
    """A view of each slot's bytes, each segment mapped once; read-only unless ``writable`` (slices
    of a read-only view stay read-only). A slot that does not lie whole within its segment (a
    malformed answer from the sidecar) raises INTERNAL naming the fields, where a slice would
    silently come back shorter; so does a writable slot that overlaps another (two blocks written
    into the same bytes), before any view is handed out. ``at``: each slot's index in the answer
    (default: its position)."""
    where = list(range(len(slots))) if at is None else list(at)
    mapped: dict[str, np.ndarray] = {}
    bases: dict[str, int] = {}
    views = []
    addresses = np.empty(len(slots), np.int64)
    lengths = np.empty(len(slots), np.int64)
    for k, (i, (seg, off, n)) in enumerate(zip(where, slots)):
        mem = mapped.get(seg)
        if mem is None:
            mem = mapped[seg] = attach(seg).view()
            mem.flags.writeable = writable
            bases[seg] = int(mem.__array_interface__["data"][0])
        addresses[k], lengths[k] = bases[seg] + off, n
        if off < 0 or n < 0 or off + n > len(mem):
            raise KVStoreError(
                f"{fields.answer}: {fields.offset.format(i)} {off} + {fields.length.format(i)} {n} is not within"
                f" segment {seg!r} ({len(mem)} bytes)"
            )
        views.append(mem[off : off + n])
    if writable:
        ends: dict[str, tuple[int, int]] = {}  # segment -> (end, index) of the slot before, in offset order
        for (seg, off, n), i in sorted(zip(slots, where)):
            end, j = ends.get(seg, (0, -1))
            if j >= 0 and off < end and n:
                raise KVStoreError(
                    f"{fields.answer}: {fields.offset.format(i)} {off} lies inside {fields.offset.format(j)}'s"
                    f" slot (which ends at {end}) in segment {seg!r}: two blocks would be written into the same bytes"
                )
            if n and off + n > end:
                ends[seg] = (off + n, i)
    return SlotViews(views, addresses, lengths, writable)


@dataclass(slots=True, frozen=True)
class PutResult:
    stored: int
    present: int
    written_through: int = 0  # with wait_write_through: blocks every write-through tier holds


class Calls:
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
        tiers = [(_TIER_NAMES.get(t, "unknown"), s) for t, s in zip(r.tiers, sizes, strict=False)]
        return LookupResult(r.matched, tiers, r.lease_id or None)

    def allocate(
        self, ns: Namespace, keys: Sequence[bytes], sizes: Sequence[int] | int, parents: Sequence[bytes] | None,
        first_parent: bytes, ttl_ms: int,
    ) -> pb.AllocateRequest:
        if isinstance(sizes, int):
            sizes = [sizes] * len(keys)
        if parents is None:  # a chain: each block's parent is the key before it
            parents = [first_parent, *keys[:-1]] if keys else []
        specs = [pb.BlockSpec(key=k, parent=p or b"", size=s) for k, p, s in zip(keys, parents, sizes, strict=False)]
        return pb.AllocateRequest(namespace=self.ns(ns), blocks=specs, ttl_ms=ttl_ms)

    def acquire(
        self, ns: Namespace, keys: Sequence[bytes], lease_ttl_ms: int, retain_ms: int = 0, retain_priority: int = 0,
        shards: Sequence[tuple[Namespace, Sequence[bytes]]] = (),
    ) -> pb.AcquireRequest:
        """``shards``: further shards of the same blocks, (namespace, keys) each (AcquireRequest.shards)."""
        return pb.AcquireRequest(namespace=self.ns(ns), keys=keys, lease_ttl_ms=lease_ttl_ms, packed=True,
                                 retain_ms=retain_ms, retain_priority=retain_priority,
                                 shards=[pb.Shard(namespace=self.ns(n), keys=k) for n, k in shards])

    def retain(self, ns: Namespace, keys: Sequence[bytes], retain_ms: int, retain_priority: int) -> pb.RetainRequest:
        return pb.RetainRequest(namespace=self.ns(ns), keys=keys, retain_ms=retain_ms, retain_priority=retain_priority)

    def delete(self, ns: Namespace, keys: Sequence[bytes], all_keys: bool) -> pb.DeleteRequest:
        return pb.DeleteRequest(namespace=self.ns(ns), keys=keys, all_keys=all_keys)

    def prefetch(self, ns: Namespace, keys: Sequence[bytes]) -> pb.PrefetchRequest:
        return pb.PrefetchRequest(namespace=self.ns(ns), keys=keys)

    @staticmethod
    def report(decisions: Sequence[dict[str, Any]]) -> pb.ReportRequest:
        return pb.ReportRequest(decisions=[pb.Decision(**d) for d in decisions])


def as_uint8(blocks: Sequence[Any]) -> list[np.ndarray]:
    """Each block (anything with the buffer protocol) as a flat uint8 array, without a copy."""
    return [np.frombuffer(memoryview(b).cast("B"), dtype=np.uint8) for b in blocks]


@dataclass(slots=True)
class _Slot:
    key: bytes
    present: bool
    view: np.ndarray | None
    slot_id: int
    ref: SlotRef | None = None


_Answer = TypeVar("_Answer", pb.AllocateResponse, pb.AcquireResponse)


class Undo(NamedTuple):
    """The call that ends what an answer opened on the sidecar: ``send(name, request)``."""

    name: str  # "Abort" (an allocation) or "Release" (a lease)
    request: Message


class Opened(Generic[_Answer]):
    """What an allocation and a lease share: the sidecar opens either when it answers (Allocate,
    Acquire), before the client has read the answer. The client may refuse it (:meth:`_fill`
    raises INTERNAL naming the field, or cannot map the slots); then ``with`` is never entered, so
    no Commit, Abort or Release of the client's follows, and what the sidecar opened would stay (an allocation's
    slots reserved, a lease's blocks pinned in DRAM) until its TTL ended it.

    :meth:`_open` is the one place that decides what follows a refused answer; :meth:`_accept` and
    :meth:`_accept_async` the one place each client sends what it decides."""

    id: str  # what the answer opened ("": nothing)

    def _fill(self, r: _Answer) -> None:
        """Read the answer; one the client refuses raises (:class:`KVStoreError` naming the field,
        or the error mapping its slots)."""
        raise NotImplementedError

    def _undo(self) -> Undo:
        """The call that ends what ``id`` names."""
        raise NotImplementedError

    def _open(self, r: _Answer) -> Iterator[Undo]:
        """Read the answer (:meth:`_fill`); where it is refused and names what the sidecar opened,
        yield first the call that ends it, then raise the refusal. A refused answer that names
        nothing yields nothing. Refused is any error reading it, not only a malformed field's
        KVStoreError: a slab this process cannot map (``FileNotFoundError``, ``PermissionError``:
        the sidecar's 0600 slab seen by another user's client over TCP) leaves the client as unable
        to use what was opened, and was left open until its TTL."""
        try:
            self._fill(r)
        except Exception:
            if self.id:
                yield self._undo()
            raise

    def _accept(self, answer: _Answer, send: Call) -> None:
        """Read ``answer`` (:meth:`_open`); a refused one's undo is sent before the refusal raises.
        Best effort: the undo's own error (already ended, unreachable: its TTL ends it) is
        suppressed, since the refusal is the error to report."""
        for name, request in self._open(answer):
            with contextlib.suppress(KVStoreError):
                send(name, request)

    async def _accept_async(self, answer: _Answer, send: AsyncCall) -> None:
        """:meth:`_accept`, for the async client."""
        for name, request in self._open(answer):
            with contextlib.suppress(KVStoreError):
                await send(name, request)


class AllocationState(Opened[pb.AllocateResponse]):
    """A two-phase write: the slots handed out, and the Commit that makes them visible."""

    def __init__(self, request: pb.AllocateRequest) -> None:
        self.request = request
        self.id = ""
        self.slots: list[_Slot] = []
        self.checksums: dict[int, int] = {}  # index in the request -> checksum sent with the Commit
        self.written_through = 0  # after commit(wait_write_through=True): blocks in every write-through tier
        self._writes: list[tuple[ReadOnlyMapping, list[Run]]] = []  # the slot pages made writable for it
        self._opened = False  # by writable(cpu=True)
        self.done = False  # committed or aborted (or being so): its slots read-only again here (_finish)

    def _finish(self) -> None:
        """Mark it done (committed or aborted, or being so) and close its writable slot pages."""
        self.done = True
        self._end_writes()

    def _open_writes(self, refs: Sequence[SlotRef]) -> None:
        """Make the pages of ``refs`` writable where this process maps their slab read-only
        (:mod:`kvstore.dram.protect`); :meth:`_end_writes` before the Commit or Abort is sent
        (and nothing once it is done)."""
        if self.done:
            return
        by_segment: dict[str, list[tuple[int, int]]] = {}
        for seg, off, n in refs:
            by_segment.setdefault(seg, []).append((off, n))
        for seg, ranges in by_segment.items():
            mapping = read_only(seg)
            if mapping is not None:
                self._writes.append((mapping, mapping.open(ranges)))

    def _end_writes(self) -> None:
        """Every mapping's runs closed; the first error (:class:`~kvstore.dram.protect.ProtectionError`)
        raised after, so neither the Commit nor the Abort is sent: pages of the slots may still be
        writable here, and the sidecar reclaiming the allocation at its ``ttl_ms`` makes every
        process's loads from the slab hash (:meth:`~kvstore.dram.slab.Slab.note_reclaimed`)."""
        writes, self._writes = self._writes, []
        first: OSError | None = None
        for mapping, rs in writes:
            try:
                mapping.close(rs)
            except OSError as exc:
                first = first or exc
        if first is not None:
            raise first

    def _fill(self, r: pb.AllocateResponse) -> None:
        """Read the answer; one that is malformed (a block count, key or slot length other than
        asked, a slot not whole within its segment, slots that overlap) raises INTERNAL naming the
        field, before any view is handed out to be written."""
        self.id = r.allocation_id
        asked = self.request.blocks
        if len(r.blocks) != len(asked):
            raise KVStoreError(f"Allocate answer: blocks has {len(r.blocks)} entries for {len(asked)} blocks asked")
        for i, (b, spec) in enumerate(zip(r.blocks, asked)):
            if b.key != spec.key:  # (its bytes would be committed under another block's key)
                raise KVStoreError(f"Allocate answer: blocks[{i}].key is not the key asked at blocks[{i}]")
        at = [i for i, b in enumerate(r.blocks) if not b.present]
        refs = [SlotRef(r.blocks[i].slot.segment, r.blocks[i].slot.offset, r.blocks[i].slot.length) for i in at]
        for i, ref in zip(at, refs):
            if ref.length != asked[i].size:
                raise KVStoreError(
                    f"Allocate answer: blocks[{i}].slot.length {ref.length} is not the size asked ({asked[i].size})"
                )
        views = dict(zip(at, mapped_views(refs, ALLOCATE_FIELDS, writable=True, at=at)))
        refs_at = dict(zip(at, refs))
        for i, b in enumerate(r.blocks):
            if b.present:
                self.slots.append(_Slot(b.key, True, None, 0))
            else:
                self.slots.append(_Slot(b.key, False, views[i], b.slot.slot_id, refs_at[i]))

    def _undo(self) -> Undo:
        self._finish()  # (ended, as abort() marks it)
        return Undo("Abort", pb.AbortRequest(allocation_id=self.id))

    def writable(self, cpu: bool = True) -> Iterator[tuple[int, np.ndarray]]:
        """(index in the request, writable uint8 view) for every block that needs its bytes.
        ``cpu``: this process's CPU writes them, so their pages are made writable here until the
        Commit or Abort (:mod:`kvstore.dram.protect`); False: a device's DMA into the pinned slab
        does, which the CPU's page tables do not gate (a CPU write then faults). Once a Commit or
        Abort was sent (even a Commit the sidecar refused), its slots are read-only here again:
        FailedPrecondition, not views whose first write would fault."""
        if self.done:
            raise FailedPrecondition(
                f"writable(): allocation {self.id} was committed or aborted (a Commit sent, even one refused, "
                "ends its writes): its slots are read-only here; commit or abort it, and allocate again to write"
            )
        if cpu and not self._opened:
            self._open_writes([s.ref for s in self.slots if s.ref is not None])
            self._opened = True  # (not before: an open that failed is tried again by the next call)
        for i, s in enumerate(self.slots):
            if s.view is not None:
                yield i, s.view

    def slot_refs(self) -> dict[int, SlotRef]:
        """Where each block that needs its bytes lies, by index in the request."""
        return {i: s.ref for i, s in enumerate(self.slots) if s.ref is not None}

    def _commit_request(
        self, indices: Sequence[int] | None, checksums: bool, wait_write_through: bool, wait_published: bool = False,
        retain: Retain = (0, 0),
    ) -> pb.CommitRequest | None:
        chosen = [i for i, s in enumerate(self.slots) if not s.present] if indices is None else list(indices)
        blocks = []
        for i in chosen:
            s = self.slots[i]
            cb = pb.CommitBlock(key=s.key, slot_id=s.slot_id)
            if checksums:
                cb.has_checksum = True
                c = checksum(s.view)  # type: ignore[arg-type]  # None: present, caller's bug
                cb.checksum = self.checksums[i] = c
            blocks.append(cb)
        self._finish()
        if not blocks:
            return None
        return pb.CommitRequest(
            allocation_id=self.id, blocks=blocks, wait_write_through=wait_write_through, wait_published=wait_published,
            retain_ms=retain[0], retain_priority=retain[1],
        )

    def _committed(self, resp: pb.CommitResponse) -> int:
        self.written_through = resp.written_through
        return resp.committed


class LeaseState(Opened[pb.AcquireResponse]):
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
        self.slots, self.checksums = acquired(r, len(self.request.keys))
        self.keys = list(self.request.keys[: len(self.slots)])  # the run is the leading keys asked for
        self.views = mapped_views(self.slots)

    def _undo(self) -> Undo:
        return Undo("Release", pb.ReleaseRequest(lease_id=self.id))

    def verify(self) -> int:
        """Check every view against its checksum; truncate at the first bad block. Returns the
        number of good blocks. Blocks the server has not sealed yet (checksum 0) pass."""
        for i, (v, c) in enumerate(zip(self.views, self.checksums, strict=False)):
            if c and checksum(v.data) != c:
                del self.views[i:], self.keys[i:], self.checksums[i:], self.slots[i:]
                return i
        return len(self.views)
