"""The GPU engine's host work per batch (issue #39), counted on CPU: what ``CupyTransfer`` works
out before and between its CUDA calls -- the slots' checks and addresses, whether they lie in a
registration, the chunks and their DMA runs, the plan tables' lookup -- driven through the
recording model of cupy (tests/support/cuda_streams.py) with a lease's slots (``SlotViews`` of a
real slab). Counted, not timed: every Python function the engine's code enters and every builtin
or numpy call it makes (``sys.setprofile``), the model's own work left out."""

from __future__ import annotations

import sys
import types
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from connector.transfer.engines import PagedKV
from kvstore.client.calls import SlotViews, mapped_views
from kvstore.dram.slab import Slab
from tests.connector.test_cuda_ordering import _kv
from tests.support.cuda_streams import DevicePlane, Gpu, installed

ENGINE = str(Path(__file__).resolve().parents[2] / "connector")
BLOCKS = 2048


def _engine_calls(f: Callable[[], Any]) -> Counter[str]:
    """Calls the engine's own code makes while ``f`` runs: Python functions of ``connector/``
    entered, and calls (Python, builtin or numpy) made from its frames."""
    n: Counter[str] = Counter()

    def count(frame: types.FrameType, event: str, arg: object) -> None:
        if event in ("call", "c_call") and frame.f_code.co_filename.startswith(ENGINE):
            n[frame.f_code.co_name if event == "call" else getattr(arg, "__qualname__", "?")] += 1

    sys.setprofile(count)
    try:
        f()
    finally:
        sys.setprofile(None)
    return n


@pytest.fixture
def lease(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Gpu, Slab, SlotViews]]:
    with installed(monkeypatch) as (g, _):
        slab = Slab(16 << 20, page_bytes=8 << 20, prefault=False, name_prefix="kvstore-host-work-test")
        try:
            bb = _kv().spec.block_bytes
            slots = slab.take(slab.class_of(bb), BLOCKS)
            views = mapped_views([(slab.name, s.offset, bb) for s in slots], writable=True)
            yield g, slab, views
            del views
        finally:
            slab.close()


def _batch_calls(slab: Slab, views: SlotViews, n: int, chunk_blocks: int) -> Counter[str]:
    """The engine's calls for its second gather of ``n`` blocks (the first one uploads the tables
    and sizes the staging) with the slab registered at start."""
    from connector.transfer.cuda import CupyTransfer

    base = _kv()
    kv = PagedKV(base.spec, [[DevicePlane(2 * BLOCKS)]], base.plan)
    ids = [(7 * i) % (2 * BLOCKS) for i in range(n)]  # out of order, as the connector hands them over
    t = CupyTransfer(chunk_blocks=chunk_blocks, stage_bytes=1 << 40)
    try:
        t.register(slab.buf)
        t.gather(kv, ids, views[:n]).wait()
        return _engine_calls(lambda: t.gather(kv, ids, views[:n]).wait())
    finally:
        t.close()


def test_a_batch_costs_no_python_work_per_slot(lease: tuple[Gpu, Slab, SlotViews]) -> None:
    """A batch of 2,048 slots side by side in one chunk makes the same calls as one of 64: the
    slots are checked, located and grouped with numpy."""
    _, slab, views = lease
    assert _batch_calls(slab, views, BLOCKS, BLOCKS).total() == _batch_calls(slab, views, 64, 64).total()


def test_what_is_known_before_a_batch_is_not_worked_out_again(lease: tuple[Gpu, Slab, SlotViews]) -> None:
    """The registrations' lookup arrays are built at register(), not per batch (before: four
    arrays built from their list by every batch), and a block's size is known from the spec
    (before: a chain of six properties asked twice a batch)."""
    _, slab, views = lease
    calls = _batch_calls(slab, views, 64, 64)
    assert calls["array"] == 0, calls
    assert calls["slot_elems"] == calls["part_shape"] == 0, calls


def test_the_calls_of_a_batch_do_not_grow_with_its_chunks_or_its_dmas(lease: tuple[Gpu, Slab, SlotViews]) -> None:
    """The same 2,048 slots in 2, 64 or 512 chunks: the same calls; so with the slots in
    reverse order (no two slots one DMA can take: a DMA per slot). The chunks and their DMAs are
    worked out with numpy for the whole batch, and the loop that enqueues them makes the CUDA
    calls and no other (the model's own are not counted). Before: per chunk, its launch
    (``_chunk``), its staging buffer, its stream and the run and chunk appended by the schedule,
    and a Python step per run."""
    _, slab, views = lease
    back = SlotViews(list(views)[::-1], views.addresses[::-1].copy(), views.lengths[::-1].copy(), views.writable)
    for slots in (views, back):
        two = _batch_calls(slab, slots, BLOCKS, BLOCKS // 2)
        assert _batch_calls(slab, slots, BLOCKS, 32) == two
        assert _batch_calls(slab, slots, BLOCKS, 4) == two
