"""A lease's slots as SlotViews: each view's address and length known from the answer, so a
transfer checks and plans a batch with numpy instead of asking every view (~2.4 µs a view)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from connector.transfer.engines import NumpyTransfer, bind_caches, slot_addresses
from kvstore.client.calls import SlotViews, mapped_views
from kvstore.dram.slab import Slab
from kvstore.errors import InvalidArgument
from tests.connector.test_copy_plan import _caches, _spec


@pytest.fixture
def slab() -> Iterator[Slab]:
    s = Slab(4 << 20, page_bytes=1 << 20, prefault=False, name_prefix="kvstore-views-test")
    yield s
    s.close()


def _views(slab: Slab, n: int, nbytes: int, writable: bool) -> SlotViews:
    slots = slab.take(slab.class_of(nbytes), n)
    return mapped_views([(slab.name, s.offset, nbytes) for s in slots[::-1]], writable=writable)


def test_views_know_their_addresses_and_slices_keep_them(slab: Slab) -> None:
    views = _views(slab, 6, 4096, True)
    assert isinstance(views, SlotViews) and len(views) == 6
    assert views.addresses.tolist() == [v.__array_interface__["data"][0] for v in views]
    assert views.lengths.tolist() == [4096] * 6
    part = views[1:4]
    assert isinstance(part, SlotViews) and part.addresses.tolist() == views.addresses[1:4].tolist()
    assert part[0] is views[1]
    del views[4:]  # a lease cut short at a bad checksum
    assert views.addresses.tolist() == [v.__array_interface__["data"][0] for v in views] and len(views.lengths) == 4
    views.clear()
    assert len(views.addresses) == len(views.lengths) == 0


def test_a_batch_through_slot_views_moves_the_same_bytes_and_is_checked_alike(slab: Slab) -> None:
    spec = _spec("vllm_cpu", 8)
    kv = bind_caches(spec, _caches("vllm_cpu", 8, torch.float16, 3))
    ids = [5, 0, 6, 2]
    views = _views(slab, 4, spec.block_bytes, True)
    assert slot_addresses(kv, ids, views, writing=True).tolist() == slot_addresses(kv, ids, list(views),
                                                                                 writing=True).tolist()
    NumpyTransfer().gather(kv, ids, views)
    ref = [np.zeros(spec.block_bytes, np.uint8) for _ in ids]
    NumpyTransfer().gather(kv, ids, ref)
    assert [v.tobytes() for v in views] == [r.tobytes() for r in ref]

    short = mapped_views([(slab.name, 0, spec.block_bytes), (slab.name, 1 << 20, spec.block_bytes - 1)])
    with pytest.raises(InvalidArgument, match=r"slot 1: \d+ bytes is smaller than a block"):
        slot_addresses(kv, [0, 1], short, writing=False)
    read_only = mapped_views([(slab.name, 0, spec.block_bytes)], writable=False)
    with pytest.raises(InvalidArgument, match="read-only"):
        NumpyTransfer().gather(kv, [0], read_only)
    with pytest.raises(InvalidArgument, match="block id 7 is outside"):
        NumpyTransfer().scatter(kv, [0, 7], views[:2])
