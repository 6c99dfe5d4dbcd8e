"""A sharded engine (two tensor-parallel ranks) against a real sidecar: each rank saves and loads
its own shard of every block under a namespace naming its rank; the scheduler counts a block only
where every rank has it, found in ONE Acquire over both ranks' keys (``AcquireRequest.shards``),
and each rank reads its own shard under its own lease, which it ends."""

from __future__ import annotations

import dataclasses

import numpy as np
from paged_cases import BLOCKS, NS, PROMPT, SPEC, caches

from connector.roles import SchedulerConnector, WorkerConnector
from connector.roles.finders import LeaseFinder
from connector.roles.pipeline import PipelineSlot
from kvstore.client import SyncClient
from kvstore.keys import PrefixKeys, prefix_keys

RANKS = [dataclasses.replace(NS, rank=r, world_size=2) for r in range(2)]


def rpcs(client: SyncClient, method: str) -> int:
    return sum(row["count"] for row in client.stats()["latency"]["rpc"] if row["method"] == method)


def leases(client: SyncClient) -> int:
    return client.stats()["index"]["leases"]


def store(client: SyncClient, blocks: list[int]) -> tuple[list[list[np.ndarray]], list[int]]:
    """Rank r saves the prompt's first ``blocks[r]`` full blocks from engine blocks 7, 6, ...:
    through one scheduler over both ranks, each worker taking its own shard of the step."""
    src, ids = [caches(10 + r) for r in range(2)], [7, 6, 5, 4, 3, 2]
    for rank, n in enumerate(blocks):
        if n == 0:
            continue
        sched = SchedulerConnector(client, RANKS[0], SPEC, shards=RANKS[1:])
        sched.schedule_save("w", PROMPT[: n * 4], ids[:n])
        worker = WorkerConnector(client, RANKS[rank], SPEC)
        worker.register_kv_caches(src[rank])
        worker.start(sched.build_connector_meta().shard(rank))
        assert [r.written for r in worker.wait_for_saves()] == [n]
        worker.close()
    return src, ids


def test_each_rank_saves_its_own_shard_under_its_own_keys(client) -> None:
    store(client, [6, 6])
    for rank in RANKS:
        assert client.lookup(rank, prefix_keys(rank, PROMPT)).matched == 6
    assert client.stats()["index"]["blocks"] == 12
    assert client.lookup(NS, prefix_keys(NS, PROMPT)).matched == 0  # neither under the unsharded namespace


def test_a_block_counts_only_where_every_rank_has_it_in_one_acquire(client) -> None:
    src, ids = store(client, [6, 4])  # rank 1's saves of blocks 4 and 5 did not land
    acquires = rpcs(client, "Acquire")
    sched = SchedulerConnector(client, RANKS[0], SPEC, finder=LeaseFinder(client), shards=RANKS[1:])
    assert sched.get_num_new_matched_tokens("r", PROMPT, 0) == 4 * 4
    assert rpcs(client, "Acquire") == acquires + 1  # both ranks' blocks in one round trip
    assert leases(client) == 2  # one per rank
    sched.update_state_after_alloc("r", list(range(BLOCKS)), 4 * 4)
    meta = sched.build_connector_meta()
    assert sched.request_finished("r") is False  # the leases went with the load
    for rank in range(2):
        [load] = meta.shard(rank).loads
        assert load.keys == tuple(prefix_keys(RANKS[rank], PROMPT)[:4]) and load.lease is not None
        dst = caches(20 + rank)
        worker = WorkerConnector(client, RANKS[rank], SPEC)
        worker.register_kv_caches(dst)
        [r] = worker.load_now([load])
        worker.close()  # ends its own lease
        assert r.ok and r.loaded == 4
        for layer in range(SPEC.num_layers):
            np.testing.assert_array_equal(dst[layer][list(load.block_ids)], src[rank][layer][ids[:4]])
    assert leases(client) == 0
    assert rpcs(client, "Acquire") == acquires + 1  # the workers read under the scheduler's leases


def test_a_rank_missing_the_first_block_means_nothing_is_loaded_and_nothing_stays_leased(client) -> None:
    store(client, [6, 0])
    sched = SchedulerConnector(client, RANKS[0], SPEC, finder=LeaseFinder(client), shards=RANKS[1:])
    assert sched.get_num_new_matched_tokens("r", PROMPT, 0) == 0
    assert leases(client) == 0 and not sched.build_connector_meta()


def test_the_early_lookup_on_the_pipeline_asks_for_every_rank(client) -> None:
    src, ids = store(client, [5, 6])
    slot = PipelineSlot(client)
    sched = SchedulerConnector(client, RANKS[0], SPEC, finder=LeaseFinder(client, slot), shards=RANKS[1:])
    sched.on_new_request("r", PROMPT)  # sent now, read when the engine asks
    assert sched.get_num_new_matched_tokens("r", PROMPT, 4) == 4 * 4  # blocks 1..4: rank 0 lacks block 5
    assert sched.stats["early_lookups"] == 1
    sched.update_state_after_alloc("r", list(range(BLOCKS)), 4 * 4)
    loads = sched.build_connector_meta()
    assert [load.first_block for load in loads.loads] == [1]
    assert [len(p.keys) for p in loads.loads[0].others] == [4]
    assert loads.loads[0].others[0].lease is not None and len(loads.loads[0].others[0].lease.slots) == 4
    for rank in range(2):
        worker = WorkerConnector(client, RANKS[rank], SPEC)
        worker.register_kv_caches(dst := caches(30))
        [r] = worker.load_now(loads.shard(rank).loads)
        worker.close()
        assert r.loaded == 4
        for layer in range(SPEC.num_layers):
            np.testing.assert_array_equal(dst[layer][[1, 2, 3, 4]], src[rank][layer][ids[1:5]])
    slot.close()
    assert leases(client) == 0


def test_a_salted_request_saves_and_finds_every_shard_under_its_salt(client) -> None:
    """A request's ``cache_salt`` is every shard's: rank 1 saves and loads under ITS namespace with
    the request's salt, never the engine's unsalted one, and salt B or no salt finds nothing."""
    salted = [dataclasses.replace(rank, cache_salt="tenant-a") for rank in RANKS]
    src, ids = [caches(40 + r) for r in range(2)], [7, 6, 5, 4, 3, 2]
    sched = SchedulerConnector(client, RANKS[0], SPEC, finder=LeaseFinder(client), shards=RANKS[1:])
    assert sched.schedule_save("w", PROMPT[:24], ids, ns=salted[0]) == 6
    meta = sched.build_connector_meta()
    for rank in range(2):
        [save] = meta.shard(rank).saves
        assert save.ns == salted[rank] and save.keys == tuple(prefix_keys(salted[rank], PROMPT)[:6])
        worker = WorkerConnector(client, RANKS[rank], SPEC)  # the engine's (unsalted) shard namespace
        worker.register_kv_caches(src[rank])
        worker.start(meta.shard(rank))
        assert [r.written for r in worker.wait_for_saves()] == [6]
        worker.close()
    for rank in range(2):  # each rank's blocks under its salted namespace only
        assert client.lookup(salted[rank], prefix_keys(salted[rank], PROMPT)).matched == 6
        assert client.lookup(RANKS[rank], prefix_keys(RANKS[rank], PROMPT)).matched == 0
    acquires = rpcs(client, "Acquire")
    other = dataclasses.replace(RANKS[0], cache_salt="tenant-b")
    assert sched.get_num_new_matched_tokens("b", PROMPT, 0, other) == 0
    assert sched.get_num_new_matched_tokens("plain", PROMPT, 0) == 0
    assert sched.get_num_new_matched_tokens("a", PROMPT, 0, salted[0]) == 6 * 4
    assert rpcs(client, "Acquire") == acquires + 3  # each one Acquire over both ranks
    sched.update_state_after_alloc("a", list(range(BLOCKS)), 6 * 4)
    meta = sched.build_connector_meta()
    for rank in range(2):
        [load] = meta.shard(rank).loads
        assert load.ns == salted[rank] and load.keys == tuple(prefix_keys(salted[rank], PROMPT)[:6])
        worker = WorkerConnector(client, RANKS[rank], SPEC)
        worker.register_kv_caches(dst := caches(50 + rank))
        [r] = worker.load_now([load])
        worker.close()
        assert r.ok and r.loaded == 6
        for layer in range(SPEC.num_layers):
            np.testing.assert_array_equal(dst[layer][list(load.block_ids)], src[rank][layer][ids])
    for req in ("b", "plain", "a"):
        sched.request_finished(req)
    assert leases(client) == 0


def test_a_request_s_media_are_in_every_shard_s_keys(client) -> None:
    """A multimodal request's extra key bytes (connector/vllm/request_keys.py's media_extras) go into
    the keys of every shard, not only shard 0's: rank 1 never saves it as the text-only prompt."""
    extras = {2: b"image:0123"}  # block 2 overlaps an image
    sched = SchedulerConnector(client, RANKS[0], SPEC, shards=RANKS[1:])
    sched.set_extras("m", extras)
    assert sched.schedule_save("m", PROMPT[:24], [7, 6, 5, 4, 3, 2]) == 6
    meta = sched.build_connector_meta()
    for rank in range(2):
        [save] = meta.shard(rank).saves
        assert save.keys == tuple(PrefixKeys(RANKS[rank], extras).of(PROMPT[:24]))
        plain = prefix_keys(RANKS[rank], PROMPT)[:6]
        assert save.keys[:2] == tuple(plain[:2]) and not set(save.keys[2:]) & set(plain)
