"""A DRAM copy's checksum: checked against its writer's at commit, computed later for a block
committed without one (the sealer), checked again on a local read (``dram.verify_local_reads``).

The bytes are hashed on the hash threads (:func:`kvstore.store.checksum.checksums`, which release
the GIL), never on the event loop; what is recorded is recorded by :meth:`Block.seal`, once.
Why apart from the block store: each of the three hashes a batch of slots and then judges what it
found, and what a mismatch costs (DATA_LOSS for a Commit, a dropped copy for a read) is decided
here, beside the rule it follows.

The event loop runs while the bytes are hashed: a block nothing pins (the sealer's), or whose
lease or allocation ended meanwhile (the reaper), may leave DRAM, its slot be reused by another
block, and the block come back into another slot or the same one. What was hashed was then not
(only) its bytes: each judges only the blocks that held their slot throughout
(:func:`~kvstore.store.space.held`), never records or compares another's bytes as theirs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvstore.errors import ChecksumMismatch
from kvstore.store.checksum import checksums
from kvstore.store.counters import Stats
from kvstore.store.index import Block, Index, Lease
from kvstore.store.space import DramSpace, held, tenure

log = logging.getLogger("kvstore.store.block_store")  # (the store's log: what operators grep for)


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
        tenures = [tenure(b) for _, b, _ in to_verify]
        sums = await checksums([self.space.view(b) for _, b, _ in to_verify])
        for (i, b, expected), t, got in zip(to_verify, tenures, sums):
            # (a slot freed meanwhile: the allocation was aborted or reclaimed, which the commit says)
            if got != expected and held(b, t):
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
        tenures = [tenure(b) for b in batch]
        sums = await checksums([self.space.view(b) for b in batch])
        for b, t, c in zip(batch, tenures, sums):
            if held(b, t):  # (in the same slot throughout: these are its bytes)
                b.seal(c)
            elif b.checksum is None and b.slot is not None:
                self.unsealed.append(b)
        return len(batch)

    async def verified(self, lease: Lease, deadline: float) -> tuple[Lease | None, list[Block]]:
        """Hash a leased run's DRAM copies; the lease and run cut before the first block whose
        bytes no longer match its checksum (that copy is dropped), or that left its slot while
        it was hashed (the lease ended meanwhile: a miss, nothing judged or dropped)."""
        run = lease.blocks
        tenures = [tenure(b) for b in run]
        try:
            sums = await checksums([self.space.view(b) for b in run])
        except BaseException:
            self._end_lease(lease)
            raise
        for i, (b, t, got) in enumerate(zip(run, tenures, sums)):
            if not held(b, t):  # the lease ended while it was hashed and the block moved: not judged
                return self._cut(lease, run, i, deadline)
            if not b.seal(got):  # (an unsealed one is sealed now: nothing earlier to compare with)
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
