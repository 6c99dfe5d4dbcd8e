"""Demotion: a block DRAM evicts, kept in the first level below that is up.

The block's bytes are staged (copied out of its slot into a pooled page-aligned buffer; inside
:meth:`Demotion.staging_batch` the copies of one request's evictions run together on the copy
threads), the block is placed in the target level and queued, and written in the background in two
stages per level (a :class:`Lane`): a sealer checksums what the server had not sealed yet, and what
is sealed is written in batches, ``DEMOTE_DEPTH`` batches at a time, once the level has made room
for them (:mod:`kvstore.movers.eviction`). What the level refuses goes on down the chain. The block
stays findable meanwhile, served from its staging copy.

Why staged and batched: the slot is freed at once (the request that evicted it needs it), and a
burst of evictions costs one fsync per batch, not per block; the staging pool bounds the memory a
demotion backlog may hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import mmap
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence, Set
from types import MappingProxyType

import numpy as np

from kvstore.dram.copying import copy_blocks
from kvstore.dram.staging import StagingPool
from kvstore.movers.crew import Crew
from kvstore.movers.eviction import Eviction
from kvstore.movers.level import Level
from kvstore.movers.removal import Removal
from kvstore.store.books.dram_space import DramSpace
from kvstore.store.books.index import DRAM, Block
from kvstore.store.books.placement import next_home
from kvstore.store.sealing import seal  # (the store's one hash-and-seal, from the staging copy)

STAGING_LIMIT = 512 << 20
DEMOTE_BATCH = 64  # blocks per put_many of a demotion batch
# Batches a demotion writer keeps in flight: the next batch's files are written while the one
# before waits for its fsync (4 batches of 32 x 2 MiB to new files, O_DIRECT + a directory fsync
# each: 243-253 MiB/s one after another, 292-361 MiB/s two at a time).
DEMOTE_DEPTH = 2
SEAL_BATCH = 8  # blocks per thread hop of the demotion sealer
# Demotions staged at once past which a block that a tier below holds already (written through)
# is not staged: a few write batches' worth. Such a block leaves DRAM as it is (its copy below
# serves it; counted in DRAM's ``demotions_skipped``); one with no copy below is still staged, up
# to STAGING_LIMIT. The soak's SSD writer ran ~5,300 blocks (82 MiB of staging buffers) behind a
# DRAM that evicted faster than it wrote, and ~120 MiB in a burst: the sidecar's RSS moved with
# that backlog (docs/soak.md), while every one of those blocks was in Redis already.
SPARE_STAGED = 2 * DEMOTE_DEPTH * DEMOTE_BATCH

Staged = tuple[Block, np.ndarray, mmap.mmap]  # a demotion in flight: block, its bytes, their buffer


class Lane:
    """One level's demotions in flight: queued to be sealed, sealed and ready to be written, the
    sealer, how many batches are being written, and the blocks whose batch has not started
    writing (with their bytes, per tenant too)."""

    def __init__(self) -> None:
        self.queue: list[Staged] = []  # demotions to checksum
        self.ready: list[Staged] = []  # demotions to write
        self.sealer: asyncio.Future[None] | None = None
        self.writing = 0  # demotion batches being written
        # Blocks placed in the level whose demotion batch has not started writing: counted in its
        # ``used`` (lookups find them) but taking no room in the tier yet, so eviction does not wait
        # for them. A burst of evictions bigger than the tier left ``used`` over the capacity with
        # nothing evictable, and batch after batch failed "ssd tier full" and lost its blocks.
        self.queued: set[Block] = set()
        self.queued_bytes = 0
        self.queued_by: Counter[str] = Counter()  # tenant -> its bytes of ``queued`` (with quotas)


class Demotion:
    """Demotions from DRAM into the levels of one chain, and on down it."""

    def __init__(self, space: DramSpace, levels: Sequence[Level], crew: Crew, removal: Removal,
                 staging_bytes: int = STAGING_LIMIT) -> None:
        """``staging_bytes``: the most bytes of demotions in flight (``tiering.staging_bytes``); an
        eviction past it is dropped (counted: ``drops.backlog``)."""
        self.space = space
        self.stats = space.stats
        self.levels = levels
        self.crew = crew
        self.removal = removal
        self.pool = StagingPool(staging_bytes)
        self._lanes = {lv: Lane() for lv in levels}
        self._staged: dict[Block, np.ndarray] = {}  # demotions in flight, readable meanwhile
        # Room in the levels (a batch's, a write-through's): never by evicting a block staged here.
        self.eviction = Eviction(space, levels, self._staged, removal, self)
        # (staging, slot) copies a staging_batch() defers
        self._unstaged: list[tuple[np.ndarray, np.ndarray]] | None = None

    @property
    def staged(self) -> Mapping[Block, np.ndarray]:
        """The blocks whose demotion is in flight, and their staged bytes."""
        return MappingProxyType(self._staged)

    def lane(self, lv: Level) -> Lane:
        return self._lanes[lv]

    # --- the queue: placed in a level, the batch not writing yet -----------------------------------

    def queued(self, lv: Level) -> tuple[Set[Block], int]:
        """The blocks queued for ``lv`` and the bytes they count there."""
        lane = self._lanes[lv]
        return lane.queued, lane.queued_bytes

    def queued_bytes(self, lv: Level) -> int:
        return self._lanes[lv].queued_bytes

    def queued_of(self, lv: Level, tenant: str) -> int:
        return self._lanes[lv].queued_by[tenant]

    def _enqueue(self, lv: Level, b: Block) -> None:
        """``b`` (placed in ``lv``) waits for its demotion batch."""
        lane = self._lanes[lv]
        lane.queued.add(b)
        nbytes = lv.size_of(b)
        lane.queued_bytes += nbytes
        if lv.quotas is not None:
            lane.queued_by[lv.quotas.tenant(b)] += nbytes

    def _dequeue(self, lv: Level, b: Block) -> None:
        """``b``'s bytes are being written to ``lv`` now, or it is leaving ``lv``: no longer
        waiting (called while it is still placed there: its footprint is what the queue counted)."""
        lane = self._lanes[lv]
        if b in lane.queued:
            lane.queued.discard(b)
            nbytes = lv.size_of(b)
            lane.queued_bytes -= nbytes
            if lv.quotas is not None:
                t = lv.quotas.tenant(b)
                lane.queued_by[t] -= nbytes
                if lane.queued_by[t] <= 0:
                    del lane.queued_by[t]

    def on_dram_evict(self, b: Block) -> None:
        """The store is about to free ``b``'s slot: keep the bytes below DRAM if nothing does.

        The bytes are staged (one copy into a pooled page-aligned buffer) and queued; the queue
        is written in batches, so a burst of evictions costs an fsync per batch, not per block.
        The block stays findable meanwhile and is served from the staging copy."""
        if b.replica and b.retain_until <= self.space.retention.clock():
            return  # fetched from another node, which holds it: drop this copy, spend no tier on it
        # (a retained replica is demoted as any block: the retention is a promise to keep it near)
        target = next_home(self.levels, b, DRAM, DRAM)  # (the one pass-down rule)
        if target is None:
            if not b.tiers & ~DRAM:
                self.stats.drop("dram", "no_tier")
            return  # nowhere to go, or the next tier down has it already
        if self.pool.taken >= SPARE_STAGED and any(lv.holds(b) and not lv.down for lv in self.levels):
            self.stats.tier("dram", "demotions_skipped")
            return  # demotions are behind, and a tier below holds it: not worth a buffer
        got = self.pool.take(b.size)
        if got is None:
            self.stats.tier(target.name, "errors")
            if not b.tiers & ~DRAM:
                self.stats.drop("dram", "backlog")
            return  # demotions are backed up: drop rather than hold unbounded memory
        data, buf = got
        src = self.space.view(b)
        if self._unstaged is not None:
            self._unstaged.append((data, src))
        else:
            data[:] = src
        self._stage(b, data)
        self.stats.tier("dram", "demotions")
        self._queue(target, (b, data, buf))

    @contextlib.contextmanager
    def staging_batch(self) -> Iterator[None]:
        """Evictions inside copy their blocks out to staging together, on the copy threads, as
        the block ends: before any slot they freed can be written (callers take slots in a loop
        with no await, and hand them out only after it). A burst of 32 x 2 MiB evictions held
        the event loop 8.5 ms in one-block copies (py-spy, ``kvstore bench tiers`` SSD stream)."""
        if self._unstaged is not None:
            yield  # nested: the outer batch copies
            return
        self._unstaged = []
        try:
            yield
        finally:
            pairs, self._unstaged = self._unstaged, None
            copy_blocks(pairs)

    def drop(self, b: Block) -> None:
        """``b`` is deleted (before the levels forget it): its demotion, if one is in flight, is no
        longer readable (its writer skips it, its buffer goes back when the writer ends) nor
        queued."""
        if b in self._staged:
            self._unstage(b)
        for lv in self.levels:
            self._dequeue(lv, b)

    def _stage(self, b: Block, data: np.ndarray) -> None:
        """``b``'s bytes are staged for a demotion: no level's policy offers it as a victim until
        :meth:`_unstage` (held there, instead of rejected on every pop: docs/soak.md's drain)."""
        self._staged[b] = data
        for lv in self.levels:
            lv.hold(b)

    def _unstage(self, b: Block) -> None:
        """``b``'s demotion is over (written, failed, refused, or the block deleted)."""
        del self._staged[b]
        for lv in self.levels:
            lv.unhold(b)

    def _queue(self, lv: Level, staged: Staged) -> None:
        """Place a staged block in ``lv`` and queue it to be written there."""
        b = staged[0]
        lv.place(b)
        self._enqueue(lv, b)
        lane = self._lanes[lv]
        lane.queue.append(staged)
        if lane.sealer is None or lane.sealer.done():
            lane.sealer = self.crew.spawn(self._seal_queue(lv), ended=functools.partial(self._sealer_ended, lv))

    async def _seal_queue(self, lv: Level) -> None:
        """Stage 1 of a demotion: checksums of staged blocks the server had not sealed yet, a few
        blocks per thread hop, handed to the writer as they are done, so the device starts on
        the first blocks while the rest are hashed and never waits for the hashing after that.
        A batch leaves the lane's queue only once it is sealed: what is queued when the sealer ends
        (a failure, a cancellation) is :meth:`_sealer_ended`'s."""
        lane = self._lanes[lv]
        while lane.queue:
            batch = lane.queue[:SEAL_BATCH]
            await seal([b for b, _, _ in batch], [d for _, d, _ in batch])
            del lane.queue[: len(batch)]  # (only appended to meanwhile: one sealer at a time)
            lane.ready.extend(batch)
            self._pump(lv)

    def _sealer_ended(self, lv: Level) -> None:
        """A sealer has ended, however it ended: the demotions still queued fail (their buffers go
        back, their blocks leave ``lv``), unless a sealer started since has them. A sealer
        cancelled before its first step ran none of its own code: its whole queue waited for the
        next eviction to start another, and when none came (a stop) its buffers were never given
        back."""
        lane = self._lanes[lv]
        if lane.sealer is not None and not lane.sealer.done():
            return  # the next sealer seals them
        self._demotion_failed(lv, lane.queue)

    def _pump(self, lv: Level) -> None:
        """Stage 2: write what is sealed, in batches (one fsync per batch, not per block), up to
        ``DEMOTE_DEPTH`` batches at once; called when blocks are sealed and when a batch lands."""
        lane = self._lanes[lv]
        while lane.ready and lane.writing < DEMOTE_DEPTH:
            n = self._batch_length(lv, lane.ready)
            batch, lane.ready = lane.ready[:n], lane.ready[n:]
            lane.writing += 1
            self.crew.spawn(self._write_batch(lv, batch), ended=functools.partial(self._batch_ended, lv, batch))

    @staticmethod
    def _batch_length(lv: Level, ready: list[Staged]) -> int:
        """Blocks of ``ready`` for the next batch: up to ``DEMOTE_BATCH``, and on a level with a
        capacity at most a ``2 * DEMOTE_DEPTH``-th of it (one block at least), so the batches in
        flight, which cannot be evicted, leave half of the tier to make room in. (Two batches of
        64 x 8 KiB filled a 1 MiB SSD: a batch found nothing to evict and was lost.)"""
        n = min(DEMOTE_BATCH, len(ready))
        if lv.capacity is None:
            return n
        budget, total = lv.capacity // (2 * DEMOTE_DEPTH), 0
        for i, (b, _, _) in enumerate(ready[:n]):
            total += lv.size_of(b)
            if total > budget:
                return max(i, 1)
        return n

    async def _write_batch(self, lv: Level, batch: list[Staged]) -> None:
        """Stage 2 of a demotion: one batch written to ``lv``. ``batch`` holds what is this task's
        to settle: what it passes down leaves it, what is written is released here; whatever is
        left when the task ends (a failure, a cancellation, before its first step too) fails in
        :meth:`_batch_ended`, which also frees the task's place among the batches in flight."""
        with lv.failures(f"demotion of {len(batch)} blocks to"):
            for b, _, _ in batch:
                self._dequeue(lv, b)
            kept = set(await self.eviction.make_room(lv, [b for b, _, _ in batch]))  # counted already
            refused = [s for s in batch if s[0] not in kept]
            if refused:
                batch[:] = [s for s in batch if s[0] in kept]  # (in place: _batch_ended's list)
                self._pass_down(lv, refused)
            # (what a delete took meanwhile is not written at all)
            live = [(b, d) for b, d, _ in batch if lv.holds(b) and b.ns.blocks.get(b.key) is b]
            with self.removal.writing(lv, [b for b, _ in live]):  # (deleted meanwhile: removed after)
                await self._put(lv, live)
                self._release_staged(batch)  # written

    async def _put(self, lv: Level, live: list[tuple[Block, np.ndarray]]) -> None:
        items = [lv.encoded(b, d.data) for b, d in live]  # (through the level's codec)
        with self.stats.latency.timed("demotion", (lv.name,)):  # (a failure is _write_batch's to handle)
            async with lv.slots:
                await lv.tier.put_many(items)
        self.stats.tier(lv.name, "bytes_in", sum(b.size for b, _ in live))

    def _batch_ended(self, lv: Level, batch: list[Staged]) -> None:
        """A demotion batch's task has ended, however it ended: what it did not write fails, and
        the next batch may start. A task cancelled before its first step ran none of its own
        code: its buffers were never given back and the lane's ``writing`` stayed up for good (at
        ``DEMOTE_DEPTH`` such tasks, no demotion to ``lv`` was ever written again)."""
        self._demotion_failed(lv, batch)
        self._lanes[lv].writing -= 1
        self._pump(lv)

    def _demotion_failed(self, lv: Level, batch: list[Staged]) -> None:
        """``batch``'s demotions to ``lv`` are over unwritten: out of ``lv``, buffers back (and
        ``batch`` emptied, :meth:`_release_staged`)."""
        for b, _, _ in batch:
            self._leave(lv, b, "failed")
        self._release_staged(batch)

    def _leave(self, lv: Level, b: Block, reason: str) -> None:
        """``b``'s demotion to ``lv`` is over unwritten: out of ``lv``; a live block no tier holds
        now was dropped by DRAM's eviction, for ``reason`` (counted)."""
        live = b.ns.blocks.get(b.key) is b and b.tiers & lv.bit
        if b.tiers & lv.bit:  # (a block leaves the queue while its footprint still counts there)
            self._dequeue(lv, b)
        lv.unplace(b)
        if live and not b.tiers:
            self.stats.drop("dram", reason)

    def _release_staged(self, batch: list[Staged]) -> None:
        """The one place a demotion's buffer goes back to the pool. ``batch`` is emptied: a list a
        task and its ``ended`` both hold (a batch, a lane's queue) gives nothing back twice."""
        for b, data, buf in batch:
            if self._staged.get(b) is data:  # (a delete meanwhile has unlisted it already)
                self._unstage(b)
            self.pool.give(buf)
        batch.clear()

    def _pass_down(self, lv: Level, refused: list[Staged]) -> None:
        """Demotions ``lv`` would not take (a tenant past its quota there, or no room): each goes on
        to the next level down that is up, as an eviction from ``lv`` would, or is dropped."""
        for staged in refused:
            b, data, _ = staged
            target = self.eviction.down_from(lv, b)
            if target is not None and self._staged.get(b) is data:
                self._queue(target, staged)  # placed there before it leaves lv: never in no tier
                lv.unplace(b)
            else:
                self._leave(lv, b, "refused")
                self._release_staged([staged])
