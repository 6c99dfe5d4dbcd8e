"""Promotion: a hit below DRAM brought back into a DRAM slot before a worker reads it.

An Acquire or a Prefetch hands the movers its run; the blocks of it that are only below DRAM take
slots (which may evict: :mod:`kvstore.movers.demotion`) and are read into them, one batch per source
level, fastest first -- or copied from their staging buffer while their demotion is in flight.
Every byte read from a tier is checked against the checksum recorded at commit; a bad or missing
copy is deleted from its tier, unplaced, and the run ends there (a miss).

Why one batch per tier and one future per block: a tier spreads one read over its own connections
(Redis pipelines, S3 requests, SSD threads), and concurrent promotions of a block share its read
rather than take two slots for it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Mapping, Sequence, Set

import numpy as np

from kvstore.dram.slab import Slot
from kvstore.errors import ChecksumMismatch, KVStoreError, Unavailable
from kvstore.movers.crew import Crew
from kvstore.movers.demotion import Demotion
from kvstore.movers.level import Level
from kvstore.store.books.dram_space import DramSpace
from kvstore.store.books.index import DRAM, Block, State
from kvstore.tiers.verify import decoded, verified_get

log = logging.getLogger(__name__)

Waiting = list[tuple[Block, asyncio.Future[bool]]]  # a promotion batch: each block, and its readers' future


class Promotion:
    """Promotions from the levels of one chain into the DRAM space."""

    def __init__(self, space: DramSpace, levels: Sequence[Level], crew: Crew, demotion: Demotion) -> None:
        self.space = space
        self.stats = space.stats
        self.levels = levels
        self.crew = crew
        self.demotion = demotion  # the evictions for these slots; demotions in flight are read from there
        self.staged: Mapping[Block, np.ndarray] = demotion.staged
        self._promoting: dict[Block, asyncio.Future[bool]] = {}

    @property
    def promoting(self) -> Set[Block]:
        """The blocks whose promotion is in flight (each holds a slot its ``slot`` does not name yet)."""
        return self._promoting.keys()

    async def promote(self, run: list[Block]) -> list[Block]:
        """Bring the blocks of ``run`` that are only below DRAM into DRAM slots. Returns the
        leading part of ``run`` now in DRAM (a miss or a bad copy ends it). Blocks are read in
        one batch per source tier (one pipeline / thread hop / set of concurrent GETs)."""
        if all(b.tiers & DRAM for b in run):
            return run
        with self.space.index.pinned(run):  # the whole run, while room is made for parts of it
            pending = self._start(run)
            out: list[Block] = []
            for b, fut in zip(run, pending):
                ok = True if fut is None else await asyncio.shield(fut)
                if not ok or not (b.tiers & DRAM):
                    break
                out.append(b)
            return out

    def _start(self, run: list[Block]) -> list[asyncio.Future[bool] | None]:
        """Each block's promotion: None for one in DRAM, the future of one in flight already, else
        one of a new batch, started here."""
        loop = asyncio.get_running_loop()
        pending: list[asyncio.Future[bool] | None] = []
        batch: Waiting = []
        for b in run:
            if b.tiers & DRAM:
                pending.append(None)
                continue
            fut = self._promoting.get(b)
            if fut is None:
                fut = self._promoting[b] = loop.create_future()
                batch.append((b, fut))
            pending.append(fut)
        if batch:
            self.crew.spawn(self._promote_batch(batch), ended=functools.partial(self._promoted, batch))
        return pending

    async def _promote_batch(self, batch: Waiting) -> None:
        space = self.space
        taken: list[tuple[Block, asyncio.Future[bool], Slot, np.ndarray]] = []
        try:
            with self.demotion.staging_batch():  # evictions for these slots copy out together
                for b, fut in batch:
                    slot = self._slot_for(b)
                    if slot is None:
                        self._settle(b, fut, False)
                    else:
                        taken.append((b, fut, slot, space.slab.view(slot, b.size)))
            found = await self._read_into([(b, view) for b, _, _, view in taken])
            for (b, fut, slot, _), source in zip(taken, found):
                if source is not None and b.state is State.COMMITTED and b.ns.blocks.get(b.key) is b:
                    space.place(b, slot)
                    self._settle(b, fut, True)  # before anything that may raise: the slot is b's now
                    self.stats.tier(source, "promotions")
                else:  # no good copy, or deleted meanwhile
                    space.release(slot)
                    self._settle(b, fut, False)
        except BaseException:
            for b, fut, slot, _ in taken:
                if not fut.done():
                    space.release(slot)
                    self._settle(b, fut, False)
            raise

    def _slot_for(self, b: Block) -> Slot | None:
        """A DRAM slot for ``b``'s bytes; None when no copy of it can be read (every copy is in a
        tier that is down: evict nothing for it) or DRAM is full of leased blocks."""
        if b not in self.staged and not any(lv.holds(b) and not lv.down for lv in self.levels):
            return None
        try:
            return self.space.take_slot(b)
        except KVStoreError as exc:
            log.info("cannot promote %s: %s", b.key.hex()[:16], exc)
            return None

    def _promoted(self, batch: Waiting) -> None:
        """A promotion batch has ended: whoever still waits for one of its blocks gets a miss."""
        for b, fut in batch:
            self._settle(b, fut, False)

    def _settle(self, b: Block, fut: asyncio.Future[bool], ok: bool) -> None:
        if self._promoting.get(b) is fut:  # (not a later promotion's of the same block)
            del self._promoting[b]
        if not fut.done():
            fut.set_result(ok)

    async def _read_into(self, items: list[tuple[Block, np.ndarray]]) -> list[str | None]:
        """Fill each view with its block's verified bytes: from the staging copy if a demotion is
        in flight, else from the fastest level holding it that is up. Returns the source tier
        name per block, None where no good copy was found."""
        out: list[str | None] = [None] * len(items)
        todo: list[int] = []
        for i, (b, view) in enumerate(items):
            staged = self.staged.get(b)
            if staged is not None:
                view[:] = staged
                out[i] = next((lv.name for lv in self.levels if lv.holds(b)), "dram")
            else:
                todo.append(i)
        for lv in self.levels:
            mine = [i for i in todo if lv.holds(items[i][0]) and not lv.down]
            if not mine:
                continue
            # One read per tier: the tier spreads it over its own connections (Redis pipelines,
            # S3 requests); splitting it further here measured slower.
            for i, ok in zip(mine, await self._read_level(lv, [items[i] for i in mine])):
                if ok:
                    out[i] = lv.name
            todo = [i for i in todo if out[i] is None]
        return out

    async def _read_level(self, lv: Level, items: list[tuple[Block, np.ndarray]]) -> list[bool]:
        """Read ``items`` from ``lv`` and verify them; a bad or missing copy is unplaced."""
        blocks = [b for b, _ in items]
        views = [v for _, v in items]
        try:
            with self.stats.latency.timed("promotion", (lv.name,)):  # (a tier timing out shows there)
                async with lv.slots:
                    read = await lv.tier.get_many_hashed([lv.ref(b) for b in blocks], [v.data for v in views])
            read = decoded(read, [v.data for v in views])  # (the checksum is of the raw bytes)
        except Unavailable as exc:
            lv.mark_down(exc)
            return [False] * len(items)
        except ChecksumMismatch:  # an unreadable copy in the batch: verify one by one
            metas = [await verified_get(lv.tier, lv.ref(b), v.data, b.checksum or 0) for b, v in zip(blocks, views)]
            read = [(m, None if m is None else m.checksum) for m in metas]
        found = [
            meta is not None and meta.checksum == b.checksum and got == b.checksum
            for b, (meta, got) in zip(blocks, read)
        ]
        bad = [b for b, ok in zip(blocks, found) if not ok]
        for b, (meta, _), ok in zip(blocks, read, found):
            if ok:
                self.stats.tier(lv.name, "bytes_out", b.size)
            elif meta is not None:  # a copy whose bytes do not match the commit: never served
                log.warning("checksum mismatch on %s copy of %s; dropping it", lv.name, b.key.hex()[:16])
                self.stats.tier(lv.name, "checksum_failures")
            else:  # gone, or unreadable as a whole (a Redis chunk evicted, another chunk size)
                self.stats.tier(lv.name, "misses")
        if bad:
            await self._drop(lv, bad)
        return found

    @staticmethod
    async def _drop(lv: Level, bad: list[Block]) -> None:
        """What is left of ``bad``'s copies in ``lv`` would never be read: it goes too, in one batch,
        and those copies are no more."""
        try:
            await lv.tier.delete_many([lv.ref(b) for b in bad])
        except Unavailable as exc:
            lv.mark_down(exc)
        for b in bad:
            lv.unplace(b)
