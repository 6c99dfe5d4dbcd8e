"""The block store: the sidecar's state machine over the index, the DRAM slab and its policy.

Every public method validates its whole request before it changes anything, so a rejected
request leaves no trace. Methods run on the event loop thread; only checksum work (which
releases the GIL) is sent to a thread. Lower tiers hang off :attr:`BlockStore.tiering`, which
is None for a DRAM-only store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import operator
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.config import Config
from kvstore.dram.slab import Page, Slab, Slot
from kvstore.errors import (
    ChecksumMismatch,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
)
from kvstore.keys import KEY_BYTES, Namespace
from kvstore.policy import make_policy
from kvstore.store.checksum import checksums
from kvstore.store.counters import Stats
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

if TYPE_CHECKING:
    from kvstore.tiers.movers import Tiering

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
    def __init__(self, config: Config, slab: Slab, stats: Stats | None = None, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.slab = slab
        self.stats = stats or Stats()
        self.stats.namespaces_shown = config.server.stats_namespaces
        self.clock = clock
        self.index = Index()
        self.policy = make_policy(config.index.policy)
        self.tiering: Tiering | None = None
        self._closed_allocations: OrderedDict[str, str] = OrderedDict()  # id -> "committed" | "aborted" | "reclaimed"
        self._unsealed: list[Block] = []
        self._touches: list[tuple[list[Block], bool]] = []

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
            if len(k) != KEY_BYTES:
                raise InvalidArgument(f"{field}[{i}]: a block key is {KEY_BYTES} bytes, got {len(k)}")

    def _lease_deadline(self, ttl_ms: int) -> float:
        ttl = ttl_ms or self.config.index.lease_ttl_ms
        if ttl > self.config.index.max_lease_ttl_ms:
            raise InvalidArgument(
                f"lease_ttl_ms: {ttl} exceeds the maximum of {self.config.index.max_lease_ttl_ms} (index.max_lease_ttl_ms)"
            )
        return self.clock() + ttl / 1000.0

    # --- lookup -----------------------------------------------------------------------------

    def lookup(self, ns: NsEntry, keys: Sequence[bytes], lease_ttl_ms: int = 0) -> tuple[list[Block], set[int], Lease | None]:
        """The leading run of ``keys`` that is stored, the set of placement masks in it, and a
        lease on it when ``lease_ttl_ms`` is set."""
        self._check_batch(len(keys), "keys")
        deadline = self._lease_deadline(lease_ttl_ms) if lease_ttl_ms else None
        run = self.index.leading_run(ns, keys)
        if len(run) < len(keys):  # a full hit proves every key well-formed (stored keys are)
            self._check_keys(keys, "keys")
        if self.tiering is not None and (down := self.tiering.down_mask()):
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
        self._touch(run, all_in_dram=all(m & DRAM for m in masks))
        lease = self.index.take_lease(run, deadline) if deadline is not None and run else None
        return run, masks, lease

    @staticmethod
    def _reachable(run: list[Block], down: int) -> list[Block]:
        """Cut the run at the first block whose every copy is in a tier that is down."""
        for i, b in enumerate(run):
            if not b.tiers & ~down:
                return run[:i]
        return run

    def _touch(self, run: list[Block], all_in_dram: bool = False) -> None:
        """Record hits for the policies. Applied lazily (a read buffer, as Caffeine does): off
        the request's critical path, and always before the next eviction decision."""
        if run:
            touches = self._touches
            if touches and touches[-1][0] == run:
                return  # the same run again (a hot prefix): touching it twice in a row = once
            touches.append((run, all_in_dram))
            if len(touches) >= 256:
                self.drain_touches()

    def drain_touches(self) -> None:
        touches, self._touches = self._touches, []
        access_many = self.policy.access_many
        for run, all_in_dram in touches:
            # Deepest first, so that an ancestor is always at least as recent as its descendants.
            access_many(run[::-1] if all_in_dram else [b for b in reversed(run) if b.tiers & DRAM])
            if self.tiering is not None:
                self.tiering.touch(run)

    # --- two-phase writes ---------------------------------------------------------------------

    async def allocate(self, ns: NsEntry, specs: Sequence[BlockSpec], ttl_ms: int = 0) -> tuple[Allocation, list[Slot | None]]:
        """:meth:`allocate_now`, waiting once for tier movers when only their pins stand in the way
        (backpressure rather than RESOURCE_EXHAUSTED)."""
        try:
            return self.allocate_now(ns, specs, ttl_ms)
        except ResourceExhausted:
            if self.tiering is None or not self.tiering.busy:
                raise
            await self.tiering.flush()
            return self.allocate_now(ns, specs, ttl_ms)

    def allocate_now(self, ns: NsEntry, specs: Sequence[BlockSpec], ttl_ms: int = 0) -> tuple[Allocation, list[Slot | None]]:
        """Reserve DRAM slots for the blocks not yet stored; None marks a block already present."""
        self._check_batch(len(specs), "blocks")
        seen: set[bytes] = set()
        classes: list[int] = []
        for i, s in enumerate(specs):
            if len(s.key) != KEY_BYTES:
                raise InvalidArgument(f"blocks[{i}].key: a block key is {KEY_BYTES} bytes, got {len(s.key)}")
            if s.parent and len(s.parent) != KEY_BYTES:
                raise InvalidArgument(f"blocks[{i}].parent: a block key is {KEY_BYTES} bytes (or empty), got {len(s.parent)}")
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
        ns = self.index.find(ns.root, ns.label, ns.namespace)  # the live entry: the caller's may be stale

        get = self.index.get
        new = [(i, s, cls) for i, (s, cls) in enumerate(zip(specs, classes)) if get(ns, s.key) is None]
        taken = {cls: iter(got) for cls, got in self._take_slots(Counter(cls for _, _, cls in new)).items()}
        blocks: dict[int, Block] = {}
        slots: list[Slot | None] = [None] * len(specs)  # None: present already
        for i, s, cls in new:
            slot = slots[i] = next(taken[cls])
            b = self.index.add(ns, s.key, s.parent, s.size, State.ALLOCATED)
            b.slot = slot
            slot.holder = b
            blocks[slot.slot_id] = b
        alloc = self.index.open_allocation(ns, blocks, self.clock() + ttl / 1000.0)
        self.stats.writes["allocations"] += 1
        self.stats.writes["blocks_deduplicated"] += len(specs) - len(new)
        return alloc, slots

    def _take_slot(self, cls: int, holder: Block | None = None) -> Slot:
        """One slot of class ``cls`` for ``holder`` (see :meth:`_take_slots`)."""
        slot = self._take_slots({cls: 1})[cls][0]
        slot.holder = holder
        return slot

    def _take_slots(self, needs: Mapping[int, int]) -> dict[int, list[Slot]]:
        """Slots for ``needs`` (size class -> how many), evicting the policy's victims when free
        slots and free pages do not cover them; refused before anything is evicted when they
        cannot all be had (:class:`_Room`)."""
        slab = self.slab
        if slab.fits(needs):
            return {cls: slab.take(cls, n) for cls, n in needs.items()}
        self.drain_touches()
        room = _Room(self, needs)
        with self.tiering.staging_batch() if self.tiering is not None else contextlib.nullcontext():
            return room.take()

    def _evict_from_dram(self, block: Block) -> None:
        """Drop the DRAM copy of a block the policy chose; demote it first when a lower tier takes it."""
        self.stats.tier("dram", "evictions")
        if self.tiering is not None:
            self.tiering.on_dram_evict(block)
        self._free_dram(block)

    def _free_dram(self, block: Block) -> None:
        if block.slot is not None:
            self.slab.free(block.slot)  # type: ignore[arg-type]
            block.slot = None
        block.tiers &= ~DRAM
        if not block.tiers:
            self.index.drop(block)

    def _closed(self, alloc_id: str) -> None:
        fate = self._closed_allocations.get(alloc_id)
        if fate is not None:
            raise FailedPrecondition(f"allocation_id: {alloc_id!r} was already {fate}")

    def _remember(self, alloc: Allocation, fate: str) -> None:
        self.index.close_allocation(alloc)
        self._closed_allocations[alloc.id] = fate
        while len(self._closed_allocations) > 10_000:
            self._closed_allocations.popitem(last=False)

    async def commit(self, alloc_id: str, specs: Sequence[CommitSpec], *, wait_write_through: bool = False) -> tuple[int, int]:
        """Publish the listed blocks (release the rest of the allocation). Returns (committed,
        written_through): with ``wait_write_through``, once the write-through tiers' writes of
        these blocks have finished, how many of them every such tier now holds; else 0."""
        self._closed(alloc_id)
        alloc = self.index.allocation(alloc_id)
        self._check_batch(len(specs), "blocks")
        chosen: list[tuple[Block, int | None]] = []
        seen: set[int] = set()
        for i, s in enumerate(specs):
            b = alloc.blocks.get(s.slot_id)
            if b is None:
                raise InvalidArgument(f"blocks[{i}].slot_id: slot {s.slot_id} does not belong to allocation {alloc_id}")
            if b.key != s.key:
                raise InvalidArgument(f"blocks[{i}].key: slot {s.slot_id} was allocated for another key")
            if s.slot_id in seen:
                raise InvalidArgument(f"blocks[{i}].slot_id: slot {s.slot_id} listed twice")
            seen.add(s.slot_id)
            chosen.append((b, s.checksum))
        to_verify = [(i, b, c) for i, (b, c) in enumerate(chosen) if c is not None]
        if to_verify:
            views = [self.slab.view(b.slot, b.size) for _, b, _ in to_verify]  # type: ignore[arg-type]
            sums = await checksums(views)
            for (i, b, expected), got in zip(to_verify, sums):
                if got != expected:
                    self.stats.tier("dram", "checksum_failures")
                    raise ChecksumMismatch(
                        f"blocks[{i}].checksum: the slot holds bytes with checksum {got:#018x}, the request says {expected:#018x}"
                    )
            if self.index.allocations.get(alloc_id) is not alloc:  # aborted or reaped while we hashed
                self._closed(alloc_id)
                raise FailedPrecondition(f"allocation_id: {alloc_id!r} was reclaimed during commit")
        # Apply: the listed blocks become visible, the rest of the allocation is released.
        committed = {id(b) for b, _ in chosen}
        for b in alloc.blocks.values():
            if id(b) not in committed:
                self._free_dram(b)
        nbytes = 0
        insert = self.policy.insert
        chosen.sort(key=lambda bc: bc[0].depth)  # root first, so each parent is there to link to
        for b, c in chosen:
            b.tiers |= DRAM
            self.index.publish(b)
            b.checksum = c
            if c is None:
                self._unsealed.append(b)
            parent = alloc.ns.blocks.get(b.parent) if b.parent else None
            insert(b, parent if parent is not None and parent in self.policy else None, b.depth, b.size)
            nbytes += b.size
        # Recency deepest first, so that ancestors are at least as recent as their descendants.
        self.policy.access_many([b for b, _ in reversed(chosen)])
        self._remember(alloc, "committed")
        self.stats.writes["commits"] += 1
        self.stats.writes["blocks_committed"] += len(chosen)
        self.stats.tier("dram", "bytes_in", nbytes)
        if self.tiering is None:
            return len(chosen), 0
        blocks = [b for b, _ in chosen]
        writes = self.tiering.committed(blocks)
        if not wait_write_through:
            return len(chosen), 0
        if writes:
            await asyncio.wait(writes)  # not gather: a cancelled commit must not cancel the writes (see flush)
        return len(chosen), self.tiering.written_through(blocks)

    def abort(self, alloc_id: str, fate: str = "aborted") -> int:
        self._closed(alloc_id)
        alloc = self.index.allocation(alloc_id)
        for b in alloc.blocks.values():
            self._free_dram(b)
        self._remember(alloc, fate)
        self.stats.writes[fate] += 1
        return len(alloc.blocks)

    # --- reads --------------------------------------------------------------------------------

    async def acquire(self, ns: NsEntry, keys: Sequence[bytes], ttl_ms: int = 0) -> tuple[Lease | None, list[Block]]:
        """Lease the leading run of ``keys`` that is readable from DRAM now (promoting from lower
        tiers first when there are any)."""
        self._check_batch(len(keys), "keys")
        self._check_keys(keys, "keys")
        deadline = self._lease_deadline(ttl_ms)
        run = self.index.leading_run(ns, keys)
        if self.tiering is not None:
            run = await self.tiering.promote(run)
        readable: list[Block] = []
        for b in run:
            if not (b.tiers & DRAM) or b.state is not State.COMMITTED:
                break
            readable.append(b)
        if self.config.dram.verify_local_reads and readable:
            readable = await self._verified(readable)
        self._touch(readable)
        self.stats.reads["acquires"] += 1
        self.stats.reads["blocks"] += len(readable)
        nbytes = sum(b.size for b in readable)
        self.stats.reads["bytes"] += nbytes
        self.stats.tier("dram", "bytes_out", nbytes)
        if not readable:
            return None, []
        return self.index.take_lease(readable, deadline), readable

    async def prefetch(self, ns: NsEntry, keys: Sequence[bytes]) -> int:
        """Promote the leading run of ``keys`` into DRAM; how many leading blocks are there now."""
        self._check_batch(len(keys), "keys")
        self._check_keys(keys, "keys")
        run = self.index.leading_run(ns, keys)
        if self.tiering is not None:
            run = await self.tiering.promote(run)
        ready = 0
        for b in run:
            if not b.tiers & DRAM:
                break
            ready += 1
        return ready

    async def _verified(self, run: list[Block]) -> list[Block]:
        views = [self.slab.view(b.slot, b.size) for b in run]  # type: ignore[arg-type]
        sums = await checksums(views)
        for i, (b, got) in enumerate(zip(run, sums)):
            if b.checksum is None:
                b.checksum = got  # sealed now; nothing earlier to compare with
            elif got != b.checksum:
                log.warning("checksum mismatch on DRAM block %s; dropping it", b.key.hex()[:16])
                self.stats.tier("dram", "checksum_failures")
                self.drop_corrupt_dram(b)
                return run[:i]
        return run

    def drop_corrupt_dram(self, block: Block) -> None:
        if block in self.policy:
            self.policy.remove(block)
        self._free_dram(block)

    def release(self, lease_id: str) -> int:
        return len(self.index.release_lease(lease_id).blocks)

    # --- delete -------------------------------------------------------------------------------

    async def delete(self, ns: NsEntry, keys: Sequence[bytes], all_keys: bool) -> tuple[int, int]:
        if all_keys and keys:
            raise InvalidArgument("keys: give keys or all_keys, not both")
        if not all_keys:
            self._check_batch(len(keys), "keys")
            self._check_keys(keys, "keys")
        targets = list(ns.blocks.values()) if all_keys else [b for k in keys if (b := ns.blocks.get(k)) is not None]
        deleted = skipped = 0
        copies = []
        # Every target leaves the index, DRAM and the tiers' bookkeeping before the first await: a
        # promotion in flight that landed while a delete awaited its tier put the block back in
        # the policy after the delete had taken it out (a dead entry: the next eviction failed).
        for b in targets:
            if b.pinned:
                skipped += 1
                continue
            if b in self.policy:
                self.policy.remove(b)
            self._free_dram(b)
            if self.tiering is not None:
                copies += self.tiering.forget(b)
            b.tiers = 0
            self.index.drop(b)
            deleted += 1
        self.stats.writes["deleted"] += deleted
        if copies:
            await self.tiering.delete_copies(copies)  # type: ignore[union-attr]
        return deleted, skipped

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
        views = [self.slab.view(b.slot, b.size) for b in batch]  # type: ignore[arg-type]
        sums = await checksums(views)
        for b, c in zip(batch, sums):
            if b.checksum is None and b.slot is not None:
                b.checksum = c
        return len(batch)

    def occupancy(self) -> dict[str, dict[str, object]]:
        occ: dict[str, dict[str, object]] = {"dram": {**self.slab.occupancy(), "blocks": len(self.policy)}}
        if self.tiering is not None:
            occ.update(self.tiering.occupancy())
        return occ

    def snapshot(self) -> dict[str, object]:
        doc = self.stats.snapshot(self.occupancy(), self.index.count())
        doc["policy"] = self.policy.name
        return doc


def _slot_of(b: Block) -> Slot:
    return b.slot  # type: ignore[return-value]


def _can_evict(slot: Slot) -> bool:
    """Whether the slot holds a committed block that may leave DRAM now."""
    b: Block | None = slot.holder  # type: ignore[assignment]
    return b is not None and b.slot is slot and not b.pinned


class _Room:
    """Room in DRAM for one request's slots, decided before anything is evicted.

    A size class takes its free slots, then pages from the free-page pool, then evicts its own
    blocks (the policy's victims). A class that cannot fit that way is *owed* pages: from the
    pool, then from other classes, by evicting every block of a *whole* page (one whose taken
    slots all hold blocks that may leave) -- the page of the policy's next such victim, as
    memcached's slab rebalancing moves pages. A class of the request gives pages only while what
    it keeps still holds its own slots. When the owed pages are not there, the request is refused
    and nothing was evicted. Once they are taken, each class takes its slots; when it must evict,
    the policy's next victim may also lie on a whole page of a class this request needs nothing
    more from, and that page moves: a class whose blocks are newer grows at the expense of an
    idle one instead of evicting its own.
    """

    def __init__(self, store: BlockStore, needs: Mapping[int, int]) -> None:
        self.store = store
        self.slab = store.slab
        self.needs = dict(needs)
        self.left = dict(needs)  # class -> slots it has still to take
        self.owed: dict[int, int] = {}  # class -> pages it must get before taking slots
        self.gives: dict[int, int] = {}  # class of the request -> pages it may still give to owed ones
        self._whole: dict[Page, bool] = {}  # valid while no class takes slots (cleared before each does)
        self._plan()

    def _full(self, detail: str = "") -> ResourceExhausted:
        return ResourceExhausted(
            f"blocks: DRAM is full ({self.slab.capacity_bytes} bytes){detail}; the rest is leased or being written"
        )

    def _plan(self) -> None:
        slab = self.slab
        short = {c: max(0, n - slab.free_slots(c)) for c, n in self.needs.items()}
        for c, n in short.items():
            own = self._evictable(c, n)
            if own < n:
                self.owed[c] = -(-(n - own) // slab.per_page(c))
        want = sum(self.owed.values()) - slab.free_pages
        for d in range(len(slab.classes)):
            if want <= 0:
                return
            if d in self.owed:
                continue
            if d in self.needs:  # it may give what it does not need of its free and evictable slots
                per = slab.per_page(d)
                spare = (slab.free_slots(d) + self._evictable(d, short[d] + want * per) - self.needs[d]) // per
                give = self.gives[d] = self._whole_pages(d, min(spare, want))
            else:
                give = self._whole_pages(d, want)
            want -= give
        if want > 0:
            sizes = ", ".join(f"{n} x {slab.classes[c].size} B" for c, n in self.needs.items())
            pages = sum(-(-n // slab.per_page(c)) for c, n in self.needs.items())
            if pages > slab.num_pages:
                raise ResourceExhausted(
                    f"blocks: the new blocks ({sizes}) need {pages} pages of {slab.page_bytes} bytes; DRAM has "
                    f"{slab.num_pages} (dram.capacity_bytes)"
                )
            detail = f": the new blocks ({sizes}) need {want} page(s) more than free slots and evictable blocks give"
            raise self._full(detail)

    def _evictable(self, cls: int, cap: int) -> int:
        """Slots of class ``cls`` whose blocks may be evicted, counted up to ``cap``."""
        n = 0
        if cap <= 0:
            return n
        for page in self.slab.pages(cls):
            for slot in page.slots:
                if _can_evict(slot):
                    n += 1
                    if n == cap:
                        return n
        return n

    def _is_whole(self, page: Page) -> bool:
        got = self._whole.get(page)
        if got is None:
            got = self._whole[page] = page.used > 0 and sum(map(_can_evict, page.slots)) == page.used
        return got

    def _whole_pages(self, cls: int, cap: int) -> int:
        n = 0
        for page in self.slab.pages(cls):
            if n >= cap:
                break
            n += self._is_whole(page)
        return n

    # --- taking -------------------------------------------------------------------------------

    def take(self) -> dict[int, list[Slot]]:
        slab = self.slab
        got: dict[int, list[Slot]] = {c: [] for c in self.needs}
        try:
            for c, n in self.owed.items():
                for _ in range(n):
                    if not slab.grow(c):
                        self._move(c, lambda d: d not in self.needs or self.gives.get(d, 0) > 0)
            for c, n in self.needs.items():
                self._whole.clear()  # the classes before this one took slots
                take = self._taker(c)
                for _ in range(n):
                    got[c].append(take())
                    self.left[c] -= 1
        except BaseException:
            for slots in got.values():
                for slot in slots:
                    slab.free(slot)
            raise
        return got

    def _taker(self, cls: int) -> Callable[[], Slot]:
        """What takes the next slot of class ``cls``, evicting when none is free."""
        slab, store, left, whole = self.slab, self.store, self.left, self._is_whole
        own = self._own(cls)

        def victim_ok(b: Block) -> bool:
            if b.pinned:
                return False
            slot = _slot_of(b)
            return slot.cls == cls or (not left.get(slot.cls) and whole(slab.page_of(slot)))

        def take() -> Slot:
            while (slot := slab.try_alloc(cls)) is None:
                victim: Block | None = store.policy.pop_victim(victim_ok)  # type: ignore[arg-type,assignment]
                if victim is None:  # the policy keeps the rest for their children: take one anyway
                    victim = next(own, None)
                    if victim is None:
                        raise self._full()
                    store.policy.remove(victim)
                if _slot_of(victim).cls == cls:
                    store._evict_from_dram(victim)
                else:
                    self._reclaim(slab.page_of(_slot_of(victim)), victim)
            return slot

        return take

    def _own(self, cls: int) -> Iterator[Block]:
        """The evictable blocks of class ``cls``, in slab order, each checked when reached."""
        for page in list(self.slab.pages(cls)):
            for slot in page.slots:
                if _can_evict(slot):
                    yield slot.holder  # type: ignore[misc]

    def _move(self, cls: int, donor: Callable[[int], bool]) -> None:
        """Reclaim a whole page of a ``donor`` class (the page of the policy's next victim among
        them; any whole one when the policy has none) and cut it for ``cls``."""
        slab = self.slab

        def victim_ok(b: Block) -> bool:
            return not b.pinned and donor(_slot_of(b).cls) and self._is_whole(slab.page_of(_slot_of(b)))

        victim: Block | None = self.store.policy.pop_victim(victim_ok)  # type: ignore[arg-type,assignment]
        if victim is not None:
            page: Page | None = slab.page_of(_slot_of(victim))
        else:
            donors = (d for d in range(len(slab.classes)) if d != cls and donor(d))
            page = next((p for d in donors for p in slab.pages(d) if self._is_whole(p)), None)
        if page is None:
            raise self._full()
        self._reclaim(page, victim)
        if not slab.grow(cls):
            raise self._full()

    def _reclaim(self, page: Page, victim: Block | None) -> None:
        """Evict every block of a whole page (``victim`` is one, out of the policy already): the
        page goes back to the pool with its last slot."""
        store = self.store
        cls = page.cls
        if victim is not None:
            store._evict_from_dram(victim)
        for slot in page.slots:
            if _can_evict(slot):
                b: Block = slot.holder  # type: ignore[assignment]
                store.policy.remove(b)
                store._evict_from_dram(b)
        if cls in self.gives:
            self.gives[cls] -= 1
