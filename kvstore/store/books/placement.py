"""Placement in one tier space: the one place a block enters or leaves a tier.

A :class:`Space` is one tier's bookkeeping of the blocks placed in it: the tier's bit in
``Block.tiers``, the eviction policy that orders them (entered linked to the parent when the
space holds the parent too: the prefix-aware policies evict leaves first), what each block takes
there (its footprint) and the sum, and the tier's tenant quotas. :meth:`Space.place` and
:meth:`Space.unplace` change all of these together and tell the index (``Index.moved``; a block
that leaves its last tier leaves the index).

Every placement goes through one: the DRAM space's (:class:`~kvstore.store.books.dram_space.DramSpace`,
which adds the slab and its slots), each lower tier's level (:mod:`kvstore.movers.tiering`, which
adds the demotion queue and the writes), and ``kvstore replay``'s tier spaces
(:mod:`kvstore.sim.replay`, :mod:`kvstore.sim.cluster`, which add a capacity in blocks), so the
simulator places as the store does. Pure bookkeeping, no I/O.

The eviction decision is here too, once for the store and the replay alike: which block leaves a
space next (:meth:`Space.victim`, the one victim rule: the policy's pick through the retention's
soft pin), where its bytes go when it leaves (:func:`next_home`, the one pass-down rule), and the
loop of the two that brings a space within its capacity (:func:`evictions`, the one capacity
rule: the store's level eviction and the replay's Allocate both run it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from operator import attrgetter
from typing import TYPE_CHECKING, Protocol, TypeVar, cast

from kvstore.policy.base import Eligible, EvictionPolicy
from kvstore.store.books.index import Block, Index
from kvstore.store.books.tenants import Quotas
from kvstore.util.ints import shared

if TYPE_CHECKING:
    from kvstore.store.books.retention import Retention

_TIERS, _RETAINED, _SIZE, _DEPTH, _PARENT = map(attrgetter, ("tiers", "retain_until", "size", "depth", "parent"))
_LABEL = attrgetter("ns.label")

Footprint = Callable[[int, str], int]  # (block size, namespace label) -> what the block takes in the tier


def placed_nowhere(b: Block) -> None:
    """``b`` is in no tier any more: a delete, once every space that held it has let it go
    (:meth:`Space.unplace`), clears any bit left that no space of this store books. With
    :meth:`Space.place` and :meth:`Space.unplace`, the one place ``Block.tiers`` is written."""
    b.tiers = 0


class Space:
    """The blocks placed in one tier: bit, policy, footprints, quotas (see the module)."""

    __slots__ = ("bit", "footprint", "index", "policy", "quotas", "sizes", "used")

    def __init__(
        self,
        bit: int,
        policy: EvictionPolicy | None,
        index: Index,
        footprint: Footprint | None = None,
        quotas: Quotas | None = None,
    ) -> None:
        self.bit = bit  # the tier's bit in Block.tiers (a plain int: enum arithmetic runs in Python)
        self.policy = policy  # orders the placed blocks; None: an unordered tier (no eviction here)
        self.index = index
        self.footprint = footprint  # None: a block takes its size
        self.quotas = quotas  # the tier's tenant quotas, when configured
        self.sizes: dict[Block, int] = {}  # each placed block -> its footprint
        self.used = 0  # the sum of ``sizes``

    def place(self, b: Block) -> bool:
        """``b`` is in this tier now: its bit, its footprint (counted against its tenant's quota),
        the policy's insert with its parent when the policy holds that. False (nothing done)
        when it was placed already."""
        bit = self.bit
        if b.tiers & bit:
            return False
        b.tiers |= bit
        self.index.moved(b)
        footprint = self.footprint
        n = self.sizes[b] = b.size if footprint is None else shared(footprint(b.size, b.ns.label))
        self.used += n
        if self.quotas is not None:
            self.quotas.placed(b, n)
        policy = self.policy
        if policy is not None:
            parent = b.ns.blocks.get(b.parent)  # (a root's b"" is no block's key)
            policy.insert(b, parent if parent is not None and parent in policy else None, b.depth, b.size)
        return True

    def place_many(self, blocks: Sequence[Block]) -> int:
        """:meth:`place` for each of ``blocks`` in order (a restart's batch: kvstore/movers/recovery.py),
        how many it placed. Blocks placed nowhere yet and never retained take the bulk path: their
        bits, the index told, the footprints (asked once per size and label: ``footprint`` is pure
        in them), the quotas, then one :meth:`~kvstore.policy.base.EvictionPolicy.insert_many` with
        each block's parent in the index (the policy links it when it holds it at that block's
        turn); the same state as one :meth:`place` after the other."""
        bit = self.bit
        if any(map(bit.__and__, map(_TIERS, blocks))) or any(map(_RETAINED, blocks)):  # (the careful path)
            return sum(map(self.place, blocks))
        for b in blocks:
            b.tiers |= bit
        self.index.moved_many(blocks)
        sizes = list(map(_SIZE, blocks))
        ns = blocks[0].ns if blocks else None
        one = all(b.ns is ns for b in blocks)  # (one namespace: the usual batch)
        footprint = self.footprint
        if footprint is None:
            took = sizes
        elif one and ns is not None:
            label = ns.label
            memo = {size: shared(footprint(size, label)) for size in dict.fromkeys(sizes)}
            took = list(map(memo.__getitem__, sizes))
        else:
            pairs = list(zip(sizes, map(_LABEL, blocks)))
            memo2 = {pair: shared(footprint(*pair)) for pair in dict.fromkeys(pairs)}
            took = list(map(memo2.__getitem__, pairs))
        self.sizes.update(zip(blocks, took))
        self.used += sum(took)
        if self.quotas is not None:
            for b, n in zip(blocks, took):
                self.quotas.placed(b, n)
        policy = self.policy
        if policy is not None:
            if one and ns is not None:
                parents = list(map(ns.blocks.get, map(_PARENT, blocks)))
            else:
                parents = [b.ns.blocks.get(b.parent) for b in blocks]
            policy.insert_many(blocks, parents, list(map(_DEPTH, blocks)), sizes)
        return len(blocks)

    def unplace(self, b: Block) -> bool:
        """``b`` leaves this tier (out of the policy too, unless the policy gave it up as a
        victim already); a block that no tier holds any more leaves the index. False (nothing
        done) when it was not placed here."""
        bit = self.bit
        if not b.tiers & bit:
            return False
        b.tiers &= ~bit
        index = self.index
        index.moved(b)
        n = self.sizes.pop(b, 0)
        self.used -= n
        if self.quotas is not None:
            self.quotas.freed(b, n)
        policy = self.policy
        if policy is not None and b in policy:
            policy.remove(b)
        if not b.tiers:  # (Index.drop_if_gone, inline)
            index.drop(b)
        return True

    def victim(
        self, retention: Retention | None, ok: Callable[[Block], bool] | None = None, rest: Iterable[Block] = ()
    ) -> Block | None:
        """The one victim rule: the block to leave this space next, out of the policy now. The
        policy's next victim among the blocks ``ok`` accepts (None: any), through ``retention``'s
        soft pin (an unretained one while there is any; None: no hints, the policy's own pick);
        when the policy offers none (a prefix-aware one keeps parents for their children), the
        first of ``rest`` (the caller's evictable blocks here, which the policy holds) by
        retention alone. None: nothing may leave. The store's DRAM and levels and ``kvstore
        replay``'s spaces all pick through it."""
        policy = cast(EvictionPolicy, self.policy)  # (an unordered space has no victims)
        if retention is None:
            b = cast("Block | None", policy.pop_victim(cast("Eligible | None", ok)))
        else:
            b = retention.pop_victim(policy, ok)
        if b is None:
            b = next(iter(rest), None) if retention is None else retention.least(rest)
            if b is not None:
                policy.remove(b)
        return b

    def __len__(self) -> int:
        """How many blocks are placed here."""
        return len(self.sizes)


class Home(Protocol):
    """A tier a block may pass down to (a store's level, a replay's space)."""

    @property
    def bit(self) -> int: ...  # the tier's bit in Block.tiers

    @property
    def down(self) -> bool: ...  # True: it takes no blocks now (an outage)


H = TypeVar("H", bound=Home)


def next_home(below: Sequence[H], b: Block, leaving: int, top: int) -> H | None:
    """The one pass-down rule: where ``b``'s bytes go when ``b`` leaves the tier of bit
    ``leaving``, given ``below``, the tiers under that one (fastest first), and ``top``, the bit
    of the top tier (DRAM). It goes to the first of ``below`` that is up, unless its bytes are
    kept below already: leaving the top, when that tier holds it; leaving a lower tier, when any
    tier but the top and the one it leaves holds it. None: nowhere (dropped, unless a tier holds
    it). The store's movers (a DRAM eviction's demotion, a level's victim or refused demotion)
    and ``kvstore replay`` both ask it."""
    for target in below:  # (a loop, not next() over a generator: the replay asks per victim)
        if not target.down:
            kept = b.tiers & target.bit if leaving == top else b.tiers & ~(top | leaving)
            return None if kept else target
    return None


def evictions(
    space: Space,
    over: Callable[[], bool],
    retention: Retention | None,
    below: Sequence[H],
    top: int,
    ok: Callable[[Block], bool] | None = None,
    rest: Callable[[], Iterable[Block]] | None = None,
) -> Iterator[tuple[Block, H | None]]:
    """The one capacity rule: while ``over()`` (the space holds more than it may), the block to
    leave ``space`` next (:meth:`Space.victim` with ``retention``, ``ok`` and ``rest()``) and
    where its bytes go (:func:`next_home` over ``below``, the tiers under it, and ``top``; None:
    nowhere). Stops when ``over()`` is false or nothing may leave. The caller moves each victim
    before the next is decided (``over()`` is asked again then): the store's level eviction
    reads it back and writes it below (awaiting between steps), ``kvstore replay`` places it
    below at once; both unplace it from ``space``."""
    bit = space.bit
    victim = space.victim
    while over():
        b = victim(retention, ok, () if rest is None else rest())
        if b is None:
            return
        yield b, next_home(below, b, bit, top)
