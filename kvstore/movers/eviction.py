"""Eviction: room in a level below DRAM before blocks are written there.

Before a level takes blocks (a demotion batch, a write-through, a victim of the level above), every
tenant past its quota there loses its own blocks first, then a bounded level (SSD) evicts through
its own policy until what it holds fits its capacity. A victim that no other tier holds is read
back, checked, and written to the next level down that is up and takes it (its own room made the
same way), or dropped when there is none. What the room cannot be made for is refused: the caller
leaves it out of the level.

Why apart from the level's books: room is made across the chain (a victim goes on down), it waits
for the tier (reads, writes, deletes), and it follows the store's rules for victims (the retention's
soft pin, DRAM's pending hits); the level only counts what it holds.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Callable, Container, Iterable, Iterator, Sequence
from typing import Protocol

import numpy as np

from kvstore.errors import Unavailable
from kvstore.movers.level import Level
from kvstore.movers.removal import Removal
from kvstore.stats.counters import Stats
from kvstore.store.books.dram_space import DramSpace
from kvstore.store.books.index import DRAM, Block
from kvstore.store.books.placement import evictions, next_home
from kvstore.store.books.tenants import Quotas
from kvstore.tiers.verify import verified_get


class Backlog(Protocol):
    """The demotions a level has queued (:class:`~kvstore.movers.demotion.Demotion`): placed there,
    their batch not writing yet, so they take no room in the tier yet."""

    def queued_bytes(self, lv: Level) -> int:
        """Bytes of the blocks queued for ``lv``."""
        ...

    def queued_of(self, lv: Level, tenant: str) -> int:
        """Bytes of ``tenant``'s blocks queued for ``lv`` (with quotas; 0 without)."""
        ...


class Eviction:
    """Room in the levels of one chain (fastest first)."""

    def __init__(
        self, space: DramSpace, levels: Sequence[Level], staged: Container[Block], removal: Removal, backlog: Backlog
    ) -> None:
        self.space = space
        self.stats: Stats = space.stats
        self.levels = levels
        self.staged = staged  # demotions in flight: never a victim (their bytes are not written yet)
        self.removal = removal  # the deletes whose room is still releasing
        self.backlog = backlog  # the demotions queued: they count in their own batch's pass
        self.kept: set[Block] = set()  # never a victim either: blocks a stop's drain wrote (kvstore.movers.drain)
        # Per level, bytes per tenant that passed the quota and are being written there, not placed
        # yet (a write-through, a demotion from the level above): counted by the next quota pass.
        self._reserved: dict[Level, Counter[str]] = {lv: Counter() for lv in levels}
        # One eviction pass at a time per level: a batch's put starts only once the deletes that
        # made room for it are done (a second writer saw the room counted free while the file was
        # still there, and its put failed "ssd tier full" at the capacity's edge).
        self._passes = {lv: asyncio.Lock() for lv in levels}

    def down_from(self, lv: Level, b: Block) -> Level | None:
        """Where ``b``'s bytes go when it leaves ``lv`` (:func:`next_home`, the one pass-down rule):
        the next level below ``lv`` that is up, unless a tier below DRAM other than ``lv`` holds
        it; None: nowhere (dropped, unless such a tier holds it)."""
        return next_home(self.levels[self.levels.index(lv) + 1 :], b, lv.bit, DRAM)

    async def trim(self, lv: Level) -> None:
        """Every tenant within its quota in ``lv`` (quotas lowered since its blocks were written)."""
        await self.make_room(lv)

    @contextlib.asynccontextmanager
    async def room(self, lv: Level, blocks: Sequence[Block], fresh: bool = False) -> AsyncIterator[list[Block]]:
        """Room in ``lv`` for ``blocks``, about to be written there (:meth:`make_room`): the blocks
        that fit, their bytes reserved against their tenants' quotas until the body (which writes
        and places them) ends."""
        kept = await self.make_room(lv, blocks, fresh)
        with self._reserving(lv, kept):
            yield kept

    @contextlib.contextmanager
    def _reserving(self, lv: Level, blocks: Sequence[Block]) -> Iterator[None]:
        """``blocks`` are being written to ``lv`` inside (not placed yet): their bytes count
        against their tenants' quotas there until the body ends."""
        quotas, reserved = lv.quotas, self._reserved[lv]
        held = [(quotas.tenant(b), lv.footprint(b.size, b.ns.label)) for b in blocks] if quotas is not None else []
        for t, n in held:
            reserved[t] += n
        try:
            yield
        finally:
            for t, n in held:
                reserved[t] -= n
                if reserved[t] <= 0:
                    del reserved[t]

    def _pending(self, lv: Level, tenant: str) -> int:
        """Bytes of ``tenant`` a quota pass in ``lv`` counts besides what is placed: those reserved
        for writes in flight there, less those of its queued blocks (they count in their own
        batch's pass)."""
        return self._reserved[lv][tenant] - self.backlog.queued_of(lv, tenant)

    async def make_room(self, lv: Level, incoming: Sequence[Block] = (), fresh: bool = False) -> list[Block]:
        """Room in ``lv`` for ``incoming`` (a demotion batch, placed already; or blocks about to be
        written there, ``fresh`` ones just committed): every tenant past its quota in ``lv`` loses
        its own blocks first (:meth:`_within_quotas`), then a bounded level evicts until it fits,
        never a block of a tenant within its quota (each victim demoted to the next tier down, or
        dropped). Returns the blocks of ``incoming`` that fit, once the victims' copies are gone;
        the caller leaves the others out of ``lv``."""
        if lv.policy is None:
            return list(incoming)
        async with self._passes[lv]:
            keep = list(incoming)
            out: dict[Block, int] = {}  # refused blocks ``lv`` counts still (placed demotions)
            if lv.quotas is not None:
                await self._within_quotas(lv, lv.quotas, keep, out, fresh)
            if lv.capacity is not None:
                await self._within_capacity(lv, lv.capacity, keep, out)
            return keep

    @staticmethod
    def _refuse(lv: Level, b: Block, keep: list[Block], out: dict[Block, int]) -> None:
        keep.remove(b)
        if lv.holds(b):
            out[b] = lv.size_of(b)

    def _evictable(self, lv: Level, ok: Callable[[Block], bool]) -> Block | None:
        """The policy's next victim in ``lv`` that ``ok`` accepts, and that is not pinned or being
        written there (out of the policy now); any such block when the policy offers none (a
        prefix-aware one keeps parents for their children)."""
        may, rest = self._may(lv, ok)
        # The one victim rule, the store's soft pin with it: a retained block goes last here too.
        return lv.placement.victim(self.space.retention, may, rest())

    def _may(
        self, lv: Level, ok: Callable[[Block], bool]
    ) -> tuple[Callable[[Block], bool], Callable[[], Iterable[Block]]]:
        """What may leave ``lv``: the blocks ``ok`` accepts that are not pinned, being written
        there or kept by a drain; and the caller's evictable blocks there (lazy: read only when
        the policy offers no victim), as :meth:`Space.victim` takes them."""
        policy = lv.policy
        assert policy is not None
        staged, kept = self.staged, self.kept

        def may(x: Block) -> bool:
            return not x.pinned and x not in staged and x not in kept and ok(x)

        def rest() -> Iterator[Block]:
            yield from (x for x in lv.held if x in policy and may(x))

        return may, rest

    async def _within_quotas(
        self, lv: Level, quotas: Quotas, keep: list[Block], out: dict[Block, int], fresh: bool
    ) -> None:
        """Each tenant of ``keep``, and each past its quota in ``lv``, within its quota there
        (:meth:`_tenant_within`)."""
        for tenant in sorted({quotas.tenant(b) for b in keep} | set(quotas.over())):
            if quotas.quota(tenant):
                await self._tenant_within(lv, quotas, tenant, keep, out, fresh)

    async def _tenant_within(
        self, lv: Level, quotas: Quotas, tenant: str, keep: list[Block], out: dict[Block, int], fresh: bool
    ) -> None:
        """``tenant`` within its quota in ``lv``. It counts what ``lv`` holds of it, what is being
        written there and ``keep``; blocks queued for later batches count in theirs. What goes, in
        this order: its blocks in ``lv`` that are not in DRAM (colder than anything DRAM holds or
        has just let go), in the policy's order; then its blocks of ``keep``, oldest first, and its
        copies of blocks DRAM holds -- the copies first when ``keep`` is ``fresh`` (just
        committed, the newest there are)."""
        tenant_of = quotas.tenant
        incoming = set(keep)

        def own(x: Block) -> bool:
            return x not in incoming and tenant_of(x) == tenant

        def cold(x: Block) -> bool:
            return own(x) and not x.tiers & DRAM

        while True:
            mine = [b for b in keep if tenant_of(b) == tenant]
            new = sum(lv.footprint(b.size, b.ns.label) for b in mine if not lv.holds(b))
            gone = sum(n for b, n in out.items() if lv.holds(b) and tenant_of(b) == tenant)
            if not quotas.excess(tenant, new + self._pending(lv, tenant) - gone):
                return
            victim = self._evictable(lv, cold)
            if victim is None and (fresh or not mine):
                victim = self._evictable(lv, own)
            if victim is not None:
                await self._evict(lv, victim, self.down_from(lv, victim))
            elif mine:
                quotas.refuse(tenant, 1)
                self._refuse(lv, mine[0], keep, out)
            else:
                return

    async def _within_capacity(self, lv: Level, capacity: int, keep: list[Block], out: dict[Block, int]) -> None:
        """Evict from a bounded level until what it holds fits ``capacity``, never a block of a
        tenant within its quota: the victims and where each goes are :func:`evictions`' (the one
        capacity rule, ``kvstore replay``'s too); when nothing may go, the oldest placed blocks
        of ``keep`` are refused instead."""
        may, rest = self._may(lv, lv.quotas.evictable_for(None) if lv.quotas is not None else (lambda x: True))
        queued = self.backlog.queued_bytes
        if lv.used - queued(lv) > capacity:
            self.space.drain_touches()

        def held() -> int:
            return lv.used - queued(lv) - sum(n for b, n in out.items() if lv.holds(b))

        def over() -> bool:
            return held() > capacity

        below = self.levels[self.levels.index(lv) + 1 :]
        while True:
            for victim, home in evictions(lv.placement, over, self.space.retention, below, DRAM, may, rest):
                await self._evict(lv, victim, home)
            if held() <= capacity:
                if held() + self.removal.releasing(lv) <= capacity:
                    return
                await self.removal.wait_released(lv)  # deletes in flight make the room
                continue
            placed = [b for b in keep if lv.holds(b)]
            if not placed:
                return
            self._refuse(lv, placed[0], keep, out)

    async def _evict(self, lv: Level, b: Block, target: Level | None) -> None:
        """Evict ``b`` (out of ``lv``'s policy already) from ``lv``: its bytes go to ``target``
        (:func:`next_home`'s answer, None: nowhere) when it takes them (its quotas), else it is
        dropped unless another tier holds it."""
        self.stats.tier(lv.name, "evictions")
        if lv.quotas is not None:
            lv.quotas.evicted(b)
        reason = "no_tier"  # why it is dropped if no tier holds it after this
        if target is not None:
            try:
                reason = await self._pass_down(lv, target, b)
            except Unavailable as exc:
                target.mark_down(exc)
                reason = "failed"
        # Unplaced (and dropped if no tier holds it) before the await: a lookup meanwhile
        # found a visible block in no tier ("internal error: KeyError: 'none'").
        live = b.ns.blocks.get(b.key) is b and b.tiers & lv.bit
        lv.unplace(b)
        if live and not b.tiers:
            self.stats.drop(lv.name, reason)
        try:
            await lv.tier.delete(lv.ref(b))
        except Unavailable as exc:
            lv.mark_down(exc)

    async def _pass_down(self, lv: Level, target: Level, b: Block) -> str:
        """``b``'s bytes read back from ``lv`` (checked) and written to ``target``, when it takes them;
        the drop reason that applies when it did not ("failed": unreadable, "refused")."""
        buf = np.empty(b.size, dtype=np.uint8)
        async with lv.slots:
            got = await verified_get(lv.tier, lv.ref(b), buf.data, b.checksum or 0)
        if got is None:
            return "failed"
        async with self.room(target, [b]) as taken:
            if not taken:
                return "refused"
            meta, data = target.encoded(b, buf.data)  # (through target's codec, as a demotion)
            with self.stats.latency.timed("demotion", (target.name,)):  # (a failure is _evict's to handle)
                async with target.slots:
                    await target.tier.put(meta, data)
            target.place(b)
            self.stats.tier(lv.name, "demotions")
        return "failed"  # (placed: not dropped, the reason goes unused)
