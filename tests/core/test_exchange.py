"""The store's door for the cluster (kvstore/store/exchange.py) and the index's change feed, on a
store without a cluster: what a peer fetch, an adoption and a lend do to the store, checked by the
audit.

A peer fetch's blocks are ALLOCATED while their bytes arrive. They used to be made by the cluster
node itself (Index.add, DramSpace.take_slot) and belonged to no allocation, so the audit let an
ALLOCATED block of no allocation through whenever a cluster was wired in. Now they belong to a
Reservation the audit knows: on a store without a cluster, with a fetch's reservation open, the
audit is clean; once no request is in flight, an open reservation is a finding."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.checksum import checksum
from kvstore.dram.slab import Slab
from kvstore.keys import Namespace, prefix_keys
from kvstore.store.block_store import BlockSpec, BlockStore, CommitSpec
from kvstore.store.books.index import DRAM, REDIS, State
from kvstore.store.remote import PeerBlock
from tests.conftest import small_config
from tests.support.audit import audit

NS = Namespace(model="tiny-llama", kv_layout="raw", dtype="float16", block_size=16)
SIZE = 8192


@pytest.fixture
def store(tmp_path: Path) -> Iterator[BlockStore]:
    cfg = small_config(tmp_path)
    slab = Slab(cfg.dram.capacity_bytes, cfg.dram.page_bytes, cfg.dram.min_slot_bytes, prefault=False)
    try:
        yield BlockStore(cfg, slab)
    finally:
        slab.close()


async def put(store: BlockStore, keys: list[bytes], fill: int) -> None:
    """Commit ``keys`` as one prefix, without checksums (unsealed)."""
    alloc, slots = store.allocate_now(
        store.namespace(NS), [BlockSpec(k, p, SIZE) for k, p in zip(keys, [b"", *keys[:-1]])]
    )
    for slot in slots:
        assert slot is not None
        store.slab.view(slot, SIZE)[:] = fill
    await store.commit(alloc.id, [CommitSpec(b.key, slot_id, None) for slot_id, b in alloc.blocks.items()])


def test_a_peer_fetch_reserves_slots_in_an_allocation_the_audit_knows_and_settles_its_intact_run(
    store: BlockStore,
) -> None:
    keys = prefix_keys(NS, list(range(3 * NS.block_size)))
    holders = [PeerBlock("other", DRAM, SIZE, 0) for _ in keys]
    r = store.exchange.reserve(store.namespace(NS), keys, b"", 1, holders)
    assert len(r) == 3 and all(b.state is State.ALLOCATED and b.slot is not None for b in r.blocks)
    assert audit(store) == []  # a fetch in flight: its blocks are the reservation's
    assert any("reservation" in f for f in audit(store, quiescent=True))  # nothing in flight: one is left open
    views = r.views(0, 3)
    for v in views[:2]:
        v[:] = 5
    sums = [checksum(v) for v in views[:2]]
    assert r.settle(sums) == 2  # the first two arrived intact, the third did not
    entry = store.namespace(NS)
    placed = [entry.blocks[k] for k in keys[:2]]
    assert all(b.state is State.COMMITTED and b.replica and b.tiers == DRAM for b in placed)
    assert [b.checksum for b in placed] == sums
    assert keys[2] not in entry.blocks  # never visible: its slot went back and it left the index
    assert store.index.leading_run(entry, keys) == placed
    assert audit(store, quiescent=True) == []


async def test_a_reservation_stops_at_a_key_stored_here_meanwhile(store: BlockStore) -> None:
    keys = prefix_keys(NS, list(range(3 * NS.block_size)))
    await put(store, keys[1:2], 1)
    r = store.exchange.reserve(store.namespace(NS), keys, b"", 1, [PeerBlock("other", DRAM, SIZE) for _ in keys])
    assert [b.key for b in r.blocks] == keys[:1]
    assert r.settle([]) == 0
    assert audit(store, quiescent=True) == []


def test_a_shared_tier_block_this_node_lacks_the_tier_of_is_not_adopted(store: BlockStore) -> None:
    keys = prefix_keys(NS, list(range(NS.block_size)))
    assert store.exchange.adopt(store.namespace(NS), keys[0], b"", SIZE, REDIS, 7, 1) is None  # no movers, no Redis
    assert keys[0] not in store.namespace(NS).blocks
    assert audit(store, quiescent=True) == []


async def test_a_lent_run_is_leased_sealed_and_released(store: BlockStore) -> None:
    keys = prefix_keys(NS, list(range(2 * NS.block_size)))
    await put(store, keys, 9)
    entry = store.namespace(NS)
    run = store.index.leading_run(entry, keys)
    assert all(b.checksum is None for b in run)  # unsealed: the lend hashes them
    loan = await store.exchange.lend(run, 60.0)
    assert loan is not None and len(loan.blocks) == 2 and loan.left_s() > 0
    expected = checksum(np.full(SIZE, 9, dtype=np.uint8))
    assert [c for c, _ in loan.blocks] == [expected, expected] == [b.checksum for b in run]
    assert all(b.leases == 1 for b in run) and len(store.index.leases) == 1
    loan.release()
    loan.release()  # (twice: the second finds it gone)
    assert all(b.leases == 0 for b in run) and not store.index.leases
    assert await store.exchange.lend([], 60.0) is None
    assert audit(store, quiescent=True) == []


async def test_a_loan_carries_each_blocks_retention_now_and_a_settle_adopts_what_the_answer_gave(
    store: BlockStore,
) -> None:
    """The holder's side tells each block's retention now (ms left, priority); the fetcher's side
    retains a settled block for what its holder's answer gave, on its own clock (the PeerBlock, a
    directory record's, has no retention to give)."""
    keys = prefix_keys(NS, list(range(2 * NS.block_size)))
    await put(store, keys, 3)
    entry = store.namespace(NS)
    run = store.index.leading_run(entry, keys)
    store.retention.retain(run[:1], 60_000, 2)
    loan = await store.exchange.lend(run, 60.0)
    assert loan is not None
    (left, priority), unretained = loan.retained
    assert 59_000 < left <= 60_000 and priority == 2 and unretained == (0, 0)
    loan.release()

    fetched = prefix_keys(NS, list(range(100 * NS.block_size, 103 * NS.block_size)))
    r = store.exchange.reserve(store.namespace(NS), fetched, b"", 1, [PeerBlock("other", DRAM, SIZE) for _ in fetched])
    views = r.views(0, 3)
    for v in views:
        v[:] = 4
    assert r.settle([checksum(v) for v in views], [(30_000, 1), (0, 0), (86_400_000, 3)]) == 3
    placed = [store.namespace(NS).blocks[k] for k in fetched]
    now = store.clock()
    assert 29 < placed[0].retain_until - now <= 30 and placed[0].retain_priority == 1
    assert placed[1].retain_until == 0.0
    assert 86_399 < placed[2].retain_until - now <= 86_400 and placed[2].retain_priority == 3
    assert store.retention.count() == 3  # the lent one and two adopted
    assert audit(store, quiescent=True) == []


async def test_the_change_feed_holds_what_changed_since_its_last_drain(store: BlockStore) -> None:
    keys = prefix_keys(NS, list(range(2 * NS.block_size)))
    await put(store, keys[:1], 1)  # before any subscription: nothing kept
    feed = store.index.subscribe()
    assert not feed
    await put(store, keys[1:], 2)
    entry = store.namespace(NS)
    new = entry.blocks[keys[1]]
    assert feed.drain() == {new: True}  # committed: new here
    assert not feed
    old = entry.blocks[keys[0]]
    store.space.remove(old)  # left DRAM, and the index: it moved
    assert feed.drain() == {old: False}
    feed.restore({new: True, old: False})  # a failed pass puts its changes back, before the later ones
    store.space.remove(new)
    assert list(feed.drain().items()) == [(new, True), (old, False)]
    store.index.unsubscribe()
    await put(store, keys[:1], 3)
    assert not feed
