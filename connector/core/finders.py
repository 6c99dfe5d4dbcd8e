"""How the scheduler side finds a request's blocks in the sidecar: a strategy, chosen by the adapter.

* :class:`LookupFinder` -- one ``Lookup``: the leading run in every tier (tiers and sizes feed the
  cost model), optionally leased. The worker then acquires the blocks itself (a second round trip)
  and the scheduler releases the lookup's lease.
* :class:`DirectoryFinder` -- no round trip when the engine already knows where every block lies
  (:mod:`connector.core.directory`), else a :class:`LeaseFinder`.
* :class:`LeaseFinder` -- one ``Acquire``: the leading run readable from DRAM now, leased, with
  where each block lies in the sidecar's shared memory. The lease moves into the
  :class:`~connector.core.metadata.LoadSpec`, so the worker copies straight out of shared memory
  (no round trip before the forward pass) and releases the lease afterwards, off the request's
  path. Blocks only in lower tiers are promoted first by the sidecar (on the scheduler's thread).

Each cross-process round trip after an idle spell costs milliseconds on a busy host (both
processes must be woken), which is why the engine adapters that wait for loads use
:class:`LeaseFinder`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from connector.core.client import ConnectorClient
from connector.core.directory import BlockDirectory, epoch_of
from connector.cost import tier_name
from kvstore.keys import BlockKey, Namespace

DEFAULT_LEASE_TTL_MS = 30_000  # LeaseFinder's lease when none is configured


@dataclass(slots=True, frozen=True)
class HeldLease:
    """A read lease on keys ``[first, first + len(slots))`` of a request's key list -- or, with
    ``epoch`` set, no lease at all: places from the engine's :mod:`~connector.core.directory`,
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
            raise ValueError(f"lease covers keys {self.first}..{self.first + len(self.slots)}, not {first}..{first + n}")
        return HeldLease(self.id, first, self.slots[i : i + n], self.checksums[i : i + n], self.deadline, self.epoch)


@dataclass(slots=True, frozen=True)
class Found:
    """The leading run of a request's keys the sidecar has (from key 0)."""

    tiers: tuple[str, ...]
    sizes: tuple[int, ...]
    lease: HeldLease | None = None


class Finder(Protocol):
    def find(self, ns: Namespace, keys: Sequence[BlockKey], have: int, lease_ttl_ms: int) -> Found:
        """Look ``keys`` up; the engine already holds the first ``have`` of them."""
        ...


class LookupFinder:
    def __init__(self, client: ConnectorClient) -> None:
        self.client = client

    def find(self, ns: Namespace, keys: Sequence[BlockKey], have: int, lease_ttl_ms: int) -> Found:
        res = self.client.lookup(ns, keys, lease_ttl_ms=lease_ttl_ms)
        matched = list(res.blocks)[: res.matched]
        lease_id = getattr(res, "lease_id", None) or None
        return Found(tuple(tier_name(t) for t, _ in matched), tuple(int(s) for _, s in matched),
                     HeldLease(lease_id) if lease_id else None)


class DirectoryFinder:
    """The engine's :class:`~connector.core.directory.BlockDirectory` first (no round trip when
    every block beyond the engine's own is known at the current free epoch), else ``inner``
    (a :class:`LeaseFinder`), whose leased answer is remembered for next time."""

    def __init__(self, inner: LeaseFinder, directory: BlockDirectory) -> None:
        self.inner, self.directory = inner, directory

    def find(self, ns: Namespace, keys: Sequence[BlockKey], have: int, lease_ttl_ms: int) -> Found:
        tail = keys[have:]
        places = self.directory.find(tail)
        if places is not None:
            held = HeldLease("", have, tuple(p.slot for p in places), tuple(p.checksum for p in places),
                             math.inf, places[0].epoch)
            return Found(("dram",) * len(keys), (places[0].slot.length,) * have + tuple(p.slot.length for p in places), held)
        found = self.inner.find(ns, keys, have, lease_ttl_ms)
        lease = found.lease
        if lease is not None and lease.slots:
            epoch = epoch_of(lease.slots[0].segment)  # read while the lease pins the blocks
            if epoch is not None:
                self.directory.learn(tail[: len(lease.slots)], lease.slots, lease.checksums, epoch)
        return found


class LeaseFinder:
    def __init__(self, client: Any) -> None:  # kvstore.client.SyncClient (acquire with a TTL, release)
        self.client = client

    def find(self, ns: Namespace, keys: Sequence[BlockKey], have: int, lease_ttl_ms: int) -> Found:
        ttl = lease_ttl_ms or DEFAULT_LEASE_TTL_MS
        deadline = time.monotonic() + ttl / 1000
        # held past this call: ended by id (release), never by leaving a with-block
        lease = self.client.acquire(ns, list(keys[have:]), lease_ttl_ms=ttl).__enter__()
        n = len(lease.slots)
        if not n:
            return Found(("dram",) * have, (0,) * have)
        size = lease.slots[0].length
        held = HeldLease(lease.id, have, tuple(lease.slots), tuple(lease.checksums), deadline)
        # the engine's own blocks are reported as the run's tier (nothing reads it)
        return Found(("dram",) * (have + n), (size,) * have + tuple(s.length for s in lease.slots), held)
