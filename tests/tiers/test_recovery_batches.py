"""A restart's recovery in batches (kvstore.movers.recovery) leaves the same index and the same
policy order as the one-record-at-a-time pass it replaced (``Level.recover``, kept here as the
reference), whatever the batch size: one batch of everything, batches of 7, batches of 1. A real
segment tier on disk, the sidecar's default policy."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from kvstore.checksum import checksum
from kvstore.config import Config
from kvstore.keys import Namespace, namespace_root, prefix_keys
from kvstore.movers.level import Level
from kvstore.movers.recovery import Recovery
from kvstore.policy import make_policy
from kvstore.policy.leaves import Leaves
from kvstore.policy.tree import PrefixLinks
from kvstore.stats.counters import Stats
from kvstore.store.books.index import SSD, Block, Index, State
from kvstore.tiers.base import BlockMeta, BlockRef
from kvstore.tiers.segments.tier import SegmentTier

NS = Namespace(model="tiny-llama", kv_layout="raw", dtype="float16", block_size=16)
PROMPTS, CHAIN, BLOCK = 40, 5, 4096


def write(ssd: Path) -> None:
    tier = SegmentTier(ssd, 1 << 30)
    root = namespace_root(NS)
    items = []
    for p in range(PROMPTS):
        keys = prefix_keys(NS, [p] * (16 * CHAIN))
        for i, k in enumerate(keys):
            data = bytes([p, i]) * (BLOCK // 2 - (p % 3))  # three sizes: tails among them
            parent = keys[i - 1] if i else b""
            items.append((BlockMeta(BlockRef(root, k), parent, len(data), checksum(data), NS.label), memoryview(data)))

    async def put() -> None:
        for a in range(0, len(items), 64):
            await tier.put_many(items[a : a + 64])
        await tier.close()

    asyncio.run(put())


async def one_by_one(lv: Level, index: Index) -> int:
    """The recovery before batches (main's ``Level.recover``, verbatim but for ``self``)."""
    found = 0
    async for meta in lv.tier.scan():  # type: ignore[attr-defined]
        ns = index.namespace(meta.ref.ns, meta.label or meta.ref.ns.hex()[:16], tenant=meta.tenant)
        b = ns.blocks.get(meta.ref.key)
        if b is None:
            b = index.add(ns, meta.ref.key, meta.parent, meta.size, State.COMMITTED)
            b.seal(meta.checksum)
        elif b.checksum != meta.checksum:
            continue
        lv.place(b)
        found += 1
    return found


def books(index: Index, lv: Level) -> Any:
    """The index's and the level's state, and every attribute of the level's policy (its ticks,
    queues, links, leaf entries), each block as its key, dicts and sets as their items in order."""

    def plain(v: Any) -> Any:
        if isinstance(v, Block):
            return ("block", v.key, v.parent, v.size, v.depth, v.state, v.tiers, v.checksum)
        if isinstance(v, (Leaves, PrefixLinks)):
            return plain({f: getattr(v, f) for f in type(v).__slots__})
        if isinstance(v, dict):
            return [(plain(k), plain(x)) for k, x in v.items()]
        if isinstance(v, set):  # (in no order: a set of Blocks iterates by their addresses)
            return sorted(plain(x) for x in v)
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v

    spaces = [(ns.root, plain(ns.blocks), plain(ns.visible), plain(ns.visible_sizes))
              for ns in index.namespaces.values()]
    policy = {k: plain(v) for k, v in vars(lv.policy).items() if k != "band"}
    return spaces, plain(lv.placement.sizes), lv.used, policy


def recovered(ssd: Path, batch: int) -> tuple[list[bytes], list[bytes], int, Any]:
    """The blocks the index holds, the policy's victims in order until none is left, the
    batches, and the books (:func:`books`) after a recovery in batches of ``batch`` (0: the
    reference, one by one)."""

    async def run() -> tuple[list[bytes], list[bytes], int, Any]:
        tier = SegmentTier(ssd, 1 << 30)
        index = Index()
        lv = Level("ssd", SSD, tier, index, Stats(), capacity=1 << 30,
                   policy=make_policy(Config().index.policy), footprint=tier.footprint)
        if batch:
            rec = Recovery([lv], index, batch)
            assert await rec.run() == PROMPTS * CHAIN
            batches = rec.batches
        else:
            assert await one_by_one(lv, index) == PROMPTS * CHAIN
            batches = 0
        held = sorted(b.key for b in lv.held)
        assert lv.policy is not None
        state = books(index, lv)
        order = []
        while (victim := lv.policy.pop_victim()) is not None:
            order.append(victim.key)
            lv.unplace(victim)
        await tier.close()
        return held, order, batches, state

    return asyncio.run(run())


def test_the_batch_size_changes_neither_the_blocks_nor_the_policy_order(tmp_path):
    write(tmp_path / "ssd")
    n = PROMPTS * CHAIN
    whole = recovered(tmp_path / "ssd", 0)
    assert len(whole[0]) == n and len(whole[1]) == n
    for batch in (n, 7, 1):
        held, order, batches, state = recovered(tmp_path / "ssd", batch)
        assert batches == -(-n // batch)
        assert held == whole[0]
        assert order == whole[1]
        assert state == whole[3]  # (the batches in bulk: Index.add_sealed, Space.place_many, insert_many)
