"""Drain: at a planned stop, what only DRAM holds written down to the SSD, hottest first.

A restart finds what the SSD tier holds (its files carry each block's key, namespace and
checksum); DRAM's slab dies with the process. So at a stop (SIGTERM), once no request is served
any more, the blocks no lower tier holds are written to the SSD level in batches, in the reverse of
DRAM's eviction order (the policy's last victims first: the hottest, and a prefix's parents before
its children), for at most ``server.drain_s``: a batch starts only before that deadline. Room is
made as for any write (the SSD's coldest blocks give way); a block drained already, or a copy of a
block DRAM holds, is never a victim, so when the SSD cannot hold them all, the coldest are left. A
block goes down as a demotion writes it: through the level's codec (:meth:`Level.encoded
<kvstore.movers.level.Level.encoded>`). What is left (out of time, refused, a failed write) is
counted in the :class:`Drained` the stop logs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.movers.demotion import DEMOTE_BATCH, DEMOTE_DEPTH
from kvstore.movers.eviction import Eviction
from kvstore.movers.level import Level
from kvstore.store.books.dram_space import DramSpace
from kvstore.store.books.index import DRAM, Block
from kvstore.store.sealing import seal


@dataclass(slots=True, frozen=True)
class Drained:
    """What a drain did: of ``blocks`` only DRAM held, ``written`` reached the SSD and ``left`` did
    not (the deadline came first, the SSD refused them, or a write failed)."""

    blocks: int
    written: int
    left: int
    seconds: float


def _dram_only(b: Block) -> bool:
    """``b`` is live, in DRAM, and in no tier below it (nothing else keeps it across a restart)."""
    return b.ns.blocks.get(b.key) is b and b.slot is not None and b.tiers == DRAM


async def drain(space: DramSpace, lv: Level, eviction: Eviction, seconds: float,
                clock: Callable[[], float] = time.monotonic) -> Drained:
    """Write the blocks only DRAM holds to ``lv``, hottest first, batches starting within ``seconds``
    (consumes DRAM's policy: for a stop only, once nothing else uses the space)."""
    start = clock()
    deadline = start + seconds
    held = space.hottest_first()
    order = [b for b in held if _dram_only(b)]
    # a batch at most a quarter of a bounded level, as a demotion's: room is made among the rest
    most = DEMOTE_BATCH if lv.capacity is None else max(1, lv.capacity // (2 * DEMOTE_DEPTH))
    written, i = 0, 0
    # No victim of the drain's room: a block it wrote (held out of lv's policy too), nor the copy of
    # a block DRAM holds (lost at the stop otherwise: only SSD-only blocks, the coldest, give way).
    kept = eviction.kept
    kept.update(b for b in held if lv.holds(b))
    done: list[Block] = []
    try:
        while i < len(order) and clock() < deadline and not lv.down:
            batch: list[Block] = []
            size = 0
            while i < len(order) and len(batch) < DEMOTE_BATCH:
                b = order[i]
                if batch and size + lv.footprint(b.size, b.ns.label) > most:
                    break
                i += 1
                if _dram_only(b):
                    batch.append(b)
                    size += lv.footprint(b.size, b.ns.label)
            wrote = await _write(space, lv, eviction, batch)
            kept.update(wrote)
            done += wrote
            written += len(wrote)
            if len(wrote) < len(batch):
                break  # the SSD holds only what must stay (hotter than these): the rest are left
    finally:
        for b in done:
            lv.unhold(b)
        kept.clear()
    return Drained(len(order), written, len(order) - written, clock() - start)


async def _write(space: DramSpace, lv: Level, eviction: Eviction, batch: list[Block]) -> list[Block]:
    """One batch placed in ``lv`` and held out of its victims, room made for it (what does not fit is
    refused, the coldest first), and written; the blocks written (the others leave ``lv`` again).
    The batch is no victim of its own room (``eviction.kept``): placed but not written yet, an
    eviction of one of its blocks freed bytes the tier never held (its put then failed "ssd tier
    full", or landed a file the level no longer counted)."""
    for b in batch:
        lv.place(b)
        lv.hold(b)
    eviction.kept.update(batch)
    written: list[Block] = []
    try:
        with lv.failures(f"drain of {len(batch)} blocks to"):
            kept = await eviction.make_room(lv, batch[::-1])  # (refuses its first: the coldest)
            views = [space.view(b) for b in kept]
            await seal(kept, views)
            async with lv.slots:
                await lv.tier.put_many([lv.encoded(b, v.data) for b, v in zip(kept, views)])  # (as a demotion)
            space.stats.tier(lv.name, "bytes_in", sum(b.size for b in kept))
            written = kept
    finally:
        for b in set(batch).difference(written):
            eviction.kept.discard(b)
            lv.unhold(b)
            lv.unplace(b)  # (still in DRAM: it stays in the index)
    return written
