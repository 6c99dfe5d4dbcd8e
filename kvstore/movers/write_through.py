"""Write-through: every committed block copied at once to the write-through levels (Redis, S3).

At commit the blocks are pinned in DRAM (``Block.moving``, through ``Index.start_moving``) while a
mover task hashes the unsealed ones from their slots and writes them to each write-through level
that is up, with the room made there first (tenant quotas: :mod:`kvstore.movers.eviction`); what
lands is placed in that level. A delete of a block being written through waits for the write to
end (:meth:`WriteThrough.ended`).

Why at once: other hosts of a cluster read a shared tier's copy as soon as the block is committed,
and a Commit may wait for it (``wait_write_through``).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from time import perf_counter

from kvstore.errors import Unavailable
from kvstore.movers.crew import Crew
from kvstore.movers.eviction import Eviction
from kvstore.movers.level import Level
from kvstore.store.books.dram_space import DramSpace
from kvstore.store.books.index import Block
from kvstore.store.sealing import seal


class WriteThrough:
    """Write-throughs to the write-through levels of one chain."""

    def __init__(self, space: DramSpace, levels: Sequence[Level], crew: Crew, eviction: Eviction) -> None:
        self.space = space
        self.stats = space.stats
        self.levels = [lv for lv in levels if lv.write_through]
        self.crew = crew
        self.eviction = eviction
        self._ended = asyncio.Event()  # set as each write-through ends (its blocks' ``moving`` down)
        self._closing = False

    def committed(self, blocks: Sequence[Block]) -> list[asyncio.Future[None]]:
        """Copy freshly committed blocks to the write-through levels now. Returns the writes
        started (they never raise: a failure is counted and marks the tier down)."""
        started: list[asyncio.Future[None]] = []
        for lv in self.levels:
            if lv.down:
                continue
            todo = [b for b in blocks if not lv.holds(b)]
            if todo:
                self.space.index.start_moving(todo)  # pinned while the slot is read
                started.append(self.crew.spawn(self._write(lv, todo), ended=functools.partial(self._unpin, todo)))
        return started

    def _unpin(self, pinned: list[Block]) -> None:
        """A write-through has ended: its blocks' slots are no longer read; the deletes waiting wake."""
        self.space.index.stop_moving(pinned)
        self._ended.set()

    async def _write(self, lv: Level, pinned: list[Block]) -> None:
        """(``pinned`` stay pinned until the task has ended: :meth:`_unpin`.)"""
        start = perf_counter()
        outcome: str | None = "error"
        try:
            with lv.failures(f"write-through of {len(pinned)} blocks to"):
                async with self.eviction.room(lv, pinned, fresh=True) as blocks:  # (a tenant past its quota: not all)
                    if not blocks:
                        outcome = None  # nothing written: nothing timed
                        return
                    views = [self.space.view(b) for b in blocks]
                    await seal(blocks, views)
                    items = [lv.encoded(b, v.data) for b, v in zip(blocks, views)]  # (as a demotion)
                    async with lv.slots:
                        await lv.tier.put_many(items)
                    for b in blocks:
                        if b.ns.blocks.get(b.key) is b:  # not deleted meanwhile
                            lv.place(b)
                    outcome = "ok"
                    self.stats.tier(lv.name, "bytes_in", sum(b.size for b in blocks))
        finally:  # timed however it ended (lv.failures has counted a failure): a tier timing out shows
            if outcome is not None:
                self.stats.latency.histogram("write_through", (lv.name, outcome)).since(start)

    async def ended(self, blocks: Sequence[Block]) -> None:
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
            self._ended.clear()
            await self._ended.wait()

    def close(self) -> None:
        """The movers are closing: the deletes waiting for write-throughs raise Unavailable now."""
        self._closing = True
        self._ended.set()
