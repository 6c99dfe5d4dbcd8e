"""Every invariant of a block store, checked at once: :func:`audit` returns each broken one as a
sentence (an empty list: healthy).

Pure reads of the store's own structures, no I/O, no await: call it on the store's event-loop
thread (between two steps of the loop nothing moves). It costs O(blocks + slots + leases), so a test
may call it after every request. What it checks:

* **Namespaces** -- each registered entry is filed under its own root and holds a block (an empty
  namespace is not registered); every block is filed under its key in its own entry; ``visible``
  is exactly the COMMITTED blocks of ``blocks``, and ``visible_sizes`` counts their sizes.
* **Blocks** -- a COMMITTED block lies in some tier (lookups trust ``visible``); the DRAM bit means
  a COMMITTED block that holds a slot and is in the DRAM policy (:meth:`DramSpace.place`); a slot
  without the DRAM bit means an ALLOCATED block (being written); an ALLOCATED block holds a slot,
  lies in no tier and is not leased.
* **Index <-> slab** -- a block's slot names it as its holder, is handed out (not free), is the
  slot object its page is cut into now, of the block's size class; no slot is held by two blocks;
  every slot in use has a holder that holds it (or, while a request is in flight, a promotion that
  reads into it); the slab's own books add up: each page is in the free-page pool or cut for one
  class, its free list and use count agree, a class's use count is the sum of its pages', a page
  with a free slot is open, and no page is cut but empty (the last free takes a page back).
* **Index <-> policy** -- the DRAM policy orders exactly the blocks with the DRAM bit.
* **Leases** -- a live lease names blocks the index still holds, COMMITTED; a block's ``leases``
  equals the number of live leases naming it (a promotion in flight pins its run without a lease,
  as a peer fetch pins the local run it extends, so only then may it be more).
* **Allocations** -- an open allocation's blocks are ALLOCATED, filed in its namespace, each under
  the slot id it was handed; no block belongs to two; no open allocation is recorded as closed;
  every ALLOCATED block belongs to an open allocation. A peer fetch's reservation
  (:class:`kvstore.store.exchange.Reservation`) is an open allocation too: its blocks are
  ALLOCATED, filed in its namespace, each holding a slot; no block belongs to two.
* **Tenant quotas** -- each tier's quotas count, per tenant, exactly the bytes of its blocks there
  (DRAM: the sizes of the blocks with the DRAM bit; a level: what the level counts for them); with
  no request in flight, no DRAM bytes are reserved for blocks on their way in (``Quotas.reserve``).
* **Index <-> tiers** (the levels below DRAM, :class:`~kvstore.store.books.below.Lower`, read through
  the DRAM space's ``below``) -- a level counts (``held``) exactly the blocks with its bit, none the
  index has dropped; ``used`` and ``queued_bytes`` add up; a bounded level's policy orders its
  blocks; a block lies only in tiers the store has; a demotion in flight (the movers' ``staged``)
  is placed in a level.

``quiescent=True`` asserts that no request and no mover is in flight (every client call answered,
``Movers.flush`` done): then no promotion may hold a slot or pin a run, no peer fetch holds a
reservation, nothing is staged, no block is ``moving``, and a bounded level is within
its capacity and its policy orders every block it holds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, cast

from kvstore.keys import KEY_BYTES, NamespaceRoot
from kvstore.store.books.below import NoMovers
from kvstore.store.books.index import DRAM, Block, NsEntry, State
from kvstore.store.remote import NoRemote
from kvstore.tier_table import all_bits

if TYPE_CHECKING:
    from kvstore.dram.slab import Page, Slot
    from kvstore.store.block_store import BlockStore
    from kvstore.store.books.tenants import Quotas

MAX_FINDINGS = 200  # past this, one sentence says how many more


def _name(b: Block) -> str:
    return f"block {b.key.hex()[:16]} of namespace {b.ns.label!r}"


def _indexed(b: Block, namespaces: Mapping[NamespaceRoot, NsEntry]) -> bool:
    """Whether ``b`` is the index's record under its key (not dropped, not replaced)."""
    return namespaces.get(b.ns.root) is b.ns and b.ns.blocks.get(b.key) is b


def _holder(slot: Slot) -> Block | None:
    """The block a slot names (the slab knows it only as a :class:`~kvstore.dram.slab.Holder`)."""
    return cast("Block | None", slot.holder)


def _slot_name(slot: Slot) -> str:
    return f"slot {slot.slot_id} (offset {slot.offset}, page {slot.page})"


class _Findings:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.more = 0

    def __call__(self, line: str) -> None:
        if len(self.lines) < MAX_FINDINGS:
            self.lines.append(line)
        else:
            self.more += 1

    def result(self) -> list[str]:
        if self.more:
            return [*self.lines, f"... and {self.more} more broken invariants"]
        return self.lines


def audit(store: BlockStore, *, quiescent: bool = False) -> list[str]:
    """Every broken invariant of ``store`` as a sentence; [] when it is healthy. See the module
    docstring for what is checked, and what ``quiescent`` adds."""
    bad = _Findings()
    blocks = _namespaces(store, bad)
    promoting = _promotions(store)
    _blocks(store, blocks, bad)
    _slab(store, blocks, promoting, quiescent, bad)
    _leases(store, blocks, quiescent, bad)
    _allocations(store, blocks, quiescent, bad)
    _tiers(store, blocks, quiescent, bad)
    _quotas(store, blocks, quiescent, bad)
    return bad.result()


# --- namespaces -----------------------------------------------------------------------------------


def _namespaces(store: BlockStore, bad: _Findings) -> list[Block]:
    """Check the namespace entries; every block the index holds."""
    out: list[Block] = []
    for root, ns in store.index.namespaces.items():
        if ns.root != root:
            bad(
                f"namespace {ns.label!r} is registered under root {bytes(root).hex()[:16]}, its root is "
                f"{bytes(ns.root).hex()[:16]}"
            )
        if not ns.blocks:
            bad(f"namespace {ns.label!r} is registered but holds no block (the last block to go takes its entry)")
        for key, b in ns.blocks.items():
            out.append(b)
            if b.key != key:
                bad(f"{_name(b)} is filed under key {key.hex()[:16]}")
            if b.ns is not ns:
                bad(f"{_name(b)} is filed in namespace {ns.label!r} but names another entry as its namespace")
            shown = ns.visible.get(key)
            if b.state is State.COMMITTED and shown is not b:
                bad(f"{_name(b)} is COMMITTED but not visible to lookups")
            elif b.state is State.ALLOCATED and shown is not None:
                bad(f"{_name(b)} is ALLOCATED but a lookup sees a block under its key")
        for key, b in ns.visible.items():
            if ns.blocks.get(key) is not b:
                bad(f"{_name(b)} is visible in namespace {ns.label!r} but not its block under key {key.hex()[:16]}")
        sizes: dict[int, int] = {}
        for b in ns.visible.values():
            sizes[b.size] = sizes.get(b.size, 0) + 1
        if sizes != ns.visible_sizes:
            bad(
                f"namespace {ns.label!r}: visible_sizes is {dict(sorted(ns.visible_sizes.items()))}, its visible "
                f"blocks have sizes {dict(sorted(sizes.items()))}"
            )
    return out


# --- blocks ---------------------------------------------------------------------------------------


def _blocks(store: BlockStore, blocks: list[Block], bad: _Findings) -> None:
    policy = store.space.policy
    in_dram = 0
    for b in blocks:
        if len(b.key) != KEY_BYTES:
            bad(f"{_name(b)} has a key of {len(b.key)} bytes")
        if b.parent and len(b.parent) != KEY_BYTES:
            bad(f"{_name(b)} has a parent key of {len(b.parent)} bytes")
        if b.size <= 0 or b.depth < 1 or b.leases < 0 or b.moving < 0:
            bad(f"{_name(b)} has size {b.size}, depth {b.depth}, leases {b.leases}, moving {b.moving}")
        if b.tiers & ~all_bits():
            bad(f"{_name(b)} has placement bits {b.tiers:#x} outside the four tiers")
        if b.state is State.COMMITTED and not b.tiers:
            bad(f"{_name(b)} is COMMITTED but lies in no tier (a lookup would serve a block nobody holds)")
        if b.tiers & DRAM:
            in_dram += 1
            if b.state is not State.COMMITTED:
                bad(f"{_name(b)} has the DRAM bit but is {b.state.name}")
            if b.slot is None:
                bad(f"{_name(b)} has the DRAM bit but holds no slot")
            if b not in policy:
                bad(f"{_name(b)} is in DRAM but not in the DRAM policy (it can never be evicted)")
        else:
            if b in policy:
                bad(f"{_name(b)} is in the DRAM policy but not in DRAM")
            if b.slot is not None and b.state is not State.ALLOCATED:
                bad(f"{_name(b)} holds {_slot_name(b.slot)} without the DRAM bit but is {b.state.name}")
        if b.state is State.ALLOCATED:
            if b.slot is None:
                bad(f"{_name(b)} is ALLOCATED but holds no slot to be written into")
            if b.tiers:
                bad(f"{_name(b)} is ALLOCATED but placed in tiers {b.tiers:#x}")
            if b.leases:
                bad(f"{_name(b)} is ALLOCATED but leased {b.leases} time(s)")
    if len(policy) != in_dram:
        bad(f"the DRAM policy orders {len(policy)} blocks, the index has {in_dram} in DRAM")


# --- slab -----------------------------------------------------------------------------------------


def _promotions(store: BlockStore) -> Collection[Block]:
    """Blocks whose promotion into DRAM is in flight (they hold a slot their ``slot`` does not name yet)."""
    return store.space.movers.promoting


def _slab(
    store: BlockStore, blocks: list[Block], promoting: Collection[Block], quiescent: bool, bad: _Findings
) -> None:
    slab = store.slab
    free_ids: set[int] = set()  # id() of every free slot of a cut page
    in_use = 0
    reading = 0  # slots promotions in flight read into
    placed: list[Page] = []
    for cls, sc in enumerate(slab.classes):
        used = 0
        for page in sc.pages:
            placed.append(page)
            used += page.used
            where = f"page {page.index} (class {sc.size} B)"
            if page.cls != cls:
                bad(f"{where} is listed for class {cls} but cut for class {page.cls}")
            if len(page.slots) != sc.per_page:
                bad(f"{where} is cut into {len(page.slots)} slots, its class has {sc.per_page} to a page")
            cut = {id(s) for s in page.slots}
            free = {id(s) for s in page.free}
            if len(free) != len(page.free) or not free <= cut:
                bad(f"{where}: its free list repeats a slot or lists one it is not cut into")
            if page.used != len(page.slots) - len(page.free):
                bad(f"{where} counts {page.used} slots in use; {len(page.slots)} cut, {len(page.free)} free")
            if page.used <= 0:
                bad(f"{where} is cut but has no slot in use (stranded: only a freed last slot returns a page)")
            if bool(page.free) != (page in sc.open):
                bad(f"{where} has {len(page.free)} free slots but is {'' if page in sc.open else 'not '}open")
            n, r = _slots(store, cls, page, free, promoting, quiescent, bad)
            in_use, reading = in_use + n, reading + r
            free_ids |= free
        if used != sc.used:
            bad(f"class {sc.size} B counts {sc.used} slots in use, its pages {used}")
        if set(sc.open) - set(sc.pages):
            bad(f"class {sc.size} B lists open pages it is not cut into")
    pool = slab.pool_pages()
    for page in pool:
        if page.cls != -1 or page.used or page.free:
            bad(f"page {page.index} is in the free-page pool but cut for class {page.cls} with {page.used} in use")
    indices = sorted(p.index for p in [*placed, *pool])
    if indices != list(range(slab.num_pages)):
        bad(f"the slab's {slab.num_pages} pages are not each in the pool or one class: {indices}")
    _holders(store, blocks, free_ids, in_use, reading, bad)


def _slots(
    store: BlockStore,
    cls: int,
    page: Page,
    free: set[int],
    promoting: Collection[Block],
    quiescent: bool,
    bad: _Findings,
) -> tuple[int, int]:
    """Check the slots ``page`` (listed for class ``cls``) is cut into (``free``: the id() of its
    free ones); how many are in use, and how many of those a promotion in flight reads into."""
    slab, namespaces = store.slab, store.index.namespaces
    sc = slab.classes[cls]
    where = f"page {page.index} (class {sc.size} B)"
    in_use = reading = 0
    base = page.index * slab.page_bytes
    for i, s in enumerate(page.slots):
        if (s.page, s.cls, s.capacity, s.offset) != (page.index, cls, sc.size, base + i * sc.size):
            bad(f"{_slot_name(s)} does not lie where {where} cuts its slot {i}")
        if id(s) in free:
            if (held := _holder(s)) is not None:
                bad(f"free {_slot_name(s)} still names {_name(held)} as its holder")
            continue
        in_use += 1
        h = _holder(s)
        if h is None:
            bad(f"{_slot_name(s)} is in use but has no holder (leaked)")
        elif h.slot is s:
            if not _indexed(h, namespaces):
                bad(f"{_slot_name(s)} is held by {_name(h)}, which the index no longer holds (leaked)")
        elif h.slot is None and h in promoting and not quiescent:
            reading += 1  # a promotion reads into it; placed (or given back) when the read lands
        else:
            bad(
                f"{_slot_name(s)} is in use, its holder {_name(h)} holds "
                f"{'no slot' if h.slot is None else _slot_name(h.slot)}"
            )
    return in_use, reading


def _holders(
    store: BlockStore, blocks: list[Block], free_ids: set[int], in_use: int, reading: int, bad: _Findings
) -> None:
    """Each block's slot: its own, handed out, still cut, of its size class; ``in_use`` slots (of
    which promotions in flight read into ``reading``) are the blocks' slots."""
    slab = store.slab
    holders: dict[int, Block] = {}  # id(slot) -> the block holding it
    with_slot = 0
    for b in blocks:
        slot = b.slot
        if slot is None:
            continue
        with_slot += 1
        other = holders.setdefault(id(slot), b)
        if other is not b:
            bad(f"{_slot_name(slot)} is held twice: by {_name(other)} and {_name(b)}")
        if slot.holder is not b:
            bad(
                f"{_name(b)} holds {_slot_name(slot)}, which names "
                f"{'no holder (freed)' if slot.holder is None else _name(cast(Block, slot.holder))}"
            )
        if id(slot) in free_ids:
            bad(f"{_name(b)} holds {_slot_name(slot)}, which is free")
        page = slab.page_of(slot)
        i = (slot.offset - page.index * slab.page_bytes) // max(1, slot.capacity)
        if not (0 <= i < len(page.slots) and page.slots[i] is slot):
            bad(f"{_name(b)} holds {_slot_name(slot)}, which page {page.index} is no longer cut into (re-cut)")
        if slot.capacity < b.size or (b.size <= slab.max_slot_bytes and slot.cls != slab.class_of(b.size)):
            bad(f"{_name(b)} of {b.size} bytes holds {_slot_name(slot)} of class {slot.capacity} B")
    if in_use != with_slot + reading:
        bad(f"the slab has {in_use} slots in use; blocks hold {with_slot}, promotions in flight read into {reading}")


# --- leases ---------------------------------------------------------------------------------------


def _leases(store: BlockStore, blocks: list[Block], quiescent: bool, bad: _Findings) -> None:
    namespaces = store.index.namespaces
    named: dict[Block, int] = {}
    for lease_id, lease in store.index.leases.items():
        if lease.id != lease_id:
            bad(f"lease {lease.id!r} is filed under id {lease_id!r}")
        for b in lease.blocks:
            named[b] = named.get(b, 0) + 1
    # A promotion pins the run it brings up (leases + 1, no Lease) until it returns, and a peer fetch
    # the local run it extends (ClusterReads.complete): only then more.
    pinning = not isinstance(store.space.movers, NoMovers) or not isinstance(store.remote, NoRemote)
    pins_allowed = not quiescent and pinning
    for b, n in named.items():
        if not _indexed(b, namespaces):
            bad(f"{_name(b)} is leased {n} time(s) but the index no longer holds it (dropped while leased)")
        if b.state is not State.COMMITTED:
            bad(f"{_name(b)} is leased but {b.state.name}")
    for b in [*blocks, *(b for b in named if not _indexed(b, namespaces))]:
        n = named.get(b, 0)
        if b.leases != n and not (pins_allowed and b.leases > n):
            bad(f"{_name(b)} counts {b.leases} lease(s), {n} live lease(s) name it")


# --- allocations ----------------------------------------------------------------------------------


def _allocations(store: BlockStore, blocks: list[Block], quiescent: bool, bad: _Findings) -> None:
    namespaces = store.index.namespaces
    closed = store.closed_allocations
    owner: dict[Block, str] = {}
    for alloc_id, alloc in store.index.allocations.items():
        if alloc.id != alloc_id:
            bad(f"allocation {alloc.id!r} is filed under id {alloc_id!r}")
        if alloc_id in closed:
            bad(f"allocation {alloc_id!r} is open but recorded as {closed[alloc_id]}")
        for slot_id, b in alloc.blocks.items():
            first = owner.setdefault(b, alloc_id)
            if first != alloc_id:
                bad(f"{_name(b)} belongs to allocations {first!r} and {alloc_id!r}")
            if b.state is not State.ALLOCATED:
                bad(f"{_name(b)} of open allocation {alloc_id!r} is {b.state.name}")
            if b.slot is None or b.slot.slot_id != slot_id:
                bad(
                    f"{_name(b)} is filed under slot {slot_id} in allocation {alloc_id!r} but holds "
                    f"{'no slot' if b.slot is None else _slot_name(b.slot)}"
                )
            if b.ns is not alloc.ns or not _indexed(b, namespaces):
                bad(f"{_name(b)} of open allocation {alloc_id!r} is not the index's block under its key")
    _reservations(store, owner, quiescent, bad)
    for b in blocks:
        if b.state is not State.ALLOCATED or b in owner:
            continue
        bad(f"{_name(b)} is ALLOCATED but no open allocation owns it (its slot never comes back)")


def _reservations(store: BlockStore, owner: dict[Block, str], quiescent: bool, bad: _Findings) -> None:
    """A peer fetch's open reservation: an allocation of the cluster's (``owner`` gains its blocks)."""
    namespaces = store.index.namespaces
    for r in store.exchange.reservations:
        name = f"peer fetch reservation {id(r):#x}"
        if quiescent:
            bad(f"{name} is open with no request in flight")
        for b in r.blocks:
            first = owner.setdefault(b, name)
            if first != name:
                bad(f"{_name(b)} belongs to {first!r} and {name!r}")
            if b.state is not State.ALLOCATED:
                bad(f"{_name(b)} of {name} is {b.state.name}")
            if b.slot is None:
                bad(f"{_name(b)} of {name} holds no slot")
            if not _indexed(b, namespaces):
                bad(f"{_name(b)} of {name} is not the index's block under its key")


# --- tiers ----------------------------------------------------------------------------------------


def _tiers(store: BlockStore, blocks: list[Block], quiescent: bool, bad: _Findings) -> None:
    levels = store.space.below.levels
    namespaces = store.index.namespaces
    have = DRAM
    for lv in levels:
        have |= lv.bit
    holding: dict[int, list[Block]] = {lv.bit: [] for lv in levels}
    for b in blocks:
        if b.tiers & ~have:
            bad(f"{_name(b)} is placed in tiers {b.tiers & ~have:#x} this store does not have")
        for bit, held in holding.items():
            if b.tiers & bit:
                held.append(b)
    for lv in levels:
        held = holding[lv.bit]
        for b in held:
            if b not in lv.held:
                bad(f"{_name(b)} has the {lv.name} bit but the {lv.name} level does not count it")
        for b in lv.held:
            if not b.tiers & lv.bit:
                bad(f"the {lv.name} level counts {_name(b)}, which lacks its bit")
            elif not _indexed(b, namespaces):
                bad(f"the {lv.name} level counts {_name(b)}, which the index no longer holds")
        total = sum(lv.held.values())
        if lv.used != total:
            bad(f"the {lv.name} level counts {lv.used} bytes used, its blocks take {total}")
        queued_blocks, queued_bytes = store.space.movers.queued[lv]
        if not queued_blocks <= lv.held.keys():
            bad(f"the {lv.name} level queues blocks it does not count")
        queued = sum(lv.held.get(b, 0) for b in queued_blocks)
        if queued_bytes != queued:
            bad(f"the {lv.name} level counts {queued_bytes} bytes queued, its queued blocks take {queued}")
        if lv.policy is not None:
            if len(lv.policy) > len(lv.held):
                bad(f"the {lv.name} policy orders {len(lv.policy)} blocks, the level holds {len(lv.held)}")
            if quiescent:
                missing = [b for b in lv.held if b not in lv.policy]
                if missing or len(lv.policy) != len(lv.held):
                    bad(
                        f"the {lv.name} policy orders {len(lv.policy)} blocks, the level holds {len(lv.held)} "
                        f"({len(missing)} not in the policy)"
                    )
        if quiescent and lv.capacity is not None and lv.used > lv.capacity:
            bad(f"the {lv.name} level holds {lv.used} bytes, over its capacity of {lv.capacity}")
    staged = store.space.movers.staged
    below = have & ~DRAM
    for b in staged:
        if not b.tiers & below:
            bad(f"{_name(b)} is staged for demotion but placed in no level")
    if quiescent and staged:
        bad(f"{len(staged)} demotion(s) staged with no mover in flight")
    if quiescent:
        if _promotions(store):
            bad(f"{len(_promotions(store))} promotion(s) listed with no mover in flight")
        for b in blocks:
            if b.moving:
                bad(f"{_name(b)} is pinned by {b.moving} write-through(s) with no mover in flight")


def _quotas(store: BlockStore, blocks: list[Block], quiescent: bool, bad: _Findings) -> None:
    counted: list[tuple[str, Quotas, Mapping[Block, int]]] = []
    if store.space.quotas is not None:
        counted.append(("DRAM", store.space.quotas, {b: b.size for b in blocks if b.tiers & DRAM}))
        if quiescent and store.space.quotas.coming:  # (reserved by a promotion or peer fetch in flight)
            bad(
                f"the DRAM quotas count {dict(store.space.quotas.coming)} bytes per tenant on their way in, "
                "with nothing in flight"
            )
    for lv in store.space.below.levels:
        if lv.quotas is not None:
            counted.append((lv.name, lv.quotas, lv.held))
    for name, quotas, sizes in counted:
        held: Counter[str] = Counter()
        for b, n in sizes.items():
            held[quotas.tenant(b)] += n
        if +held != +quotas.used:
            bad(f"the {name} quotas count {dict(+quotas.used)} bytes per tenant, its blocks take {dict(+held)}")
