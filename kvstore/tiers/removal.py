"""Removal: a delete's copies taken out of the levels below DRAM.

A delete takes its blocks out of every level's books at once, then removes their copies from the
tiers in the background, one batch per tier; until a copy is gone its room counts as releasing (an
eviction pass waits for it rather than count it free). A copy whose demotion is being written is
removed by its writer once the write lands (:meth:`Removal.remove`).

Why at once, then later: nothing awaits before the books are done, so no promotion in flight can
land a deleted block in DRAM again, and the caller may stop waiting without stopping the removal
(a mover task).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Sequence

from kvstore.store.below import nothing
from kvstore.store.index import Block
from kvstore.tiers.base import BlockRef
from kvstore.tiers.crew import Crew, ended
from kvstore.tiers.level import Level

Copies = dict[Level, tuple[list[BlockRef], int]]  # per level: the copies to delete, their bytes


class Removal:
    """Deletes of copies in the levels of one chain."""

    def __init__(self, levels: Sequence[Level], crew: Crew) -> None:
        self.levels = levels
        self.crew = crew

    def forget(self, blocks: Sequence[Block]) -> Awaitable[None]:
        """Take ``blocks`` out of every level's books now; awaiting the result waits for their
        copies to be removed (a mover task: a caller that stops waiting does not stop it, nor does
        the task ending cancelled raise in the caller)."""
        copies: Copies = {}
        for b in blocks:
            for lv in self.levels:
                if lv.holds(b) and (nbytes := lv.forget(b)) is not None:
                    refs, total = copies.get(lv, ([], 0))
                    refs.append(lv.ref(b))
                    copies[lv] = (refs, total + nbytes)
        if not copies:
            return nothing()
        return ended(self.remove(copies))

    def remove(self, copies: Copies) -> asyncio.Task[None]:
        """Delete ``copies`` (forgotten by their levels already) from their tiers, in a mover task."""
        return self.crew.spawn(self._delete(copies), ended=functools.partial(self._released, copies))

    async def _delete(self, copies: Copies) -> None:
        """Remove copies from their tiers; each tier's bytes stop counting as releasing once its
        delete has ended, however it ended (those not begun: :meth:`_released`)."""
        for lv, (refs, _) in list(copies.items()):
            try:
                with lv.failures(f"deleting {len(refs)} blocks from"):
                    await lv.tier.delete_many(refs)
            finally:
                self._released({lv: copies.pop(lv)})

    @staticmethod
    def _released(copies: Copies) -> None:
        """These copies' deletes have ended (or will never run): their room is no longer releasing."""
        for lv, (_, nbytes) in copies.items():
            lv.released(nbytes)
        copies.clear()
