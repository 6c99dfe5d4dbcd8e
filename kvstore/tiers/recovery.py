"""Recovery: at a restart, the blocks the tiers below DRAM hold entered into the index, in batches
that yield to the event loop (issue 41 item 3), so the sidecar serves while it loads.

:meth:`Recovery.start` runs it as a task; the sidecar is ready (``/readyz`` 200) as soon as the
task has started, and ``/stats`` ``recovery`` says whether it is still ``recovering`` and how many
``blocks`` and ``batches`` it has entered. The rules while it runs:

* **A Lookup counts what is not loaded yet as a miss**: a block is in the index, and found, from
  the batch that enters it on; one not loaded yet is absent, as on a sidecar that never had it.
* **A put of a key still loading: the put wins.** The put goes ahead as on a miss (a new block in
  DRAM); when the recovery reaches that key's record, it finds the block in the index and does
  what a restart does for a second tier's copy: the record is placed as the block's copy in this
  tier when the block is committed with the same checksum, and skipped otherwise (the put is
  still writing, or its bytes differ; counted in ``skipped``). A skipped record stays in the tier
  until the block is demoted there (written over) or the next restart finds it.
* **A delete of a key still loading** deletes nothing (the index does not hold it yet): the record
  comes back when its batch is loaded, as a block another client put again would.

A batch is ``tiering.recover_batch`` records: entered in one go, with no await inside, so each
batch is atomic to the other requests; between batches the loop yields. With no traffic in between
the index and every level's policy end exactly as one pass over the records would leave them (the
same blocks, inserted in the tiers' scan order: the same policy order and tie-breaks).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from kvstore.errors import Unavailable
from kvstore.store.index import Index, NsEntry, State
from kvstore.tiers.base import BlockMeta, Recoverable
from kvstore.tiers.level import Level
from kvstore.util.tasks import cancel_and_wait
from kvstore.util.tuning import freeze_loaded

log = logging.getLogger("kvstore.tiers.movers")

RECOVER_BATCH = 4096  # records entered between two yields to the event loop (tiering.recover_batch)


class Recovery:
    """The levels' blocks entered into the index, a batch at a time (see the module)."""

    def __init__(self, levels: Sequence[Level], index: Index, batch: int = RECOVER_BATCH) -> None:
        self._levels = levels
        self._index = index
        self.batch = batch
        self.recovering = False
        self.blocks = 0  # block copies entered (placed in a level)
        self.batches = 0  # batches entered
        self.skipped = 0  # records of a block the index holds with another checksum, or unsealed
        self.done = asyncio.Event()
        self.then: Callable[[], None] | None = None  # called once every level is recovered
        self._task: asyncio.Task[int] | None = None

    def start(self) -> None:
        """Recover in a task; the caller goes on serving. ``recovering`` is True from now on."""
        self.recovering = True
        self._task = asyncio.create_task(self.run(), name="kvstore-recovery")

    async def wait(self) -> int:
        """The recovery's end (started or not); block copies entered."""
        if self._task is None:
            return await self.run()
        return await asyncio.shield(self._task)

    async def cancel(self) -> None:
        """A stop while recovering: the batch in progress ends, the rest is not loaded."""
        await cancel_and_wait([self._task])

    async def run(self) -> int:
        self.recovering = True
        try:
            for lv in self._levels:
                if isinstance(lv.tier, Recoverable):
                    await self._level(lv, lv.tier)
        finally:
            self.recovering = False
            self.done.set()
        if self.then is not None:
            self.then()
        if self.blocks:
            log.info("recovered %d block copies from lower tiers in %d batches", self.blocks, self.batches)
        return self.blocks

    async def _level(self, lv: Level, tier: Recoverable) -> None:
        pending: list[BlockMeta] = []
        try:
            async for meta in tier.scan():
                pending.append(meta)
                if len(pending) >= self.batch:
                    self._enter(lv, pending)
                    pending = []
                    await self.between(self.batches)
            if pending:
                self._enter(lv, pending)
        except Unavailable as exc:
            lv.mark_down(exc)

    def _enter(self, lv: Level, metas: Sequence[BlockMeta]) -> None:
        """One batch: each record's block found or added (committed, sealed with the record's
        checksum) and placed in ``lv``. No await: atomic to the other requests."""
        index, place = self._index, lv.placement.place
        entries: dict[bytes, NsEntry] = {}  # this batch's namespaces (an emptied one is re-registered)
        found = skipped = 0
        for meta in metas:
            ref = meta.ref
            ns = entries.get(ref.ns)
            if ns is None:
                ns = entries[ref.ns] = index.namespace(ref.ns, meta.label or ref.ns.hex()[:16], tenant=meta.tenant)
            b = ns.blocks.get(ref.key)
            if b is None:
                b = index.add(ns, ref.key, meta.parent, meta.size, State.COMMITTED)
                ns = entries[ref.ns] = b.ns  # (add registers a detached entry: the live one from now on)
                b.seal(meta.checksum)
            elif b.checksum != meta.checksum:
                skipped += 1
                continue
            if place(b):
                found += 1
        self.blocks += found
        self.skipped += skipped
        self.batches += 1
        freeze_loaded()  # (long-lived: out of the collector's scans, as the index at a start)

    async def between(self, batches: int) -> None:
        """Between two batches (``batches`` entered so far): the requests waiting run. (A test's
        wrapper replaces it to hold the recovery after a batch; tests/tiers/test_restart_serving.py.)"""
        await asyncio.sleep(0)

    def snapshot(self) -> dict[str, object]:
        """``/stats`` ``recovery``."""
        return {"recovering": self.recovering, "blocks": self.blocks, "batches": self.batches,
                "skipped": self.skipped, "batch": self.batch}
