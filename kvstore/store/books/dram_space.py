"""The DRAM space: one owner for the slab, its eviction policy and the blocks placed in it.

Whatever takes a slot, places a block in DRAM, frees one or evicts one goes through
:class:`DramSpace`: the block store (writes, reads, deletes) and the tier movers (promotions) alike.
It also buffers the hits the policies learn of (applied before every eviction decision) and hands
each block it evicts to the movers, which keep its bytes below DRAM (:class:`~kvstore.store.books.below.Movers`).

A slot's :attr:`~kvstore.dram.slab.Slot.holder` is the block written into it. A block is *in DRAM*
once its bytes are there (the DRAM bit, :meth:`DramSpace.place`); until then (an allocation being
written, a promotion being read) it holds its slot and cannot be evicted. What placing it changes
(the bit, the policy, the footprint, the tenant's bytes, the index) is DRAM's
:class:`~kvstore.store.books.placement.Space`, the one every tier and ``kvstore replay`` place through.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import cast

import numpy as np

from kvstore.dram.slab import Page, Slab, Slot
from kvstore.errors import KVStoreError, ResourceExhausted
from kvstore.keys import BlockKey
from kvstore.policy.base import EvictionPolicy
from kvstore.stats.counters import Stats
from kvstore.store.books.below import Below, Movers, NoMovers
from kvstore.store.books.index import DRAM, Block, Index, NsEntry, State
from kvstore.store.books.placement import Space
from kvstore.store.books.retention import Retention
from kvstore.store.books.tenants import Quotas

# A block to reserve a slot for: its key, its parent's key, its size, and its 1-based depth when
# the caller knows it (None: derived from the parent, Index.add). (A plain tuple: an Allocate
# makes one per block.)
Wanted = tuple[BlockKey, bytes, int, int | None]


class DramSpace:
    def __init__(self, slab: Slab, policy: EvictionPolicy, index: Index, stats: Stats) -> None:
        self.slab = slab
        self.placement = Space(DRAM, policy, index)  # the blocks placed in DRAM (footprint: their size)
        self.index = index
        self.stats = stats
        self.movers: Movers = NoMovers()  # the tiers below DRAM, once the sidecar wires them
        self.below = Below()  # their levels, whose policies learn this space's hits
        # The retention hints (the soft pin): every victim of DRAM and of the tiers below is its pick.
        self.retention = Retention()
        self._touches: list[tuple[list[Block], bool]] = []

    @property
    def policy(self) -> EvictionPolicy:
        """DRAM's eviction policy (its placement's)."""
        return cast(EvictionPolicy, self.placement.policy)

    @property
    def quotas(self) -> Quotas | None:
        """DRAM's tenant quotas (kvstore.store.books.tenants), when configured (its placement's)."""
        return self.placement.quotas

    @quotas.setter
    def quotas(self, quotas: Quotas | None) -> None:
        self.placement.quotas = quotas

    # --- hits -----------------------------------------------------------------------------

    def touch(self, run: list[Block], all_in_dram: bool = False) -> None:
        """Record hits for the policies (this space's and the tiers'). Applied lazily (a read
        buffer, as Caffeine does): off the request's critical path, and always before the next
        eviction decision."""
        if run:
            touches = self._touches
            if touches and touches[-1][0] == run:
                return  # the same run again (a hot prefix): touching it twice in a row = once
            touches.append((run, all_in_dram))
            if len(touches) >= 256:
                self.drain_touches()

    def resume(self, b: Block, uses: int) -> None:
        """Another node remembered ``uses`` uses of ``b`` (the cluster's ghost, read when ``b``
        became new here): this space's policy and those of the tiers below that hold it resume
        them, as if their own ghosts had remembered them."""
        if b.tiers & DRAM:
            self.policy.resume(b, uses)
        self.below.resume(b, uses)

    def uses(self, b: Block | bytes) -> int:
        """The use count this node's policies have or remember of ``b`` (a Block, or a block key
        for the ghosts), the most any of its tiers keeps: what it leaves in the cluster's ghost
        when it lets ``b`` go (a block evicted from its SSD may be long gone from DRAM's ghost)."""
        return max(self.policy.uses(b), self.below.uses(b))

    def ghost_size(self) -> int:
        """The most evicted blocks' counts one of this node's tiers remembers: how long a count
        lasts in the node's own ghosts (kvstore.policy.ghost)."""
        return max(self.policy.ghost_size(), self.below.ghost_size())

    def drain_touches(self) -> None:
        touches, self._touches = self._touches, []
        access_many, touch_below = self.policy.access_many, self.below.touch
        for run, all_in_dram in touches:
            # Deepest first, so that an ancestor is always at least as recent as its descendants.
            access_many(run[::-1] if all_in_dram else [b for b in reversed(run) if b.tiers & DRAM])
            touch_below(run)

    # --- slots ------------------------------------------------------------------------------

    def take(self, needs: Mapping[int, int], tenant: str = "", nbytes: int = 0) -> dict[int, list[Slot]]:
        """Slots for ``needs`` (size class -> how many), evicting the policy's victims when free
        slots and free pages do not cover them; refused before anything is evicted when they
        cannot all be had (:class:`_Room`). The caller makes each slot's block its holder. With
        tenant quotas, ``nbytes`` of ``tenant``'s blocks are on their way in: it first evicts its
        own blocks past its quota, and evicts no block of a tenant within its quota."""
        slab = self.slab
        may_evict = None
        if self.quotas is not None:
            try:
                with self.movers.staging_batch():
                    self._within_quota(tenant, nbytes)
            except ResourceExhausted:
                self.quotas.refuse(tenant, sum(needs.values()))
                raise
            may_evict = self.quotas.evictable_for(tenant)
        if slab.fits(needs):
            return {cls: slab.take(cls, n) for cls, n in needs.items()}
        self.drain_touches()
        room = _Room(self, needs, may_evict)
        with self.movers.staging_batch():
            return room.take()

    def _within_quota(self, tenant: str, nbytes: int) -> None:
        """Evict ``tenant``'s own blocks until ``nbytes`` more fit its quota; refused first when
        its unpinned blocks cannot make that room."""
        quotas = self.quotas
        assert quotas is not None
        excess = quotas.excess(tenant, nbytes)
        if not excess:
            return
        self.drain_touches()

        def own(b: Block) -> bool:
            return not b.pinned and quotas.tenant(b) == tenant

        evictable = sum(b.size for b in self.policy_blocks() if own(b))
        if evictable < excess:
            raise ResourceExhausted(
                f"blocks: tenant {tenant or '-'!r} would pass its DRAM quota of {quotas.quota(tenant)} bytes "
                f"(tenants.dram_quota_bytes) by {excess} bytes, and only {evictable} bytes of its blocks may leave"
            )
        def theirs() -> Iterator[Block]:  # (lazy: scanned only when the policy offers no victim)
            yield from (b for b in self.policy_blocks() if own(b))

        while quotas.excess(tenant, nbytes):
            victim = self.victim(own, theirs())
            assert victim is not None, "the tenant's evictable bytes were counted above"
            self.evict(victim)

    def victim(self, ok: Callable[[Block], bool] | None, rest: Iterable[Block] = ()) -> Block | None:
        """DRAM's next victim that ``ok`` accepts, out of the policy now; the first of ``rest``
        by retention when the policy offers none (:meth:`Space.victim`, the one victim rule)."""
        return self.placement.victim(self.retention, ok, rest)

    def policy_blocks(self) -> list[Block]:
        """The blocks in DRAM (placed), in slab order."""
        slab = self.slab
        return [
            cast(Block, s.holder)
            for c in range(len(slab.classes))
            for p in slab.pages(c)
            for s in p.slots
            if _placed(s)
        ]

    def hottest_first(self) -> list[Block]:
        """The blocks in DRAM, hottest first: the policy's victims in the order an eviction takes
        them (the retention's soft pin too), reversed, then any it held out (being written). It
        empties the policy: for a stop's drain only (:mod:`kvstore.movers.drain`)."""
        self.drain_touches()
        order: list[Block] = []
        while (b := self.victim(None)) is not None:
            order.append(b)
        order.reverse()
        popped = set(order)
        return order + [b for b in self.policy_blocks() if b not in popped]

    def take_slot(self, holder: Block) -> Slot:
        """One slot for ``holder``'s bytes (see :meth:`take`); it holds the slot from now on. With
        tenant quotas its size counts against its tenant's from now on (``Quotas.reserve``), until
        it is placed (:meth:`place`) or its slot is given back (:meth:`release`, :meth:`free`)."""
        cls = self.slab.class_of(holder.size)
        tenant = self.quotas.tenant(holder) if self.quotas is not None else ""
        slot = self.take({cls: 1}, tenant, holder.size)[cls][0]
        slot.holder = holder
        if self.quotas is not None:
            self.quotas.reserve(holder)
        return slot

    def bind(self, b: Block, slot: Slot) -> None:
        """``slot`` is ``b``'s from now on: its bytes are written there (an allocation, a peer
        fetch's reservation) or are there (:meth:`place`). The one place a block's ``slot`` is
        set; :meth:`free` is the one place it is unset."""
        b.slot = slot
        slot.holder = b

    def reserve(self, ns: NsEntry, wanted: Sequence[Wanted], classes: Sequence[int] | None = None) -> list[Block]:
        """The one slot reservation (an Allocate's, a peer fetch's): each of ``wanted`` filed in
        ``ns`` (its live entry) as ALLOCATED, holding a slot its bytes are written into (placed by
        the commit, or when the fetch settles); in no tier until then. With ``classes`` (an
        Allocate: each block's size class, checked already) slots for all of them or none
        (:meth:`take`, refused before anything is evicted). Without (a fetch) the leading run that
        DRAM takes one slot at a time (:meth:`take_slot`): it stops at a key stored (written or
        fetched here meanwhile), or when DRAM cannot take one more (full of pinned blocks, or a
        size the slab has no class for)."""
        index = self.index
        taken: dict[int, Iterator[Slot]] = {}
        if classes is not None:
            need = Counter(classes)
            taken = {c: iter(got) for c, got in self.take(need, ns.tenant, sum(w[2] for w in wanted)).items()}
        out: list[Block] = []
        for j, (key, parent, size, depth) in enumerate(wanted):
            if classes is not None:
                slot = next(taken[classes[j]])
                b = index.add(ns, key, parent, size, State.ALLOCATED, depth)
            else:  # (a fetch)
                if index.get(ns, key) is not None:
                    break
                b = index.add(ns, key, parent, size, State.ALLOCATED, depth)
                try:
                    slot = self.take_slot(b)
                except KVStoreError:
                    index.drop(b)
                    break
            ns = b.ns
            self.bind(b, slot)  # written into now, placed at commit (or a fetch's settle)
            out.append(b)
        return out

    def view(self, b: Block) -> np.ndarray:
        """The bytes of ``b``'s slot (``b`` holds one)."""
        slot = b.slot
        assert slot is not None, "a block without a slot has no bytes in DRAM"
        return self.slab.view(slot, b.size)

    # --- placement --------------------------------------------------------------------------

    def place(self, b: Block, slot: Slot | None = None) -> None:
        """``b``'s bytes are in ``slot`` now (by default the slot it was allocated): it is in DRAM
        and the policy orders it (:meth:`Space.place`); its slot's reservation against its
        tenant's quota ends."""
        if slot is not None:
            self.bind(b, slot)
        if self.quotas is not None:
            self.quotas.settle(b)
        self.placement.place(b)

    def release(self, slot: Slot) -> None:
        """Give back a slot that never held a placed block (a promotion that found no good copy)."""
        if self.quotas is not None and slot.holder is not None:
            self.quotas.settle(cast(Block, slot.holder))
        self.slab.free(slot)

    def free(self, b: Block) -> None:
        """``b`` gives back its slot and leaves DRAM (:meth:`Space.unplace`); a block no tier
        holds leaves the index, one never placed (an allocation let go) too."""
        if b.slot is not None:
            self.slab.free(b.slot)
            b.slot = None
        if self.quotas is not None:
            self.quotas.settle(b)
        if not self.placement.unplace(b):
            self.index.moved(b)
            self.index.drop_if_gone(b)

    def remove(self, b: Block) -> None:
        """``b`` leaves DRAM for another reason than eviction (a delete, a corrupt copy): out of
        the policy too."""
        self.free(b)

    def evict(self, b: Block) -> None:
        """Drop the DRAM copy of a block the policy chose (out of it already); the movers keep its
        bytes below DRAM first when a lower tier takes them."""
        self.stats.tier("dram", "evictions")
        if self.quotas is not None:
            self.quotas.evicted(b)
        self.movers.on_dram_evict(b)
        self.free(b)

    # --- reporting ---------------------------------------------------------------------------

    def occupancy(self) -> dict[str, object]:
        # demotions_in_flight: evicted blocks staged for a tier below, not written there yet
        return {**self.slab.occupancy(), "blocks": len(self.policy), "demotions_in_flight": len(self.movers.staged)}


Tenure = tuple[Slot, int]  # a block's slot, and how many times that slot had been freed (:func:`tenure`)


def tenure(b: Block) -> Tenure:
    """``b``'s slot and its count of frees, read before an await that reads the slot's bytes
    (hashing them); :func:`held` says afterwards whether they were ``b``'s throughout."""
    slot = b.slot
    assert slot is not None, "a block without a slot has no bytes in DRAM"
    return slot, slot.frees


def held(b: Block, t: Tenure) -> bool:
    """Whether ``b`` has held the slot of ``t`` without a break since ``t`` was read, so that
    what was read from it meanwhile was ``b``'s bytes. Not when it left DRAM meanwhile (evicted
    or deleted once nothing pinned it: an expired lease, an allocation reclaimed): it may be
    back in another slot, or in the same one after another block's bytes were there (slot
    objects are reused, so ``b.slot is slot`` alone does not say)."""
    slot, frees = t
    return b.slot is slot and slot.frees == frees


def _placed(slot: Slot) -> bool:
    """Whether the slot holds a block placed in DRAM."""
    b = slot.holder
    return b is not None and b.slot is slot and bool(b.tiers & DRAM)


def _can_evict(slot: Slot) -> bool:
    """Whether the slot holds a block in DRAM that may leave it now."""
    b = slot.holder
    return b is not None and b.slot is slot and not b.pinned


def _slot_of(b: Block) -> Slot:
    slot = b.slot
    assert slot is not None, "the policy holds only blocks in DRAM"
    return slot


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

    def __init__(
        self, space: DramSpace, needs: Mapping[int, int], may_evict: Callable[[Block], bool] | None = None
    ) -> None:
        self.space = space
        self.may_evict = may_evict  # whose blocks this request may evict (tenant quotas); None: anyone's
        self.slab = space.slab
        self.needs = dict(needs)
        self.left = dict(needs)  # class -> slots it has still to take
        self.owed: dict[int, int] = {}  # class -> pages it must get before taking slots
        self.gives: dict[int, int] = {}  # class of the request -> pages it may still give to owed ones
        self._whole: dict[Page, bool] = {}  # valid while no class takes slots (cleared before each does)
        self._plan()

    def _can(self, slot: Slot) -> bool:
        """Whether this request may evict the block in ``slot`` now."""
        if not _can_evict(slot):
            return False
        return self.may_evict is None or self.may_evict(cast(Block, slot.holder))

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
                if self._can(slot):
                    n += 1
                    if n == cap:
                        return n
        return n

    def _is_whole(self, page: Page) -> bool:
        got = self._whole.get(page)
        if got is None:
            got = self._whole[page] = page.used > 0 and sum(map(self._can, page.slots)) == page.used
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
        slab, space, left, whole = self.slab, self.space, self.left, self._is_whole
        own = self._own(cls)

        may_evict = self.may_evict

        def victim_ok(b: Block) -> bool:
            if b.pinned or (may_evict is not None and not may_evict(b)):
                return False
            slot = _slot_of(b)
            return slot.cls == cls or (not left.get(slot.cls) and whole(slab.page_of(slot)))

        pick = space.victim

        def take() -> Slot:
            while (slot := slab.try_alloc(cls)) is None:
                victim = pick(victim_ok, own)
                if victim is None:
                    raise self._full()
                if _slot_of(victim).cls == cls:
                    space.evict(victim)
                else:
                    self._reclaim(slab.page_of(_slot_of(victim)), victim)
            return slot

        return take

    def _own(self, cls: int) -> Iterator[Block]:
        """The evictable blocks of class ``cls``, in slab order, each checked when reached."""
        for page in list(self.slab.pages(cls)):
            for slot in page.slots:
                if self._can(slot):
                    yield cast(Block, slot.holder)

    def _move(self, cls: int, donor: Callable[[int], bool]) -> None:
        """Reclaim a whole page of a ``donor`` class (the page of the policy's next victim among
        them; any whole one when the policy has none) and cut it for ``cls``."""
        slab = self.slab

        may_evict = self.may_evict

        def victim_ok(b: Block) -> bool:
            return (
                not b.pinned
                and (may_evict is None or may_evict(b))
                and donor(_slot_of(b).cls)
                and self._is_whole(slab.page_of(_slot_of(b)))
            )

        victim = self.space.victim(victim_ok)
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
        space = self.space
        cls = page.cls
        if victim is not None:
            space.evict(victim)
        for slot in page.slots:
            if self._can(slot):
                b = cast(Block, slot.holder)
                space.policy.remove(b)
                space.evict(b)
        if cls in self.gives:
            self.gives[cls] -= 1
