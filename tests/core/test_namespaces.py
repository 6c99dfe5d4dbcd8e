"""Namespaces cost memory only while they store blocks, and /stats and /metrics stay bounded
whatever namespaces clients name: the busiest ``server.stats_namespaces`` have their own entry,
the rest are summed as "other"."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.client import KVStoreClient
from kvstore.keys import Namespace, prefix_keys
from kvstore.server.sidecar import Sidecar
from tests.conftest import small_config

SHOWN = 4
BLOCK = np.ones(65536, np.uint8)  # one page: the slab holds four


def namespace(model: str) -> Namespace:
    return Namespace(model=model, kv_layout="raw", dtype="uint8", block_size=16)


def keys(ns: Namespace, n: int, seed: int = 0) -> list[bytes]:
    return prefix_keys(ns, [seed] * (16 * n))


@pytest.fixture
async def env(tmp_path) -> AsyncIterator[tuple[Sidecar, KVStoreClient, aiohttp.ClientSession]]:
    async with (Sidecar(small_config(tmp_path, **{"server.stats_namespaces": SHOWN})) as sc,
                KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c, aiohttp.ClientSession() as http):
        yield sc, c, http


async def get(sc: Sidecar, http: aiohttp.ClientSession, path: str) -> str:
    async with http.get(f"http://127.0.0.1:{sc.http_port}{path}") as r:
        assert r.status == 200
        return await r.text()


async def stats(sc: Sidecar, http: aiohttp.ClientSession) -> dict[str, Any]:
    return json.loads(await get(sc, http, "/stats"))


async def metric_namespaces(sc: Sidecar, http: aiohttp.ClientSession) -> dict[str, float]:
    text = await get(sc, http, "/metrics")
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    return {s.labels["namespace"]: s.value for s in fams["kvstore_namespace_lookups"].samples}


async def test_reads_of_namespaces_that_store_nothing_leave_nothing_behind(env):
    sc, c, http = env
    stored = namespace("stored")
    await c.put_blocks(stored, keys(stored, 1), [BLOCK])
    strangers = [namespace(f"model-{i:03d}-" + "x" * 100) for i in range(200)]
    for i, ns in enumerate(strangers):
        assert (await c.lookup(ns, keys(ns, 2))).matched == 0
        if i % 4 == 0:
            async with c.acquire(ns, keys(ns, 1)) as lease:
                assert lease.views == []
            assert await c.prefetch(ns, keys(ns, 1)) == 0
            assert await c.delete(ns, all_keys=True) == (0, 0)
    doc = await stats(sc, http)
    assert doc["index"]["namespaces"] == 1  # the one that stores a block
    assert len(doc["namespaces"]) == SHOWN + 1 and "other" in doc["namespaces"]
    assert sum(n["calls"] for n in doc["namespaces"].values()) == doc["lookups"]["calls"] == 200
    assert sum(n["blocks_requested"] for n in doc["namespaces"].values()) == 400
    assert await metric_namespaces(sc, http) == {label: n["calls"] for label, n in doc["namespaces"].items()}
    assert len(sc.store.stats.per_namespace) <= 4 * SHOWN  # what is kept, not only what is shown
    assert (await c.lookup(stored, keys(stored, 1))).matched == 1


async def test_the_busiest_namespaces_keep_their_own_entry(env):
    sc, c, http = env
    hot = namespace("hot")
    await c.put_blocks(hot, keys(hot, 2), [BLOCK, BLOCK])
    for i in range(100):
        await c.lookup(hot, keys(hot, 4))
        cold = namespace(f"cold-{i}")
        await c.lookup(cold, keys(cold, 1))
    shown = (await stats(sc, http))["namespaces"]
    assert len(shown) == SHOWN + 1
    assert shown["hot"] == {"calls": 100, "blocks_requested": 400, "blocks_hit": 200, "full_hits": 0, "hit_rate": 0.5}
    assert shown["other"]["calls"] == 100 - (SHOWN - 1)
    assert sum(n["calls"] for n in shown.values()) == 200


async def test_a_namespace_goes_with_its_last_block(env):
    sc, c, http = env
    a, b, fresh = namespace("a"), namespace("b"), namespace("fresh")
    await c.put_blocks(a, keys(a, 2), [BLOCK, BLOCK])
    await c.put_blocks(b, keys(b, 2), [BLOCK, BLOCK])
    assert (await stats(sc, http))["index"]["namespaces"] == 2
    assert await c.delete(a, all_keys=True) == (2, 0)
    assert (await stats(sc, http))["index"]["namespaces"] == 1
    await c.put_blocks(fresh, keys(fresh, 4), [BLOCK] * 4)  # evicts both of b's blocks (DRAM only)
    doc = await stats(sc, http)
    assert doc["index"] == {"namespaces": 1, "blocks": 4, "allocations": 0, "leases": 0}
    assert (await c.lookup(b, keys(b, 2))).matched == 0
    await c.put_blocks(a, keys(a, 1), [BLOCK])  # a namespace comes back with its next block
    assert (await c.lookup(a, keys(a, 1))).matched == 1
    assert (await stats(sc, http))["index"]["namespaces"] == 2


async def test_an_allocation_that_evicts_its_own_namespace_keeps_it(env):
    """The allocation's evictions drop the namespace's last old block, then its new blocks are
    added: the namespace must be registered again, or its new blocks would be invisible."""
    sc, c, http = env
    ns = namespace("self-evicting")
    await c.put_blocks(ns, keys(ns, 4, seed=1), [BLOCK] * 4)
    new = keys(ns, 4, seed=2)
    assert (await c.put_blocks(ns, new, [BLOCK * 3] * 4)).stored == 4
    assert (await c.lookup(ns, new)).matched == 4
    assert [v.tobytes() for v in await c.get_blocks(ns, new, verify=True)] == [(BLOCK * 3).tobytes()] * 4
    assert (await stats(sc, http))["index"] == {"namespaces": 1, "blocks": 4, "allocations": 0, "leases": 0}
