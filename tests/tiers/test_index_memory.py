"""The sidecar's memory per block held on the SSD tier (issue 41 item 1, the compact index): a
restart's recovery of a real segment tier into the index and a level with the server's policies,
the bytes it leaves allocated counted with ``tracemalloc`` (deterministic: no timing), per block.

On main before the compact index (64f3aff) this was 1,245 B a block with the credit policy and
1,000 B with LRU (at these 20,000 blocks): a 64-byte root + key built for the tier's dict, the key
held again in its 128-byte record, the parent a bytes object of its own, a size and a footprint int
per block, and four dict entries a block in the credit policy. The compact index took 813 B and
627 B (1c33cf0); its second step (a twelve-slot ``Block``, one dict a namespace, the credit
policy's fresh blocks marked, not kept in a set) 678 B and 587 B. The bounds leave ~2-5 % over
that (both fail on 1c33cf0), so that a change that puts a per-block object back fails."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import sys
import tracemalloc
from pathlib import Path

import pytest

from kvstore.keys import BlockKey, Namespace, namespace_root
from kvstore.movers.level import Level
from kvstore.movers.recovery import Recovery
from kvstore.policy import make_policy
from kvstore.stats.counters import Stats
from kvstore.store.books.index import SSD, Index, State
from kvstore.tiers.base import BlockMeta, BlockRef
from kvstore.tiers.file_io import DiskSettings
from kvstore.tiers.segments.tier import SegmentTier

NS = Namespace(model="index-memory", kv_layout="raw", dtype="float16", block_size=16)
BLOCKS, CHAIN, SIZE = 20_000, 16, 4096


def key(i: int) -> BlockKey:
    return BlockKey(hashlib.blake2b(i.to_bytes(8, "big"), digest_size=32).digest())


def write(ssd: Path) -> None:
    """``BLOCKS`` blocks in prompts of ``CHAIN``, each linked to its parent."""
    root, payload = namespace_root(NS), memoryview(bytes(SIZE))
    metas = [
        BlockMeta(BlockRef(root, key(i)), key(i - 1) if i % CHAIN else b"", SIZE, i * 2654435761 % (1 << 63), NS.label)
        for i in range(BLOCKS)
    ]

    async def put() -> None:
        tier = SegmentTier(ssd, 1 << 40, DiskSettings(fsync=False))
        for a in range(0, BLOCKS, 64):
            await tier.put_many([(m, payload) for m in metas[a : a + 64]])
        await tier.close()

    asyncio.run(put())


def bytes_per_block(ssd: Path, policy: str) -> tuple[float, Index]:
    """The tier opened and recovered into an index and a level: the bytes left allocated, per block."""

    async def recover() -> tuple[int, Index, SegmentTier]:
        tier = SegmentTier(ssd, 1 << 40, DiskSettings(fsync=False))
        index = Index()
        lv = Level("ssd", SSD, tier, index, Stats(), capacity=1 << 40, policy=make_policy(policy),
                   footprint=tier.footprint)
        found = await Recovery([lv], index).run()
        held.append(lv)
        return found, index, tier

    held: list[Level] = []
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        found, index, tier = asyncio.run(recover())
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert found == BLOCKS
    asyncio.run(tier.close())
    return (after - before) / BLOCKS, index


@pytest.fixture(scope="module")
def ssd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("index-memory") / "ssd"
    write(path)
    return path


@pytest.mark.parametrize(("policy", "bound"), [("credit", 710), ("lru", 600)])
def test_a_block_held_on_the_ssd_tier_takes_at_most_the_compact_index_bytes(ssd: Path, policy: str, bound: int) -> None:
    per_block, _ = bytes_per_block(ssd, policy)
    assert per_block <= bound, f"{per_block:.0f} B a block with {policy}"


def test_a_recovered_block_shares_its_parent_key_with_its_parent(ssd: Path) -> None:
    """The parent link is the parent block's own key object, not equal bytes of its own."""
    _, index = bytes_per_block(ssd, "lru")
    (entry,) = index.namespaces.values()
    children = [b for b in entry.blocks.values() if b.parent]
    assert len(children) == BLOCKS - BLOCKS // CHAIN
    assert all(b.parent is entry.blocks[b.parent].key for b in children)


def test_a_block_keeps_its_rare_fields_aside_while_they_are_unset() -> None:
    """A ``Block`` is twelve slots (issue 41): its replica mark and retention share one, which holds
    a side object only while the mark or the retention is set (on main, 14 slots a block: 144
    bytes). Its pins and DRAM slot are slots of their own: a lease or a mover allocates nothing."""
    index = Index()
    entry = index.namespace(namespace_root(NS), NS.label, NS)
    blocks = [index.add(entry, key(i), b"", SIZE, State.COMMITTED if i else State.ALLOCATED) for i in range(1_000)]
    assert max(map(sys.getsizeof, blocks)) <= 32 + 12 * 8  # (object and GC headers, 16 B each)

    def held() -> int:
        gc.collect()
        return tracemalloc.get_traced_memory()[0]

    tracemalloc.start()
    try:
        before = held()
        lease = index.take_lease(blocks, deadline=1.0)
        index.start_moving(blocks)
        assert all(b.leases == 1 and b.moving == 1 and b.pinned for b in blocks)
        assert held() - before <= 8 * len(blocks) + 1_000  # (the lease's list of them: no object a block)
        index.stop_moving(blocks)
        index.release_lease(lease.id)
        del lease
        index.publish(blocks[0], replica=True)  # (fetched from a peer: its replica mark kept aside)
        assert not any(b.pinned for b in blocks) and blocks[0].replica
        after = held()
    finally:
        tracemalloc.stop()
    assert 40 <= after - before <= 1_000  # the replica's side object alone
    assert [(b.leases, b.moving, b.replica, b.slot, b.retain_until, b.retain_priority) for b in blocks[:2]] == [
        (0, 0, True, None, 0.0, 0),
        (0, 0, False, None, 0.0, 0),
    ]


def test_a_namespace_keeps_one_dict_entry_a_block() -> None:
    """A namespace's blocks are one dict; what lookups see (``visible``, the committed ones) is a
    view of it, not a second dict (issue 41); the few being written are listed apart (``pending``),
    so that a lookup's run stops at them. The index's bytes a block, less the ``Block``s
    themselves: one dict entry's, 38 B at these 20,000 blocks (main's two: 68 B)."""
    index = Index()
    entry = index.namespace(namespace_root(NS), NS.label, NS)
    keys = [key(i) for i in range(BLOCKS)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        states = [State.COMMITTED if i % 100 else State.ALLOCATED for i in range(BLOCKS)]  # (1 in 100 being written)
        blocks = [index.add(entry, k, b"", SIZE, state) for k, state in zip(keys, states, strict=True)]
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    per_block = (grown - sum(map(sys.getsizeof, blocks)) - sys.getsizeof(blocks)) / BLOCKS
    assert per_block <= 50, f"{per_block:.0f} B a block in the index's dicts"
    assert len(entry.visible) == BLOCKS - BLOCKS // 100 and len(entry.blocks) == BLOCKS
    assert entry.visible.get(keys[0]) is None and keys[0] not in entry.visible and entry.blocks[keys[0]] is blocks[0]
    assert Index.leading_run(entry, keys[1:5]) == blocks[1:5]
    assert Index.leading_run(entry, keys[99:102]) == blocks[99:100]  # (stops at the one being written)
    index.publish(blocks[100])
    assert entry.visible[keys[100]] is blocks[100] and Index.leading_run(entry, keys[99:102]) == blocks[99:102]
    index.drop(blocks[1])
    assert keys[1] not in entry.visible and len(entry.visible) == BLOCKS - BLOCKS // 100
    index.drop(blocks[200])  # (being written: it leaves the blocks being written too)
    assert len(entry.pending) == BLOCKS // 100 - 2 and keys[200] not in entry.pending
    assert Index.leading_run(entry, keys[199:202]) == blocks[199:200]
