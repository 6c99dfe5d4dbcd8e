"""A block that leaves its DRAM slot while its bytes are being hashed (kvstore/store/sealing.py).

The DRAM copies are hashed on the hash threads while the event loop runs on. A block nothing pins
(the sealer's), or whose lease or allocation ended meanwhile (the reaper, an Abort), may be
evicted then, its slot reused by another block, and the block promoted back into another slot --
or into the same one once the other block has left it (the slab hands the same slot objects out
again). The sealer used to record the checksum of what it hashed whenever the block had *a* slot
afterwards: of the other block's bytes, once and for good, so that every verified read of the
block's good copies mismatched and dropped them. A verified read whose lease ended while it hashed
dropped the block's good DRAM copy as corrupt, a lend sealed and lent the block with the other
block's checksum, and a Commit whose allocation was aborted while it hashed answered DATA_LOSS.
Now each judges only a block that held its slot throughout.

Each test makes the race happen without timing: the hash the code under test awaits is wrapped so
that the blocks move (through the store's own calls) before the real hash reads the slots, and
move again after. A real store with a real SSD tier below DRAM (four 64 KiB slots), whose
demotions are held back before they are sealed (a demotion backlog, as under a burst of
evictions): the evicted block comes back up from its staging copy still unsealed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

import kvstore.movers.demotion
import kvstore.store.sealing
from kvstore.checksum import checksum
from kvstore.dram.slab import Slab
from kvstore.errors import FailedPrecondition
from kvstore.keys import Namespace, prefix_keys
from kvstore.movers.tiering import Tiering
from kvstore.store.block_store import BlockSpec, BlockStore, CommitSpec
from kvstore.store.books.index import DRAM, Block, NsEntry
from tests.conftest import small_config
from tests.support.audit import audit

NS = Namespace(model="tiny-llama", kv_layout="raw", dtype="float16", block_size=16)
SIZE = 65536  # one slot to a page: DRAM holds four blocks


@dataclass
class Env:
    store: BlockStore
    ns: NsEntry
    now: list[float]  # the store's clock
    behind: asyncio.Event  # set: the demotions are sealed and written (until then they wait)

    def later(self, seconds: float) -> None:
        """The clock moves on, and the reaper runs: every lease past its deadline ends."""
        self.now[0] += seconds
        self.store.reap()


@pytest.fixture
async def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Env]:
    cfg = small_config(
        tmp_path,
        **{
            "ssd.enabled": True,
            "ssd.path": str(tmp_path / "ssd"),
            "ssd.capacity_bytes": 64 * SIZE,
            "dram.verify_local_reads": True,
        },
    )
    now = [1000.0]
    slab = Slab(cfg.dram.capacity_bytes, cfg.dram.page_bytes, cfg.dram.min_slot_bytes, prefault=False)
    store = BlockStore(cfg, slab, clock=lambda: now[0])
    store.tiering = await Tiering.start(store.space, cfg, store.tenants)
    behind = asyncio.Event()
    seal = kvstore.movers.demotion.seal

    async def held_back(blocks: list[Block], views: list[np.ndarray]) -> None:
        await behind.wait()
        await seal(blocks, views)

    monkeypatch.setattr(kvstore.movers.demotion, "seal", held_back)
    try:
        yield Env(store, store.namespace(NS), now, behind)
    finally:
        behind.set()
        await store.tiering.close()
        slab.close()


def data(fill: int) -> np.ndarray:
    return np.random.default_rng(fill).integers(0, 256, SIZE, dtype=np.uint8)


async def put(env: Env, first_token: int, fills: list[int], sent: bool = False) -> list[Block]:
    """A prefix of ``len(fills)`` blocks, each of ``data(fill)``, committed with or without checksums."""
    keys = prefix_keys(NS, [first_token] * (len(fills) * NS.block_size))
    store = env.store
    alloc, slots = store.allocate_now(env.ns, [BlockSpec(k, p, SIZE) for k, p in zip(keys, [b"", *keys[:-1]])])
    specs = []
    for k, slot, fill in zip(keys, slots, fills):
        assert slot is not None
        store.slab.view(slot, SIZE)[:] = data(fill)
        specs.append(CommitSpec(k, slot.slot_id, checksum(data(fill)) if sent else None))
    await store.commit(alloc.id, specs)
    env.ns = store.index.live(env.ns)
    return [env.ns.blocks[k] for k in keys]


def hashing_while(
    monkeypatch: pytest.MonkeyPatch,
    module: ModuleType,
    before: Callable[[], Awaitable[object]],
    after: Callable[[], Awaitable[object]] | None = None,
) -> None:
    """The next hash ``module`` awaits reads its slots after ``before`` and before ``after``
    (what the event loop ran while the hash threads read); the later ones are left alone."""
    real: Callable[[list[np.ndarray]], Awaitable[list[int]]] = module.checksums
    pending = [True]

    async def hook(views: list[np.ndarray]) -> list[int]:
        if not pending:
            return await real(views)
        pending.clear()
        await before()
        sums = await real(views)
        if after is not None:
            await after()
        return sums

    monkeypatch.setattr(module, "checksums", hook)


def dram_failures(env: Env) -> int:
    return env.store.stats.tiers["dram"]["checksum_failures"]


@pytest.mark.parametrize("back_in", ["another slot", "the same slot, after another block"])
async def test_the_sealer_records_no_checksum_of_bytes_a_block_left_while_they_were_hashed(
    env: Env, monkeypatch: pytest.MonkeyPatch, back_in: str
) -> None:
    store = env.store
    [a] = await put(env, 1, [1])  # unsealed: the sealer hashes it
    await put(env, 2, [2, 3, 4])  # DRAM is full; a is the least recent
    old_slot, other = a.slot, []

    async def evicted_and_reused() -> None:  # a goes down (staged), another block's bytes take its slot
        other.extend(await put(env, 3, [5]))
        assert a.slot is None and other[0].slot is old_slot

    async def back() -> None:  # promoted back from its staging copy, unsealed still
        if back_in != "another slot":
            await store.delete(env.ns, [other[0].key], False)
        assert await store.prefetch(env.ns, [a.key]) == 1
        assert (a.slot is old_slot) == (back_in != "another slot") and a.checksum is None

    hashing_while(monkeypatch, kvstore.store.sealing, evicted_and_reused, back)
    await store.seal()
    truth = checksum(data(1))
    assert a.checksum in (None, truth), "a was sealed with another block's bytes"
    await store.seal()  # (it waited for the next pass: hashed from where it is now)
    assert a.checksum == truth
    env.behind.set()
    await store.tiering.flush()
    lease, run = await store.acquire(env.ns, [a.key])  # a verified read (dram.verify_local_reads)
    assert lease is not None and run == [a] and np.array_equal(store.space.view(a), data(1))
    store.release(lease.id)
    assert dram_failures(env) == 0
    assert audit(store, quiescent=True) == []


async def test_a_verified_read_whose_lease_ended_while_it_hashed_drops_no_good_copy(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = env.store
    [a] = await put(env, 1, [1], sent=True)
    await put(env, 2, [2, 3, 4])

    async def evicted_and_reused() -> None:  # the lease ends (the reaper) and a goes down
        env.later(3600)
        await put(env, 3, [5])
        assert a.slot is None

    async def back() -> None:
        assert await store.prefetch(env.ns, [a.key]) == 1

    hashing_while(monkeypatch, kvstore.store.sealing, evicted_and_reused, back)
    lease, run = await store.acquire(env.ns, [a.key])
    assert (lease, run) == (None, [])  # a miss this time: its bytes were not all hashed
    assert dram_failures(env) == 0, "a copy never corrupt was counted corrupt"
    assert a.tiers & DRAM, "a's good DRAM copy was dropped"
    lease, run = await store.acquire(env.ns, [a.key])
    assert lease is not None and run == [a] and np.array_equal(store.space.view(a), data(1))
    store.release(lease.id)
    env.behind.set()
    await store.tiering.flush()
    assert audit(store, quiescent=True) == []


async def test_a_lend_whose_lease_ended_while_it_hashed_lends_no_checksum_of_other_bytes(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = env.store
    [a] = await put(env, 1, [1])  # unsealed: the lend hashes it
    await put(env, 2, [2, 3, 4])

    async def evicted_and_reused() -> None:
        env.later(3600)
        await put(env, 3, [5])

    async def back() -> None:
        assert await store.prefetch(env.ns, [a.key]) == 1

    hashing_while(monkeypatch, kvstore.store.sealing, evicted_and_reused, back)
    loan = await store.exchange.lend([a], 1.0)
    assert a.checksum in (None, checksum(data(1))), "a was sealed with another block's bytes"
    assert loan is None or all(c == checksum(v) for c, v in loan.blocks), "lent with another block's checksum"
    env.behind.set()
    await store.tiering.flush()
    assert a.checksum == checksum(data(1))  # (its demotion sealed it from its staging copy)
    assert audit(store, quiescent=True) == []


async def test_a_commit_whose_allocation_was_aborted_while_it_hashed_is_no_data_loss(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = env.store
    key = prefix_keys(NS, [1] * NS.block_size)[0]
    alloc, [slot] = store.allocate_now(env.ns, [BlockSpec(key, b"", SIZE)])
    assert slot is not None
    store.slab.view(slot, SIZE)[:] = data(1)

    async def aborted_and_reused() -> None:  # (an Abort, or the reaper), and the slot written again
        store.abort(alloc.id)
        [b] = await put(env, 3, [5])
        assert b.slot is slot

    hashing_while(monkeypatch, kvstore.store.sealing, aborted_and_reused)
    with pytest.raises(FailedPrecondition, match="already aborted"):
        await store.commit(alloc.id, [CommitSpec(key, slot.slot_id, checksum(data(1)))])
    assert dram_failures(env) == 0
    assert audit(store, quiescent=True) == []
