"""Checksum-verified reads from a tier: a bad copy is a miss, and is removed."""

from __future__ import annotations

from kvstore.errors import ChecksumMismatch
from kvstore.store.checksum import checksum
from kvstore.tiers.base import BlockMeta, BlockRef, Tier


async def verified_get(tier: Tier, ref: BlockRef, into: memoryview, expected_checksum: int) -> BlockMeta | None:
    """Read ``ref`` into ``into`` and check its bytes against ``expected_checksum`` (the one
    recorded at commit, ``BlockMeta.checksum`` in the index).

    Returns the header, or None on a miss. A copy whose header is unreadable, whose stored
    checksum differs from the expected one, or whose bytes do not hash to it is deleted from the
    tier and reported as a miss: never wrong data.
    """
    try:
        meta = await tier.get(ref, into)
    except ChecksumMismatch:
        meta = None
        bad = True
    else:
        if meta is None:
            return None
        bad = meta.checksum != expected_checksum or checksum(into[: meta.size]) != expected_checksum
    if bad:
        await tier.delete(ref)
        return None
    return meta
