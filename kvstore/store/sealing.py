"""A DRAM copy's checksum: checked against its writer's at commit, computed later for a block
committed without one (the sealer), checked again on a local read (``dram.verify_local_reads``).

The bytes are hashed on the hash threads (:func:`kvstore.checksum.checksums`, which release
the GIL), never on the event loop; what is recorded is recorded by :meth:`Block.seal`, once.
:func:`hashed` is the one hash of blocks' bytes and :func:`seal` the one hash-and-seal: the three
here, the exchange's lend (a run sealed before it is lent) and a demotion's sealer (from the staging
copy) all go through them.
Why apart from the block store: each of the three hashes a batch of slots and then judges what it
found, and what a mismatch costs (DATA_LOSS for a Commit, a dropped copy for a read) is decided
here, beside the rule it follows.

The event loop runs while the bytes are hashed: a block nothing pins (the sealer's), or whose
lease or allocation ended meanwhile (the reaper), may leave DRAM, its slot be reused by another
block, and the block come back into another slot or the same one. What was hashed was then not
(only) its bytes: each judges only the blocks that held their slot throughout
(:func:`~kvstore.store.books.dram_space.held`), never records or compares another's bytes as theirs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from kvstore.checksum import checksums
from kvstore.errors import ChecksumMismatch
from kvstore.stats.counters import Stats
from kvstore.store.books.dram_space import DramSpace, Tenure, held, tenure
from kvstore.store.books.index import Block, Index, Lease

log = logging.getLogger(__name__)

Bytes = np.ndarray | memoryview


def in_slots(space: DramSpace, blocks: Sequence[Block]) -> tuple[list[np.ndarray], list[Tenure]]:
    """The bytes of ``blocks``' DRAM slots, and their tenures (read together, before the hash)."""
    return [space.view(b) for b in blocks], [tenure(b) for b in blocks]


async def hashed(
    blocks: Sequence[Block], views: Sequence[Bytes], tenures: Sequence[Tenure] | None = None
) -> list[int | None]:
    """The one hash of blocks' bytes: the checksum of each block's bytes in ``views``; None for a
    block that left its slot while they were hashed (``tenures``: :func:`~kvstore.store.books.dram_space.held`),
    what was hashed there was not (only) its bytes. Without ``tenures`` the bytes are the caller's
    own (a staging copy) and every checksum counts. Nothing to hash: no await."""
    if not blocks:
        return []
    sums = await checksums(list(views))
    if tenures is None:
        return list(sums)
    return [c if held(b, t) else None for b, t, c in zip(blocks, tenures, sums)]


async def seal(
    blocks: Sequence[Block],
    views: Sequence[Bytes],
    tenures: Sequence[Tenure] | None = None,
    *,
    verify: bool = False,
) -> list[bool | None]:
    """The one hash-and-seal: each block not sealed yet hashed from its bytes in ``views`` and
    sealed (:meth:`Block.seal`; one sealed meanwhile from its slot keeps its own: the same bytes).
    Per block: None when it left its slot while they were hashed (``tenures``; not sealed from
    what was hashed), else True. With ``verify`` every block is hashed, a sealed one checked (False:
    its bytes disagree with its checksum), and the answer ends at the first block not True (the
    blocks after it are neither sealed nor judged)."""
    todo = list(range(len(blocks))) if verify else [i for i, b in enumerate(blocks) if b.checksum is None]
    sums = await hashed(
        [blocks[i] for i in todo], [views[i] for i in todo], None if tenures is None else [tenures[i] for i in todo]
    )
    got = dict(zip(todo, sums))
    out: list[bool | None] = []
    for i, b in enumerate(blocks):
        if i in got:
            c = got[i]
            ok = None if c is None else b.seal(c)
            out.append(ok if verify else (None if ok is None else True))
        else:  # (already sealed: not hashed, but it may have left its slot meanwhile all the same)
            out.append(None if tenures is not None and not held(b, tenures[i]) else True)
        if verify and out[-1] is not True:
            break
    return out


class Sealing:
    """The DRAM copies' checksums of one store, and the committed blocks waiting for the sealer."""

    def __init__(self, index: Index, space: DramSpace, stats: Stats) -> None:
        self.index = index
        self.space = space
        self.stats = stats
        self.unsealed: list[Block] = []  # committed without a checksum, in commit order

    async def check_sent(self, chosen: Sequence[tuple[Block, int | None]]) -> None:
        """Compare the checksums a Commit's writer sent (None: none) with its slots' bytes;
        ChecksumMismatch (DATA_LOSS) naming the first block whose bytes disagree."""
        to_verify = [(i, b, c) for i, (b, c) in enumerate(chosen) if c is not None]
        if not to_verify:
            return
        blocks = [b for _, b, _ in to_verify]
        sums = await hashed(blocks, *in_slots(self.space, blocks))
        for (i, _, expected), got in zip(to_verify, sums):
            # (None: the slot was freed meanwhile, the allocation aborted or reclaimed, which the commit says)
            if got is not None and got != expected:
                self.stats.tier("dram", "checksum_failures")
                raise ChecksumMismatch(
                    f"blocks[{i}].checksum: the slot holds bytes with checksum {got:#018x}, "
                    f"the request says {expected:#018x}"
                )

    def committed(self, b: Block, checksum: int | None) -> None:
        """``b`` is committed with its writer's ``checksum``; without one it waits for :meth:`seal`."""
        if checksum is None:
            self.unsealed.append(b)
        else:
            b.seal(checksum)

    async def seal(self, limit: int = 256) -> int:
        """Compute checksums of committed blocks whose writer did not send one, off the
        clients' critical path. A block that left its slot while it was hashed is not sealed
        from it: back in DRAM still unsealed, it waits for the next pass (hashed from its slot
        then); gone from DRAM, its demotion seals it from its own bytes (or it is gone)."""
        batch, self.unsealed = self.unsealed[:limit], self.unsealed[limit:]
        batch = [b for b in batch if b.checksum is None and b.slot is not None]
        if not batch:
            return 0
        for b, kept in zip(batch, await seal(batch, *in_slots(self.space, batch))):
            if kept is None and b.checksum is None and b.slot is not None:  # (left its slot meanwhile)
                self.unsealed.append(b)
        return len(batch)

    async def verified(self, lease: Lease, deadline: float) -> tuple[Lease | None, list[Block]]:
        """Hash a leased run's DRAM copies; the lease and run cut before the first block whose
        bytes no longer match its checksum (that copy is dropped), or that left its slot while
        it was hashed (the lease ended meanwhile: a miss, nothing judged or dropped)."""
        run = lease.blocks
        try:
            verdicts = await seal(run, *in_slots(self.space, run), verify=True)
        except BaseException:
            self._end_lease(lease)
            raise
        for i, (b, ok) in enumerate(zip(run, verdicts)):
            if ok is None:  # the lease ended while it was hashed and the block moved: not judged
                return self._cut(lease, run, i, deadline)
            if not ok:  # (an unsealed one was sealed: nothing earlier to compare with)
                log.warning("checksum mismatch on DRAM block %s; dropping it", b.key.hex()[:16])
                self.stats.tier("dram", "checksum_failures")
                self._end_lease(lease)  # (before it leaves DRAM, as ever; _cut finds it ended)
                self.space.remove(b)
                return self._cut(lease, run, i, deadline)
        return lease, run

    def _cut(self, lease: Lease, run: list[Block], i: int, deadline: float) -> tuple[Lease | None, list[Block]]:
        """End ``lease``; a new one on the run before ``run[i]`` (None when that is empty), and that run."""
        self._end_lease(lease)
        good = run[:i]
        return (self.index.take_lease(good, deadline) if good else None), good

    def _end_lease(self, lease: Lease) -> None:
        if lease.id in self.index.leases:  # (the reaper may have ended a very short one meanwhile)
            self.index.release_lease(lease.id)
