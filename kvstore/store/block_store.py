"""The block store: the sidecar's state machine over the index, the DRAM space and the tiers below.

Every public method validates its whole request before it changes anything
(:class:`~kvstore.store.checks.Checks`), so a rejected request leaves no trace. Methods run on the
event loop thread; only checksum work (which releases the GIL) is sent to a thread: the DRAM
copies' checksums, checked at commit, sealed later and checked on a local read, are
:class:`~kvstore.store.sealing.Sealing`'s. DRAM -- slots, placement, eviction, the policy -- is the
:class:`~kvstore.store.books.dram_space.DramSpace`'s; the tiers below DRAM are :attr:`BlockStore.tiering`, the
movers (:class:`~kvstore.store.books.below.NoMovers` for a DRAM-only store). The rest of a cluster is
:attr:`BlockStore.remote`, which works on this store only through :attr:`BlockStore.exchange`
(:mod:`kvstore.store.exchange`: a peer fetch's reserved slots, adopted shared-tier blocks, runs lent);
the reads that reach it (a Lookup continued through it, a run completed from it, the per-node
prefixes) are :class:`~kvstore.store.cluster_reads.ClusterReads`'.
"""

from __future__ import annotations

import asyncio
import logging
import operator
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from kvstore.config import Config
from kvstore.dram.slab import Slab, Slot
from kvstore.errors import (
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    shown,
)
from kvstore.keys import Namespace
from kvstore.policy import make_policy
from kvstore.policy.base import EvictionPolicy
from kvstore.stats.counters import Stats, busiest, folded
from kvstore.store.books.below import Below, Movers
from kvstore.store.books.dram_space import DramSpace
from kvstore.store.books.hint_budget import HintBudget
from kvstore.store.books.index import (
    DRAM,
    Allocation,
    Block,
    Index,
    Lease,
    NsEntry,
    State,
    top_label,
)
from kvstore.store.books.placement import placed_nowhere
from kvstore.store.books.retention import Retention
from kvstore.store.books.tenants import Tenants
from kvstore.store.checks import BlockSpec, Checks, CommitSpec
from kvstore.store.cluster_reads import ClusterReads
from kvstore.store.exchange import Exchange
from kvstore.store.remote import PeerBlock, Remote
from kvstore.store.sealing import Sealing

__all__ = ["BlockSpec", "BlockStore", "CommitSpec"]  # a request's blocks are defined with their checks

log = logging.getLogger(__name__)
_TIERS = operator.attrgetter("tiers")


class BlockStore:
    def __init__(
        self, config: Config, slab: Slab, stats: Stats | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.slab = slab
        self.stats = stats or Stats()
        self.stats.namespaces_shown = config.server.stats_namespaces
        self.clock = clock
        self.index = Index()
        self.space = DramSpace(slab, make_policy(config.index.policy), self.index, self.stats)
        self.tenants = Tenants.from_config(config.tenants)  # per tier; the sidecar hands the tiers theirs
        self.space.quotas = self.tenants.attach("dram")
        capacities = {"dram": slab.capacity_bytes, "ssd": config.ssd.capacity_bytes if config.ssd.enabled else 0}
        totals = config.tenants.retained_totals(capacities)  # (none at a fraction of 1)
        budget = HintBudget(totals, config.tenants.retained_fraction, config.tenants.retained_adaptive) \
            if totals else None
        self.space.retention = self.retention = Retention(
            clock, config.tenants.retained_bounds(), budget, config.server.stats_namespaces,
        )
        self.index.retained = self.retention.recount  # a retained block's bytes move with its tiers
        self.retention.watch(self.space.policy)  # the DRAM policy keeps retained blocks apart
        self._closed_allocations: OrderedDict[str, str] = OrderedDict()  # id -> "committed" | "aborted" | "reclaimed"
        self.checks = Checks(config, slab, clock)  # what every call validates first
        self.sealing = Sealing(self.index, self.space, self.stats)  # the DRAM copies' checksums
        self.cluster_reads = ClusterReads(self.index, self.checks, self.stats, self.lookup)
        self.exchange = Exchange(self.index, self.space, self.retention, clock)  # what the cluster may do here

    @property
    def tiering(self) -> Movers:
        """The tiers below DRAM and their movers; the DRAM space hands them what it evicts."""
        return self.space.movers

    @tiering.setter
    def tiering(self, movers: Movers) -> None:
        self.space.movers = movers
        self.space.below = Below(movers.levels)

    @property
    def remote(self) -> Remote:
        """The rest of the cluster (:class:`NoRemote` until the sidecar wires a node in); the reads
        that reach it are :attr:`cluster_reads`'."""
        return self.cluster_reads.remote

    @remote.setter
    def remote(self, remote: Remote) -> None:
        self.cluster_reads.remote = remote

    @property
    def closed_allocations(self) -> Mapping[str, str]:
        """The allocations closed lately (the last 10,000), each with its fate: "committed",
        "aborted" or "reclaimed"."""
        return MappingProxyType(self._closed_allocations)

    @property
    def policy(self) -> EvictionPolicy:
        """The DRAM space's eviction policy."""
        return self.space.policy

    # --- namespaces -----------------------------------------------------------------------

    def namespace(self, ns: Namespace) -> NsEntry:
        """Its entry; an empty detached one when it stores nothing (a write registers it)."""
        return self.index.find(ns.root, ns.label, ns)

    # --- lookup -----------------------------------------------------------------------------

    def lookup(
        self, ns: NsEntry, keys: Sequence[bytes], lease_ttl_ms: int = 0
    ) -> tuple[list[Block], set[int], Lease | None]:
        """The leading run of ``keys`` that is stored, the set of placement masks in it, and a
        lease on it when ``lease_ttl_ms`` is set."""
        self.checks.batch(len(keys), "keys")
        deadline = self.checks.lease_deadline(lease_ttl_ms) if lease_ttl_ms else None
        run = self.index.leading_run(ns, keys)
        if len(run) < len(keys):  # a full hit proves every key well-formed (stored keys are)
            self.checks.keys(keys, "keys")
        if down := self.space.below.down_mask():
            run = self._reachable(run, down)
        self.stats.lookup(ns.label, len(keys), len(run))
        masks = set(map(_TIERS, run))
        tier_stats = self.stats.tiers
        if len(masks) == 1:
            tier_stats[top_label(next(iter(masks)))]["hits"] += len(run)
        else:
            for mask, n in Counter(map(_TIERS, run)).items():
                tier_stats[top_label(mask)]["hits"] += n
        if len(run) < len(keys):
            tier_stats["dram"]["misses"] += 1
        self.space.touch(run, all_in_dram=all(m & DRAM for m in masks))
        lease = self.index.take_lease(run, deadline) if deadline is not None and run else None
        return run, masks, lease

    async def lookup_cluster(
        self, ns: NsEntry, keys: Sequence[bytes], lease_ttl_ms: int = 0
    ) -> tuple[list[Block], set[int], Lease | None, list[PeerBlock]]:
        """:meth:`lookup`, the run continued through the blocks the rest of the cluster holds
        (:meth:`ClusterReads.lookup`: the peers' blocks come back after the local run)."""
        return await self.cluster_reads.lookup(ns, keys, lease_ttl_ms)

    async def prefixes(self, ns: NsEntry, keys: Sequence[bytes]) -> dict[str, dict[str, int]]:
        """Per node of the cluster, the leading run of ``keys`` it can serve by where it lies
        (:meth:`ClusterReads.prefixes`); a node on its own answers for itself as ``""``."""
        return await self.cluster_reads.prefixes(ns, keys)

    @staticmethod
    def _reachable(run: list[Block], down: int) -> list[Block]:
        """Cut the run at the first block whose every copy is in a tier that is down."""
        for i, b in enumerate(run):
            if not b.tiers & ~down:
                return run[:i]
        return run

    def drain_touches(self) -> None:
        """Apply the hits buffered for the policies (:meth:`DramSpace.touch`)."""
        self.space.drain_touches()

    # --- two-phase writes ---------------------------------------------------------------------

    async def allocate(
        self, ns: NsEntry, specs: Sequence[BlockSpec], ttl_ms: int = 0
    ) -> tuple[Allocation, list[Slot | None]]:
        """:meth:`allocate_now`, waiting once for tier movers when only their pins stand in the way
        (backpressure rather than RESOURCE_EXHAUSTED)."""
        try:
            return self.allocate_now(ns, specs, ttl_ms)
        except ResourceExhausted:
            if not await self.space.movers.flush():
                raise
            return self.allocate_now(ns, specs, ttl_ms)

    def allocate_now(
        self, ns: NsEntry, specs: Sequence[BlockSpec], ttl_ms: int = 0
    ) -> tuple[Allocation, list[Slot | None]]:
        """Reserve DRAM slots for the blocks not yet stored; None marks a block already present."""
        keys, classes, ttl = self.checks.blocks(specs, ttl_ms)
        ns = self.index.live(ns)  # the caller's may be stale

        get = self.index.get
        new = [i for i, s in enumerate(specs) if get(ns, s.key) is None]
        reserved = self.space.reserve(
            ns, [(keys[i], specs[i].parent, specs[i].size, None) for i in new], [classes[i] for i in new]
        )
        blocks: dict[int, Block] = {}
        slots: list[Slot | None] = [None] * len(specs)  # None: present already
        for i, b in zip(new, reserved):
            slot = slots[i] = b.slot
            assert slot is not None  # (reserved: it holds one)
            blocks[slot.slot_id] = b
        alloc = self.index.open_allocation(ns, blocks, self.clock() + ttl / 1000.0)
        self.stats.writes["allocations"] += 1
        self.stats.writes["blocks_deduplicated"] += len(specs) - len(new)
        return alloc, slots

    def _closed(self, alloc_id: str) -> None:
        fate = self._closed_allocations.get(alloc_id)
        if fate is not None:
            raise FailedPrecondition(f"allocation_id: {shown(alloc_id)} was already {fate}")

    def _remember(self, alloc: Allocation, fate: str) -> None:
        self.index.close_allocation(alloc)
        self._closed_allocations[alloc.id] = fate
        while len(self._closed_allocations) > 10_000:
            self._closed_allocations.popitem(last=False)

    async def commit(
        self,
        alloc_id: str,
        specs: Sequence[CommitSpec],
        *,
        wait_write_through: bool = False,
        wait_published: bool = False,
        retain_ms: int = 0,
        retain_priority: int = 0,
    ) -> tuple[int, int]:
        """Publish the listed blocks (release the rest of the allocation). Returns (committed,
        written_through): with ``wait_write_through``, once the write-through tiers' writes of
        these blocks have finished, how many of them every such tier now holds; else 0. With
        ``wait_published``, once the cluster directory lists them: an error where it did not list
        every one (refused a record, or could not be written to; the blocks stay committed here).
        With ``retain_ms``, they are retained (kvstore.store.books.retention); a hint past the tenant's
        bound refuses the commit, the allocation left open."""
        self._closed(alloc_id)
        alloc = self.index.allocation(alloc_id)
        chosen = self.checks.slots(alloc_id, alloc, specs)
        await self.sealing.check_sent(chosen)  # (DATA_LOSS on a mismatch)
        if self.index.allocations.get(alloc_id) is not alloc:  # aborted or reaped while we hashed
            self._closed(alloc_id)
            raise FailedPrecondition(f"allocation_id: {shown(alloc_id)} was reclaimed during commit")
        self.retention.check([b for b, _ in chosen], retain_ms, retain_priority, into=DRAM)
        blocks = self._publish(alloc, chosen, retain_ms, retain_priority)
        writes = self.space.movers.committed(blocks)
        written = 0
        if wait_write_through:
            if writes:
                await asyncio.wait(writes)  # not gather: a cancelled commit must not cancel the writes
            written = self.space.below.written_through(blocks)
        # After the write-through: the record then lists the shared tiers too (a reader elsewhere
        # reads them from there rather than from this node).
        if wait_published and (listed := self.remote.published(blocks)) is not None:
            await asyncio.wait([listed])  # a cancelled commit must not cancel the publish
            listed.result()  # (not listed: FailedPrecondition or Unavailable, naming wait_published)
        return len(chosen), written

    def _publish(
        self, alloc: Allocation, chosen: list[tuple[Block, int | None]], retain_ms: int, retain_priority: int
    ) -> list[Block]:
        """Apply a checked Commit: the listed blocks become visible (with their checksums, if sent),
        the rest of the allocation is released, the allocation closed. The blocks, root first."""
        space = self.space
        committed = {id(b) for b, _ in chosen}
        for b in alloc.blocks.values():
            if id(b) not in committed:
                space.free(b)
        nbytes = 0
        chosen.sort(key=lambda bc: bc[0].depth)  # root first, so each parent is there to link to
        if retain_ms:  # retained before they are placed: each enters the policy in its band at once
            self.retention.retain([b for b, _ in chosen], retain_ms, retain_priority, into=DRAM)
        for b, c in chosen:
            space.place(b)  # into the slot it was allocated
            self.index.publish(b)
            self.sealing.committed(b, c)
            nbytes += b.size
        # Recency deepest first, so that ancestors are at least as recent as their descendants.
        space.policy.access_many([b for b, _ in reversed(chosen)])
        self.retention.stored(b for b, _ in chosen)  # (what the hints were worth: kvstore/store/books/hint_worth.py)
        self._remember(alloc, "committed")
        self.stats.writes["commits"] += 1
        self.stats.writes["blocks_committed"] += len(chosen)
        self.stats.tier("dram", "bytes_in", nbytes)
        return [b for b, _ in chosen]

    def abort(self, alloc_id: str, fate: str = "aborted") -> int:
        self._closed(alloc_id)
        alloc = self.index.allocation(alloc_id)
        for b in alloc.blocks.values():
            self.space.free(b)
        self._remember(alloc, fate)
        self.stats.writes[fate] += 1
        return len(alloc.blocks)

    # --- reads --------------------------------------------------------------------------------

    async def acquire(
        self, ns: NsEntry, keys: Sequence[bytes], ttl_ms: int = 0, retain_ms: int = 0, retain_priority: int = 0
    ) -> tuple[Lease | None, list[Block]]:
        """Lease the leading run of ``keys`` that is readable from DRAM now (promoting from lower
        tiers first when there are any). With ``retain_ms``, the leased run is retained; the
        hint is checked against the bounds on the run held here before anything moves, and again
        on the whole run (fetched from peers, promoted) before it is leased."""
        self.checks.batch(len(keys), "keys")
        self.checks.keys(keys, "keys")
        deadline = self.checks.lease_deadline(ttl_ms)
        self.retention.check(self.index.leading_run(ns, keys), retain_ms, retain_priority, into=DRAM)
        ns, run = await self.cluster_reads.complete(ns, keys)
        run = await self.space.movers.promote(run)
        readable: list[Block] = []
        for b in run:
            if not (b.tiers & DRAM) or b.state is not State.COMMITTED:
                break
            readable.append(b)
        self.retention.check(readable, retain_ms, retain_priority)  # the whole run now (nothing leased yet)
        # Leased before any await: while the run is hashed (dram.verify_local_reads) no Allocate
        # may evict it and no Delete take it (an Acquire leased blocks that had left DRAM).
        lease = self.index.take_lease(readable, deadline) if readable else None
        if lease is not None and self.config.dram.verify_local_reads:
            lease, readable = await self.sealing.verified(lease, deadline)
        self.space.touch(readable)
        self.retention.used(readable)
        if retain_ms and readable:
            self.retention.retain(readable, retain_ms, retain_priority)
        self.stats.reads["acquires"] += 1
        self.stats.reads["blocks"] += len(readable)
        nbytes = sum(b.size for b in readable)
        self.stats.reads["bytes"] += nbytes
        self.stats.tier("dram", "bytes_out", nbytes)
        return lease, readable

    def retain(self, ns: NsEntry, keys: Sequence[bytes], retain_ms: int, retain_priority: int = 0) -> tuple[int, int]:
        """Retain the committed blocks of ``keys`` held here for ``retain_ms`` (0: end their
        retention); refused whole past a tenant's bound. How many it retains (the leading ones the
        budget for hints affords; a key given twice counts once) or ended, and their bytes."""
        self.checks.batch(len(keys), "keys")
        self.checks.keys(keys, "keys")
        blocks = list(dict.fromkeys(b for k in keys if (b := ns.visible.get(k)) is not None and b.tiers))
        self.retention.check(blocks, retain_ms, retain_priority)
        held = self.retention.retain(blocks, retain_ms, retain_priority)
        return len(held), sum(b.size for b in held)

    async def prefetch(self, ns: NsEntry, keys: Sequence[bytes]) -> int:
        """Promote the leading run of ``keys`` into DRAM; how many leading blocks are there now."""
        self.checks.batch(len(keys), "keys")
        self.checks.keys(keys, "keys")
        ns, run = await self.cluster_reads.complete(ns, keys)
        run = await self.space.movers.promote(run)
        ready = 0
        for b in run:
            if not b.tiers & DRAM:
                break
            ready += 1
        return ready

    def release(self, lease_id: str) -> int:
        return len(self.index.release_lease(lease_id).blocks)

    # --- delete -------------------------------------------------------------------------------

    async def delete(self, ns: NsEntry, keys: Sequence[bytes], all_keys: bool) -> tuple[int, int]:
        if all_keys and keys:
            raise InvalidArgument("keys: give keys or all_keys, not both")
        if not all_keys:
            self.checks.batch(len(keys), "keys")
            self.checks.keys(keys, "keys")
        # counted per block: a key named twice is one block deleted (or skipped), as Lookup counts per key
        targets = (
            list(ns.blocks.values())
            if all_keys
            else [b for k in dict.fromkeys(keys) if (b := ns.blocks.get(k)) is not None]
        )
        # Keys a restart's recovery has not loaded yet (the whole namespace for all_keys): not
        # loaded after this either, their copies removed below (kvstore.movers.recovery).
        unloaded = self.space.movers.forget(
            (), (ns.root, None if all_keys else [k for k in dict.fromkeys(keys) if k not in ns.blocks])
        )
        if any(b.moving and not b.leases for b in targets):
            # A write-through in flight reads these blocks' slots (a Commit that did not wait for
            # it): the delete waits for it, then deletes them everywhere, the copy it made too.
            # Only a reader's lease keeps a block (skipped_leased); an open allocation its own.
            await self.space.movers.writes_ended([b for b in targets if b.moving and not b.leases])
            targets = [b for b in targets if ns.blocks.get(b.key) is b]  # (another delete's meanwhile: not ours)
        gone = [b for b in targets if not b.pinned]
        # Every target leaves DRAM, the tiers' bookkeeping and the index before the first await: a
        # promotion in flight that landed while a delete awaited its tier put the block back in
        # the policy after the delete had taken it out (a dead entry: the next eviction failed).
        for b in gone:
            self.space.remove(b)
        # (and while a restart still loads: a record of theirs in a level not loaded yet -- a
        # block put during the loading, or loaded from one level of two -- tombstoned and removed)
        copies = self.space.movers.forget(gone, (ns.root, [b.key for b in gone]))
        for b in gone:
            placed_nowhere(b)
            self.retention.recount(b)
            self.index.drop(b)
        self.stats.writes["deleted"] += len(gone)
        await copies
        await unloaded
        return len(gone), len(targets) - len(gone)

    # --- background ---------------------------------------------------------------------------

    def reap(self) -> tuple[int, int]:
        """Reclaim abandoned allocations and expired leases. Returns (allocations, leases)."""
        now = self.clock()
        allocs = self.index.expired_allocations(now)
        for a in allocs:
            log.info("reclaiming abandoned allocation %s (%d blocks)", a.id, len(a.blocks))
            if a.blocks:  # (its writer may still write those slots: clients' loads hash from now on)
                self.space.slab.note_reclaimed()
            self.abort(a.id, fate="reclaimed")
        leases = self.index.expired_leases(now)
        for le in leases:
            self.index.release_lease(le.id)
        self.stats.reads["leases_expired"] += len(leases)
        return len(allocs), len(leases)

    async def seal(self, limit: int = 256) -> int:
        """Compute checksums of committed blocks whose writer did not send one, off the
        clients' critical path (:meth:`Sealing.seal`)."""
        return await self.sealing.seal(limit)

    def occupancy(self) -> dict[str, dict[str, object]]:
        return {"dram": self.space.occupancy(), **self.space.below.occupancy()}

    def snapshot(self) -> dict[str, object]:
        doc = self.stats.snapshot(self.occupancy(), self.index.count())
        doc["policy"] = self.space.policy.name
        doc["recovery"] = dict(self.tiering.recovery_stats)
        if self.tenants.attached:
            doc["tenants"] = self.tenants.snapshot(self.config.server.stats_namespaces)
        doc["retained"] = self._retained(self.config.server.stats_namespaces)
        return doc

    def _retained(self, shown: int) -> dict[str, Any]:
        """The ``retained`` entry of /stats with its tenants capped as the others' (a salt is free):
        bytes per tier of the ``shown`` tenants retaining the most, refusals of the ``shown`` refused
        most, each tier's and the refusals' rest summed as "other"."""
        doc: dict[str, Any] = self.retention.snapshot()
        by_tier: dict[str, dict[str, int]] = doc["tenants"]
        total: Counter[str] = Counter()
        for c in by_tier.values():
            total.update(c)
        keep = busiest(total, shown)
        doc["tenants"] = {tier: folded(c, keep) for tier, c in by_tier.items()}
        doc["refused"] = folded(doc["refused"], busiest(doc["refused"], shown))
        return doc
