"""The use count a store with an SSD tier keeps of a block (``DramSpace.uses``, ``ghost_size``): the
most any tier's policy counts or remembers, not DRAM's alone.

A block reused while the SSD holds it, and long out of DRAM since, has fallen off DRAM's ghost list
(credit keeps 4 x DRAM's capacity there) while the SSD's policy still counts it, and remembers it on
its own ghost once the SSD lets it go: that count is what a cluster node leaves in the directory's
ghost when the block leaves the node (kvstore/cluster/publisher.py; tests/cluster/test_cluster_ghost.py).
A real sidecar over gRPC with the ``credit`` policy and an SSD directory."""

from __future__ import annotations

from collections.abc import Callable
from itertools import count
from pathlib import Path

import numpy as np

from kvstore.client import KVStoreClient
from kvstore.keys import Namespace, prefix_keys
from kvstore.movers.level import Level
from kvstore.movers.tiering import Tiering
from kvstore.server.sidecar import Sidecar
from kvstore.store.books.index import SSD, Block
from tests.tiers.test_tiering import PAGE, tiered_config

PROMPT = 4  # blocks per filler prompt (DRAM holds 4 blocks of a PAGE)


def payload(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def ssd_level(sc: Sidecar) -> Level:
    tiering = sc.store.tiering
    assert isinstance(tiering, Tiering)
    return next(lv for lv in tiering.levels if lv.name == "ssd")


def held(sc: Sidecar, ns: Namespace, key: bytes) -> Block | None:
    entry = sc.store.index.namespaces.get(ns.root)
    return entry.blocks.get(key) if entry is not None else None


class Traffic:
    """Other prompts stored on a sidecar, each with its own tokens, until a condition holds; the
    moves they start (demotions, the SSD's evictions) are over before the condition is asked."""

    def __init__(self, sc: Sidecar, c: KVStoreClient, ns: Namespace, size: int) -> None:
        self.sc, self.c, self.ns, self.size = sc, c, ns, size
        self._seeds = count(100)

    async def until(self, done: Callable[[], bool], most: int, what: str) -> None:
        """Store up to ``most`` prompts, until ``done()`` (asked before each, and after the last)."""
        for stored in range(most + 1):
            self.sc.store.drain_touches()
            if done():
                return
            if stored == most:
                raise AssertionError(f"not {what} after {most} prompts of {PROMPT} blocks")
            seed = next(self._seeds)
            keys = prefix_keys(self.ns, list(range(seed * 1000, seed * 1000 + PROMPT * self.ns.block_size)))
            await self.c.put_blocks(self.ns, keys, [payload(seed * PROMPT + i, self.size) for i in range(PROMPT)])
            await self.sc.store.tiering.flush()


async def reused_on_ssd(traffic: Traffic, key: bytes) -> tuple[Block, int]:
    """Store ``key``, let DRAM demote it, hit it while the SSD holds it (each hit promotes it and
    counts on both tiers' policies), then store other prompts until DRAM's policy has forgotten it
    (off its ghost list) and only the SSD holds it. The block and the SSD policy's count of it."""
    sc, c, ns = traffic.sc, traffic.c, traffic.ns
    store, ssd = sc.store, ssd_level(sc)
    assert ssd.policy is not None
    data = payload(1, traffic.size)
    await c.put_blocks(ns, [key], [data])
    b = held(sc, ns, key)
    assert b is not None
    await traffic.until(lambda: b.tiers == SSD, 20, "demoted")
    for _ in range(4):
        [got] = await c.get_blocks(ns, [key])
        assert got.tobytes() == data.tobytes()
        store.drain_touches()  # (the same run touched twice in a row counts once)
    n = ssd.policy.uses(b)
    assert n >= 2, f"the SSD's policy counted {n} use(s) of a block hit 4 times there"
    await traffic.until(lambda: store.space.policy.uses(b) == 0, 100, "off DRAM's ghost")
    assert b.tiers == SSD, "the SSD let the block go before DRAM's ghost did: a bigger SSD"
    return b, n


async def test_a_block_dram_forgot_keeps_the_count_the_ssd_has_and_remembers(tmp_path: Path, ns: Namespace) -> None:
    """While the SSD holds the block, and once it let it go too (its own ghost): the SSD's count.
    The ghost the store's counts last in is the larger of the two tiers' (the SSD's, here)."""
    config = tiered_config(tmp_path, **{"index.policy": "credit"})
    async with Sidecar(config) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        space, ssd = sc.store.space, ssd_level(sc)
        assert ssd.policy is not None
        traffic = Traffic(sc, c, ns, PAGE)
        key = prefix_keys(ns, list(range(ns.block_size)))[0]
        b, n = await reused_on_ssd(traffic, key)
        assert (space.policy.uses(b), space.uses(b)) == (0, n)

        await traffic.until(lambda: held(sc, ns, key) is None, 200, "let go by the SSD")
        # what the cluster node asks of the block it let go (and of its key): the SSD's ghost
        assert (space.policy.uses(b), ssd.policy.uses(b), space.uses(b), space.uses(key)) == (0, n, n, n)
        assert space.ghost_size() == ssd.policy.ghost_size() > space.policy.ghost_size() > 0
