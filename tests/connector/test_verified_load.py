"""A load checks each slot against its checksum right before copying it, the hashing overlapped
with the copy of the chunk before (``connector/roles/verified.py``): bytes a process changes in
the sidecar's shared memory after they were sealed -- before the load or while it copies -- never
reach the engine's cache, and the blocks from there on are reported for recompute. Real sidecar,
real slab."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from paged_cases import NS, SPEC, caches, stored
from test_connector_held_leases import held_load

from connector.roles.metadata import Failure, LoadSpec
from connector.roles.ops import load_blocks
from connector.roles.verified import chunks
from connector.transfer.engines import Completion, NumpyTransfer, PagedKV, bind_caches
from tests.support.corrupt import flip


def sealed_load(client: Any) -> tuple[list[np.ndarray], list[int], LoadSpec]:
    """The 6 stored blocks (their source cache and engine ids) and a held lease over them once the
    sidecar has sealed all their checksums."""
    src, ids = stored(client)
    deadline = time.monotonic() + 30
    while True:
        load = held_load(client)
        assert load.lease is not None
        if all(load.lease.checksums):
            return src, ids, load
        client.release(load.lease.id)
        if time.monotonic() > deadline:
            raise AssertionError("checksums never sealed")
        time.sleep(0.01)


def scribble(load: LoadSpec, i: int) -> None:
    """What a buggy process that maps the slab read-write can do to a sealed slot (not through
    this process's mapping, which is read-only: tests/connector/test_load_guard.py)."""
    assert load.lease is not None
    slot = load.lease.slots[i]
    flip(slot.segment, slot.offset + slot.length // 3, 0x5A)


class Recording(NumpyTransfer):
    """The CPU engine, recording each scatter's block ids; ``during_first`` runs inside the first
    one (while the copy of the first chunk is under way)."""

    def __init__(self, during_first: Any = None) -> None:
        super().__init__()
        self.calls: list[list[int]] = []
        self.during_first = during_first

    def scatter(self, kv: PagedKV, block_ids: Sequence[int], slots: Sequence[Any]) -> Completion:
        self.calls.append(list(block_ids))
        if len(self.calls) == 1 and self.during_first is not None:
            self.during_first()
        return super().scatter(kv, block_ids, slots)


def test_chunks_start_small_and_double() -> None:
    assert chunks(6) == [(0, 1), (1, 3), (3, 5), (5, 6)]
    assert chunks(128) == [(0, 8), (8, 24), (24, 56), (56, 88), (88, 120), (120, 128)]
    assert chunks(1) == [(0, 1)] and chunks(0) == []
    for n in range(1, 300):
        spans = chunks(n)
        assert spans[0][0] == 0 and spans[-1][1] == n
        assert all(a < b and b == c for (a, b), (c, _) in itertools.pairwise(spans))


@pytest.mark.parametrize("where", [0, 3, 5])
def test_a_slot_changed_after_it_was_sealed_is_never_copied(client, where: int) -> None:
    _, _, load = sealed_load(client)
    scribble(load, where)
    dst = caches(2)
    before = [layer.copy() for layer in dst]
    kv = bind_caches(SPEC, dst)
    t = Recording()
    r = load_blocks(client, NS, kv, t, load, verify=True, guard="hash")
    client.release(load.lease.id)
    assert (r.loaded, r.failure) == (where, Failure.CHECKSUM)
    assert r.failed_block_ids == load.block_ids[where:]
    # chunk by chunk, each checked before its copy; the copies stop before the changed slot
    assert t.calls == [list(load.block_ids[a:min(b, where)]) for a, b in chunks(6) if a < where]
    for layer, old in zip(dst, before):  # its block and the ones after it keep what they held
        np.testing.assert_array_equal(layer[list(load.block_ids[where:])], old[list(load.block_ids[where:])])


def test_a_slot_changed_while_the_load_copies_is_never_copied(client) -> None:
    """Slot 4 is changed while the load copies slot 0 (its chunk, 3-5, is hashed only after the
    first chunk's copy): it is refused, and blocks 0-3 are loaded. Hashing the whole batch before
    the copy let such a change through."""
    src, ids, load = sealed_load(client)
    dst = caches(2)
    before = [layer.copy() for layer in dst]
    t = Recording(during_first=lambda: scribble(load, 4))
    r = load_blocks(client, NS, bind_caches(SPEC, dst), t, load, verify=True, guard="hash")
    client.release(load.lease.id)
    assert (r.loaded, r.failure) == (4, Failure.CHECKSUM)
    assert r.failed_block_ids == load.block_ids[4:]
    assert t.calls == [list(load.block_ids[0:1]), list(load.block_ids[1:3]), list(load.block_ids[3:4])]
    for layer in range(SPEC.num_layers):
        np.testing.assert_array_equal(dst[layer][list(load.block_ids[:4])], src[layer][ids[:4]])
        np.testing.assert_array_equal(dst[layer][list(load.block_ids[4:])], before[layer][list(load.block_ids[4:])])


def test_an_intact_batch_loads_in_chunks(client) -> None:
    src, ids, load = sealed_load(client)
    dst = caches(2)
    t = Recording()
    r = load_blocks(client, NS, bind_caches(SPEC, dst), t, load, verify=True, guard="hash")
    client.release(load.lease.id)
    assert r.ok and r.loaded == 6
    assert t.calls == [list(load.block_ids[a:b]) for a, b in chunks(6)]
    for layer in range(SPEC.num_layers):
        np.testing.assert_array_equal(dst[layer][list(load.block_ids)], src[layer][ids])
