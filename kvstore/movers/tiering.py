"""Tiering: the tiers below DRAM and the movers between them and the DRAM space, put together.

:meth:`Tiering.start` builds the configured chain (one :class:`~kvstore.movers.level.Level` per
enabled tier, fastest first), recovers what the tiers hold, and starts the health probe; the
:class:`Tiering` it returns is the store's :class:`~kvstore.store.books.below.Movers`, each call handed to
the room that does it:

* :mod:`~kvstore.movers.demotion` -- a DRAM eviction staged and written to the first level that is
  up (sealer, batches, pass-down);
* :mod:`~kvstore.movers.eviction` -- room made in a bounded level, or under tenant quotas, before
  blocks are written there;
* :mod:`~kvstore.movers.write_through` -- committed blocks copied at once to Redis or S3;
* :mod:`~kvstore.movers.promotion` -- a hit below DRAM read back into a slot, checked;
* :mod:`~kvstore.movers.removal` -- a delete's copies;
* :mod:`~kvstore.movers.health` -- the probe that brings a level marked down back;
* :mod:`~kvstore.movers.crew` -- the mover tasks they all run as.

Why a facade: the block store and the DRAM space know the movers only through the Protocol
(``kvstore/store/books/below.py``); each concern keeps its own state in its own module, and this one only
wires them and hands each call on.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Collection, Mapping, Sequence, Set
from contextlib import AbstractContextManager

from kvstore.config import Config
from kvstore.movers.crew import Crew, ended
from kvstore.movers.demotion import STAGING_LIMIT, Demotion
from kvstore.movers.drain import Drained, drain
from kvstore.movers.eviction import Eviction
from kvstore.movers.health import Probe
from kvstore.movers.level import Level
from kvstore.movers.promotion import Promotion
from kvstore.movers.recovery import RECOVER_BATCH, Recovery
from kvstore.movers.removal import Removal
from kvstore.movers.write_through import WriteThrough
from kvstore.policy import make_policy
from kvstore.store.books.below import Lower, Movers, NoMovers, Unloaded, both, nothing
from kvstore.store.books.dram_space import DramSpace
from kvstore.store.books.index import SSD, Block
from kvstore.store.books.tenants import Tenants
from kvstore.tier_table import BY_NAME
from kvstore.tiers import build_tier
from kvstore.tiers.base import Bounded
from kvstore.util.tasks import TaskHealth

log = logging.getLogger(__name__)

def build_levels(space: DramSpace, config: Config, tenants: Tenants | None = None) -> list[Level]:
    """One level per enabled tier of the configured chain, fastest first."""
    levels = []
    for name in (n for n in config.tiering.chain if config.tier_enabled(n)):
        tier, bit = build_tier(name, config), BY_NAME[name].bit
        quotas = tenants.attach(name) if tenants is not None else None
        through = name in config.tiering.write_through
        if isinstance(tier, Bounded):
            level = Level(
                name,
                bit,
                tier,
                space.index,
                space.stats,
                capacity=tier.capacity_bytes,
                policy=make_policy(config.index.policy),
                # (pure in (size, label), asked once a block placed: a restart places millions)
                footprint=functools.lru_cache(maxsize=4096)(tier.footprint),
                quotas=quotas,
                write_through=through,
            )
        else:  # ordered only to evict a tenant's own oldest blocks past its quota
            policy = make_policy(config.index.policy) if quotas is not None else None
            level = Level(
                name, bit, tier, space.index, space.stats, policy=policy, quotas=quotas, write_through=through
            )
        if level.placement.policy is not None:
            space.retention.watch(level.placement.policy)  # (its retained blocks apart, as DRAM's)
        levels.append(level)
    return levels


class Tiering:
    """The movers between the DRAM space and the levels below it (a :class:`~kvstore.store.books.below.Movers`)."""

    def __init__(self, space: DramSpace, levels: list[Level], staging_bytes: int = STAGING_LIMIT,
                 recover_batch: int = RECOVER_BATCH) -> None:
        self.space = space
        self._levels = levels
        self.crew = Crew()
        self.removal = Removal(levels, self.crew)
        self.demotion = Demotion(space, levels, self.crew, self.removal, staging_bytes)
        self.eviction: Eviction = self.demotion.eviction
        self.promotion = Promotion(space, levels, self.crew, self.demotion)
        self.write_through = WriteThrough(space, levels, self.crew, self.eviction)
        self.probe = Probe(levels)
        self.recovery = Recovery(levels, space.index, recover_batch)  # what the tiers held at a restart
        self.recovery.then = self._within_quotas

    @classmethod
    async def start(
        cls, space: DramSpace, config: Config, tenants: Tenants | None = None, health: TaskHealth | None = None,
        *, recover: bool = True,
    ) -> Movers:
        """The configured chain below ``space``, its blocks recovered (and then each tenant
        brought within its quotas); :class:`NoMovers` when no tier is enabled. ``health``: where
        the probe loop's errors go (counted, logged, reported by ``/readyz``). ``recover`` False:
        the caller starts ``recovery`` (:mod:`kvstore.movers.recovery`: in batches, in the
        background; the sidecar does once it serves)."""
        levels = build_levels(space, config, tenants)
        if not levels:
            return NoMovers()
        self = cls(space, levels, config.tiering.staging_bytes, config.tiering.recover_batch)
        if recover:
            await self.recovery.wait()
        self.probe.start(health or TaskHealth())
        return self

    def _within_quotas(self) -> None:
        """The recovery's end: each tenant over its quota in a level (quotas lowered since these
        blocks were written) trimmed back."""
        for lv in self._levels:
            if lv.quotas is not None and lv.quotas.over():
                self.crew.spawn(self.eviction.trim(lv))

    @property
    def recovery_stats(self) -> Mapping[str, object]:
        """``/stats`` ``recovery``: whether the restart's recovery is still loading, what it entered."""
        return self.recovery.snapshot()

    # --- the Movers ------------------------------------------------------------------------------

    @property
    def levels(self) -> Sequence[Level]:
        return self._levels

    @property
    def staged(self) -> Collection[Block]:
        return self.demotion.staged.keys()

    @property
    def promoting(self) -> Collection[Block]:
        return self.promotion.promoting

    @property
    def queued(self) -> Mapping[Lower, tuple[Set[Block], int]]:
        out: dict[Lower, tuple[Set[Block], int]] = {lv: self.demotion.queued(lv) for lv in self._levels}
        return out

    @property
    def outage_trims(self) -> int:
        """Heap trims while a tier was down (:mod:`kvstore.movers.health`)."""
        return self.probe.outage_trims

    def on_dram_evict(self, b: Block) -> None:
        self.demotion.on_dram_evict(b)

    def staging_batch(self) -> AbstractContextManager[None]:
        return self.demotion.staging_batch()

    def committed(self, blocks: Sequence[Block]) -> list[asyncio.Future[None]]:
        return self.write_through.committed(blocks)

    async def promote(self, run: list[Block]) -> list[Block]:
        return await self.promotion.promote(run)

    async def writes_ended(self, blocks: Sequence[Block]) -> None:
        await self.write_through.ended(blocks)

    def forget(self, blocks: Sequence[Block], unloaded: Unloaded | None = None) -> asyncio.Future[None]:
        """Take ``blocks`` out of every level's books now (a delete): a demotion in flight is no
        longer readable, each level forgets them (:mod:`kvstore.movers.removal`); awaiting the
        result waits for their copies to be removed. ``unloaded``, keys the recovery has not
        loaded yet (:meth:`Recovery.forget`): tombstoned for the loading, their records removed
        from the recovered levels' tiers in a mover task (no bytes to release: no level counts
        them yet)."""
        for b in blocks:
            self.demotion.drop(b)
        copies = self.removal.forget(blocks) if blocks else nothing()
        refs = self.recovery.forget(*unloaded) if unloaded is not None else None
        if not refs:
            return copies
        records = ended(self.removal.remove({lv: (refs, 0) for lv in self.recovery.levels}))
        return both(copies, records)

    async def flush(self) -> bool:
        """Wait for demotions, promotions and write-throughs in flight; whether there were any."""
        return await self.crew.flush()

    async def drain(self, seconds: float) -> Drained | None:
        """At a stop: the blocks only DRAM holds written to the SSD level, hottest first, for at
        most ``seconds`` (:mod:`kvstore.movers.drain`); None when there is no SSD level up."""
        lv = next((lv for lv in self._levels if lv.bit == SSD and not lv.down), None)
        if lv is None:
            return None
        await self.recovery.cancel()  # (a stop while recovering: the rest stays on disk, unloaded)
        await self.crew.flush()  # the moves in flight first: their deletes free the room they hold on disk
        return await drain(self.space, lv, self.eviction, seconds)

    async def close(self) -> None:
        await self.recovery.cancel()
        self.write_through.close()  # the deletes waiting for write-throughs: Unavailable now
        await self.probe.stop()
        await self.crew.flush()
        for lv in self._levels:
            try:
                await lv.tier.close()
            except Exception:
                log.exception("closing %s", lv.name)
