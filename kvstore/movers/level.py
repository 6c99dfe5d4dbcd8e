"""Level: one tier below DRAM, what is placed there, and whether it is up.

A level is a tier (SSD, Redis, S3) with its placement space (:class:`~kvstore.store.books.placement.Space`:
the blocks placed there and their footprints, the bytes used, each tenant's share of them, the
policy that orders its blocks when it is bounded or has quotas), its capacity, whether the tier is
down, and the tier's requests in flight.

What the movers count on their way in and out is theirs, not the level's (issue #40): the
demotion queue (blocks placed here whose batch has not started writing) is the demotion's
(:class:`~kvstore.movers.demotion.Lane`), the bytes a delete is still releasing and the copies it
left to a put in flight are the removal's (:class:`~kvstore.movers.removal.Removal`), the quota
reservations of writes in flight and the one eviction pass at a time are the eviction's
(:class:`~kvstore.movers.eviction.Eviction`). The audit (``tests.support.audit``) checks that they
add up with the level's books.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType

from kvstore.codec import IDENTITY, Codec, encode
from kvstore.config import TIER_IN_FLIGHT
from kvstore.errors import Unavailable
from kvstore.policy.base import EvictionPolicy
from kvstore.stats.counters import Stats
from kvstore.store.books.index import Block, Index
from kvstore.store.books.placement import Footprint, Space
from kvstore.store.books.tenants import Quotas
from kvstore.tiers.base import BlockMeta, BlockRef, Tier

log = logging.getLogger(__name__)


def _size(size: int, label: str) -> int:
    return size


class Level:
    """One tier below DRAM and what is placed there (a :class:`~kvstore.store.books.below.Lower`)."""

    def __init__(
        self,
        name: str,
        bit: int,
        tier: Tier,
        index: Index,
        stats: Stats,
        *,
        capacity: int | None = None,
        policy: EvictionPolicy | None = None,
        footprint: Callable[[int, str], int] = _size,
        quotas: Quotas | None = None,
        write_through: bool = False,
    ) -> None:
        self.name = name
        self.tier = tier
        self.capacity = capacity  # None: the server manages its own memory (Redis maxmemory, S3)
        # The blocks placed here: the tier bit, the policy (a bounded level's, or one with tenant
        # quotas), each block's footprint and their sum, the tenant quotas in this tier.
        self.placement = Space(bit, policy, index, footprint, quotas)
        self.write_through = write_through  # every committed block is written here at once
        self.codec: Codec = IDENTITY  # what a demotion writes here goes through it (kvstore.codec)
        self._index = index
        self._stats = stats
        # Requests in flight to this tier at once: movers start one task per block, and a burst of
        # hundreds must not open hundreds of connections (redis.max_connections is sized for this).
        self.slots = asyncio.Semaphore(TIER_IN_FLIGHT)
        self._down = False

    # --- what it holds (read-only) --------------------------------------------------------------

    @property
    def bit(self) -> int:
        """The tier's bit in ``Block.tiers``."""
        return self.placement.bit

    @property
    def policy(self) -> EvictionPolicy | None:
        """What orders the blocks here: a bounded level's policy, or one with tenant quotas."""
        return self.placement.policy

    @property
    def footprint(self) -> Footprint:
        """``(block size, namespace label) -> bytes`` it takes in the tier."""
        return self.placement.footprint or _size

    @property
    def quotas(self) -> Quotas | None:
        """The tenant quotas in this tier (kvstore.store.books.tenants)."""
        return self.placement.quotas

    @property
    def down(self) -> bool:
        """Whether the tier is out of reach (lookups treat it as a miss until the probe finds it back)."""
        return self._down

    @property
    def used(self) -> int:
        """Bytes of the blocks placed here (their footprints), queued ones included."""
        return self.placement.used

    @property
    def held(self) -> Mapping[Block, int]:
        """Each block placed here and the bytes it takes (its footprint)."""
        return MappingProxyType(self.placement.sizes)

    def holds(self, b: Block) -> bool:
        return bool(b.tiers & self.bit)

    def size_of(self, b: Block) -> int:
        """The bytes ``b`` takes here (0: not placed here)."""
        return self.placement.sizes.get(b, 0)

    def ref(self, b: Block) -> BlockRef:
        return BlockRef(b.ns.root, b.key)

    def meta(self, b: Block) -> BlockMeta:
        """What the tier keeps next to ``b``'s bytes."""
        return BlockMeta(self.ref(b), b.parent, b.size, b.checksum or 0, b.ns.label, b.ns.tenant)

    def encoded(self, b: Block, raw: memoryview) -> tuple[BlockMeta, memoryview]:
        """What a write gives the tier for ``b`` (a demotion's, a write-through's, an eviction's
        pass-down, the drain's: the one place for it): its header naming this level's codec, and
        ``raw`` through that codec (:mod:`kvstore.codec`; the header's checksum stays the raw bytes')."""
        meta = self.meta(b)
        if self.codec is not IDENTITY:
            meta = dataclasses.replace(meta, codec=self.codec.id)
        return meta, encode(self.codec, raw)

    # --- placement --------------------------------------------------------------------------------

    def place(self, b: Block) -> None:
        """``b`` is in this tier now (or on its way: a staged demotion): its bit, its footprint,
        its tenant's share, the policy's insert with its parent (:meth:`Space.place`)."""
        self.placement.place(b)

    def unplace(self, b: Block) -> None:
        """``b`` is no longer in this tier; a block no tier holds leaves the index
        (:meth:`Space.unplace`)."""
        if b.tiers & self.bit:  # (a block queued for a demotion here leaves that queue first)
            self.placement.unplace(b)  # (a block with no tier bit is committed: only those are placed)

    # --- health -------------------------------------------------------------------------------------

    def mark_down(self, exc: BaseException) -> None:
        """The tier is out of reach: counted as an error, served without until it is back."""
        self._stats.tier(self.name, "errors")
        if not self._down:
            log.warning("tier %s unavailable, serving without it: %s", self.name, exc)
        self._down = True

    def mark_up(self) -> None:
        log.info("tier %s is back", self.name)
        self._down = False

    @contextlib.contextmanager
    def failures(self, what: str) -> Iterator[None]:
        """A background call to the tier (a demotion, a write-through, a delete) that fails: a tier
        out of reach is marked down; any other failure is logged ("``what`` ``name`` failed") and
        counted in the tier's errors. Nobody awaits these calls for their outcome."""
        try:
            yield
        except Unavailable as exc:
            self.mark_down(exc)
        except Exception:
            log.exception("%s %s failed", what, self.name)
            self._stats.tier(self.name, "errors")

    # --- the policy -----------------------------------------------------------------------------------

    def hold(self, b: Block) -> None:
        """``b`` is being demoted: the policy offers it as no victim until :meth:`unhold`."""
        if self.policy is not None:
            self.policy.hold(b)

    def unhold(self, b: Block) -> None:
        if self.policy is not None:
            self.policy.release(b)

    # --- reporting ----------------------------------------------------------------------------------

    def occupancy(self) -> dict[str, object]:
        return {
            "used_bytes": self.placement.used,
            "capacity_bytes": self.capacity or 0,
            "recycled_bytes": getattr(self.tier, "recycled_bytes", 0),  # SSD: deleted files kept for reuse
            "blocks": len(self.placement.sizes),
            "down": self._down,
            "write_through": self.write_through,
        }
