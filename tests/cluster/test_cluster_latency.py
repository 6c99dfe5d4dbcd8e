"""Latency of the cluster's calls through two real sidecars and a redis-server directory: peer
fetches (the fetcher's side), answers (the holder's) and directory round trips."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import redis.asyncio

from kvstore.client import KVStoreClient
from kvstore.harness.servers import RedisServer
from kvstore.keys import Namespace
from kvstore.server.sidecar import Sidecar
from tests.cluster.nodes import blocks, client_of, keys_for


def rows(doc: dict, family: str, *labels: str) -> dict[tuple[str, ...], dict]:
    return {tuple(r[n] for n in labels): r for r in doc["latency"][family]}


async def stats_once(client: KVStoreClient, ready: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The sidecar's stats once ``ready`` holds of them (bounded polling, no timing assumed): the
    last ones read if it never does."""
    for _ in range(400):
        doc: dict[str, Any] = await client.stats()
        if ready(doc):
            break
        await asyncio.sleep(0.025)
    return doc


async def once_answered(holder: KVStoreClient) -> dict[str, Any]:
    """The holder's stats once its answer is counted: it is observed as the send's task ends, which
    may come after the fetcher has every byte."""
    return await stats_once(holder, lambda doc: bool(doc["latency"]["peer_answer"]))


async def trips_once(client: KVStoreClient, op: str) -> dict[tuple[str, ...], dict]:
    """The directory round trips by (op, outcome) once one of ``op`` has ended ok."""
    doc = await stats_once(client, lambda d: (op, "ok") in rows(d, "directory", "op", "outcome"))
    return rows(doc, "directory", "op", "outcome")


async def test_peer_fetches_answers_and_directory_round_trips_are_timed(
    pair: tuple[Sidecar, Sidecar], ns: Namespace
) -> None:
    a, b = pair
    keys, data = keys_for(ns, 4), blocks(4)
    async with client_of(a) as ca, client_of(b) as cb:
        await ca.put_blocks(ns, keys, data, wait_published=True)
        got = await cb.get_blocks(ns, keys, verify=True)
        assert [bytes(g) for g in got] == [bytes(d) for d in data]
        on_a, on_b = await once_answered(ca), await cb.stats()
    fetches = rows(on_b, "peer_fetch", "outcome")
    assert fetches[("ok",)]["count"] == 1 and fetches[("ok",)]["p50_s"] > 0
    assert rows(on_a, "peer_answer", "outcome")[("ok",)]["count"] == 1
    assert not on_a["latency"]["peer_fetch"] and not on_b["latency"]["peer_answer"]
    trips_a, trips_b = rows(on_a, "directory", "op", "outcome"), rows(on_b, "directory", "op", "outcome")
    assert trips_a[("publish", "ok")]["count"] >= 1 and trips_a[("heartbeat", "ok")]["count"] >= 1
    assert trips_b[("find", "ok")]["count"] >= 1
    assert on_b["cluster"]["directory_lookups"] == trips_b[("find", "ok")]["count"]


async def test_the_sweeps_passes_are_timed(pair: tuple[Sidecar, Sidecar]) -> None:
    """Each pass of the walk that deletes void records (kvstore/cluster/sweep.py) is a directory
    round trip of its own, ``op="sweep"`` (bounded polling: the walk runs on the heartbeat's
    interval, no timing assumed)."""
    a, _ = pair
    async with client_of(a) as ca:
        trips = await trips_once(ca, "sweep")
    assert trips[("sweep", "ok")]["count"] >= 1 and trips[("sweep", "ok")]["sum_s"] > 0
    assert ("sweep", "error") not in trips


async def test_the_deletion_of_unreadable_members_entries_is_timed(
    pair: tuple[Sidecar, Sidecar], directory: RedisServer
) -> None:
    """Deleting members entries nobody can read (kvstore/cluster/membership.py, `UnreadableMembers`), once they have
    outlasted a lease (1 s here), is a directory round trip of its own after the heartbeat's,
    ``op="forget_members"`` (bounded polling, no timing assumed)."""
    a, _ = pair
    r = redis.asyncio.Redis.from_url(directory.url)
    try:
        await r.hset(f"{a.config.cluster.key_prefix}:members", b"junk", b"not|an|entry")
        async with client_of(a) as ca:
            trips = await trips_once(ca, "forget_members")
        assert trips[("forget_members", "ok")]["count"] >= 1 and trips[("forget_members", "ok")]["sum_s"] > 0
        assert ("forget_members", "error") not in trips
        assert not await r.hexists(f"{a.config.cluster.key_prefix}:members", b"junk")
    finally:
        await r.aclose()
