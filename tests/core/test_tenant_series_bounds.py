"""The retained and refused series are capped like the other tenant series (issue 37, part 5): a
cache salt is free, so 2,000 salts that each retain a block, or are each refused a hint, make at
most ``server.stats_namespaces`` + 1 series of ``kvstore_retained_bytes{tier,tenant}`` and of
``kvstore_retain_refused_total{tenant}`` (the busiest, and "other" summing the rest), and as many
entries in /stats's ``retained`` maps, with every byte and refusal still counted. On 66d9839 each
made 2,000 series. A real sidecar, real sockets (the local socket's calls) and its real HTTP server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kvstore.client import KVStoreClient
from kvstore.errors import ResourceExhausted
from kvstore.keys import Namespace, prefix_keys
from kvstore.server.sidecar import Sidecar
from tests.conftest import small_config

SALTS = 2_000
SHOWN = 8  # server.stats_namespaces
BLOCK = 4096
MINUTE = 60_000
AT_ONCE = 50  # salts in flight together


async def sidecar(tmp_path: Path, **overrides: Any) -> AsyncIterator[tuple[Sidecar, KVStoreClient]]:
    cfg = small_config(tmp_path, **{
        "server.stats_namespaces": SHOWN,
        "dram.capacity_bytes": 2 * SALTS * BLOCK + (4 << 20),  # every salt's blocks stay in DRAM
        **overrides,
    })
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}", local=True) as c:
        yield sc, c


@pytest.fixture
async def unbounded(tmp_path: Path) -> AsyncIterator[tuple[Sidecar, KVStoreClient]]:
    async for env in sidecar(tmp_path):
        yield env


@pytest.fixture
async def bounded(tmp_path: Path) -> AsyncIterator[tuple[Sidecar, KVStoreClient]]:
    async for env in sidecar(tmp_path, **{"tenants.dram_retained_bytes": BLOCK}):  # two blocks are refused
        yield env


def salted(i: int) -> tuple[Namespace, list[bytes]]:
    ns = Namespace(model="m", kv_layout="raw", dtype="uint8", block_size=16, cache_salt=f"salt-{i}")
    return ns, prefix_keys(ns, list(range(32)))


async def each_salt(c: KVStoreClient, step: Callable[[KVStoreClient, int], Awaitable[None]]) -> None:
    for first in range(0, SALTS, AT_ONCE):
        await asyncio.gather(*(step(c, i) for i in range(first, first + AT_ONCE)))


async def scraped(sc: Sidecar, family: str) -> tuple[list[Sample], dict[str, Any]]:
    """The samples of ``family`` on /metrics, and /stats's ``retained`` entry."""
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{sc.http_port}/metrics") as r:
            families = {f.name: f for f in text_string_to_metric_families(await r.text())}
        async with http.get(f"http://127.0.0.1:{sc.http_port}/stats") as r:
            doc: dict[str, Any] = (await r.json())["retained"]
    return [s for s in families[family].samples if not s.name.endswith("_created")], doc


async def test_two_thousand_salts_make_at_most_cap_plus_one_retained_series(
    unbounded: tuple[Sidecar, KVStoreClient],
) -> None:
    sc, c = unbounded

    async def retain(c: KVStoreClient, i: int) -> None:
        ns, keys = salted(i)
        await c.put_blocks(ns, keys[:1], [np.full(BLOCK, i % 251, dtype=np.uint8)], retain=(MINUTE, 0))

    await each_salt(c, retain)
    samples, doc = await scraped(sc, "kvstore_retained_bytes")
    assert len(samples) == SHOWN + 1 and {s.labels["tier"] for s in samples} == {"dram"}
    assert "other" in {s.labels["tenant"] for s in samples}
    assert sum(s.value for s in samples) == SALTS * BLOCK  # (the rest summed, none lost)
    assert len(doc["tenants"]["dram"]) == SHOWN + 1
    assert sum(doc["tenants"]["dram"].values()) == doc["bytes"]["dram"] == SALTS * BLOCK


async def test_two_thousand_salts_make_at_most_cap_plus_one_refused_series(
    bounded: tuple[Sidecar, KVStoreClient],
) -> None:
    sc, c = bounded

    async def refused(c: KVStoreClient, i: int) -> None:
        ns, keys = salted(i)
        await c.put_blocks(ns, keys, [np.full(BLOCK, i % 251, dtype=np.uint8)] * 2)
        with pytest.raises(ResourceExhausted):
            await c.retain(ns, keys, MINUTE)

    await each_salt(c, refused)
    samples, doc = await scraped(sc, "kvstore_retain_refused")
    assert len(samples) == SHOWN + 1 and "other" in {s.labels["tenant"] for s in samples}
    assert sum(s.value for s in samples) == SALTS
    assert len(doc["refused"]) == SHOWN + 1 and sum(doc["refused"].values()) == SALTS


@pytest.fixture
async def quoted(tmp_path: Path) -> AsyncIterator[tuple[Sidecar, KVStoreClient]]:
    async for env in sidecar(tmp_path, **{"tenants.dram_quota_bytes": 2 * BLOCK}):  # two blocks each
        yield env


async def test_two_thousand_salts_gone_leave_no_quota_counters_behind(quoted: tuple[Sidecar, KVStoreClient]) -> None:
    """Each salt is refused a write past its DRAM quota, evicts one of its own blocks for another
    and deletes what it holds: the tier's per-tenant counters of evictions and refusals (shown on
    /stats only for tenants that hold bytes or have a quota of their own) are let go once there are
    many, not kept per salt for ever (on 66d9839, 2,000 of each)."""
    sc, c = quoted

    async def come_and_go(c: KVStoreClient, i: int) -> None:
        ns, keys = salted(i)
        keys += prefix_keys(ns, list(range(48)))[2:]
        blocks = [np.full(BLOCK, i % 251, dtype=np.uint8)] * 3
        with pytest.raises(ResourceExhausted):
            await c.put_blocks(ns, keys, blocks)  # three at once: past the quota, refused
        await c.put_blocks(ns, keys[:2], blocks[:2])
        await c.put_blocks(ns, keys[:3], blocks)  # the third: its own first block evicted for it
        assert await c.delete(ns, all_keys=True) == (2, 0)

    await each_salt(c, come_and_go)
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{sc.http_port}/stats") as r:
        doc = await r.json()
    assert doc["tiers"]["dram"]["evictions"] == SALTS and doc.get("tenants", {}) == {}  # (each evicted one; gone)
    quotas = sc.store.tenants.attached["dram"]
    kept = len(quotas.evictions) + len(quotas.refused)
    assert not quotas.used and kept <= 1024 + 1, kept  # (let go past 1,024: tenants.PRUNE_FLOOR)
