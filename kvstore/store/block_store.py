"""The block store: the sidecar's state machine over the index, the DRAM space and the tiers below.

Every public method validates its whole request before it changes anything, so a rejected
request leaves no trace. Methods run on the event loop thread; only checksum work (which
releases the GIL) is sent to a thread. DRAM -- slots, placement, eviction, the policy -- is the
:class:`~kvstore.store.space.DramSpace`'s; the tiers below DRAM are :attr:`BlockStore.tiering`, the
movers (:class:`~kvstore.store.below.NoMovers` for a DRAM-only store). The rest of a cluster is
:attr:`BlockStore.remote`, which works on this store only through :attr:`BlockStore.exchange`
(:mod:`kvstore.store.exchange`: a peer fetch's reserved slots, adopted shared-tier blocks, runs lent).
"""

from __future__ import annotations

import asyncio
import logging
import operator
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from kvstore.config import Config
from kvstore.dram.slab import Slab, Slot
from kvstore.errors import (
    ChecksumMismatch,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    shown,
)
from kvstore.keys import KEY_BYTES, Namespace, check_key
from kvstore.policy import make_policy
from kvstore.policy.base import EvictionPolicy
from kvstore.store.below import Below, Movers
from kvstore.store.checksum import checksums
from kvstore.store.counters import Stats
from kvstore.store.exchange import Exchange
from kvstore.store.index import (
    DRAM,
    Allocation,
    Block,
    Index,
    Lease,
    NsEntry,
    State,
    top_label,
)
from kvstore.store.remote import NoRemote, PeerBlock, Remote
from kvstore.store.retention import Retention
from kvstore.store.space import DramSpace
from kvstore.store.tenants import Tenants

log = logging.getLogger("kvstore.store.block_store")
_TIERS = operator.attrgetter("tiers")


@dataclass(slots=True, frozen=True)
class BlockSpec:
    key: bytes
    parent: bytes
    size: int


@dataclass(slots=True, frozen=True)
class CommitSpec:
    key: bytes
    slot_id: int
    checksum: int | None


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
        self.space.retention = self.retention = Retention(clock, config.tenants.retained_bounds())
        self.retention.changed = self.index.moved  # a retained block's record carries its retention
        self._closed_allocations: OrderedDict[str, str] = OrderedDict()  # id -> "committed" | "aborted" | "reclaimed"
        self._unsealed: list[Block] = []
        self.remote: Remote = NoRemote()  # the rest of the cluster, once the sidecar wires it
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

    # --- validation helpers -----------------------------------------------------------------

    def _check_batch(self, n: int, field: str) -> None:
        if n == 0:
            raise InvalidArgument(f"{field}: empty batch")
        limit = self.config.server.max_batch_blocks
        if n > limit:
            raise InvalidArgument(f"{field}: {n} blocks exceed the batch limit of {limit} (server.max_batch_blocks)")

    @staticmethod
    def _check_keys(keys: Sequence[bytes], field: str) -> None:
        if set(map(len, keys)) <= {KEY_BYTES}:
            return
        for i, k in enumerate(keys):
            check_key(k, f"{field}[{i}]")

    def _lease_deadline(self, ttl_ms: int) -> float:
        ttl = ttl_ms or self.config.index.lease_ttl_ms
        cap = self.config.index.max_lease_ttl_ms
        if ttl > cap:
            raise InvalidArgument(f"lease_ttl_ms: {ttl} exceeds the maximum of {cap} (index.max_lease_ttl_ms)")
        return self.clock() + ttl / 1000.0

    # --- lookup -----------------------------------------------------------------------------

    def lookup(
        self, ns: NsEntry, keys: Sequence[bytes], lease_ttl_ms: int = 0
    ) -> tuple[list[Block], set[int], Lease | None]:
        """The leading run of ``keys`` that is stored, the set of placement masks in it, and a
        lease on it when ``lease_ttl_ms`` is set."""
        self._check_batch(len(keys), "keys")
        deadline = self._lease_deadline(lease_ttl_ms) if lease_ttl_ms else None
        run = self.index.leading_run(ns, keys)
        if len(run) < len(keys):  # a full hit proves every key well-formed (stored keys are)
            self._check_keys(keys, "keys")
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
        """:meth:`lookup`, the run continued through the blocks the rest of the cluster holds: those
        in a shared tier this node has join the local run, the others come back as
        :class:`PeerBlock` s after it. A full local hit asks nobody; a miss costs one directory
        round trip."""
        remote = self.remote
        peers: list[PeerBlock] = []
        if remote.active:
            self._check_batch(len(keys), "keys")
            have = len(self.index.leading_run(ns, keys))
            if have < len(keys):
                self._check_keys(keys, "keys")
                if lease_ttl_ms:
                    self._lease_deadline(lease_ttl_ms)  # rejected before anything is asked
                adopted, peers = await remote.find(ns, keys[have:], keys[have - 1] if have else b"", have + 1)
                if adopted:
                    ns = self.index.live(ns)
                run, masks, lease = self.lookup(ns, keys, lease_ttl_ms)
                if len(run) != have + adopted:  # cut short (a tier went down): the peers' run does not join
                    peers = []
                self.stats.cluster["peer_blocks_found"] += len(peers)
                return run, masks, lease, peers
        run, masks, lease = self.lookup(ns, keys, lease_ttl_ms)
        return run, masks, lease, peers

    async def prefixes(self, ns: NsEntry, keys: Sequence[bytes]) -> dict[str, dict[str, int]]:
        """Per node of the cluster, the leading run of ``keys`` it can serve by where it lies
        (:meth:`Remote.prefixes`); a node on its own answers for itself as ``""``."""
        self._check_batch(len(keys), "keys")
        self._check_keys(keys, "keys")
        if self.remote.active:
            return await self.remote.prefixes(ns, keys)
        return {"": dict(Counter(top_label(b.tiers) for b in self.index.leading_run(ns, keys)))}

    async def _with_cluster(self, ns: NsEntry, keys: Sequence[bytes]) -> tuple[NsEntry, list[Block]]:
        """The leading run of ``keys`` here, first completed from the rest of the cluster."""
        run = self.index.leading_run(ns, keys)
        if len(run) < len(keys) and self.remote.active:
            parent = keys[len(run) - 1] if run else b""
            for b in run:  # pinned while the rest is fetched: room for it (the tenant's quota) is not made of them
                b.leases += 1
            try:
                fetched = await self.remote.fetch(ns, keys[len(run) :], parent, len(run) + 1)
            finally:
                for b in run:
                    b.leases -= 1
            if fetched:
                ns = self.index.live(ns)
                run = self.index.leading_run(ns, keys)
        return ns, run

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
        self._check_batch(len(specs), "blocks")
        seen: set[bytes] = set()
        classes: list[int] = []
        keys = []
        for i, s in enumerate(specs):
            keys.append(check_key(s.key, f"blocks[{i}].key"))
            if s.parent and len(s.parent) != KEY_BYTES:
                raise InvalidArgument(
                    f"blocks[{i}].parent: a block key is {KEY_BYTES} bytes (or empty), got {len(s.parent)}"
                )
            if s.key in seen:
                raise InvalidArgument(f"blocks[{i}].key: duplicate key in one request")
            seen.add(s.key)
            try:
                classes.append(self.slab.class_of(s.size))
            except InvalidArgument as exc:
                raise InvalidArgument(f"blocks[{i}].{exc}") from None
        cap = self.config.index.max_allocation_ttl_ms
        if ttl_ms > cap:
            raise InvalidArgument(f"ttl_ms: {ttl_ms} exceeds the maximum of {cap} (index.max_allocation_ttl_ms)")
        ttl = ttl_ms or self.config.index.allocation_ttl_ms
        ns = self.index.live(ns)  # the caller's may be stale

        get = self.index.get
        new = [(i, s, cls) for i, (s, cls) in enumerate(zip(specs, classes)) if get(ns, s.key) is None]
        tenant = ns.tenant
        need = Counter(cls for _, _, cls in new)
        taken = {cls: iter(got) for cls, got in self.space.take(need, tenant, sum(s.size for _, s, _ in new)).items()}
        blocks: dict[int, Block] = {}
        slots: list[Slot | None] = [None] * len(specs)  # None: present already
        for i, s, cls in new:
            slot = slots[i] = next(taken[cls])
            b = self.index.add(ns, keys[i], s.parent, s.size, State.ALLOCATED)
            b.slot = slot  # written into now, placed in DRAM at commit
            slot.holder = b
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
        With ``retain_ms``, they are retained (kvstore.store.retention); a hint past the tenant's
        bound refuses the commit, the allocation left open."""
        self._closed(alloc_id)
        alloc = self.index.allocation(alloc_id)
        self._check_batch(len(specs), "blocks")
        chosen: list[tuple[Block, int | None]] = []
        seen: set[int] = set()
        for i, s in enumerate(specs):
            b = alloc.blocks.get(s.slot_id)
            if b is None:
                raise InvalidArgument(
                    f"blocks[{i}].slot_id: slot {s.slot_id} does not belong to allocation {alloc_id}"
                )
            if b.key != s.key:
                raise InvalidArgument(f"blocks[{i}].key: slot {s.slot_id} was allocated for another key")
            if s.slot_id in seen:
                raise InvalidArgument(f"blocks[{i}].slot_id: slot {s.slot_id} listed twice")
            seen.add(s.slot_id)
            chosen.append((b, s.checksum))
        to_verify = [(i, b, c) for i, (b, c) in enumerate(chosen) if c is not None]
        if to_verify:
            sums = await checksums([self.space.view(b) for _, b, _ in to_verify])
            for (i, _, expected), got in zip(to_verify, sums):
                if got != expected:
                    self.stats.tier("dram", "checksum_failures")
                    raise ChecksumMismatch(
                        f"blocks[{i}].checksum: the slot holds bytes with checksum {got:#018x}, "
                        f"the request says {expected:#018x}"
                    )
            if self.index.allocations.get(alloc_id) is not alloc:  # aborted or reaped while we hashed
                self._closed(alloc_id)
                raise FailedPrecondition(f"allocation_id: {shown(alloc_id)} was reclaimed during commit")
        self.retention.check([b for b, _ in chosen], retain_ms, retain_priority, into=DRAM)
        # Apply: the listed blocks become visible, the rest of the allocation is released.
        space = self.space
        committed = {id(b) for b, _ in chosen}
        for b in alloc.blocks.values():
            if id(b) not in committed:
                space.free(b)
        nbytes = 0
        chosen.sort(key=lambda bc: bc[0].depth)  # root first, so each parent is there to link to
        for b, c in chosen:
            space.place(b)  # into the slot it was allocated
            self.index.publish(b)
            if c is None:
                self._unsealed.append(b)
            else:
                b.seal(c)
            nbytes += b.size
        # Recency deepest first, so that ancestors are at least as recent as their descendants.
        space.policy.access_many([b for b, _ in reversed(chosen)])
        if retain_ms:
            self.retention.retain([b for b, _ in chosen], retain_ms, retain_priority)
        self._remember(alloc, "committed")
        self.stats.writes["commits"] += 1
        self.stats.writes["blocks_committed"] += len(chosen)
        self.stats.tier("dram", "bytes_in", nbytes)
        blocks = [b for b, _ in chosen]
        writes = space.movers.committed(blocks)
        written = 0
        if wait_write_through:
            if writes:
                await asyncio.wait(writes)  # not gather: a cancelled commit must not cancel the writes
            written = space.below.written_through(blocks)
        # After the write-through: the record then lists the shared tiers too (a reader elsewhere
        # reads them from there rather than from this node).
        if wait_published and (listed := self.remote.published(blocks)) is not None:
            await asyncio.wait([listed])  # a cancelled commit must not cancel the publish
            listed.result()  # (not listed: FailedPrecondition or Unavailable, naming wait_published)
        return len(chosen), written

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
        hint is checked against the tenant's bound on the run held here before anything moves."""
        self._check_batch(len(keys), "keys")
        self._check_keys(keys, "keys")
        deadline = self._lease_deadline(ttl_ms)
        self.retention.check(self.index.leading_run(ns, keys), retain_ms, retain_priority, into=DRAM)
        ns, run = await self._with_cluster(ns, keys)
        run = await self.space.movers.promote(run)
        readable: list[Block] = []
        for b in run:
            if not (b.tiers & DRAM) or b.state is not State.COMMITTED:
                break
            readable.append(b)
        # Leased before any await: while the run is hashed (dram.verify_local_reads) no Allocate
        # may evict it and no Delete take it (an Acquire leased blocks that had left DRAM).
        lease = self.index.take_lease(readable, deadline) if readable else None
        if lease is not None and self.config.dram.verify_local_reads:
            lease, readable = await self._verified(lease, deadline)
        self.space.touch(readable)
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
        retention); refused whole past a tenant's bound. How many were found, and their bytes."""
        self._check_batch(len(keys), "keys")
        self._check_keys(keys, "keys")
        blocks = [b for k in keys if (b := ns.visible.get(k)) is not None and b.tiers]
        self.retention.check(blocks, retain_ms, retain_priority)
        self.retention.retain(blocks, retain_ms, retain_priority)
        return len(blocks), sum(b.size for b in blocks)

    async def prefetch(self, ns: NsEntry, keys: Sequence[bytes]) -> int:
        """Promote the leading run of ``keys`` into DRAM; how many leading blocks are there now."""
        self._check_batch(len(keys), "keys")
        self._check_keys(keys, "keys")
        ns, run = await self._with_cluster(ns, keys)
        run = await self.space.movers.promote(run)
        ready = 0
        for b in run:
            if not b.tiers & DRAM:
                break
            ready += 1
        return ready

    async def _verified(self, lease: Lease, deadline: float) -> tuple[Lease | None, list[Block]]:
        """Hash a leased run's DRAM copies; the lease and run cut before the first block whose
        bytes no longer match its checksum (that copy is dropped)."""
        run = lease.blocks
        try:
            sums = await checksums([self.space.view(b) for b in run])
        except BaseException:
            self._end_lease(lease)
            raise
        for i, (b, got) in enumerate(zip(run, sums)):
            if not b.seal(got):  # (an unsealed one is sealed now: nothing earlier to compare with)
                log.warning("checksum mismatch on DRAM block %s; dropping it", b.key.hex()[:16])
                self.stats.tier("dram", "checksum_failures")
                self._end_lease(lease)
                self.space.remove(b)
                good = run[:i]
                return (self.index.take_lease(good, deadline) if good else None), good
        return lease, run

    def _end_lease(self, lease: Lease) -> None:
        if lease.id in self.index.leases:  # (the reaper may have ended a very short one meanwhile)
            self.index.release_lease(lease.id)

    def release(self, lease_id: str) -> int:
        return len(self.index.release_lease(lease_id).blocks)

    # --- delete -------------------------------------------------------------------------------

    async def delete(self, ns: NsEntry, keys: Sequence[bytes], all_keys: bool) -> tuple[int, int]:
        if all_keys and keys:
            raise InvalidArgument("keys: give keys or all_keys, not both")
        if not all_keys:
            self._check_batch(len(keys), "keys")
            self._check_keys(keys, "keys")
        # counted per block: a key named twice is one block deleted (or skipped), as Lookup counts per key
        targets = list(ns.blocks.values()) if all_keys else [
            b for k in dict.fromkeys(keys) if (b := ns.blocks.get(k)) is not None]
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
        copies = self.space.movers.forget(gone)
        for b in gone:
            b.tiers = 0
            self.index.drop(b)
        self.stats.writes["deleted"] += len(gone)
        await copies
        return len(gone), len(targets) - len(gone)

    # --- background ---------------------------------------------------------------------------

    def reap(self) -> tuple[int, int]:
        """Reclaim abandoned allocations and expired leases. Returns (allocations, leases)."""
        now = self.clock()
        allocs = self.index.expired_allocations(now)
        for a in allocs:
            log.info("reclaiming abandoned allocation %s (%d blocks)", a.id, len(a.blocks))
            self.abort(a.id, fate="reclaimed")
        leases = self.index.expired_leases(now)
        for le in leases:
            self.index.release_lease(le.id)
        self.stats.reads["leases_expired"] += len(leases)
        return len(allocs), len(leases)

    async def seal(self, limit: int = 256) -> int:
        """Compute checksums of committed blocks whose writer did not send one, off the
        clients' critical path."""
        batch, self._unsealed = self._unsealed[:limit], self._unsealed[limit:]
        batch = [b for b in batch if b.checksum is None and b.slot is not None]
        if not batch:
            return 0
        sums = await checksums([self.space.view(b) for b in batch])
        for b, c in zip(batch, sums):
            if b.slot is not None:  # (still in DRAM: these are its bytes)
                b.seal(c)
        return len(batch)

    def occupancy(self) -> dict[str, dict[str, object]]:
        return {"dram": self.space.occupancy(), **self.space.below.occupancy()}

    def snapshot(self) -> dict[str, object]:
        doc = self.stats.snapshot(self.occupancy(), self.index.count())
        doc["policy"] = self.space.policy.name
        if self.tenants.attached:
            doc["tenants"] = self.tenants.snapshot(self.config.server.stats_namespaces)
        doc["retained"] = self.retention.snapshot()
        return doc
