"""Removal: a delete's copies taken out of the levels below DRAM.

A delete takes its blocks out of every level's books at once, then removes their copies from the
tiers in the background, one batch per tier; until a copy is gone its room counts as releasing (an
eviction pass waits for it rather than count it free: :meth:`Removal.releasing`). A copy whose
demotion put is being written (:meth:`Removal.writing`, around the put) is removed once the put
lands. This room owns that state: the bytes releasing per level and the copies doomed.

Why at once, then later: nothing awaits before the books are done, so no promotion in flight can
land a deleted block in DRAM again, and the caller may stop waiting without stopping the removal
(a mover task).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Iterator, Sequence

from kvstore.movers.crew import Crew, ended
from kvstore.movers.level import Level
from kvstore.store.books.below import nothing
from kvstore.store.books.index import Block
from kvstore.tiers.base import BlockRef

Copies = dict[Level, tuple[list[BlockRef], int]]  # per level: the copies to delete, their bytes


class Removal:
    """Deletes of copies in the levels of one chain."""

    def __init__(self, levels: Sequence[Level], crew: Crew) -> None:
        self.levels = levels
        self.crew = crew
        # Per level, room that deletes have taken out of ``used`` but whose files are not gone yet
        # (the tier still counts them): an eviction pass waits for it rather than count it free. A
        # demotion into that room failed "ssd tier full" and lost its batch (the soak: with the
        # orphans below, 25,218 failed batches in 10 minutes).
        self._releasing: dict[Level, int] = {lv: 0 for lv in levels}
        self._release_ended = {lv: asyncio.Event() for lv in levels}  # set as each such delete ends
        # Per level, blocks whose demotion put is being written now, and those of them deleted
        # meanwhile (their footprint): removed once the put lands, else they stay as orphans (room
        # the tier counts and the movers do not; a restart recovered the deleted blocks).
        self._putting: dict[Level, set[Block]] = {lv: set() for lv in levels}
        self._doomed: dict[Level, dict[Block, int]] = {lv: {} for lv in levels}

    def releasing(self, lv: Level) -> int:
        """Bytes deleted from ``lv``'s books whose copies are not gone from the tier yet."""
        return self._releasing[lv]

    async def wait_released(self, lv: Level) -> None:
        """Until the next delete of copies in ``lv`` ends."""
        event = self._release_ended[lv]
        event.clear()
        await event.wait()

    def forget(self, blocks: Sequence[Block]) -> asyncio.Future[None]:
        """Take ``blocks`` out of every level's books now; awaiting the result waits for their
        copies to be removed (a mover task: a caller that stops waiting does not stop it, nor does
        the task ending cancelled raise in the caller)."""
        copies: Copies = {}
        for b in blocks:
            for lv in self.levels:
                if lv.holds(b) and (nbytes := self._forget(lv, b)) is not None:
                    refs, total = copies.get(lv, ([], 0))
                    refs.append(lv.ref(b))
                    copies[lv] = (refs, total + nbytes)
        if not copies:
            return nothing()
        return ended(self.remove(copies))

    def _forget(self, lv: Level, b: Block) -> int | None:
        """A delete takes ``b`` (placed in ``lv``) out of its books now; its room counts as
        releasing until its copy is removed. Returns its bytes when its copy is the caller's to
        remove, None when a demotion put is writing it (removed once that put lands)."""
        nbytes = lv.size_of(b)
        self._releasing[lv] += nbytes
        lv.unplace(b)
        if b in self._putting[lv]:
            self._doomed[lv][b] = nbytes
            return None
        return nbytes

    @contextlib.contextmanager
    def writing(self, lv: Level, blocks: Sequence[Block]) -> Iterator[None]:
        """A demotion put of ``blocks`` to ``lv`` is being written inside: a delete meanwhile
        leaves their files to it; once it has ended, however it ended, the files of those deleted
        meanwhile are removed."""
        putting = self._putting[lv]
        putting.update(blocks)
        try:
            yield
        finally:
            putting.difference_update(blocks)
            doomed = self._doomed[lv]
            gone = {b: doomed.pop(b) for b in blocks if b in doomed}
            if gone:
                self.remove({lv: ([lv.ref(b) for b in gone], sum(gone.values()))})

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

    def _released(self, copies: Copies) -> None:
        """These copies' deletes have ended (or will never run): their room is no longer releasing."""
        for lv, (_, nbytes) in copies.items():
            self._releasing[lv] -= nbytes
            self._release_ended[lv].set()
        copies.clear()
