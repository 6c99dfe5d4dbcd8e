"""Tiering: the tiers below DRAM, and the movers between them and the DRAM space.

The movers work on :class:`~kvstore.store.space.DramSpace` (slots, placement) and the index; the
block store knows them only as a :class:`~kvstore.store.below.Movers`, wired in by the sidecar.

* DRAM eviction demotes: the block's bytes are staged (copied out of its slot) and written to the
  first lower tier in the background, in two stages per tier: a sealer checksums what the server
  had not sealed yet, and what is sealed is written in batches, two batches at a time. The
  block stays findable meanwhile, served from the staging copy.
* A lower tier with a capacity (SSD) evicts through its own policy instance and demotes further
  down the chain, or drops the block when nothing is below.
* Tenant quotas (:mod:`kvstore.store.tenants`): before a tier takes blocks (a demotion batch, a
  write-through, a demotion from the tier above) a tenant past its quota there loses its own
  oldest blocks in it; what they cannot make room for is not written there (a refused demotion
  goes on down the chain). A tier with quotas and no capacity (Redis, S3) gets a policy to order
  each tenant's blocks by.
* Write-through tiers (Redis, S3) receive every committed block at once so other hosts can read
  it; the block is pinned in DRAM while its slot is read.
* A hit below DRAM is promoted into a DRAM slot before a worker reads it (Acquire, Prefetch).
  Every byte that crosses a tier boundary is checked against the checksum recorded at commit;
  a bad copy is deleted and treated as a miss.
* A tier that raises Unavailable is marked down: lookups treat it as a miss, errors are counted,
  and a background probe brings it back when its server returns.
* At start, every Recoverable tier is scanned and its blocks re-enter the index.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import mmap
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

import numpy as np

from kvstore.config import TIER_IN_FLIGHT, Config
from kvstore.dram.copying import copy_blocks
from kvstore.dram.slab import Slot
from kvstore.dram.staging import StagingPool
from kvstore.errors import ChecksumMismatch, KVStoreError, Unavailable
from kvstore.keys import BlockKey, NamespaceRoot
from kvstore.policy import make_policy
from kvstore.policy.base import EvictionPolicy
from kvstore.store.below import Movers, NoMovers, nothing
from kvstore.store.checksum import checksums
from kvstore.store.index import DRAM, REDIS, S3, SSD, Block, State
from kvstore.store.space import DramSpace, enter
from kvstore.store.tenants import Quotas, Tenants
from kvstore.tiers import build_tier
from kvstore.tiers.base import BlockMeta, BlockRef, Bounded, Recoverable, Tier
from kvstore.tiers.verify import verified_get
from kvstore.util.tasks import TaskHealth, cancel_and_wait, every
from kvstore.util.tuning import trim_heap

log = logging.getLogger("kvstore.tiers.movers")

BITS = {"ssd": SSD, "redis": REDIS, "s3": S3}
SHARED = REDIS | S3  # tiers every node of a cluster reaches (a node's SSD is its own)
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
PROBE_TASK = "kvstore-tier-probe"
OUTAGE_TRIM_S = 5.0  # while a tier is down, the heap is trimmed this often (_probe_down_tiers)

Staged = tuple[Block, np.ndarray, mmap.mmap]  # a demotion in flight: block, its bytes, their buffer


async def _ended(task: asyncio.Task[None]) -> None:
    """Wait for ``task`` to end, however it ends: a waiter that is cancelled leaves it running, and
    it ending cancelled is not the waiter's cancellation."""
    await asyncio.wait([task])


async def _seal(blocks: Sequence[Block], views: Sequence[np.ndarray | memoryview]) -> None:
    """Checksums of the blocks the server had not sealed yet, from their bytes in ``views``."""
    unsealed = [(b, v) for b, v in zip(blocks, views) if b.checksum is None]
    for (b, _), c in zip(unsealed, await checksums([v for _, v in unsealed])):
        b.checksum = c


@dataclass(eq=False)
class Level:
    """One tier below DRAM with its own accounting."""

    name: str
    bit: int
    tier: Tier
    capacity: int | None  # None: the server manages its own memory (Redis maxmemory, S3)
    policy: EvictionPolicy | None  # a bounded level's, or one with tenant quotas
    footprint: Callable[[int, str], int] = lambda size, label: size  # (block size, namespace label)
    # Requests in flight to this tier at once: movers start one task per block, and a burst of
    # hundreds must not open hundreds of connections (redis.max_connections is sized for this).
    slots: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(TIER_IN_FLIGHT))
    queue: list[Staged] = field(default_factory=list)  # demotions to checksum
    ready: list[Staged] = field(default_factory=list)  # demotions to write
    sealer: asyncio.Future[None] | None = None
    # One eviction pass at a time: a batch's put starts only once the deletes that made room
    # for it are done (a second writer saw the room counted free while the file was still there,
    # and its put failed "ssd tier full" at the capacity's edge).
    evicting: asyncio.Lock = field(default_factory=asyncio.Lock)
    writing: int = 0  # demotion batches being written
    used: int = 0
    down: bool = False
    sizes: dict[Block, int] = field(default_factory=dict)
    # Placed blocks whose demotion batch has not started writing: counted in ``used`` (lookups
    # find them) but taking no room in the tier yet, so eviction does not wait for them. A burst
    # of evictions bigger than the tier left ``used`` over the capacity with nothing evictable,
    # and batch after batch failed "ssd tier full" and lost its blocks.
    queued: set[Block] = field(default_factory=set)
    queued_bytes: int = 0
    # Room that deletes have taken out of ``used`` but whose files are not gone yet (the tier
    # still counts them): an eviction pass waits for it rather than count it free. A demotion
    # into that room failed "ssd tier full" and lost its batch (the soak: with the orphans below,
    # 25,218 failed batches in 10 minutes).
    releasing: int = 0
    released: asyncio.Event = field(default_factory=asyncio.Event)  # set as each such delete ends
    # Blocks whose demotion put is being written now, and those of them deleted meanwhile (their
    # footprint): the writer removes those files once its put lands, else they stay as orphans
    # (room the tier counts and the movers do not; a restart recovered the deleted blocks).
    putting: set[Block] = field(default_factory=set)
    doomed: dict[Block, int] = field(default_factory=dict)
    quotas: Quotas | None = None  # tenant quotas in this tier (kvstore.store.tenants)
    # Bytes per tenant that passed the quota and are being written here, not placed yet (a
    # write-through, a demotion from the level above): counted by the next quota pass.
    reserved: Counter[str] = field(default_factory=Counter)
    queued_by: Counter[str] = field(default_factory=Counter)  # tenant -> its bytes of ``queued`` (with quotas)

    def enqueue(self, b: Block) -> None:
        """``b`` (placed) waits for its demotion batch."""
        self.queued.add(b)
        nbytes = self.sizes[b]
        self.queued_bytes += nbytes
        if self.quotas is not None:
            self.queued_by[self.quotas.tenant(b)] += nbytes

    def dequeue(self, b: Block) -> None:
        """``b``'s bytes are being written now, or it left the tier: no longer waiting."""
        if b in self.queued:
            self.queued.discard(b)
            nbytes = self.sizes.get(b, 0)
            self.queued_bytes -= nbytes
            if self.quotas is not None:
                t = self.quotas.tenant(b)
                self.queued_by[t] -= nbytes
                if self.queued_by[t] <= 0:
                    del self.queued_by[t]

    def ref(self, b: Block) -> BlockRef:
        return BlockRef(b.ns.root, b.key)


class Tiering:
    """The movers between the DRAM space and the tiers below it (a :class:`~kvstore.store.below.Movers`)."""

    def __init__(self, space: DramSpace, levels: list[Level], write_through: list[Level]) -> None:
        self.space = space
        self.index = space.index
        self.stats = space.stats
        self.levels = levels
        self.write_through = write_through
        self._staged: dict[Block, np.ndarray] = {}  # demotions in flight, readable meanwhile
        # (staging, slot) copies a staging_batch() defers
        self._unstaged: list[tuple[np.ndarray, np.ndarray]] | None = None
        self._pool = StagingPool(STAGING_LIMIT)
        self._promoting: dict[Block, asyncio.Future[bool]] = {}
        self._through_ended = asyncio.Event()  # set as each write-through ends (its blocks' ``moving`` down)
        self._tasks: set[asyncio.Task[None]] = set()
        self._probe: asyncio.Task[None] | None = None
        self._trimmed = 0.0  # (loop time) the heap's last trim during an outage
        self.outage_trims = 0  # heap trims while a tier was down
        self._closing = False

    # --- construction ----------------------------------------------------------------------

    @classmethod
    async def start(
        cls, space: DramSpace, config: Config, tenants: Tenants | None = None, health: TaskHealth | None = None
    ) -> Movers:
        """The configured chain below ``space``, its blocks recovered (and each tenant brought
        within its quotas); :class:`NoMovers` when no tier is enabled. ``health``: where the
        probe loop's errors go (counted, logged, reported by ``/readyz``)."""
        enabled = {"ssd": config.ssd.enabled, "redis": config.redis.enabled, "s3": config.s3.enabled}
        names = [n for n in config.tiering.chain if enabled[n]]
        if not names:
            return NoMovers()
        levels = []
        for name in names:
            tier = build_tier(name, config)
            quotas = tenants.attach(name) if tenants is not None else None
            if isinstance(tier, Bounded):
                bounded = make_policy(config.index.policy)
                cap = tier.capacity_bytes
                levels.append(Level(name, BITS[name], tier, cap, bounded, tier.footprint, quotas=quotas))
            else:  # ordered only to evict a tenant's own oldest blocks past its quota
                policy = make_policy(config.index.policy) if quotas is not None else None
                levels.append(Level(name, BITS[name], tier, None, policy, quotas=quotas))
        wt = [lv for lv in levels if lv.name in config.tiering.write_through]
        self = cls(space, levels, wt)
        await self.recover()
        for lv in levels:
            if lv.quotas is not None and lv.quotas.over():  # quotas lowered since these blocks were written
                self._spawn(self._trim(lv))
        self._trimmed = asyncio.get_running_loop().time()
        # (stopped by _closing, not only by a cancel: a probe through redis-py can lose it, gh-86296)
        self._probe = asyncio.create_task(
            every(PROBE_TASK, 1.0, self._probe_down_tiers, health or TaskHealth(), stop=lambda: self._closing),
            name=PROBE_TASK,
        )
        return self

    async def recover(self) -> int:
        """Re-enter every block a Recoverable tier holds into the index (restart)."""
        index = self.index
        found = 0
        for lv in self.levels:
            if not isinstance(lv.tier, Recoverable):
                continue
            try:
                async for meta in lv.tier.scan():
                    ns = index.namespace(meta.ref.ns, meta.label or meta.ref.ns.hex()[:16], tenant=meta.tenant)
                    b = ns.blocks.get(meta.ref.key)
                    if b is None:
                        b = index.add(ns, meta.ref.key, meta.parent, meta.size, State.COMMITTED)
                        b.checksum = meta.checksum
                    elif b.checksum != meta.checksum:
                        continue  # a disagreeing copy: leave it, reads verify against the first
                    self._placed(lv, b)
                    found += 1
            except Unavailable as exc:
                self._mark_down(lv, exc)
        if found:
            log.info("recovered %d block copies from lower tiers", found)
        return found

    # --- placement bookkeeping ---------------------------------------------------------------

    def _placed(self, lv: Level, b: Block) -> None:
        if b.tiers & lv.bit:
            return
        b.tiers |= lv.bit
        self.index.moved(b)
        nbytes = lv.sizes[b] = lv.footprint(b.size, b.ns.label)
        lv.used += nbytes
        if lv.quotas is not None:
            lv.quotas.placed(b, nbytes)
        if lv.policy is not None:
            enter(lv.policy, b)

    def _unplaced(self, lv: Level, b: Block) -> None:
        if not b.tiers & lv.bit:
            return
        b.tiers &= ~lv.bit
        self.index.moved(b)
        lv.dequeue(b)
        nbytes = lv.sizes.pop(b, 0)
        lv.used -= nbytes
        if lv.quotas is not None:
            lv.quotas.freed(b, nbytes)
        if lv.policy is not None and b in lv.policy:
            lv.policy.remove(b)
        self.index.drop_if_gone(b)  # (a block with no tier bit is committed: only those are placed)

    def down_mask(self) -> int:
        mask = 0
        for lv in self.levels:
            if lv.down:
                mask |= lv.bit
        return mask

    def _mark_down(self, lv: Level, exc: BaseException) -> None:
        self.stats.tier(lv.name, "errors")
        if not lv.down:
            log.warning("tier %s unavailable, serving without it: %s", lv.name, exc)
        lv.down = True

    def _spawn(self, coro: Coroutine[Any, Any, None], ended: Callable[[], None] | None = None) -> asyncio.Task[None]:
        """A mover task. ``ended`` runs as it ends, however it ends: a task cancelled before its
        first step runs none of its own code, so the cleanup that its waiters need (an unpin, a
        future settled, room given back) is there, not in a ``finally`` of ``coro``."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        if ended is not None:
            task.add_done_callback(lambda _: ended())
        return task

    @staticmethod
    def _meta(lv: Level, b: Block) -> BlockMeta:
        """What ``lv`` keeps next to ``b``'s bytes."""
        return BlockMeta(lv.ref(b), b.parent, b.size, b.checksum or 0, b.ns.label, b.ns.tenant)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("tier mover failed", exc_info=exc)

    # --- hooks called by the store -------------------------------------------------------------

    def touch(self, run: Sequence[Block]) -> None:
        for lv in self.levels:
            if lv.policy is not None:
                lv.policy.access_many([b for b in reversed(run) if b.tiers & lv.bit])

    def resume(self, b: Block, uses: int) -> None:
        for lv in self.levels:
            if lv.policy is not None and b.tiers & lv.bit:
                lv.policy.resume(b, uses)

    def uses(self, b: Block | bytes) -> int:
        return max((lv.policy.uses(b) for lv in self.levels if lv.policy is not None), default=0)

    def ghost_size(self) -> int:
        return max((lv.policy.ghost_size() for lv in self.levels if lv.policy is not None), default=0)

    def adopt(self, b: Block, mask: int) -> int:
        """Place ``b`` in the shared tiers of ``mask`` (Redis, S3: written by another node) that
        this node has and that are up; the bits it is placed in now."""
        for lv in self.levels:
            if lv.bit & mask & SHARED and not lv.down:
                self._placed(lv, b)
        return b.tiers & SHARED

    def on_dram_evict(self, b: Block) -> None:
        """The store is about to free ``b``'s slot: keep the bytes below DRAM if nothing does.

        The bytes are staged (one copy into a pooled page-aligned buffer) and queued; the queue
        is written in batches, so a burst of evictions costs an fsync per batch, not per block.
        The block stays findable meanwhile and is served from the staging copy."""
        if b.replica and b.retain_until <= self.space.retention.clock():
            return  # fetched from another node, which holds it: drop this copy, spend no tier on it
        # (a retained replica is demoted as any block: the retention is a promise to keep it near)
        target = next((lv for lv in self.levels if not lv.down), None)
        if target is None or b.tiers & target.bit:
            return  # nowhere to go, or the next tier down has it already
        if self._pool.taken >= SPARE_STAGED and any(b.tiers & lv.bit and not lv.down for lv in self.levels):
            self.stats.tier("dram", "demotions_skipped")
            return  # demotions are behind, and a tier below holds it: not worth a buffer
        got = self._pool.take(b.size)
        if got is None:
            self.stats.tier(target.name, "errors")
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

    def _stage(self, b: Block, data: np.ndarray) -> None:
        """``b``'s bytes are staged for a demotion: no tier's policy offers it as a victim until
        :meth:`_unstage` (held there, instead of rejected on every pop: docs/soak.md's drain)."""
        self._staged[b] = data
        for lv in self.levels:
            if lv.policy is not None:
                lv.policy.hold(b)

    def _unstage(self, b: Block) -> None:
        """``b``'s demotion is over (written, failed, refused, or the block deleted)."""
        del self._staged[b]
        for lv in self.levels:
            if lv.policy is not None:
                lv.policy.release(b)

    def _queue(self, lv: Level, staged: Staged) -> None:
        """Place a staged block in ``lv`` and queue it to be written there."""
        b = staged[0]
        self._placed(lv, b)
        lv.enqueue(b)
        lv.queue.append(staged)
        if lv.sealer is None or lv.sealer.done():
            lv.sealer = self._spawn(self._seal_queue(lv), ended=functools.partial(self._sealer_ended, lv))

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

    async def _seal_queue(self, lv: Level) -> None:
        """Stage 1 of a demotion: checksums of staged blocks the server had not sealed yet, a few
        blocks per thread hop, handed to the writer as they are done, so the device starts on
        the first blocks while the rest are hashed and never waits for the hashing after that.
        A batch leaves ``lv.queue`` only once it is sealed: what is queued when the sealer ends
        (a failure, a cancellation) is :meth:`_sealer_ended`'s."""
        while lv.queue:
            batch = lv.queue[:SEAL_BATCH]
            await _seal([b for b, _, _ in batch], [d for _, d, _ in batch])
            del lv.queue[: len(batch)]  # (only appended to meanwhile: one sealer at a time)
            lv.ready.extend(batch)
            self._pump(lv)

    def _sealer_ended(self, lv: Level) -> None:
        """A sealer has ended, however it ended: the demotions still queued fail (their buffers go
        back, their blocks leave ``lv``), unless a sealer started since has them. A sealer
        cancelled before its first step ran none of its own code: its whole queue waited for the
        next eviction to start another, and when none came (a stop) its buffers were never given
        back."""
        if lv.sealer is not None and not lv.sealer.done():
            return  # the next sealer seals them
        self._demotion_failed(lv, lv.queue)

    def _pump(self, lv: Level) -> None:
        """Stage 2: write what is sealed, in batches (one fsync per batch, not per block), up to
        ``DEMOTE_DEPTH`` batches at once; called when blocks are sealed and when a batch lands."""
        while lv.ready and lv.writing < DEMOTE_DEPTH:
            n = self._batch_length(lv)
            batch, lv.ready = lv.ready[:n], lv.ready[n:]
            lv.writing += 1
            self._spawn(self._write_batch(lv, batch), ended=functools.partial(self._batch_ended, lv, batch))

    @staticmethod
    def _batch_length(lv: Level) -> int:
        """Blocks of ``lv.ready`` for the next batch: up to ``DEMOTE_BATCH``, and on a tier with a
        capacity at most a ``2 * DEMOTE_DEPTH``-th of it (one block at least), so the batches in
        flight, which cannot be evicted, leave half of the tier to make room in. (Two batches of
        64 x 8 KiB filled a 1 MiB SSD: a batch found nothing to evict and was lost.)"""
        n = min(DEMOTE_BATCH, len(lv.ready))
        if lv.capacity is None:
            return n
        budget, total = lv.capacity // (2 * DEMOTE_DEPTH), 0
        for i, (b, _, _) in enumerate(lv.ready[:n]):
            total += lv.sizes.get(b, 0)
            if total > budget:
                return max(i, 1)
        return n

    async def _write_batch(self, lv: Level, batch: list[Staged]) -> None:
        """Stage 2 of a demotion: one batch written to ``lv``. ``batch`` holds what is this task's
        to settle: what it passes down leaves it, what is written is released here; whatever is
        left when the task ends (a failure, a cancellation, before its first step too) fails in
        :meth:`_batch_ended`, which also frees the task's place among the batches in flight."""
        live: list[tuple[Block, np.ndarray]] = []
        try:
            with self._failures(lv, f"demotion of {len(batch)} blocks to"):
                for b, _, _ in batch:
                    lv.dequeue(b)
                kept = set(await self._make_room(lv, [b for b, _, _ in batch]))  # counted already
                refused = [s for s in batch if s[0] not in kept]
                if refused:
                    batch[:] = [s for s in batch if s[0] in kept]  # (in place: _batch_ended's list)
                    self._pass_down(lv, refused)
                # (what a delete took meanwhile is not written at all)
                live = [(b, d) for b, d, _ in batch if b.tiers & lv.bit and b.ns.blocks.get(b.key) is b]
                lv.putting.update(b for b, _ in live)
                items = [(self._meta(lv, b), d.data) for b, d in live]
                start = perf_counter()
                async with lv.slots:
                    await lv.tier.put_many(items)
                self.stats.latency.histogram("demotion", (lv.name,)).since(start)
                self.stats.tier(lv.name, "bytes_in", sum(b.size for b, _ in live))
                self._release_staged(batch)  # written
        finally:
            lv.putting.difference_update(b for b, _ in live)
            doomed = {b: lv.doomed.pop(b) for b, _ in live if b in lv.doomed}
            if doomed:  # deleted while their files were being written: the files go now
                self._delete_copies_task({lv: ([lv.ref(b) for b in doomed], sum(doomed.values()))})

    def _batch_ended(self, lv: Level, batch: list[Staged]) -> None:
        """A demotion batch's task has ended, however it ended: what it did not write fails, and
        the next batch may start. A task cancelled before its first step ran none of its own
        code: its buffers were never given back and ``lv.writing`` stayed up for good (at
        ``DEMOTE_DEPTH`` such tasks, no demotion to ``lv`` was ever written again)."""
        self._demotion_failed(lv, batch)
        lv.writing -= 1
        self._pump(lv)

    def _demotion_failed(self, lv: Level, batch: list[Staged]) -> None:
        """``batch``'s demotions to ``lv`` are over unwritten: out of ``lv``, buffers back (and
        ``batch`` emptied, :meth:`_release_staged`)."""
        for b, _, _ in batch:
            self._unplaced(lv, b)
        self._release_staged(batch)

    def _release_staged(self, batch: list[Staged]) -> None:
        """The one place a demotion's buffer goes back to the pool. ``batch`` is emptied: a list a
        task and its ``ended`` both hold (a batch, a level's queue) gives nothing back twice."""
        for b, data, buf in batch:
            if self._staged.get(b) is data:  # (a delete meanwhile has unlisted it already)
                self._unstage(b)
            self._pool.give(buf)
        batch.clear()

    def _pass_down(self, lv: Level, refused: list[Staged]) -> None:
        """Demotions ``lv`` would not take (a tenant past its quota there, or no room): each goes on
        to the next tier down that is up, as an eviction from ``lv`` would, or is dropped."""
        for staged in refused:
            b, data, _ = staged
            target = self._down_from(lv, b)
            if target is not None and not b.tiers & ~(DRAM | lv.bit) and self._staged.get(b) is data:
                self._queue(target, staged)  # placed there before it leaves lv: never in no tier
                self._unplaced(lv, b)
            else:
                self._unplaced(lv, b)
                self._release_staged([staged])

    def _down_from(self, lv: Level, b: Block) -> Level | None:
        """Where ``b`` goes when it leaves ``lv``: the next tier below ``lv`` that is up and does not
        hold it already; None: nowhere (dropped)."""
        below = self.levels[self.levels.index(lv) + 1 :]
        return next((t for t in below if not t.down and not b.tiers & t.bit), None)

    async def _trim(self, lv: Level) -> None:
        await self._make_room(lv)

    async def _make_room(self, lv: Level, incoming: Sequence[Block] = (), fresh: bool = False) -> list[Block]:
        """Room in ``lv`` for ``incoming`` (a demotion batch, placed already; or blocks about to be
        written there, ``fresh`` ones just committed): every tenant past its quota in ``lv`` loses
        its own blocks first (:meth:`_within_quotas`), then a bounded level evicts until it fits,
        never a block of a tenant within its quota (each victim demoted to the next tier down, or
        dropped). Returns the blocks of ``incoming`` that fit, once the victims' copies are gone;
        the caller leaves the others out of ``lv``."""
        if lv.policy is None:
            return list(incoming)
        async with lv.evicting:
            keep = list(incoming)
            out: dict[Block, int] = {}  # refused blocks ``lv`` counts still (placed demotions)
            if lv.quotas is not None:
                await self._within_quotas(lv, lv.quotas, keep, out, fresh)
            if lv.capacity is not None:
                await self._within_capacity(lv, lv.capacity, keep, out)
            return keep

    def _refuse(self, lv: Level, b: Block, keep: list[Block], out: dict[Block, int]) -> None:
        keep.remove(b)
        if b.tiers & lv.bit:
            out[b] = lv.sizes.get(b, 0)

    def _evictable(self, lv: Level, ok: Callable[[Block], bool]) -> Block | None:
        """The policy's next victim in ``lv`` that ``ok`` accepts, and that is not pinned or being
        written there (out of the policy now); any such block when the policy offers none (a
        prefix-aware one keeps parents for their children)."""
        assert lv.policy is not None

        def may(x: Block) -> bool:
            return not x.pinned and x not in self._staged and ok(x)

        retention = self.space.retention  # the soft pin: a retained block goes last here too
        b = retention.pop_victim(lv.policy, may)
        if b is None:
            b = retention.least(x for x in lv.sizes if x in lv.policy and may(x))
            if b is not None:
                lv.policy.remove(b)
        return b

    async def _within_quotas(
        self, lv: Level, quotas: Quotas, keep: list[Block], out: dict[Block, int], fresh: bool
    ) -> None:
        """Each tenant of ``keep``, and each past its quota in ``lv``, within its quota there. It
        counts what ``lv`` holds of it, what is being written there and ``keep``; blocks queued
        for later batches count in theirs. What goes, in this order: its blocks in ``lv`` that are
        not in DRAM (colder than anything DRAM holds or has just let go), in the policy's order;
        then its blocks of ``keep``, oldest first, and its copies of blocks DRAM holds -- the
        copies first when ``keep`` is ``fresh`` (just committed, the newest there are)."""
        tenant_of = quotas.tenant
        incoming = set(keep)
        for tenant in sorted({tenant_of(b) for b in keep} | set(quotas.over())):
            if not quotas.quota(tenant):
                continue

            def own(x: Block, tenant: str = tenant) -> bool:
                return x not in incoming and tenant_of(x) == tenant

            def cold(x: Block, own: Callable[[Block], bool] = own) -> bool:
                return own(x) and not x.tiers & DRAM

            while True:
                mine = [b for b in keep if tenant_of(b) == tenant]
                new = sum(lv.footprint(b.size, b.ns.label) for b in mine if not b.tiers & lv.bit)
                gone = sum(n for b, n in out.items() if b.tiers & lv.bit and tenant_of(b) == tenant)
                if not quotas.excess(tenant, new + lv.reserved[tenant] - gone - lv.queued_by[tenant]):
                    break
                victim = self._evictable(lv, cold)
                if victim is None and (fresh or not mine):
                    victim = self._evictable(lv, own)
                if victim is not None:
                    await self._evict(lv, victim)
                elif mine:
                    quotas.refused[tenant] += 1
                    self._refuse(lv, mine[0], keep, out)
                else:
                    break

    async def _within_capacity(self, lv: Level, capacity: int, keep: list[Block], out: dict[Block, int]) -> None:
        """Evict from a bounded level until what it holds fits ``capacity``, never a block of a
        tenant within its quota; when nothing may go, the oldest placed blocks of ``keep`` are
        refused instead."""
        may = lv.quotas.evictable_for(None) if lv.quotas is not None else (lambda x: True)
        if lv.used - lv.queued_bytes > capacity:
            self.space.drain_touches()
        while True:
            held = lv.used - lv.queued_bytes - sum(n for b, n in out.items() if b.tiers & lv.bit)
            if held + lv.releasing <= capacity:
                return
            if held <= capacity:  # deletes in flight make the room
                lv.released.clear()
                await lv.released.wait()
                continue
            victim = self._evictable(lv, may)
            if victim is not None:
                await self._evict(lv, victim)
                continue
            placed = [b for b in keep if b.tiers & lv.bit]
            if not placed:
                return
            self._refuse(lv, placed[0], keep, out)

    async def _evict(self, lv: Level, b: Block) -> None:
        """Evict ``b`` (out of ``lv``'s policy already) from ``lv``: when no other tier holds it, its
        bytes go to the next tier down that is up and takes them (its quotas), else it is dropped."""
        self.stats.tier(lv.name, "evictions")
        if lv.quotas is not None:
            lv.quotas.evictions[lv.quotas.tenant(b)] += 1
        target = self._down_from(lv, b)
        if target is not None and not b.tiers & ~(DRAM | lv.bit):
            buf = np.empty(b.size, dtype=np.uint8)
            try:
                async with lv.slots:
                    got = await verified_get(lv.tier, lv.ref(b), buf.data, b.checksum or 0)
                if got is not None:
                    async with self._room(target, [b]) as taken:
                        if taken:
                            meta = self._meta(target, b)
                            start = perf_counter()
                            async with target.slots:
                                await target.tier.put(meta, buf.data)
                            self.stats.latency.histogram("demotion", (target.name,)).since(start)
                            self._placed(target, b)
                            self.stats.tier(lv.name, "demotions")
            except Unavailable as exc:
                self._mark_down(target, exc)
        # Unplaced (and dropped if no tier holds it) before the await: a lookup meanwhile
        # found a visible block in no tier ("internal error: KeyError: 'none'").
        self._unplaced(lv, b)
        try:
            await lv.tier.delete(lv.ref(b))
        except Unavailable as exc:
            self._mark_down(lv, exc)

    @contextlib.asynccontextmanager
    async def _room(self, lv: Level, blocks: Sequence[Block], fresh: bool = False) -> AsyncIterator[list[Block]]:
        """Room in ``lv`` for ``blocks``, about to be written there (:meth:`_make_room`): the blocks
        that fit, their bytes reserved against their tenants' quotas until the body (which writes
        and places them) ends."""
        kept = await self._make_room(lv, blocks, fresh)
        quotas = lv.quotas
        held = [(quotas.tenant(b), lv.footprint(b.size, b.ns.label)) for b in kept] if quotas is not None else []
        for t, n in held:
            lv.reserved[t] += n
        try:
            yield kept
        finally:
            for t, n in held:
                lv.reserved[t] -= n
                if lv.reserved[t] <= 0:
                    del lv.reserved[t]

    def committed(self, blocks: Sequence[Block]) -> list[asyncio.Future[None]]:
        """Write-through: copy freshly committed blocks to the remote tiers now. Returns the
        writes started (they never raise: a failure is counted and marks the tier down)."""
        started: list[asyncio.Future[None]] = []
        for lv in self.write_through:
            if lv.down:
                continue
            todo = [b for b in blocks if not b.tiers & lv.bit]
            if todo:
                for b in todo:
                    b.moving += 1  # pinned while the slot is read
                started.append(self._spawn(self._write_through(lv, todo), ended=functools.partial(self._unpin, todo)))
        return started

    def _unpin(self, pinned: list[Block]) -> None:
        """A write-through has ended: its blocks' slots are no longer read; the deletes waiting wake."""
        for b in pinned:
            b.moving -= 1
        self._through_ended.set()

    def written_through(self, blocks: Sequence[Block]) -> int:
        """How many of ``blocks`` are in every write-through tier (0 when there is none)."""
        mask = sum(lv.bit for lv in self.write_through)
        return sum(1 for b in blocks if b.tiers & mask == mask) if mask else 0

    async def _write_through(self, lv: Level, pinned: list[Block]) -> None:
        """(``pinned`` stay pinned until the task has ended: :meth:`_unpin`.)"""
        start = perf_counter()
        with self._failures(lv, f"write-through of {len(pinned)} blocks to"):
            async with self._room(lv, pinned, fresh=True) as blocks:  # (a tenant past its quota: not all)
                if not blocks:
                    return
                views = [self.space.view(b) for b in blocks]
                await _seal(blocks, views)
                items = [(self._meta(lv, b), v.data) for b, v in zip(blocks, views)]
                async with lv.slots:
                    await lv.tier.put_many(items)
                for b in blocks:
                    if b.ns.blocks.get(b.key) is b:  # not deleted meanwhile
                        self._placed(lv, b)
                self.stats.latency.histogram("write_through", (lv.name,)).since(start)
                self.stats.tier(lv.name, "bytes_in", sum(b.size for b in blocks))

    async def writes_ended(self, blocks: Sequence[Block]) -> None:
        """Wait until no write-through reads any of ``blocks`` (a delete's, before it takes them:
        its slot must not be freed under the reader, nor its copy land after the delete removed
        the others). A write-through ends within its tier's own timeouts, so this wait does too;
        once :meth:`close` has begun it is not waited for: Unavailable (the caller has changed
        nothing yet)."""
        while any(b.moving for b in blocks):
            if self._closing:
                raise Unavailable(
                    "the store is shutting down: the write-throughs of these blocks are "
                    "still in flight; nothing was deleted"
                )
            self._through_ended.clear()
            await self._through_ended.wait()

    async def promote(self, run: list[Block]) -> list[Block]:
        """Bring the blocks of ``run`` that are only below DRAM into DRAM slots. Returns the
        leading part of ``run`` now in DRAM (a miss or a bad copy ends it). Blocks are read in
        one batch per source tier (one pipeline / thread hop / set of concurrent GETs)."""
        if all(b.tiers & DRAM for b in run):
            return run
        for b in run:
            b.leases += 1  # pin the whole run while we make room for parts of it
        try:
            loop = asyncio.get_running_loop()
            pending: list[asyncio.Future[bool] | None] = []
            batch: list[tuple[Block, asyncio.Future[bool]]] = []
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
                self._spawn(self._promote_batch(batch), ended=functools.partial(self._promoted, batch))
            out: list[Block] = []
            for b, fut in zip(run, pending):
                ok = True if fut is None else await asyncio.shield(fut)
                if not ok or not (b.tiers & DRAM):
                    break
                out.append(b)
            return out
        finally:
            for b in run:
                b.leases -= 1

    async def _promote_batch(self, batch: list[tuple[Block, asyncio.Future[bool]]]) -> None:
        space = self.space
        taken: list[tuple[Block, asyncio.Future[bool], Slot, np.ndarray]] = []
        try:
            with self.staging_batch():  # evictions for these slots copy out together
                for b, fut in batch:
                    reachable = b in self._staged or any(b.tiers & lv.bit and not lv.down for lv in self.levels)
                    if not reachable:
                        self._settle(b, fut, False)  # every copy is in a tier that is down: evict nothing for it
                        continue
                    try:
                        slot = space.take_slot(b)
                    except KVStoreError as exc:  # DRAM full of leased blocks
                        log.info("cannot promote %s: %s", b.key.hex()[:16], exc)
                        self._settle(b, fut, False)
                        continue
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

    def _promoted(self, batch: list[tuple[Block, asyncio.Future[bool]]]) -> None:
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
        in flight, else from the fastest tier holding it that is up. Returns the source tier
        name per block, None where no good copy was found."""
        out: list[str | None] = [None] * len(items)
        todo: list[int] = []
        for i, (b, view) in enumerate(items):
            staged = self._staged.get(b)
            if staged is not None:
                view[:] = staged
                out[i] = next((lv.name for lv in self.levels if b.tiers & lv.bit), "dram")
            else:
                todo.append(i)
        for lv in self.levels:
            mine = [i for i in todo if items[i][0].tiers & lv.bit and not lv.down]
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
        start = perf_counter()
        try:
            async with lv.slots:
                read = await lv.tier.get_many_hashed([lv.ref(b) for b in blocks], [v.data for v in views])
            self.stats.latency.histogram("promotion", (lv.name,)).since(start)
        except Unavailable as exc:
            self._mark_down(lv, exc)
            return [False] * len(items)
        except ChecksumMismatch:  # an unreadable copy in the batch: verify one by one
            metas = [await verified_get(lv.tier, lv.ref(b), v.data, b.checksum or 0) for b, v in zip(blocks, views)]
            read = [(m, None if m is None else m.checksum) for m in metas]
        found, bad = [], []
        for b, (meta, got) in zip(blocks, read):
            ok = meta is not None and meta.checksum == b.checksum and got == b.checksum
            found.append(ok)
            if ok:
                self.stats.tier(lv.name, "bytes_out", b.size)
                continue
            if meta is not None:  # a copy whose bytes do not match the commit: never served
                log.warning("checksum mismatch on %s copy of %s; dropping it", lv.name, b.key.hex()[:16])
                self.stats.tier(lv.name, "checksum_failures")
            else:  # gone, or unreadable as a whole (a Redis chunk evicted, another chunk size)
                self.stats.tier(lv.name, "misses")
            bad.append(b)
        if bad:
            try:  # what is left of them would never be read: it goes too, in one batch
                await lv.tier.delete_many([lv.ref(b) for b in bad])
            except Unavailable as exc:
                self._mark_down(lv, exc)
            for b in bad:
                self._unplaced(lv, b)  # that copy is no more
        return found

    def forget(self, blocks: Sequence[Block]) -> Awaitable[None]:
        """Take ``blocks`` out of every lower tier's bookkeeping now (a delete); awaiting the
        result waits for their copies to be removed, one batch per tier (a mover task: a caller
        that stops waiting does not stop it, nor does the task ending cancelled raise in the
        caller). Nothing awaits before the bookkeeping is done, so no promotion in flight can land
        a deleted block in DRAM again. Until a copy is gone its
        room counts as ``releasing``; a copy whose demotion is being written is removed by its
        writer once the write lands."""
        copies: dict[Level, tuple[list[BlockRef], int]] = {}
        for b in blocks:
            if b in self._staged:
                self._unstage(b)
            for lv in self.levels:
                if b.tiers & lv.bit:
                    nbytes = lv.sizes.get(b, 0)
                    lv.releasing += nbytes
                    if b in lv.putting:
                        lv.doomed[b] = nbytes
                    else:
                        refs, total = copies.get(lv, ([], 0))
                        refs.append(lv.ref(b))
                        copies[lv] = (refs, total + nbytes)
                    self._unplaced(lv, b)
        if not copies:
            return nothing()
        return _ended(self._delete_copies_task(copies))

    def _delete_copies_task(self, copies: dict[Level, tuple[list[BlockRef], int]]) -> asyncio.Task[None]:
        return self._spawn(self._delete_copies(copies), ended=functools.partial(self._copies_released, copies))

    async def _delete_copies(self, copies: dict[Level, tuple[list[BlockRef], int]]) -> None:
        """Remove copies from their tiers; each tier's ``nbytes`` stop counting as ``releasing``
        once its delete has ended, however it ended (those not begun: :meth:`_copies_released`)."""
        for lv, (refs, _) in list(copies.items()):
            try:
                with self._failures(lv, f"deleting {len(refs)} blocks from"):
                    await lv.tier.delete_many(refs)
            finally:
                self._copies_released({lv: copies.pop(lv)})

    @staticmethod
    def _copies_released(copies: dict[Level, tuple[list[BlockRef], int]]) -> None:
        """These copies' deletes have ended (or will never run): their room is no longer releasing."""
        for lv, (_, nbytes) in copies.items():
            lv.releasing -= nbytes
            lv.released.set()
        copies.clear()

    @contextlib.contextmanager
    def _failures(self, lv: Level, what: str) -> Iterator[None]:
        """A background call to ``lv`` (a demotion, a write-through, a delete) that fails: a tier
        out of reach is marked down; any other failure is logged ("``what`` ``lv.name`` failed")
        and counted in the tier's errors. Nobody awaits these calls for their outcome."""
        try:
            yield
        except Unavailable as exc:
            self._mark_down(lv, exc)
        except Exception:
            log.exception("%s %s failed", what, lv.name)
            self.stats.tier(lv.name, "errors")

    async def _probe_down_tiers(self) -> None:
        """A pass a second: each down tier is probed; one that answers is up again. While any is down,
        the heap is trimmed every ``OUTAGE_TRIM_S`` as well as when it comes back: an outage's
        failed calls (their tracebacks, frames, dead connections) are garbage in reference cycles
        that only a full collection frees, and left to pile up for the outage's length they grow
        the heap to a peak it keeps (the soak's sidecar: ``RssAnon`` +6.7 MiB in an 18 s outage)."""
        probe = BlockRef(NamespaceRoot(bytes(32)), BlockKey(bytes(32)))
        now = asyncio.get_running_loop().time()
        if any(lv.down for lv in self.levels) and now - self._trimmed >= OUTAGE_TRIM_S:
            self._trimmed = now
            self.outage_trims += 1
            trim_heap()
        for lv in self.levels:
            if not lv.down:
                continue
            try:
                await lv.tier.contains(probe)
            except Unavailable:
                continue
            log.info("tier %s is back", lv.name)
            lv.down = False
            trim_heap()  # the outage's garbage (failed calls, dead connections): not kept at its peak

    # --- reporting / shutdown ------------------------------------------------------------------

    def occupancy(self) -> dict[str, dict[str, object]]:
        return {
            lv.name: {
                "used_bytes": lv.used,
                "capacity_bytes": lv.capacity or 0,
                "recycled_bytes": getattr(lv.tier, "recycled_bytes", 0),  # SSD: deleted files kept for reuse
                "blocks": len(lv.sizes),
                "down": lv.down,
                "write_through": lv in self.write_through,
            }
            for lv in self.levels
        }

    @property
    def busy(self) -> bool:
        return bool(self._tasks)

    async def flush(self) -> None:
        """Wait for demotions, promotions and write-throughs in flight. A caller that is cancelled
        while it waits (an Allocate past its deadline) leaves them running: ``asyncio.gather``
        cancelled its children, and a write-through cancelled before it began never unpinned its
        blocks (their DRAM was "leased or being written" for the process's life)."""
        while self._tasks:
            await asyncio.wait(list(self._tasks))

    async def close(self) -> None:
        self._closing = True
        self._through_ended.set()  # the deletes waiting for write-throughs: Unavailable now (writes_ended)
        await cancel_and_wait([self._probe])
        await self.flush()
        for lv in self.levels:
            try:
                await lv.tier.close()
            except Exception:
                log.exception("closing %s", lv.name)
