"""DRAM space: a request that cannot fit is refused before it evicts anything, and slab pages move
between size classes (issue 16, defects 1 and 7). Through a real sidecar over gRPC and its local
socket, plus the slab's page bookkeeping on its own."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections.abc import AsyncIterator, Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.client import KVStoreClient
from kvstore.dram.slab import Slab, Slot
from kvstore.errors import ConfigError, InvalidArgument, ResourceExhausted
from kvstore.keys import Namespace, prefix_keys
from kvstore.server.sidecar import Sidecar
from kvstore.store.books.index import DRAM
from tests.conftest import small_config

MiB = 1 << 20
SMALL, BIG = 4096, 2 * MiB  # 1,024 small slots or two big ones to a 4 MiB page
NS = Namespace(model="m", kv_layout="raw", dtype="uint8", block_size=16)


@pytest.fixture(params=["lru", "credit"])
async def env(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[tuple[Sidecar, KVStoreClient]]:
    """The issue's sidecar: `--dram-bytes 16777216`, SSD off (four 4 MiB pages)."""
    overrides = {"dram.capacity_bytes": 16 * MiB, "dram.page_bytes": 4 * MiB, "index.policy": request.param}
    cfg = small_config(tmp_path, **overrides)
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        yield sc, c


def chain(first_token: int, n: int) -> list[bytes]:
    return prefix_keys(NS, range(first_token, first_token + n * NS.block_size))


def blocks(n: int, size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


async def dram(c: KVStoreClient) -> dict[str, Any]:
    """What the sidecar reports of its DRAM: occupancy (per class pages and slots) and counters."""
    d = (await c.stats())["tiers"]["dram"]
    return {k: d[k] for k in ("used_bytes", "free_pages", "page_moves", "classes", "blocks", "evictions")}


def check_slots(sc: Sidecar) -> None:
    """Every block in DRAM owns its slot: the slot names it, lies in a page cut for its class, and
    no two blocks' slots overlap."""
    spans = []
    for ns in sc.store.index.namespaces.values():
        for b in ns.blocks.values():
            if b.tiers & DRAM or b.slot is not None:
                slot: Slot = b.slot  # type: ignore[assignment]  # Block.slot is typed object
                assert slot.holder is b
                assert sc.slab.page_of(slot).cls == slot.cls
                spans.append((slot.offset, slot.offset + slot.capacity))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in pairwise(spans))


async def test_a_put_that_cannot_fit_is_refused_before_it_evicts(env):
    sc, c = env
    first = chain(0, 1000)
    data = blocks(1000, SMALL, seed=1)
    await c.put_blocks(NS, first, data)
    before = await dram(c)
    assert before["classes"] == {str(SMALL): {"pages": 1, "used_slots": 1000, "free_slots": 24}}

    too_big = r"blocks: the new blocks \(5000 x 4096 B\) need 5 pages of 4194304 bytes; DRAM has 4"
    with pytest.raises(ResourceExhausted, match=too_big):
        await c.put_blocks(NS, chain(10**6, 5000), [np.ones(SMALL, np.uint8)] * 5000)

    assert (await c.lookup(NS, first)).matched == 1000
    assert await dram(c) == before  # no eviction, no page kept by the refused request
    assert [g.tobytes() for g in await c.get_blocks(NS, first[:3], verify=True)] == [d.tobytes() for d in data[:3]]
    check_slots(sc)


async def test_pages_freed_by_deletes_serve_another_size_class(env):
    sc, c = env
    await c.put_blocks(NS, chain(0, 4096), blocks(4096, SMALL, seed=2))  # every page in the 4 KiB class
    assert (await dram(c))["free_pages"] == 0
    assert await c.delete(NS, all_keys=True) == (4096, 0)
    occ = await dram(c)
    assert (occ["used_bytes"], occ["free_pages"], occ["classes"]) == (0, 4, {})

    big = chain(3 * 10**6, 8)
    data = blocks(8, BIG, seed=4)
    assert (await c.put_blocks(NS, big, data)).stored == 8  # all 16 MiB, in the 2 MiB class now
    assert [g.tobytes() for g in await c.get_blocks(NS, big, verify=True)] == [d.tobytes() for d in data]
    assert (await dram(c))["classes"] == {str(BIG): {"pages": 4, "used_slots": 8, "free_slots": 0}}
    check_slots(sc)


async def test_a_full_slab_evicts_a_page_of_small_blocks_for_a_big_one(env):
    sc, c = env
    small = [chain(k * 10**5, 1024) for k in range(4)]  # one chain to a page, the first written oldest
    for k, keys in enumerate(small):
        await c.put_blocks(NS, keys, blocks(1024, SMALL, seed=10 + k))
    kept = blocks(1, SMALL, seed=11)[0]  # chain 1's first block
    big, data = chain(9 * 10**6, 1), blocks(1, BIG, seed=5)

    assert (await c.put_blocks(NS, big, data)).stored == 1
    assert [g.tobytes() for g in await c.get_blocks(NS, big, verify=True)] == [data[0].tobytes()]
    # The policy's victim is the oldest chain's leaf: its page went, every block on it, nothing else.
    assert [(await c.lookup(NS, keys)).matched for keys in small] == [0, 1024, 1024, 1024]
    assert (await c.get_blocks(NS, small[1][:1]))[0].tobytes() == kept.tobytes()
    occ = await dram(c)
    assert occ["classes"] == {str(SMALL): {"pages": 3, "used_slots": 3072, "free_slots": 0},
                              str(BIG): {"pages": 1, "used_slots": 1, "free_slots": 1}}
    assert (occ["page_moves"], occ["evictions"]) == (1, 1024)
    check_slots(sc)

    # And back: a small block takes the big class's page once the big block is the oldest.
    for k in (1, 2, 3):
        assert (await c.lookup(NS, small[k])).matched == 1024
    more = chain(8 * 10**6, 1)
    await c.put_blocks(NS, more, blocks(1, SMALL, seed=6))
    assert (await c.lookup(NS, big)).matched == 0
    assert (await dram(c))["classes"][str(SMALL)]["pages"] == 4
    check_slots(sc)


async def test_leased_blocks_keep_their_pages(env):
    sc, c = env
    small = [chain(k * 10**5, 1024) for k in range(4)]
    for k, keys in enumerate(small):
        await c.put_blocks(NS, keys, blocks(1024, SMALL, seed=20 + k))
    leases = [(await c.lookup(NS, [keys[500]], lease_ttl_ms=60_000)).lease_id for keys in small]
    before = await dram(c)
    big = chain(9 * 10**6, 1)

    with pytest.raises(ResourceExhausted, match="leased"):  # every page holds a leased block
        await c.put_blocks(NS, big, blocks(1, BIG, seed=7))
    assert await dram(c) == before
    assert [(await c.lookup(NS, keys)).matched for keys in small] == [1024] * 4

    await c.release(leases[2])  # now the page of chain 2 may go, and only it
    assert (await c.put_blocks(NS, big, blocks(1, BIG, seed=7))).stored == 1
    assert [(await c.lookup(NS, keys)).matched for keys in small] == [1024, 1024, 0, 1024]
    check_slots(sc)


async def test_one_request_of_two_sizes_moves_a_page_between_its_own_classes(env):
    """A full slab of small blocks and a put of 100 small blocks plus one big one: the small class
    gives a page and still holds its own 100 (the old code evicted 100 blocks, then refused)."""
    sc, c = env
    small = [chain(k * 10**5, 1024) for k in range(4)]
    for k, keys in enumerate(small):
        await c.put_blocks(NS, keys, blocks(1024, SMALL, seed=30 + k))
    keys = chain(9 * 10**6, 101)
    data = blocks(100, SMALL, seed=8) + blocks(1, BIG, seed=9)

    assert (await c.put_blocks(NS, keys, data)).stored == 101
    assert [g.tobytes() for g in await c.get_blocks(NS, keys, verify=True)] == [d.tobytes() for d in data]
    occ = await dram(c)
    assert occ["classes"] == {str(SMALL): {"pages": 3, "used_slots": 3072, "free_slots": 0},
                              str(BIG): {"pages": 1, "used_slots": 1, "free_slots": 1}}
    assert occ["evictions"] == 1024 + 100  # a page of small blocks for the big one, then 100 for the small ones
    check_slots(sc)


async def test_promoted_blocks_hold_their_slots_and_their_page_can_move(tmp_path):
    """Blocks promoted from SSD are known to their slots like written ones: their page is whole
    and moves when it holds the policy's next victim."""
    ssd = {"ssd.enabled": True, "ssd.path": str(tmp_path / "ssd"), "ssd.capacity_bytes": 64 * MiB, "ssd.fsync": False}
    cfg = small_config(tmp_path, **{"dram.capacity_bytes": 16 * MiB, "dram.page_bytes": 4 * MiB, **ssd})
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        small = [chain(k * 10**5, 1024) for k in range(5)]
        data = [blocks(1024, SMALL, seed=40 + k) for k in range(5)]
        for keys, d in zip(small, data):
            await c.put_blocks(NS, keys, d)  # the fifth chain sends the first to SSD
        got = await c.get_blocks(NS, small[0], verify=True)  # back to DRAM, in the second chain's page
        assert [g.tobytes() for g in got] == [d.tobytes() for d in data[0]]
        check_slots(sc)
        for keys in small[2:]:
            await c.lookup(NS, keys)  # the promoted chain is the oldest in DRAM now

        assert (await c.put_blocks(NS, chain(9 * 10**6, 1), blocks(1, BIG, seed=12))).stored == 1
        for keys in small[2:]:
            assert [t for t, _ in (await c.lookup(NS, keys)).blocks] == ["dram"] * 1024
        assert (await dram(c))["classes"] == {str(SMALL): {"pages": 3, "used_slots": 3072, "free_slots": 0},
                                              str(BIG): {"pages": 1, "used_slots": 1, "free_slots": 1}}
        check_slots(sc)


async def test_a_leased_leaf_does_not_keep_its_unleased_ancestors(tmp_path):
    """The policy never picks a block whose child is resident; when only such blocks are left and
    they are not leased, one still goes (the old code refused the write)."""
    async with Sidecar(small_config(tmp_path)) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        a, data = chain(0, 4), blocks(4, 65536, seed=50)  # the slab's four 64 KiB slots
        await c.put_blocks(NS, a, data)
        look = await c.lookup(NS, a[3:], lease_ttl_ms=60_000)  # the leaf only
        assert look.matched == 1
        assert (await c.put_blocks(NS, chain(10**5, 1), blocks(1, 65536, seed=51))).stored == 1
        assert (await c.get_blocks(NS, a[3:]))[0].tobytes() == data[3].tobytes()
        assert sum(k in sc.store.index.namespaces[NS.root].blocks for k in a) == 3
        check_slots(sc)


async def test_allocation_ttl_is_capped(tmp_path):
    cfg = small_config(tmp_path, **{"index.allocation_ttl_ms": 5_000, "index.max_allocation_ttl_ms": 5_000})
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        keys = chain(0, 1)
        for ttl in (5_001, 2**32 - 1):
            expected = rf"ttl_ms: {ttl} exceeds the maximum of 5000 \(index.max_allocation_ttl_ms\)"
            with pytest.raises(InvalidArgument, match=expected):
                async with c.allocate(NS, keys, SMALL, ttl_ms=ttl):
                    pass
            assert sc.store.index.count()["allocations"] == 0 and sc.slab.used_bytes == 0
        async with c.allocate(NS, keys, SMALL, ttl_ms=5_000) as alloc:
            assert sc.store.index.count()["allocations"] == 1
            await alloc.commit()
        assert (await c.lookup(NS, keys)).matched == 1


@pytest.mark.parametrize("default, cap", [("allocation_ttl_ms", "max_allocation_ttl_ms"),
                                          ("lease_ttl_ms", "max_lease_ttl_ms")])
def test_a_default_ttl_above_its_cap_is_refused_at_start(tmp_path, default: str, cap: str):
    """Otherwise every call that takes the default would be refused INVALID_ARGUMENT."""
    with pytest.raises(ConfigError, match=rf"index: .*{default} \(30000\) exceeds {cap} \(5000\)"):
        small_config(tmp_path, **{f"index.{cap}": 5_000})


async def test_the_default_allocation_ttl_cap_is_the_lease_cap(tmp_path):
    cfg = small_config(tmp_path)
    assert cfg.index.max_allocation_ttl_ms == cfg.index.max_lease_ttl_ms == 600_000
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        with pytest.raises(InvalidArgument, match="ttl_ms"):
            async with c.allocate(NS, chain(0, 1), SMALL, ttl_ms=2**32 - 1):
                pass


# --- the slab's pages ---------------------------------------------------------------------------


@pytest.fixture
def slab() -> Iterator[Slab]:
    s = Slab(4 * 65536, page_bytes=65536, min_slot_bytes=4096, prefault=False, name_prefix="kvstore-test")
    yield s
    s.close()


def take(slab: Slab, cls: int, n: int) -> list[Slot]:
    got = [slab.try_alloc(cls) for _ in range(n)]
    assert None not in got
    return got  # type: ignore[return-value]  # no None: asserted above


def pool(slab: Slab) -> int:
    return slab.occupancy()["free_pages"]  # type: ignore[return-value]  # occupancy() is typed dict[str, object]


def test_a_page_whose_slots_are_all_free_goes_back_to_the_pool(slab: Slab):
    small, whole = slab.class_of(4096), slab.class_of(65536)
    slots = take(slab, small, 17)  # a page and one slot of a second
    assert pool(slab) == 2
    slab.free(slots.pop())
    assert pool(slab) == 3  # the second page held only that slot
    for s in slots[1:]:
        slab.free(s)
    assert pool(slab) == 3  # one slot still taken: its page stays
    assert slab.occupancy()["classes"] == {"4096": {"pages": 1, "used_slots": 1, "free_slots": 15}}
    slab.free(slots[0])
    assert pool(slab) == 4 and slab.occupancy()["classes"] == {}
    assert len(take(slab, whole, 4)) == 4  # every page serves the 64 KiB class now
    assert slab.try_alloc(whole) is None and slab.occupancy()["page_moves"] == 2  # the two cut for 4 KiB


def test_slot_ids_name_one_offset_for_the_slab_s_life(slab: Slab):
    small, half = slab.class_of(4096), slab.class_of(32768)
    ids: dict[int, tuple[int, int]] = {}

    def cut(cls: int, n: int) -> set[int]:
        slots = take(slab, cls, n)
        for s in slots:
            assert ids.setdefault(s.slot_id, (s.offset, s.capacity)) == (s.offset, s.capacity)
            slab.free(s)
        return {s.slot_id for s in slots}

    first = cut(small, 64)
    assert cut(small, 64) == first  # back in the class it last served: the same slots
    other = cut(half, 8)
    again = cut(small, 64)
    assert not first & other and not again & (first | other)  # cut for another class: new ids
    assert len(ids) == 64 + 8 + 64


def test_a_page_with_a_taken_slot_is_not_cut_for_another_class(slab: Slab):
    small, whole = slab.class_of(4096), slab.class_of(65536)
    pages = [take(slab, small, 16) for _ in range(4)]  # every page in the 4 KiB class
    for slots in pages:
        for s in slots[1:]:
            slab.free(s)  # one slot kept on each page
    assert pool(slab) == 0 and slab.try_alloc(whole) is None
    slab.free(pages[2][0])
    got = slab.try_alloc(whole)
    assert got is not None and got.offset == 2 * 65536
    assert slab.occupancy()["classes"] == {"4096": {"pages": 3, "used_slots": 3, "free_slots": 45},
                                           "65536": {"pages": 1, "used_slots": 1, "free_slots": 0}}


def test_every_free_moves_the_epoch_and_the_pool_is_only_cut_when_asked(slab: Slab):
    small = slab.class_of(4096)
    epoch = slab._epoch
    slots = take(slab, small, 2)
    e0 = int(epoch[0])
    slab.free(slots[0])
    slab.free(slots[1])  # the page's last slot: it goes back to the pool, and the epoch still moves
    assert int(epoch[0]) == e0 + 2 and pool(slab) == 4
    assert slab.try_alloc(small, grow=False) is None and pool(slab) == 4
    assert slab.fits({small: 64}) and not slab.fits({small: 65})


def _segment_fds(name: str) -> list[str]:
    """This process's descriptors on the shared-memory segment ``name`` (its own and its mapping's)."""
    found = []
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):  # the descriptor iterdir itself opened, closed by now
            if (target := os.readlink(fd)).startswith(f"/dev/shm/{name}"):
                found.append(target)
    return found


@pytest.mark.parametrize("held_by", ["a variable", "a reference cycle"])
def test_a_slab_closed_under_a_live_view_closes_its_segment_once_the_view_is_gone(held_by: str):
    """A slot's view can outlive the slab's close: a caller's lease or allocation, the frames of a
    traceback a test keeps (``pytest.raises``) in a cycle with its own frame. The segment is closed
    once the last view is gone; its SharedMemory was dropped with the slab instead, and its
    ``__del__`` raised an unraisable BufferError ("cannot close exported pointers exist", in
    whichever test the collection happened to run) and left its descriptors open for good."""
    s = Slab(65536, page_bytes=65536, min_slot_bytes=4096, prefault=False, name_prefix="kvstore-test")
    name, view = s.name, s.view(s.try_alloc(0), 4096)
    unraisable: list[Any] = []
    hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        s.close()
        del s
        gc.collect()
        assert _segment_fds(name) and unraisable == []  # still mapped: the view reads the slot
        view[:] = 7
        if held_by == "a reference cycle":
            cycle: list[Any] = [view]
            cycle.append(cycle)
            del cycle
        del view
        gc.collect()  # frees the cycle; and closes what no view exports any more
    finally:
        sys.unraisablehook = hook
    assert [u.exc_value for u in unraisable] == [] and _segment_fds(name) == []
