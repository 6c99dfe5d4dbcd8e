"""A lookup through ``LeaseFinder`` leases the blocks and says where they lie; the worker copies them
straight out of shared memory under that lease (no second round trip) and ends it afterwards. A
lease near its end is not trusted, and bytes that changed under a lease fail their checksum."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
from paged_cases import BLOCKS, NS, PROMPT, SPEC, caches, stored

from connector.roles import SchedulerConnector, WorkerConnector
from connector.roles.finders import LeaseFinder
from connector.roles.metadata import Failure, LoadSpec
from kvstore.client import SyncClient
from tests.support.corrupt import flip


def leases(client: SyncClient) -> int:
    return client.stats()["index"]["leases"]


def held_load(client: SyncClient, have: int = 0) -> LoadSpec:
    sched = SchedulerConnector(client, NS, SPEC, finder=LeaseFinder(client))
    assert sched.get_num_new_matched_tokens("r", PROMPT, have * 4) == (6 - have) * 4
    sched.update_state_after_alloc("r", list(range(BLOCKS)), (6 - have) * 4)
    [load] = sched.build_connector_meta().loads
    assert sched.request_finished("r") is False  # the lease went with the load: nothing to end here
    return load


def test_the_worker_reads_under_the_lookups_lease_and_ends_it(client) -> None:
    src, ids = stored(client)
    load = held_load(client, have=1)  # the engine holds block 0 already
    assert load.lease is not None and len(load.lease.slots) == len(load.keys) == 5 and load.lease.first == 1
    assert leases(client) == 1
    acquires = client.stats()["reads"]["acquires"]
    dst = caches(2)
    worker = WorkerConnector(client, NS, SPEC)
    worker.register_kv_caches(dst)
    [r] = worker.load_now([load])
    worker.close()  # waits for the release it queued
    assert r.ok and r.loaded == 5
    assert client.stats()["reads"]["acquires"] == acquires  # no second round trip
    assert leases(client) == 0
    for layer in range(SPEC.num_layers):
        np.testing.assert_array_equal(dst[layer][list(load.block_ids)], src[layer][ids[1:]])


def test_a_lease_near_its_end_is_replaced_by_a_new_acquire(client) -> None:
    src, ids = stored(client)
    load = held_load(client)
    stale = dataclasses.replace(load, lease=dataclasses.replace(load.lease, deadline=time.monotonic()))
    acquires = client.stats()["reads"]["acquires"]
    dst = caches(2)
    worker = WorkerConnector(client, NS, SPEC)
    worker.register_kv_caches(dst)
    [r] = worker.load_now([stale])
    worker.close()
    assert r.ok and r.loaded == 6
    assert client.stats()["reads"]["acquires"] == acquires + 1
    assert leases(client) == 0  # the stale lease is ended too
    for layer in range(SPEC.num_layers):
        np.testing.assert_array_equal(dst[layer][list(load.block_ids)], src[layer][ids])


def test_bytes_changed_under_a_lease_fail_their_checksum(client) -> None:
    stored(client)
    deadline = time.monotonic() + 30
    while True:  # checksums are sealed off the critical path (the sidecar's background pass)
        load = held_load(client)
        if all(load.lease.checksums):
            break
        client.release(load.lease.id)
        if time.monotonic() > deadline:
            raise AssertionError("checksums never sealed")
        time.sleep(0.01)
    slot = load.lease.slots[3]
    flip(slot.segment, slot.offset + 5)  # by a process that maps the slab read-write: only a hash sees it
    worker = WorkerConnector(client, NS, SPEC, load_guard="hash")
    worker.register_kv_caches(caches(2))
    [r] = worker.load_now([load])
    worker.close()
    assert (r.loaded, r.failure) == (3, Failure.CHECKSUM)
    assert r.failed_block_ids == load.block_ids[3:]
    assert worker.get_block_ids_with_load_errors() == set(load.block_ids[3:])
    assert leases(client) == 0


def _until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_the_lease_ends_a_step_after_the_load_or_when_the_request_finishes(client) -> None:
    """The release is not sent during the loading step (it would compete with its forward pass):
    it goes at the end of the next step, or at the end of this one if the request finished."""
    stored(client)
    worker = WorkerConnector(client, NS, SPEC)
    worker.register_kv_caches(caches(2))
    try:
        worker.load_now([held_load(client)])
        worker.get_finished()  # the loading step ends: the lease is still held
        time.sleep(0.2)
        assert leases(client) == 1
        worker.get_finished()  # the next step ends: released
        assert _until(lambda: leases(client) == 0)

        worker.load_now([held_load(client)])
        worker.get_finished(finished={"r"})  # the request finished in its loading step
        assert _until(lambda: leases(client) == 0)
    finally:
        worker.close()
