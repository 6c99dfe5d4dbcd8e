"""A step's block ids reach the transfer engine as the one int64 array the scheduler side built
(``connector/roles/block_ids.py``): no conversion of each id on the worker's batch path, across
the process boundary too (vLLM pickles the metadata to its workers). Real sidecar, real slab."""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from paged_cases import BLOCKS, NS, PROMPT, SPEC, caches

from connector.roles import SchedulerConnector, WorkerConnector
from connector.roles.block_ids import BlockIds, ids_array
from connector.roles.metadata import Failure, LoadSpec, SaveSpec
from connector.roles.ops import save_blocks
from connector.transfer.engines import Completion, NumpyTransfer, PagedKV, bind_caches
from kvstore.client import SyncClient
from kvstore.keys import prefix_keys


class Recording(NumpyTransfer):
    """The CPU engine, keeping the block ids each gather and scatter was handed."""

    def __init__(self) -> None:
        super().__init__()
        self.gathered: list[Any] = []
        self.scattered: list[Any] = []

    def gather(self, kv: PagedKV, block_ids: Sequence[int] | np.ndarray, slots: Sequence[Any]) -> Completion:
        self.gathered.append(block_ids)
        return super().gather(kv, block_ids, slots)

    def scatter(self, kv: PagedKV, block_ids: Sequence[int] | np.ndarray, slots: Sequence[Any]) -> Completion:
        self.scattered.append(block_ids)
        return super().scatter(kv, block_ids, slots)


def _the_specs_array(got: Any, spec_ids: Sequence[int]) -> None:
    """``got`` is an int64 array over (part of) the spec's own ids' memory: not a copy, not a sequence."""
    assert isinstance(got, np.ndarray) and got.dtype == np.int64, type(got)
    assert isinstance(spec_ids, BlockIds) and np.shares_memory(got, spec_ids.array)


def test_the_engine_receives_the_steps_block_ids_as_one_array(client: SyncClient) -> None:
    """A save and a load through the scheduler and worker sides, the metadata pickled between them
    as vLLM sends it to a worker process: each gather and scatter is handed the spec's int64
    array itself (before: a tuple, converted id by id in the engine; a save's ids a list built
    id by id in the worker)."""
    src, ids = caches(1), [7, 6, 5, 4, 3, 2]
    sched = SchedulerConnector(client, NS, SPEC)
    writing = Recording()
    writer = WorkerConnector(client, NS, SPEC, transfer=writing)
    writer.register_kv_caches(src)
    sched.schedule_save("w", PROMPT, ids)
    meta = pickle.loads(pickle.dumps(sched.build_connector_meta()))
    writer.start(meta)
    assert [r.written for r in writer.wait_for_saves()] == [6]
    writer.close()
    [save] = meta.saves
    [got] = writing.gathered
    _the_specs_array(got, save.block_ids)
    assert got.tolist() == list(save.block_ids) == ids

    dst = caches(2)
    reading = Recording()
    reader = WorkerConnector(client, NS, SPEC, transfer=reading)
    reader.register_kv_caches(dst)
    assert sched.get_num_new_matched_tokens("r", PROMPT, 0) == 24
    sched.update_state_after_alloc("r", list(range(BLOCKS)), 24)
    meta = pickle.loads(pickle.dumps(sched.build_connector_meta()))
    [load] = meta.loads
    [r] = reader.load_now(list(meta.loads))
    reader.close()
    sched.request_finished("r")
    assert r.ok and r.loaded == 6
    assert reading.scattered  # (in chunks, each checked against its checksums before its copy)
    for got in reading.scattered:
        _the_specs_array(got, load.block_ids)
    assert np.concatenate(reading.scattered).tolist() == list(load.block_ids)
    for layer in range(SPEC.num_layers):
        np.testing.assert_array_equal(dst[layer][list(load.block_ids)], src[layer][ids])


def test_block_ids_compare_hash_slice_and_pickle_as_the_tuple_of_their_ids() -> None:
    """Specs and results compare as they did with tuples; iterating gives Python ints; the array
    cannot be changed under the worker; pickled, it is the array's bytes, read back in place."""
    ids = BlockIds([9, 4, 7, 1])
    failed = (9, 4, 7, 1)  # a result's tuple on the left, as the tests of loads compare them
    assert ids == failed and failed == ids and ids != (9, 4, 7)
    seen = [9, 4, 7, 1]  # as a tuple: a list of the same ids is not equal, either way round
    assert ids != seen and seen != ids
    assert hash(ids) == hash((9, 4, 7, 1)) and ids == BlockIds((9, 4, 7, 1))
    assert ids[1:3] == (4, 7) and isinstance(ids[1:3], BlockIds) and ids[-1] == 1 and type(ids[0]) is int
    assert [type(x) for x in ids] == [int] * 4 and set(ids[2:]) == {7, 1} and 4 in ids and ids.index(7) == 2
    assert np.shares_memory(ids[1:].array, ids.array) and ids_array(ids) is ids.array
    with pytest.raises(ValueError):
        ids.array[0] = 3
    mine = np.array(ids)  # np.array copies (numpy 2's copy=True): the caller's to change, the spec's untouched
    mine.sort()
    assert mine.tolist() == [1, 4, 7, 9] and ids == failed and not np.shares_memory(mine, ids.array)
    assert np.asarray(ids) is ids.array  # asarray does not copy
    source = np.array([5, 6], np.int64)
    copied = BlockIds(source)
    source[0] = 0
    assert copied == (5, 6)  # taken from a caller's array: a copy
    back = pickle.loads(pickle.dumps(ids))
    assert back == ids and back.array.dtype == np.int64 and not back.array.flags.writeable
    assert ids_array((3, 2)).tolist() == [3, 2] and ids_array(source) is source

    keys = tuple(prefix_keys(NS, PROMPT)[:4])
    save = SaveSpec("s", keys, ids)
    kept = save.without(frozenset({1, 2}))
    assert kept.block_ids == (9, 1) and kept.keys == (keys[0], keys[3])
    load = LoadSpec("l", keys, ids, 0, 4)
    assert load.tail(1).block_ids == (4, 7, 1) and load == LoadSpec("l", keys, (9, 4, 7, 1), 0, 4)


@pytest.mark.parametrize("native", [True, False])
def test_the_cpu_engine_copies_with_the_ids_as_an_array(native: bool) -> None:
    """The CPU engine takes the ids as an int64 array on both its paths (before: the Python loop,
    without llvmlite, handed numpy integers to ``ctypes.memmove``, which refuses them)."""
    src = caches(1)
    kv = bind_caches(SPEC, src)
    t = NumpyTransfer(native=native)
    ids = np.array([5, 0, 3], np.int64)
    slots = [np.zeros(SPEC.block_bytes, np.uint8) for _ in ids]
    t.gather(kv, ids, slots).wait()
    dst = caches(2)
    t.scatter(bind_caches(SPEC, dst), ids[::-1], slots[::-1]).wait()
    for layer in range(SPEC.num_layers):
        np.testing.assert_array_equal(dst[layer][ids], src[layer][ids])


def test_a_save_with_fewer_block_ids_than_keys_fails_and_stores_nothing(client: SyncClient) -> None:
    """A save whose ids are fewer than its keys is refused before anything is allocated: no key
    is stored. (With the sidecar holding one key, two ids for the two keys to write once put
    block 6's bytes under key 2: the ids were indexed by the positions to write only when fewer.)"""
    src = caches(1)
    kv = bind_caches(SPEC, src)
    keys = tuple(prefix_keys(NS, PROMPT)[:3])
    with client.allocate(NS, [keys[1]], [SPEC.block_bytes]) as alloc:  # the sidecar has key 1: two to write
        for _, view in alloc.writable():
            view[:] = 1
        alloc.commit()
    r = save_blocks(client, NS, kv, NumpyTransfer(), SaveSpec("short", keys, BlockIds([5, 6])))
    assert r.failure is Failure.ERROR and r.written == 0
    assert client.lookup(NS, list(keys)).matched == 0  # nothing of the save stood
