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

from connector.transfer import PagedKV
from kvstore.client.wire import SlotViews, mapped_views
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
    from connector.cuda_transfer import CupyTransfer

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


def test_a_further_chunk_costs_a_few_calls(lease: tuple[Gpu, Slab, SlotViews]) -> None:
    """The same 2,048 slots in 64 chunks of 32: per further chunk, its launch (``_chunk``), its
    staging buffer, the stream it goes on, and its run and chunk appended -- nothing else in
    Python (before: nine calls a chunk, the chunk's share of each run worked out with min/max)."""
    _, slab, views = lease
    one = _batch_calls(slab, views, BLOCKS, BLOCKS).total()
    chunked = _batch_calls(slab, views, BLOCKS, 32).total()
    assert chunked - one <= 5 * 63 + 1  # + the second stream's completion event
