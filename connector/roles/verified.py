"""A load's copy with every slot checked against its checksum before its bytes are copied, the
hashing off the copy's path.

Under ``load_guard="hash"``, or from a slab this process cannot keep read-only
(:mod:`connector.roles.guard`), the checksum the lease carries is what keeps a block changed after
it was sealed from reaching a model. Hashing the whole batch on the calling thread before the copy cost
~19 ms per 512 MiB in front of ~10 ms of DMA. Here the batch goes in chunks (small first, so the
pipeline fills fast): chunk *k+1* is hashed on the checksum pool's threads while chunk *k* is
copied, and a chunk is copied only once each of its slots has matched. So the guarantee is the
one the serial check gave -- the first slot that fails, and everything after it, is never copied
into the engine's cache and is reported for recompute -- and the window in which a change goes
unseen is shorter: from a chunk's hash to its copy, not from the first slot's hash to the last
slot's copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from connector.transfer.engines import BlockIdsLike, Completion, PagedKV, Transfer
from kvstore.checksum import start_checksums

FIRST_CHUNK_PART = 16  # the first chunk is 1/16 of the batch: all that is hashed before the copy starts
LARGEST_CHUNK_PART = 4  # chunks double up to 1/4 of the batch


def chunks(n: int) -> list[tuple[int, int]]:
    """(start, end) ranges covering ``range(n)``: ⌈n/16⌉ slots first, each next twice the last,
    at most ⌈n/4⌉."""
    size, cap = -(-n // FIRST_CHUNK_PART), -(-n // LARGEST_CHUNK_PART)
    out, a = [], 0
    while a < n:
        out.append((a, min(a + size, n)))
        a, size = a + size, min(2 * size, cap)
    return out


def _first_mismatch(got: Sequence[int], want: Sequence[int]) -> int | None:
    """Where ``got`` first differs from a non-zero ``want`` (0: not sealed yet, passes)."""
    return next((i for i, (g, w) in enumerate(zip(got, want)) if w and g != w), None)


def scatter_verified(
    transfer: Transfer, kv: PagedKV, block_ids: BlockIdsLike, views: Sequence[Any], sums: Sequence[int]
) -> int | None:
    """Copy ``views[i]`` into ``kv`` block ``block_ids[i]`` for every slot before the first whose
    bytes do not match ``sums[i]``; the index of that slot, or None when all matched. Returns once
    every copy is done and no thread reads the views any more."""
    if not any(sums):  # nothing sealed yet: nothing to check
        transfer.scatter(kv, block_ids, views).wait()
        return None
    spans = chunks(len(views))
    pending: list[Completion] = []
    hashing: Callable[[], list[int]] | None = start_checksums(views[spans[0][0]:spans[0][1]])
    try:
        for k, (a, b) in enumerate(spans):
            assert hashing is not None
            miss, hashing = _first_mismatch(hashing(), sums[a:b]), None
            if miss is None and k + 1 < len(spans):  # the next chunk hashes while this one is copied
                hashing = start_checksums(views[spans[k + 1][0]:spans[k + 1][1]])
            end = b if miss is None else a + miss
            if end > a:
                pending.append(transfer.scatter(kv, block_ids[a:end], views[a:end]))
            if miss is not None:
                return a + miss
        return None
    finally:  # nothing returns while a copy or a hash still reads the views
        try:
            if hashing is not None:
                hashing()
        finally:
            for c in pending:
                c.wait()
