"""A segment-layout SSD directory as a sidecar that stopped leaves it: blocks written by the
segment tier itself (for the restart tests: tests/tiers/test_restart_serving.py,
tests/cluster/test_cluster_republish.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from kvstore.checksum import checksum
from kvstore.keys import BlockKey, Namespace, namespace_root
from kvstore.tiers.base import BlockMeta, BlockRef
from kvstore.tiers.segments.tier import SegmentTier


async def fill_segment_dir(ssd: Path, ns: Namespace, blocks: Sequence[tuple[BlockKey, bytes]]) -> None:
    """``blocks`` (key, bytes) of namespace ``ns``, each its own prompt, in a segment directory at ``ssd``."""
    tier = SegmentTier(ssd, 1 << 30)
    root = namespace_root(ns)
    await tier.put_many([(BlockMeta(BlockRef(root, k), b"", len(data), checksum(data), ns.label), memoryview(data))
                         for k, data in blocks])
    await tier.close()


def write_segment_dir(ssd: Path, ns: Namespace, blocks: Sequence[tuple[BlockKey, bytes]]) -> None:
    """:func:`fill_segment_dir` outside an event loop."""
    asyncio.run(fill_segment_dir(ssd, ns, blocks))
