"""One placement owner (issue 31): the store's DRAM space and every replay (single space, tiered,
cluster) place blocks through the same :class:`~kvstore.store.books.placement.Space`, so the simulator
cannot drift from the store; and what a placement changes, in one place."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.client import KVStoreClient
from kvstore.dram.slab import Slab
from kvstore.keys import Namespace, NamespaceRoot, prefix_keys
from kvstore.policy import make_policy
from kvstore.server.sidecar import Sidecar
from kvstore.sim.cluster import replay_cluster
from kvstore.sim.replay import TierSpec, replay
from kvstore.sim.traces import multi_turn
from kvstore.store.block_store import BlockSpec, BlockStore, CommitSpec
from kvstore.store.books.index import DRAM, SSD, Block, Index, State, TierId
from kvstore.store.books.placement import Space
from kvstore.store.books.tenants import Quotas
from tests.conftest import small_config

NS = Namespace(model="m", kv_layout="raw", dtype="uint8", block_size=16)
PAGE = 65536


@pytest.fixture
def placements(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, int, str]]]:
    """Every ``Space.place`` / ``Space.unplace`` from now on: (what, tier bit, owner's class)."""
    seen: list[tuple[str, int, str]] = []
    place, unplace = Space.place, Space.unplace

    def spy_place(self: Space, b: Block) -> bool:
        seen.append(("place", self.bit, type(self).__name__))
        return place(self, b)

    def spy_unplace(self: Space, b: Block) -> bool:
        seen.append(("unplace", self.bit, type(self).__name__))
        return unplace(self, b)

    monkeypatch.setattr(Space, "place", spy_place)
    monkeypatch.setattr(Space, "unplace", spy_unplace)
    yield seen


async def test_the_store_places_through_the_space(tmp_path: Path, placements: list[tuple[str, int, str]]) -> None:
    cfg = small_config(tmp_path)
    slab = Slab(cfg.dram.capacity_bytes, cfg.dram.page_bytes, cfg.dram.min_slot_bytes, prefault=False)
    try:
        store = BlockStore(cfg, slab)
        assert isinstance(store.space.placement, Space)
        keys = prefix_keys(NS, list(range(3 * NS.block_size)))
        alloc, _ = store.allocate_now(store.namespace(NS), [BlockSpec(k, p, 4096) for k, p in zip(keys, [b"", *keys])])
        await store.commit(alloc.id, [CommitSpec(b.key, slot_id, None) for slot_id, b in alloc.blocks.items()])
        assert placements == [("place", DRAM, "Space")] * 3
        await store.delete(store.namespace(NS), keys, False)
        assert placements[3:] == [("unplace", DRAM, "Space")] * 3
    finally:
        slab.close()


async def test_the_lower_tiers_place_through_the_space(tmp_path: Path, placements: list[tuple[str, int, str]]) -> None:
    cfg = small_config(
        tmp_path, **{"ssd.enabled": True, "ssd.path": str(tmp_path / "ssd"), "ssd.capacity_bytes": 64 * PAGE}
    )
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        [ssd] = sc.store.tiering.levels  # type: ignore[attr-defined]  # the Movers of a store with tiers
        assert isinstance(ssd.placement, Space) and ssd.placement.bit == SSD
        rng = np.random.default_rng(7)
        for first in (7, 8):  # DRAM holds 4 slots: the first chain is demoted
            keys = prefix_keys(NS, [first] * (4 * NS.block_size))
            await c.put_blocks(NS, keys, [rng.integers(0, 256, PAGE, dtype=np.uint8).tobytes() for _ in keys])
        await sc.store.tiering.flush()  # type: ignore[attr-defined]
        assert ("place", SSD, "Space") in placements
        assert ssd.used == sum(ssd.held.values()) > 0


@pytest.mark.parametrize("policy", ["lru", "credit"])
def test_every_replay_places_through_the_stores_space(policy: str, placements: list[tuple[str, int, str]]) -> None:
    t = multi_turn(sessions=40, seed=5)
    cap = t.unique_blocks() // 10

    replay(t, cap, policy)
    assert {(what, bit) for what, bit, _ in placements} == {("place", DRAM), ("unplace", DRAM)}
    placements.clear()

    run = replay(t, [TierSpec(TierId.DRAM, cap), TierSpec(TierId.SSD, cap)], policy)
    assert run.tier_prefix_hits["ssd"] > 0
    assert {(what, bit) for what, bit, _ in placements} == {(w, b) for w in ("place", "unplace") for b in (DRAM, SSD)}
    placements.clear()

    run_nodes = replay_cluster(t, 2, cap // 2, "cluster", policy=policy)
    assert run_nodes.replicas > 0
    assert {(what, bit) for what, bit, _ in placements} == {("place", DRAM), ("unplace", DRAM)}
    assert {owner for *_, owner in placements} == {"ReplaySpace"}  # the store's Space, with a capacity


def _block(index: Index, ns_label: str, key: bytes, parent: bytes, size: int = 100) -> Block:
    ns = index.namespace(NamespaceRoot(b"r" * 16), ns_label)
    return index.add(ns, key, parent, size, State.COMMITTED)


def test_place_links_the_parent_the_space_holds_and_counts_the_footprint() -> None:
    index = Index()
    feed = index.subscribe()
    quotas = Quotas(0, {})
    policy = make_policy("lru")
    space = Space(SSD, policy, index, footprint=lambda size, label: size + 10, quotas=quotas)
    root, kid, other = (_block(index, "l", k, p) for k, p in ((b"a", b""), (b"b", b"a"), (b"c", b"x")))
    assert space.place(root) and space.place(kid)
    assert not space.place(kid)  # placed already: nothing changes
    assert space.place(other)  # its parent is in no space: entered as a root
    assert root.tiers == kid.tiers == SSD
    assert space.sizes == {root: 110, kid: 110, other: 110} and space.used == 330 and len(space) == 3
    assert quotas.used[""] == 330
    assert list(feed.drain()) == [root, kid, other]
    # linked: the root, the oldest, goes only after its child (unlinked, it would go first)
    assert [policy.pop_victim() for _ in range(3)] == [kid, root, other]


def test_unplace_leaves_the_policy_and_the_index_with_the_last_tier() -> None:
    index = Index()
    quotas = Quotas(0, {})
    policy = make_policy("lru")
    space = Space(SSD, policy, index, quotas=quotas)
    kept, gone = _block(index, "l", b"a", b""), _block(index, "l", b"b", b"a")
    kept.tiers = DRAM
    space.place(kept)
    space.place(gone)
    assert space.unplace(kept) and space.unplace(gone)
    assert not space.unplace(gone)  # not placed here: nothing changes
    assert kept not in policy and gone not in policy and space.used == 0 and not space.sizes
    assert not quotas.used
    assert kept.tiers == DRAM and kept.ns.blocks.get(b"a") is kept  # DRAM holds it still
    assert gone.tiers == 0 and b"b" not in gone.ns.blocks  # no tier holds it: out of the index
