"""Retention bounds and costs on one real sidecar (kvstore/store/books/retention.py): the total bound per
tier (``tenants.retained_fraction``, kvstore/store/books/hint_budget.py) that free salts cannot pass, a
block retained on the SSD and promoted past its tenant's DRAM bound (promoted unretained, counted
as refused), a key given twice in one Retain counted once, the refused counts bounded to
``server.stats_namespaces`` tenants, and what the soft pin costs counted as work (candidates judged
per victim, blocks summed per hinted call), however many blocks are retained. Real gRPC, a real SSD
directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.client import KVStoreClient
from kvstore.errors import ResourceExhausted
from kvstore.keys import Namespace, prefix_keys, salt_tag
from kvstore.server.sidecar import Sidecar
from kvstore.store.books.index import TOP_LABEL
from tests.conftest import small_config

BLOCK = 4096
MINUTE = 60_000


def ns(salt: str) -> Namespace:
    return Namespace(model="m", kv_layout="raw", dtype="uint8", block_size=16, cache_salt=salt)


def keys(n: Namespace, seed: int, count: int) -> list[bytes]:
    """``count`` unrelated one-block prompts (each a root: every block a leaf)."""
    return [prefix_keys(n, [seed * 100_000 + i] * 16)[0] for i in range(count)]


def data(count: int, seed: int = 1) -> list[np.ndarray]:
    return [np.full(BLOCK, (seed + i) % 251, np.uint8) for i in range(count)]


async def put(c: KVStoreClient, n: Namespace, ks: list[bytes], retain: tuple[int, int] = (0, 0)) -> None:
    await c.put_blocks(n, ks, data(len(ks)), parents=[b""] * len(ks), retain=retain)


def cfg(tmp_path: Path, **more: Any) -> Any:
    return small_config(tmp_path, **{"dram.min_slot_bytes": BLOCK, **more})  # 64 slots of 4 KiB


async def test_free_salts_cannot_retain_more_than_the_tiers_share(tmp_path: Path) -> None:
    """Each salt within its own bound (8 blocks), 6 salts: all together may retain 0.6 of the 64
    blocks (tenants.retained_fraction's default: 38), so the fifth salt's hint is shortened to its
    leading 6 blocks and the sixth's refused; both commits are served, their blocks stored
    unretained (66d9839 had no total: 48 blocks retained)."""
    async with Sidecar(cfg(tmp_path, **{"tenants.dram_retained_bytes": 8 * BLOCK})) as sc, \
            KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        for s in range(6):
            await put(c, ns(f"s{s}"), keys(ns(f"s{s}"), s, 8), retain=(MINUTE, 0))
        retained = (await c.stats())["retained"]
        assert retained["totals"] == {"dram": int(0.6 * 64 * BLOCK)}
        assert retained["bytes"] == {"dram": 38 * BLOCK}
        assert retained["tenants"]["dram"][salt_tag("s4")] == 6 * BLOCK
        assert salt_tag("s5") not in retained["tenants"]["dram"]
        assert retained["budget"].pop("worth")["scale"] == 1.0  # nothing judged yet
        assert retained["budget"] == {"fraction": 0.6, "shortened": 1, "refused": 1}
        assert retained["refused"] == {}  # no tenant passed its own bound
        entry = sc.store.index.namespaces[ns("s4").root]
        now = sc.store.clock()
        assert [entry.blocks[k].retain_until > now for k in keys(ns("s4"), 4, 8)] == [True] * 6 + [False] * 2
        assert (await c.lookup(ns("s5"), keys(ns("s5"), 5, 8))).matched == 8  # the refused hint's Commit is served
        assert await c.retain(ns("s5"), keys(ns("s5"), 5, 8), MINUTE) == 0  # and a Retain holds none of them


async def test_a_block_retained_on_ssd_is_promoted_unretained_past_the_dram_bound(tmp_path: Path) -> None:
    """Retain 16 blocks that sit on the SSD only (no SSD bound), then Acquire them: promoted into
    DRAM, where the tenant's bound is 8 blocks, the ninth on are promoted unretained and counted
    as refused (66d9839: all 16 promoted still retained, twice the bound)."""
    config = cfg(tmp_path, **{"ssd.enabled": True, "ssd.path": str(tmp_path / "ssd"), "ssd.capacity_bytes": 1 << 22,
                              "tenants.dram_retained_bytes": 8 * BLOCK})
    agent, other = ns("agent"), ns("other")
    async with Sidecar(config) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        kept = keys(agent, 1, 16)
        await put(c, agent, kept)
        await put(c, other, keys(other, 2, 64))  # pushes the 16 out of DRAM onto the SSD
        await sc.store.tiering.flush()
        entry = sc.store.index.namespaces[agent.root]
        assert {TOP_LABEL[entry.blocks[k].tiers] for k in kept} == {"ssd"}
        assert await c.retain(agent, kept, MINUTE) == 16  # no bound on the SSD: taken
        async with c.acquire(agent, kept) as lease:
            assert len(lease.keys) == 16
        retained = (await c.stats())["retained"]
        tag = salt_tag("agent")
        assert retained["tenants"]["dram"] == {tag: 8 * BLOCK}
        assert retained["refused"] == {tag: 8}
        assert sum(entry.blocks[k].retain_until > sc.store.clock() for k in kept) == 8


async def test_a_key_given_twice_in_one_retain_counts_once(tmp_path: Path) -> None:
    agent = ns("agent")
    async with Sidecar(cfg(tmp_path)) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        k = keys(agent, 1, 1)
        await put(c, agent, k)
        assert await c.retain(agent, k * 60_000, MINUTE) == 1  # (66d9839: 60,000, "491 MB retained")
        assert (await c.stats())["retained"]["bytes"] == {"dram": BLOCK}


async def test_refused_counts_are_kept_for_the_shown_tenants_only(tmp_path: Path) -> None:
    """40 salts each refused once, 4 tenants shown: 4 counts and one ``other`` (66d9839: 40 kept
    for ever, one series each)."""
    config = cfg(tmp_path, **{"tenants.dram_retained_bytes": BLOCK - 1, "server.stats_namespaces": 4})
    async with Sidecar(config) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        for s in range(40):
            n = ns(f"salt{s}")
            await put(c, n, keys(n, s, 1))
            with pytest.raises(ResourceExhausted, match=r"tenants\.dram_retained_bytes"):
                await c.retain(n, keys(n, s, 1), MINUTE)
        refused = (await c.stats())["retained"]["refused"]
        assert len(refused) == 5 and refused["other"] == 36 and sum(refused.values()) == 40


async def test_a_victim_among_many_retained_blocks_judges_a_handful(tmp_path: Path) -> None:
    """A 1,024-slot slab full of one tenant's retained blocks; another tenant writes 100 blocks,
    each evicting one (its own unretained first, then the retained): the candidates judged per
    victim stay a handful (66d9839 walked every retained block on every eviction), and a hinted
    one-block commit sums one block, not the 1,024 retained."""
    config = cfg(tmp_path, **{"dram.capacity_bytes": 1 << 22, "dram.page_bytes": 1 << 20,
                              "tenants.retained_fraction": 1, "tenants.dram_retained_bytes": 1 << 22})
    filler, writer = ns("filler"), ns("writer")
    async with Sidecar(config) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        for part in range(4):
            await put(c, filler, keys(filler, 10 + part, 256), retain=(MINUTE, 0))
        assert (await c.stats())["retained"]["blocks"] == 1024
        work = (await c.stats())["retained"]["work"]
        for w in range(100):
            await put(c, writer, keys(writer, 1000 + w, 1), retain=(MINUTE if w % 2 else 0, 0))
        after = (await c.stats())["retained"]["work"]
        examined = after.get("examined", 0) - work.get("examined", 0)
        assert 100 <= examined <= 4 * 100  # (a victim each write)
        assert after["summed"] - work["summed"] == 50  # the 50 hinted commits' own blocks
        assert (await c.stats())["retained"]["blocks"] == 1024  # 50 retained victims, 50 hinted writes


def test_a_total_bound_out_of_range_is_refused_naming_the_field(tmp_path: Path) -> None:
    from kvstore.errors import ConfigError

    with pytest.raises(ConfigError, match=r"tenants\.retained_fraction: Input should be less than or equal to 1"):
        cfg(tmp_path, **{"tenants.retained_fraction": 1.5})
