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
* **A delete of a key still loading removes it.** A delete of keys the index does not hold yet
  (:meth:`Recovery.forget`) leaves a tombstone the loading consults: their records are skipped
  when their batch comes (counted in ``deleted``), whatever the index holds by then (a put of the
  key after the delete is a new block, and the record is no copy of it); the delete removes the
  records from the tiers before it answers, so they stay gone after another restart. A namespace
  drop (``all_keys``) while loading tombstones the namespace: each record of it the loading reaches
  whose key the index does not hold (put again since) is skipped, counted, and removed from its
  tier then. (A stop before the loading reaches them leaves those to the next start, which loads
  them: the drop said what it deleted, the blocks the index held.) Tombstones end with the loading.

A batch is ``tiering.recover_batch`` records: entered in one go, with no await inside, so each
batch is atomic to the other requests; between batches the loop yields. With no traffic in between
the index and every level's policy end exactly as one pass over the records would leave them (the
same blocks, inserted in the tiers' scan order: the same policy order and tie-breaks).

A batch's run of one namespace's records none of whose keys the index holds yet (a restart's
usual batch) is entered in bulk: :meth:`Index.add_sealed`, :meth:`Space.place_many` and the
policy's ``insert_many``, which leave exactly the state of one record after the other
(tests/policy/test_insert_many.py, tests/tiers/test_recovery_batches.py) at about 60 % of its CPU
(docs/ssd-layout.md). A run with a key the index holds (a put while loading), and every batch
while deletes are tombstoned, is entered one record at a time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from itertools import groupby
from operator import itemgetter

from kvstore.errors import Unavailable
from kvstore.keys import NamespaceRoot
from kvstore.movers.level import Level
from kvstore.store.books.index import Index, NsEntry, State
from kvstore.tiers.base import BlockRef, Recoverable, Row, ScansRows, meta_row
from kvstore.util.tasks import cancel_and_wait
from kvstore.util.tuning import freeze_loaded

log = logging.getLogger(__name__)

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
        self.deleted = 0  # records skipped: their key (or namespace) deleted while loading
        self._gone: dict[bytes, set[bytes]] = {}  # per namespace root, keys deleted before loaded
        self._dropped: set[bytes] = set()  # namespaces dropped (all_keys) while loading
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
            self._gone.clear()  # (the tombstones end with the loading: nothing is left to skip)
            self._dropped.clear()
            self.done.set()
        if self.then is not None:
            self.then()
        if self.blocks:
            log.info("recovered %d block copies from lower tiers in %d batches", self.blocks, self.batches)
        return self.blocks

    @property
    def levels(self) -> list[Level]:
        """The levels it loads (those whose tier lists its blocks)."""
        return [lv for lv in self._levels if isinstance(lv.tier, Recoverable)]

    def forget(self, root: NamespaceRoot, keys: Sequence[bytes] | None) -> list[BlockRef]:
        """A delete while loading of ``keys`` of namespace ``root`` (those the index does not hold,
        and those of the blocks it deleted, which a level not loaded yet may still hold; None: the
        whole namespace dropped): tombstoned, so their records are skipped when their batch comes.
        Returns the records the caller removes from the tiers now (none for a drop: the loading
        removes those it reaches). Nothing once the loading has ended."""
        if not self.recovering:
            return []
        if keys is None:
            self._dropped.add(root)
            return []
        self._gone.setdefault(root, set()).update(keys)
        return [BlockRef(root, k) for k in keys]  # type: ignore[arg-type]

    async def _level(self, lv: Level, tier: Recoverable) -> None:
        pending: list[Row] = []
        batch = self.batch
        try:
            async for rows in _rows(tier):
                pending += rows
                done = 0
                while len(pending) - done >= batch:
                    await self._remove(lv, self._enter(lv, pending[done : done + batch]))
                    done += batch
                    await self.between(self.batches)
                del pending[:done]
            if pending:
                await self._remove(lv, self._enter(lv, pending))
        except Unavailable as exc:
            lv.mark_down(exc)

    @staticmethod
    async def _remove(lv: Level, refs: list[BlockRef]) -> None:
        """The records of a namespace dropped while loading, skipped by a batch: out of the tier."""
        if refs:
            with lv.failures(f"deleting {len(refs)} dropped blocks from"):
                await lv.tier.delete_many(refs)

    def _enter(self, lv: Level, rows: Sequence[Row]) -> list[BlockRef]:
        """One batch: each record's block found or added (committed, sealed with the record's
        checksum) and placed in ``lv``. No await: atomic to the other requests. Returns the
        records of namespaces dropped meanwhile, to remove from the tier."""
        entries: dict[bytes, NsEntry] = {}  # this batch's namespaces (an emptied one is re-registered)
        doomed: list[BlockRef] = []
        if self._gone or self._dropped:
            self._rows(lv, rows, entries, doomed)
        else:  # runs of one namespace, each in bulk unless the index holds one of its keys already
            for root, run in groupby(rows, itemgetter(0)):
                self._run(lv, root, list(run), entries)
        self.batches += 1
        freeze_loaded()  # (long-lived: out of the collector's scans, as the index at a start)
        return doomed

    def _run(self, lv: Level, root: NamespaceRoot, rows: list[Row], entries: dict[bytes, NsEntry]) -> None:
        """Rows of one namespace, in order: entered in bulk (:meth:`Index.add_sealed`,
        :meth:`Space.place_many`: the same blocks, placements and policy state as one row after
        the other) when none of their keys is in the index yet, else one by one."""
        _, keys, parents, sizes, csums, labels, tenants, _ = zip(*rows, strict=True)
        ns = entries.get(root)
        if ns is None:
            ns = entries[root] = self._index.namespace(root, labels[0] or root.hex()[:16], tenant=tenants[0])
        if any(map(ns.blocks.__contains__, keys)) or len(set(keys)) != len(keys):
            self._rows(lv, rows, entries, [])
            return
        blocks = self._index.add_sealed(ns, keys, parents, sizes, csums)
        entries[root] = blocks[0].ns  # (add registers a detached entry: the live one from now on)
        self.blocks += lv.placement.place_many(blocks)

    def _rows(self, lv: Level, rows: Sequence[Row], entries: dict[bytes, NsEntry], doomed: list[BlockRef]) -> None:
        """Rows entered one by one (while deletes are tombstoned, or for a namespace the index
        holds some of the keys of already)."""
        index, place, add = self._index, lv.placement.place, self._index.add
        found = skipped = deleted = 0
        gone, dropped = self._gone, self._dropped
        for root, key, parent, size, csum, label, tenant, _ in rows:
            if gone or dropped:
                if root in gone and key in gone[root]:
                    deleted += 1
                    continue  # deleted while loading: its copy is removed by the delete
                if root in dropped and ((live := index.namespaces.get(root)) is None or key not in live.blocks):
                    doomed.append(BlockRef(root, key))  # its namespace dropped while loading
                    deleted += 1
                    continue
            ns = entries.get(root)
            if ns is None:
                ns = entries[root] = index.namespace(root, label or root.hex()[:16], tenant=tenant)
            b = ns.blocks.get(key)
            if b is None:
                b = add(ns, key, parent, size, State.COMMITTED)
                ns = entries[root] = b.ns  # (add registers a detached entry: the live one from now on)
                b.seal(csum)
            elif b.checksum != csum:
                skipped += 1
                continue
            if place(b):
                found += 1
        self.blocks += found
        self.skipped += skipped
        self.deleted += deleted

    async def between(self, batches: int) -> None:
        """Between two batches (``batches`` entered so far): the requests waiting run. (A test's
        wrapper replaces it to hold the recovery after a batch; tests/tiers/test_restart_serving.py.)"""
        await asyncio.sleep(0)

    def snapshot(self) -> dict[str, object]:
        """``/stats`` ``recovery``."""
        return {"recovering": self.recovering, "blocks": self.blocks, "batches": self.batches,
                "skipped": self.skipped, "deleted": self.deleted, "batch": self.batch}


async def _rows(tier: Recoverable) -> AsyncIterator[list[Row]]:
    """``tier``'s blocks in its scan's order, in batches of rows (:class:`ScansRows`: as the tier
    lists them; any other tier: its ``BlockMeta`` one by one, flattened)."""
    if isinstance(tier, ScansRows):
        async for rows in tier.scan_rows():
            yield rows
    else:
        async for meta in tier.scan():
            yield [meta_row(meta)]
