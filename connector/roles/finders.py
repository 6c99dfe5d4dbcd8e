"""How the scheduler side finds a request's blocks in the sidecar: a strategy, chosen by the adapter.

* :class:`LookupFinder` -- one ``Lookup``: the leading run in every tier (tiers and sizes feed the
  cost model), optionally leased. The worker then acquires the blocks itself (a second round trip)
  and the scheduler releases the lookup's lease.
* :class:`DirectoryFinder` -- no round trip when the engine already knows where every block lies
  (:mod:`connector.roles.block_directory`), else a :class:`LeaseFinder`.
* :class:`LeaseFinder` -- one ``Acquire``: the leading run readable from DRAM now, leased, with
  where each block lies in the sidecar's shared memory. The lease moves into the
  :class:`~connector.roles.metadata.LoadSpec`, so the worker copies straight out of shared memory
  (no round trip before the forward pass) and releases the lease afterwards, off the request's
  path. Blocks only in lower tiers are promoted first by the sidecar (on the scheduler's thread).

Each cross-process round trip after an idle spell costs milliseconds on a busy host (both
processes must be woken), which is why the engine adapters that wait for loads use
:class:`LeaseFinder`, and why a finder can :meth:`~LeaseFinder.begin` a lookup as soon as the
engine has a request: the ``Acquire`` goes out on a :class:`~kvstore.client.Pipeline`
and is answered while the engine works on; :meth:`Pending.result` reads the answer when the
engine asks.
"""

from __future__ import annotations

import math
import operator
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from connector.cost import tier_name
from connector.roles.block_directory import BlockDirectory, epoch_of
from connector.roles.client import ConnectorClient
from connector.roles.pipeline import PipelineSlot
from kvstore.client import Pipeline, SlotRef
from kvstore.client.calls import ShardRun, acquired, acquired_shards
from kvstore.client.pipeline import Call
from kvstore.errors import KVStoreError
from kvstore.keys import BlockKey, Namespace

DEFAULT_LEASE_TTL_MS = 30_000  # LeaseFinder's lease when none is configured
_LENGTH = operator.attrgetter("length")


@dataclass(slots=True, frozen=True)
class HeldLease:
    """A read lease on keys ``[first, first + len(slots))`` of a request's key list -- or, with
    ``epoch`` set, no lease at all: places from the engine's :mod:`~connector.roles.block_directory`,
    valid while the slab's free epoch reads ``epoch`` (``id`` is then empty)."""

    id: str
    first: int = 0
    slots: tuple[Any, ...] = ()  # kvstore.client.SlotRef per leased block (LeaseFinder only)
    checksums: tuple[int, ...] = ()  # per slot; 0: not sealed yet
    deadline: float = 0.0  # time.monotonic() after which the sidecar may have ended it
    epoch: int | None = None  # set: an unleased read, valid while the free epoch is this

    def part(self, first: int, n: int) -> HeldLease:
        """The same lease, describing only keys ``[first, first + n)``."""
        i = first - self.first
        if i < 0 or i + n > len(self.slots):
            covered = f"{self.first}..{self.first + len(self.slots)}"
            raise ValueError(f"lease covers keys {covered}, not {first}..{first + n}")
        return HeldLease(self.id, first, self.slots[i : i + n], self.checksums[i : i + n], self.deadline, self.epoch)


@dataclass(slots=True, frozen=True)
class ShardKeys:
    """Another shard of a request's blocks (a tensor-parallel rank, a pipeline stage): its
    namespace and its keys, one per block as the request's own."""

    ns: Namespace
    keys: Sequence[BlockKey]


@dataclass(slots=True, frozen=True)
class Found:
    """The leading run of a request's keys the sidecar has (from key 0); with further shards,
    the run every shard has, and ``others``: each further shard's lease on it."""

    tiers: tuple[str, ...]
    sizes: tuple[int, ...]
    lease: HeldLease | None = None
    others: tuple[HeldLease, ...] = ()


class Finder(Protocol):
    def find(
        self, ns: Namespace, keys: Sequence[BlockKey], have: int, lease_ttl_ms: int, others: Sequence[ShardKeys] = ()
    ) -> Found:
        """Look ``keys`` up; the engine already holds the first ``have`` of them. ``others``:
        further shards of the same blocks, each block counted only where every shard has it
        (a finder that cannot ask for them all at once raises ValueError)."""
        ...

    def begin(
        self, ns: Namespace, keys: Sequence[BlockKey], have: int, lease_ttl_ms: int, others: Sequence[ShardKeys] = ()
    ) -> Pending | None:
        """Send that lookup now, its answer read later; None: nothing to gain, use :meth:`find`."""
        ...


class Pending(Protocol):
    """A lookup sent and not yet read (:meth:`LeaseFinder.begin`)."""

    def result(self) -> Found:
        """Its answer (waits for it; raises the call's error)."""
        ...

    def cancel(self) -> None:
        """Its answer is not wanted: the lease it takes is ended when the answer comes."""
        ...


class LookupFinder:
    def __init__(self, client: ConnectorClient) -> None:
        self.client = client

    def find(
        self, ns: Namespace, keys: Sequence[BlockKey], have: int, lease_ttl_ms: int, others: Sequence[ShardKeys] = ()
    ) -> Found:
        if others:
            raise ValueError("LookupFinder: one shard only; a sharded engine finds its blocks with a LeaseFinder")
        res = self.client.lookup(ns, keys, lease_ttl_ms=lease_ttl_ms)
        matched = list(res.blocks)[: res.matched]
        lease_id = getattr(res, "lease_id", None) or None
        return Found(tuple(tier_name(t) for t, _ in matched), tuple(int(s) for _, s in matched),
                     HeldLease(lease_id) if lease_id else None)

    def begin(
        self, ns: Namespace, keys: Sequence[BlockKey], have: int, lease_ttl_ms: int, others: Sequence[ShardKeys] = ()
    ) -> Pending | None:
        return None


class DirectoryFinder:
    """The engine's :class:`~connector.roles.block_directory.BlockDirectory` first (no round trip when
    every block beyond the engine's own is known at the current free epoch), else ``inner``
    (a :class:`LeaseFinder`), whose leased answer is remembered for next time."""

    def __init__(self, inner: LeaseFinder, directory: BlockDirectory) -> None:
        self.inner, self.directory = inner, directory

    def find(
        self, ns: Namespace, keys: Sequence[BlockKey], have: int, lease_ttl_ms: int, others: Sequence[ShardKeys] = ()
    ) -> Found:
        if others:  # the directory knows this process's shard only
            return self.inner.find(ns, keys, have, lease_ttl_ms, others)
        found = self._known(keys, have)
        if found is None:
            found = self.learn(keys, have, self.inner.find(ns, keys, have, lease_ttl_ms))
        return found

    def begin(
        self, ns: Namespace, keys: Sequence[BlockKey], have: int, lease_ttl_ms: int, others: Sequence[ShardKeys] = ()
    ) -> Pending | None:
        """None when the directory knows the blocks (:meth:`find` answers without a round trip)."""
        if others:
            return self.inner.begin(ns, keys, have, lease_ttl_ms, others)
        if self._known(keys, have) is not None:
            return None
        pending = self.inner.begin(ns, keys, have, lease_ttl_ms)
        return None if pending is None else _Learning(self, keys, have, pending)

    def _known(self, keys: Sequence[BlockKey], have: int) -> Found | None:
        places = self.directory.find(keys[have:])
        if places is None:
            return None
        held = HeldLease("", have, tuple(p.slot for p in places), tuple(p.checksum for p in places),
                         math.inf, places[0].epoch)
        sizes = (places[0].slot.length,) * have + tuple(p.slot.length for p in places)
        return Found(("dram",) * len(keys), sizes, held)

    def learn(self, keys: Sequence[BlockKey], have: int, found: Found) -> Found:
        """Remember where a leased answer's blocks lie; returns ``found``."""
        lease = found.lease
        if lease is not None and lease.slots:
            epoch = epoch_of(lease.slots[0].segment)  # read while the lease pins the blocks
            if epoch is not None:
                self.directory.learn(keys[have : have + len(lease.slots)], lease.slots, lease.checksums, epoch)
        return found


@dataclass(slots=True)
class _Learning:
    finder: DirectoryFinder
    keys: Sequence[BlockKey]
    have: int
    pending: Pending

    def result(self) -> Found:
        return self.finder.learn(self.keys, self.have, self.pending.result())

    def cancel(self) -> None:
        self.pending.cancel()


class LeaseFinder:
    """``pipeline``: where the sidecar's Unix socket can be opened, every ``Acquire`` goes over
    it (:meth:`begin`); else, and for :meth:`find` while it cannot be opened, the client's
    blocking ``acquire``."""

    def __init__(self, client: Any, pipeline: PipelineSlot | None = None) -> None:
        self.client = client  # kvstore.client.SyncClient (acquire with a TTL, release)
        self.pipeline = pipeline

    def find(
        self, ns: Namespace, keys: Sequence[BlockKey], have: int, lease_ttl_ms: int, others: Sequence[ShardKeys] = ()
    ) -> Found:
        pending = self.begin(ns, keys, have, lease_ttl_ms, others)
        if pending is not None:
            return pending.result()
        ttl = lease_ttl_ms or DEFAULT_LEASE_TTL_MS
        deadline = time.monotonic() + ttl / 1000
        if others:
            runs = self.client.acquire_shards(ns, list(keys[have:]), _asked(others, have), lease_ttl_ms=ttl)
            return _found_shards(have, runs, deadline)
        # held past this call: ended by id (release), never by leaving a with-block
        lease = self.client.acquire(ns, list(keys[have:]), lease_ttl_ms=ttl).__enter__()
        return _found(have, lease.id, list(lease.slots), list(lease.checksums), deadline)

    def begin(
        self, ns: Namespace, keys: Sequence[BlockKey], have: int, lease_ttl_ms: int, others: Sequence[ShardKeys] = ()
    ) -> Pending | None:
        """Send the ``Acquire`` of ``keys[have:]`` (and of every further shard's) now; None
        without a pipeline."""
        pipe = self.pipeline.get() if self.pipeline is not None else None
        if pipe is None:
            return None
        ttl = lease_ttl_ms or DEFAULT_LEASE_TTL_MS
        deadline = time.monotonic() + ttl / 1000  # before the sidecar starts the lease: on the safe side
        call = pipe.acquire(ns, list(keys[have:]), ttl, shards=_asked(others, have))
        return _Acquiring(pipe, call, have, len(keys) - have, deadline, len(others))


def _asked(others: Sequence[ShardKeys], have: int) -> list[tuple[Namespace, Sequence[bytes]]]:
    return [(o.ns, list(o.keys[have:])) for o in others]


def _found_shards(have: int, runs: list[ShardRun], deadline: float) -> Found:
    """A sharded ``Acquire``'s answer (:func:`~kvstore.client.calls.acquired_shards`): the request's
    own shard as :func:`_found`, each further shard's lease in ``others``."""
    own = runs[0]
    found = _found(have, own.lease_id, own.slots, own.checksums, deadline)
    if not own.slots:
        return found
    others = tuple(HeldLease(r.lease_id, have, tuple(r.slots), tuple(r.checksums), deadline) for r in runs[1:])
    return Found(found.tiers, found.sizes, found.lease, others)


def _found(have: int, lease_id: str, slots: list[SlotRef], checksums: list[int], deadline: float) -> Found:
    """An ``Acquire``'s answer for keys ``[have:]`` as the run from key 0: the engine's own blocks
    are reported as the run's tier (nothing reads it)."""
    n = len(slots)
    if not n:
        return Found(("dram",) * have, (0,) * have)
    held = HeldLease(lease_id, have, tuple(slots), tuple(checksums), deadline)
    return Found(("dram",) * (have + n), (slots[0].length,) * have + tuple(map(_LENGTH, slots)), held)


@dataclass(slots=True)
class _Acquiring:
    pipe: Pipeline
    call: Call
    have: int
    asked: int
    deadline: float
    others: int = 0  # further shards asked for

    def result(self) -> Found:
        r = self.pipe.result(self.call)
        if self.others:
            return _found_shards(self.have, acquired_shards(r, self.asked, self.others), self.deadline)
        slots, checksums = acquired(r, self.asked)
        return _found(self.have, r.lease_id, slots, checksums, self.deadline)

    def cancel(self) -> None:
        pipe = self.pipe

        def release(answer: Any) -> None:
            if isinstance(answer, KVStoreError):
                return
            for a in (answer, *answer.shards):  # answer read later, dropped: every shard's lease
                if a.lease_id:
                    pipe.release(a.lease_id)

        pipe.forget(self.call, release)
