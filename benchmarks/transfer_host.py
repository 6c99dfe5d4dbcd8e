"""The GPU engine's host work per batch, timed on a CPU: ``CupyTransfer.gather`` itself, end to end,
over a cupy that does nothing (:func:`idle_cupy`), so what is timed is the engine's own Python
and numpy -- the ids, the slots' checks and addresses, the pinning check, the chunks and their
DMAs, the tables' lookup, the enqueue loop -- and not the driver's work, which is measured on a
GPU only. A lease's slots (``SlotViews`` of a real slab, registered at start), ids out of order,
the FlashAttention layout of each model shape, batches of 1 to 2,048 blocks.

Figures per shape and batch size ``n``: ``host_plan_us_per_batch_{n}``, the planning (the ids,
the slots' checks and addresses, the schedule against the registrations, every DMA's and
launch's arguments: what the engine works out before and between its CUDA calls), and
``host_us_per_batch_{n}``, the whole gather (the planning, the locks, the events, the enqueue
loop calling the idle cupy), both with the ids as an int64 array, as the connector hands them
over (``connector/roles/block_ids.py``: built once when the scheduler side builds the step's
metadata); ``host_plan_list_..`` and ``host_list_..`` the same with them as a list (converting
them is ~0.02 µs an id). For the shape's GPU batch (``GPU_BLOCKS``, or ``--blocks``) the older
names, the planning with the ids as the connector hands them over (an int64 array; a list
before the connector carried arrays): ``host_plan_us_per_batch`` / ``_per_block``, a batch of one
block (``host_plan_one_block_us``), what a further slot adds, and per block with plain views
(``host_plan_views_us_per_block``: every view asked its address)."""

from __future__ import annotations

import importlib
import sys
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from benchmarks.common import Result
from benchmarks.transfer_shapes import GPU_BLOCKS, MiB, best_of, random_ids, spec_of
from connector.transfer.engines import PagedKV, bind_caches
from kvstore.dram.slab import Slab

SIZES = (1, 256, 1024, 2048)


class _Stream:
    ptr = 1

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def wait_event(self, ev: object) -> None:
        return None

    def synchronize(self) -> None:
        return None


class _Event:
    done = True

    def record(self, stream: object = None) -> None:
        return None

    def synchronize(self) -> None:
        return None


class _Memory:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.data = types.SimpleNamespace(ptr=1 << 40)


class _Device:
    def __init__(self, dev: int | None = None) -> None:
        self.id = dev or 0

    def __enter__(self) -> _Device:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def idle_cupy() -> types.ModuleType:
    """A module that answers like cupy for every call ``CupyTransfer`` makes, and does nothing."""
    cp = types.ModuleType("cupy")
    stream = _Stream()
    nothing = lambda *a, **k: None  # noqa: E731
    cp.uint8 = np.uint8  # type: ignore[attr-defined]
    cp.asarray = lambda a: _Memory(np.asarray(a).nbytes)  # type: ignore[attr-defined]
    cp.empty = lambda n, dtype=np.uint8: _Memory(int(n))  # type: ignore[attr-defined]
    cp.RawModule = lambda code="", options=(): types.SimpleNamespace(get_function=lambda name: nothing)  # type: ignore[attr-defined]
    cp.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
        Stream=lambda non_blocking=False: _Stream(), ExternalStream=lambda ptr, device=0: stream,
        Event=lambda **kw: _Event(), Device=_Device, get_current_stream=lambda: stream,
        runtime=types.SimpleNamespace(memcpy2DAsync=nothing, hostRegister=nothing, hostUnregister=nothing,
                                      CUDARuntimeError=RuntimeError))
    return cp


@contextmanager
def _engine(chunk_blocks: int | None = None) -> Iterator[Any]:
    """A ``CupyTransfer`` over :func:`idle_cupy` (cupy is imported when the engine is built)."""
    module = importlib.import_module("connector.transfer.cuda")
    saved = sys.modules.get("cupy")
    sys.modules["cupy"] = idle_cupy()
    try:
        t = module.CupyTransfer() if chunk_blocks is None else module.CupyTransfer(chunk_blocks=chunk_blocks)
    finally:
        if saved is None:
            del sys.modules["cupy"]
        else:
            sys.modules["cupy"] = saved
    try:
        yield t
    finally:
        t.close()


class _Plane:
    """A cache plane "on the device" as the engine sees it: its block count and device."""

    def __init__(self, blocks: int) -> None:
        self.shape = (blocks,)
        self.device = types.SimpleNamespace(id=0)


def host_plan(res: Result, shape: str, blocks: int, rounds: int, memcpy_per_block: float) -> None:
    """The figures of the module docstring for ``shape``: batches of :data:`SIZES` and of ``blocks``
    (the shape's GPU batch when 0); ``memcpy_per_block``: a memcpy of a block's bytes on this CPU."""
    import torch

    from kvstore.client.calls import mapped_views

    n_gpu = blocks or GPU_BLOCKS[shape]
    sizes = sorted({*(s for s in SIZES if not blocks), n_gpu})
    spec = spec_of(shape, "vllm_gpu")
    bb = spec.block_bytes
    small = bind_caches(spec, [torch.empty((2, 4, spec.block_size, spec.kv_heads, spec.head_size),
                                           dtype=torch.bfloat16) for _ in range(spec.num_layers)])
    top = max(sizes)
    kv = PagedKV(spec, [[_Plane(2 * top)]], small.plan)  # the shape's plan; no cache byte is touched
    page = max(32 * MiB, bb)
    slot_bytes = 1 << (bb - 1).bit_length()  # the size class a block's slot comes from
    slab = Slab(top * slot_bytes + page, page_bytes=page, prefault=False, name_prefix="kvstore-bench-plan")
    try:
        slots = slab.take(slab.class_of(bb), top)
        views = mapped_views([(slab.name, s.offset, bb) for s in slots], writable=True)
        ids = random_ids(top, kv.num_blocks, 3)  # a list (the connector hands them over as an int64 array)
        with _engine() as t:
            t.register(slab.buf, page)
            timed: list[Callable[[], float]] = []
            for n in sizes:
                arr = np.array(ids[:n], np.int64)
                timed += [_planning(t, kv, views[:n], arr), _planning(t, kv, views[:n], ids[:n]),
                          _batch(t, kv, views[:n], arr), _batch(t, kv, views[:n], ids[:n])]
            timed.append(_planning(t, kv, list(views[:n_gpu]), np.array(ids[:n_gpu], np.int64)))
            best = best_of(max(rounds, 20), *timed)
        del views
    finally:
        slab.close()
    at = {n: best[4 * i: 4 * i + 4] for i, n in enumerate(sizes)}
    for n, (plan, plan_listed, engine, engine_listed) in at.items():
        res.figure(f"{shape}_host_plan_us_per_batch_{n}", plan * 1e6, "us")
        res.figure(f"{shape}_host_plan_list_us_per_batch_{n}", plan_listed * 1e6, "us")
        res.figure(f"{shape}_host_us_per_batch_{n}", engine * 1e6, "us")
        res.figure(f"{shape}_host_list_us_per_batch_{n}", engine_listed * 1e6, "us")
    known, asked = at[n_gpu][0], best[-1]  # the ids as the connector hands them over: an int64 array
    one = at[1][0] if 1 in at else known
    res.figure(f"{shape}_host_plan_blocks", n_gpu, "blocks")
    res.figure(f"{shape}_host_plan_us_per_batch", known * 1e6, "us")
    res.figure(f"{shape}_host_plan_us_per_block", known * 1e6 / n_gpu, "us")
    res.figure(f"{shape}_host_plan_one_block_us", one * 1e6, "us")
    res.figure(f"{shape}_host_plan_us_per_slot_above_one", max(0.0, known - one) * 1e6 / max(1, n_gpu - 1), "us")
    res.figure(f"{shape}_host_plan_views_us_per_block", asked * 1e6 / n_gpu, "us")
    res.ratio(f"{shape}_host_plan_vs_memcpy_per_block", (known / n_gpu) / memcpy_per_block)


def _batch(t: Any, kv: PagedKV, slots: Any, ids: Any) -> Callable[[], float]:
    """One gather through the engine, end to end (over :func:`idle_cupy`)."""
    def go() -> float:
        t0 = time.perf_counter()
        t.gather(kv, ids, slots).wait()
        return time.perf_counter() - t0
    return go


def _planning(t: Any, kv: PagedKV, slots: Any, ids: Any) -> Callable[[], float]:
    """The engine's planning of a gather, the steps ``CupyTransfer`` takes for it on the host
    before and around its CUDA calls: the ids, the slots' checks and addresses, the schedule
    against the registrations, every DMA's and launch's arguments (``enqueue_steps``)."""
    from connector.transfer.cuda import CHUNK_BLOCKS, STAGE_BYTES
    from connector.transfer.engines import as_ids, slot_addresses
    from connector.transfer.plan import enqueue_steps

    bb = kv.spec.block_bytes
    per_chunk = max(1, min(CHUNK_BLOCKS, STAGE_BYTES // bb))
    stages = [1 << 40, 1 << 41]

    def go() -> float:
        t0 = time.perf_counter()
        block_ids = as_ids(ids)
        addresses = slot_addresses(kv, block_ids, slots, writing=True)
        enqueue_steps(t._schedule(slots, addresses, bb, per_chunk), stages, 1 << 42, True)
        return time.perf_counter() - t0
    return go
