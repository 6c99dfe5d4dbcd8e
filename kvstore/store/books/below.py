"""What the block store and the DRAM space know of the tiers below DRAM: the levels, each a
placement space of its own (:class:`Lower`, all of them together :class:`Below`), and the work that
moves blocks between them and DRAM (:class:`Movers`; :class:`NoMovers` for a DRAM-only store).

The real ones are :class:`kvstore.movers.level.Level` and :class:`kvstore.movers.tiering.Tiering`; the
sidecar wires them in (``BlockStore.tiering``). The state layer never imports the tiers: these
Protocols are all it knows.

Why two: the levels are read and placed into synchronously, on the request's path (their policies
learn DRAM's hits, lookups skip a level that is down, a cluster adopts a shared tier's copy, the
stats show their occupancy); the movers run tasks that copy bytes. The DRAM space reaches each
level's policy itself, as it reaches its own.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Collection, Mapping, Sequence, Set
from contextlib import AbstractContextManager
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol, TypeAlias

from kvstore.keys import NamespaceRoot
from kvstore.tier_table import shared_bits

if TYPE_CHECKING:
    from kvstore.policy.base import EvictionPolicy
    from kvstore.store.books.index import Block
    from kvstore.store.books.tenants import Quotas

# A delete's keys a restart's recovery has not loaded yet: (namespace root, keys), keys None when
# the whole namespace is dropped (Movers.forget).
Unloaded: TypeAlias = tuple[NamespaceRoot, Sequence[bytes] | None]

class Lower(Protocol):
    """One tier below DRAM: its placement bit, its policy and its books."""

    @property
    def name(self) -> str: ...

    @property
    def bit(self) -> int: ...

    @property
    def policy(self) -> EvictionPolicy | None:
        """The policy ordering its blocks (a bounded level's, or one with tenant quotas)."""
        ...

    @property
    def capacity(self) -> int | None:
        """Its bytes at most; None: the tier's server manages its own memory."""
        ...

    @property
    def quotas(self) -> Quotas | None: ...

    @property
    def write_through(self) -> bool:
        """Whether every committed block is written here at once."""
        ...

    @property
    def down(self) -> bool: ...

    @property
    def used(self) -> int:
        """Bytes of the blocks placed here (their footprints), queued ones included."""
        ...

    @property
    def held(self) -> Mapping[Block, int]:
        """Each block placed here and the bytes it takes."""
        ...

    def place(self, b: Block) -> None:
        """``b`` is in this tier now: its bit, its footprint, its tenant's share, the policy."""
        ...

    def occupancy(self) -> dict[str, object]: ...


class Below:
    """The levels below DRAM, fastest first, as the DRAM space and the block store use them."""

    def __init__(self, levels: Sequence[Lower] = ()) -> None:
        self.levels = tuple(levels)

    def touch(self, run: Sequence[Block]) -> None:
        """Hits on ``run``, for the policies of the levels that hold its blocks (deepest first)."""
        for lv in self.levels:
            if lv.policy is not None:
                lv.policy.access_many([b for b in reversed(run) if b.tiers & lv.bit])

    def resume(self, b: Block, uses: int) -> None:
        """Another node remembered ``uses`` uses of ``b`` (the cluster's ghost): the policies of
        the levels that hold it resume them (:meth:`~kvstore.policy.base.EvictionPolicy.resume`)."""
        for lv in self.levels:
            if lv.policy is not None and b.tiers & lv.bit:
                lv.policy.resume(b, uses)

    def uses(self, b: Block | bytes) -> int:
        """The most uses a level's policy counts or remembers of ``b`` (a Block, or a block key for
        its ghost), 0 when none keeps a count."""
        return max((lv.policy.uses(b) for lv in self.levels if lv.policy is not None), default=0)

    def ghost_size(self) -> int:
        """The most evicted blocks' counts one level's policy keeps (0: none keeps any)."""
        return max((lv.policy.ghost_size() for lv in self.levels if lv.policy is not None), default=0)

    def down_mask(self) -> int:
        """Placement bits of the levels that are down (lookups treat them as a miss)."""
        mask = 0
        for lv in self.levels:
            if lv.down:
                mask |= lv.bit
        return mask

    def adopt(self, b: Block, mask: int) -> int:
        """Place ``b`` in the shared tiers of ``mask`` (written by another node of a cluster) that
        this node has and that are up; the placement bits it has there now."""
        for lv in self.levels:
            if lv.bit & mask & shared_bits() and not lv.down:
                lv.place(b)
        return b.tiers & shared_bits()

    def written_through(self, blocks: Sequence[Block]) -> int:
        """How many of ``blocks`` every write-through level holds (0 when there is none)."""
        mask = sum(lv.bit for lv in self.levels if lv.write_through)
        return sum(1 for b in blocks if b.tiers & mask == mask) if mask else 0

    def occupancy(self) -> dict[str, dict[str, object]]:
        """Each level's occupancy, by name."""
        return {lv.name: lv.occupancy() for lv in self.levels}


class Movers(Protocol):
    """The work that moves blocks between DRAM and the levels below it."""

    @property
    def levels(self) -> Sequence[Lower]:
        """The levels below DRAM, fastest first (the DRAM space holds them as :class:`Below`)."""
        ...

    @property
    def staged(self) -> Collection[Block]:
        """The blocks whose demotion is in flight (placed in a level, their bytes staged)."""
        ...

    @property
    def promoting(self) -> Collection[Block]:
        """The blocks whose promotion is in flight (each holds a slot its ``slot`` does not name yet)."""
        ...

    @property
    def queued(self) -> Mapping[Lower, tuple[Set[Block], int]]:
        """Per level, the blocks placed there whose demotion batch has not started writing, and the
        bytes they count there (the demotion's queue)."""
        ...

    def on_dram_evict(self, b: Block) -> None:
        """``b`` is about to leave DRAM: keep its bytes below when nothing there does."""
        ...

    def staging_batch(self) -> AbstractContextManager[None]:
        """Evictions inside copy their blocks out together when the block ends."""
        ...

    def committed(self, blocks: Sequence[Block]) -> list[asyncio.Future[None]]:
        """Freshly committed ``blocks``: the write-throughs started for them."""
        ...

    async def promote(self, run: list[Block]) -> list[Block]:
        """Bring ``run``'s blocks that are only below DRAM up; the leading part now in DRAM."""
        ...

    async def writes_ended(self, blocks: Sequence[Block]) -> None:
        """Wait until no write-through in flight reads any of ``blocks`` (``Block.moving``)."""
        ...

    def forget(self, blocks: Sequence[Block], unloaded: Unloaded | None = None) -> Awaitable[None]:
        """Take ``blocks`` out of every lower tier's bookkeeping now (a delete); awaiting the
        result removes their copies. ``unloaded``: a delete's keys the index does not hold yet,
        ``(root, keys)`` (keys None: namespace ``root`` dropped), while a restart's recovery is
        still loading: they are not loaded after it, and awaiting removes their copies from the
        tiers too (nothing once the loading has ended)."""
        ...

    async def flush(self) -> bool:
        """Wait for the moves in flight; whether there were any (their pins may be all that stood
        in a write's way)."""
        ...

    @property
    def recovery_stats(self) -> Mapping[str, object]:
        """``/stats`` ``recovery``: whether a restart's recovery of the lower tiers' blocks is
        still loading (``recovering``), and the ``blocks`` and ``batches`` it has entered."""
        ...

    async def close(self) -> None: ...


class NoMovers:
    """A DRAM-only store: nothing below, nothing moves."""

    levels: tuple[Lower, ...] = ()
    staged: frozenset[Block] = frozenset()
    promoting: frozenset[Block] = frozenset()

    queued: Mapping[Lower, tuple[Set[Block], int]] = MappingProxyType({})

    def on_dram_evict(self, b: Block) -> None:
        pass

    def staging_batch(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def committed(self, blocks: Sequence[Block]) -> list[asyncio.Future[None]]:
        return []

    async def promote(self, run: list[Block]) -> list[Block]:
        return run

    async def writes_ended(self, blocks: Sequence[Block]) -> None:
        pass

    def forget(self, blocks: Sequence[Block], unloaded: Unloaded | None = None) -> asyncio.Future[None]:
        return nothing()

    async def flush(self) -> bool:
        return False

    recovery_stats: Mapping[str, object] = MappingProxyType(
        {"recovering": False, "blocks": 0, "batches": 0, "skipped": 0, "deleted": 0}
    )

    async def close(self) -> None:
        pass


def nothing() -> asyncio.Future[None]:
    """A future already done. (The awaitables a delete gets are futures, never coroutines: one
    left unawaited when an await before it raised or was cancelled is dropped silently.)"""
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    done.set_result(None)
    return done


def both(first: asyncio.Future[None], second: asyncio.Future[None]) -> asyncio.Future[None]:
    """A future done once ``first`` and ``second`` are, however they end (a waiter cancelled
    cancels only it)."""
    done: asyncio.Future[None] = first.get_loop().create_future()

    def check(_: object) -> None:
        if first.done() and second.done() and not done.done():
            done.set_result(None)

    first.add_done_callback(check)
    second.add_done_callback(check)
    return done
