"""The engine's block directory: a lookup answered without a round trip while the slab's free
epoch has not moved, an unleased copy checked by checksum and by the epoch, and the sidecar
asked again as soon as any slot was freed. A sidecar process, the worker and scheduler sides in
this one."""

from __future__ import annotations

import numpy as np
from paged_cases import BLOCKS, NS, PROMPT, SPEC, caches, stored

from connector.roles import SchedulerConnector, WorkerConnector
from connector.roles.block_directory import BlockDirectory, epoch_of
from connector.roles.finders import DirectoryFinder, LeaseFinder
from connector.roles.metadata import Failure, LoadSpec
from kvstore.client import SlotRef, SyncClient
from kvstore.keys import Namespace, prefix_keys
from tests.support.corrupt import flip


def acquires(client: SyncClient) -> int:
    return client.stats()["reads"].get("acquires", 0)


def lookup(client: SyncClient, directory: BlockDirectory) -> LoadSpec:
    sched = SchedulerConnector(client, NS, SPEC, finder=DirectoryFinder(LeaseFinder(client), directory))
    assert sched.get_num_new_matched_tokens("r", PROMPT, 0) == 6 * 4
    sched.update_state_after_alloc("r", list(range(BLOCKS)), 6 * 4)
    [load] = sched.build_connector_meta().loads
    sched.request_finished("r")
    return load


def load(client: SyncClient, spec: LoadSpec, directory: BlockDirectory,
         guard: str = "read_only") -> tuple[list[np.ndarray], object]:
    dst = caches(2)
    worker = WorkerConnector(client, NS, SPEC, directory=directory, load_guard=guard)
    worker.register_kv_caches(dst)
    [r] = worker.load_now([spec])
    worker.close()  # waits for the touch it queued
    return dst, r


def test_saved_blocks_are_found_and_read_without_a_round_trip(client) -> None:
    directory = BlockDirectory()
    src, ids = stored(client, directory)
    assert len(directory) == 6
    before = acquires(client)
    lookups = client.stats()["lookups"]["calls"]
    spec = lookup(client, directory)
    assert spec.lease is not None and spec.lease.id == "" and spec.lease.epoch is not None
    dst, r = load(client, spec, directory)
    assert r.ok and r.loaded == 6
    for layer in range(SPEC.num_layers):
        np.testing.assert_array_equal(dst[layer][list(spec.block_ids)], src[layer][ids])
    stats = client.stats()
    assert stats["reads"].get("acquires", 0) == before  # no Acquire for the lookup or the load
    assert stats["lookups"]["calls"] == lookups + 1  # the hit reached the sidecar afterwards
    assert stats["index"]["leases"] == 0


def test_any_freed_slot_sends_the_next_lookup_to_the_sidecar(client) -> None:
    directory = BlockDirectory()
    src, ids = stored(client, directory)
    ns = Namespace(model="other", kv_layout="raw", dtype="uint8", block_size=1)
    other = prefix_keys(ns, [1, 2])
    client.put_blocks(ns, other, [np.ones(64, np.uint8)] * 2)
    client.delete(ns, other)  # frees two slots that have nothing to do with ours
    before = acquires(client)
    spec = lookup(client, directory)
    assert spec.lease is not None and spec.lease.id != ""  # a real lease: the sidecar was asked
    assert acquires(client) == before + 1
    dst, r = load(client, spec, directory)
    assert r.ok and r.loaded == 6
    for layer in range(SPEC.num_layers):
        np.testing.assert_array_equal(dst[layer][list(spec.block_ids)], src[layer][ids])
    assert lookup(client, directory).lease.id == ""  # learned again from that answer


def test_a_slot_freed_before_the_load_sends_it_to_the_sidecar(client) -> None:
    directory = BlockDirectory()
    stored(client, directory)
    spec = lookup(client, directory)
    assert spec.lease.id == ""
    client.delete(NS, [spec.keys[5]])  # the last block goes: its slot is freed, the epoch moves
    dst = caches(2)
    untouched = [d.copy() for d in dst]
    worker = WorkerConnector(client, NS, SPEC, directory=directory)
    worker.register_kv_caches(dst)
    # the epoch moved before the copy: the worker acquires instead and gets the 5 that are left
    [r] = worker.load_now([spec])
    worker.close()
    assert (r.loaded, r.failure) == (5, Failure.MISSING)
    assert r.failed_block_ids == spec.block_ids[5:]
    for layer in range(SPEC.num_layers):  # the block that is gone was not written
        np.testing.assert_array_equal(dst[layer][spec.block_ids[5]], untouched[layer][spec.block_ids[5]])


def test_the_epoch_moving_mid_copy_reports_every_block(client, monkeypatch) -> None:
    directory = BlockDirectory()
    stored(client, directory)
    spec = lookup(client, directory)
    from connector.roles import ops

    real = ops.epoch_of
    calls = []

    def moving(segment: str) -> int | None:  # the second read (after the copy) sees a free
        calls.append(segment)
        e = real(segment)
        return e if len(calls) == 1 or e is None else e + 1

    monkeypatch.setattr(ops, "epoch_of", moving)
    _, r = load(client, spec, directory)
    assert (r.loaded, r.failure) == (0, Failure.MISSING)
    assert r.failed_block_ids == spec.block_ids


def test_a_corrupted_slot_is_caught_on_the_unleased_path(client) -> None:
    directory = BlockDirectory()
    stored(client, directory)
    spec = lookup(client, directory)
    slot = spec.lease.slots[2]
    flip(slot.segment, slot.offset + 3)  # by a process that maps the slab read-write: only a hash sees it
    _, r = load(client, spec, directory, guard="hash")
    assert (r.loaded, r.failure) == (2, Failure.CHECKSUM)
    assert r.failed_block_ids == spec.block_ids[2:]


def test_directory_answers_all_or_nothing_and_stays_bounded(client) -> None:
    seg = client.hello().segment
    epoch = epoch_of(seg)
    d = BlockDirectory(capacity=3)
    refs = [SlotRef(seg, i * 4096, 4096) for i in range(4)]
    d.learn([b"a", b"b", b"c", b"d"], refs, [1, 2, 3, 4], epoch)
    assert len(d) == 3 and d.find([b"a"]) is None  # the oldest went
    assert [p.checksum for p in d.find([b"b", b"c"])] == [2, 3]
    assert d.find([b"b", b"x"]) is None
    d.learn([b"e"], [refs[0]], [0], epoch)  # an unsealed block is not remembered
    assert d.find([b"e"]) is None
    d.learn([b"f"], [refs[0]], [9], epoch - 1 if epoch else epoch + 1)  # learned at another epoch
    assert d.find([b"f"]) is None
    assert epoch_of("no-such-segment") is None
