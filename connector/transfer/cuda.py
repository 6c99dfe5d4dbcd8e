"""GPU caches <-> pinned DRAM slots at the link's rate: a fused kernel per chunk, DMAs per run.

A gather of ``n`` blocks is cut into chunks of at most ``chunk_blocks`` blocks (and
``stage_bytes`` of staging). Per chunk, on one of two streams: one launch of ``kv_gather``
(``connector/transfer/kernels/kv_copy.cu``) copies every piece of every layer and plane of the chunk's
blocks into a device staging buffer, blocks side by side; then one 2-D DMA per run of evenly
spaced slots (:func:`connector.transfer.plan.dma_runs`) moves the chunk to the pinned slab. The next
chunk's kernel runs on the other stream while this chunk's DMA is on the copy engine. A scatter
is the mirror image (DMA in, then ``kv_scatter``). Saves and loads have their own streams and
staging, so a save's gather and a load's scatter run at once, one per copy direction.

What is uploaded when: the plan's device tables (piece addresses, strides, lengths, offsets) once
per bound cache (kept for the last few caches), the block ids once per batch, both on the batch's
first stream before the event its other streams wait on (a batch of the other direction that
reuses the tables waits on their upload's event). The slab is registered with
``cudaHostRegister`` (portable: pinned for every device) once, by :meth:`CupyTransfer.register`
at the connector's start, under the engine's device (named, else torch's current one), in pieces
of at most ``REGISTER_PIECE`` bytes cut at the slab's pages (one registration fails at >= 512
GiB); a slot outside every registration is pinned when first seen, with a warning (that costs
~0.1 s a GB on the request's path). :meth:`CupyTransfer.close` refuses new batches, waits for
those being queued and in flight, then unregisters.

Every batch runs on the cache's own device (streams, staging, kernels and tables per device), so
a tensor-parallel rank on ``cuda:3`` or a pool thread whose current device is 0 are the same. It
waits first on the engine's stream -- torch's current stream of the calling thread for the
cache's device, else cupy's -- so KV the forward pass wrote is visible; completion is a blocking
CUDA event per stream (``wait`` sleeps, it does not spin). A batch that fails halfway waits for
what it had queued before its buffers are let go.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from connector.transfer.engines import BlockIdsLike, Completion, PagedKV, as_ids, slot_addresses
from connector.transfer.layout import Array
from connector.transfer.plan import (
    Piece,
    Registrations,
    Schedule,
    enqueue_steps,
    launch_shape,
    plan_tables,
    registration_pieces,
    schedule,
    uncovered,
)
from kvstore.dram.slab import read_only_at
from kvstore.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger(__name__)

KERNEL_SOURCE = Path(__file__).with_name("kernels") / "kv_copy.cu"
REGISTER_PIECE = 64 << 30
CHUNK_BLOCKS = 32
STAGE_BYTES = 64 << 20  # per stream
TABLES_KEPT = 8
HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, not only the current one
_D2H, _H2D = 2, 1  # cudaMemcpyKind


@dataclass(slots=True)
class _Tables:
    """A plan on the device: one array per field, ``len(plan)`` entries each."""

    src: Any
    stride: Any
    nbytes: Any
    off: Any
    pieces: int
    threads: int
    parts: int  # thread blocks per piece (a large piece is cut so the launch fills the device)
    plan: tuple[Piece, ...]  # what they were built from: a hit on the key is checked against it
    stream: Any  # the stream the upload was queued on, and an event after it: a batch on another
    ready: Any  # stream waits on it before its first kernel


class _Direction:
    """Streams and staging buffers of one copy direction on one device."""

    def __init__(self, cp: Any, streams: int) -> None:
        self.streams = [cp.cuda.Stream(non_blocking=True) for _ in range(max(1, streams))]
        self.stage: list[Any] = [None] * len(self.streams)
        self.bases = [0] * len(self.streams)  # their staging buffers' device addresses
        self.lock = threading.Lock()  # one batch enqueued at a time: chunks of two would share staging
        # re-recorded every batch (under the lock): a wait already queued keeps the record it saw
        self.engine_done = cp.cuda.Event(block=True, disable_timing=True)
        self.uploaded = cp.cuda.Event(block=True, disable_timing=True)
        self._cp = cp

    def buffers(self, used: int, nbytes: int) -> list[int]:
        """The device addresses of the first ``used`` streams' staging buffers, each at least
        ``nbytes`` (``bases``: kept between batches); a smaller one is let go only after its stream
        has finished with it."""
        for j in range(used):
            buf = self.stage[j]
            if buf is None or buf.nbytes < nbytes:
                self.streams[j].synchronize()
                buf = self.stage[j] = self._cp.empty(nbytes, dtype=self._cp.uint8)
                self.bases[j] = int(buf.data.ptr)
        return self.bases if used == len(self.bases) else self.bases[:used]

    def finish(self) -> None:
        for s in self.streams:
            s.synchronize()
        self.stage = [None] * len(self.streams)


class _Device:
    """What one device needs: the compiled kernels, each direction's streams, the plan tables."""

    def __init__(self, cp: Any, streams: int) -> None:
        module = cp.RawModule(code=KERNEL_SOURCE.read_text(), options=("--std=c++14",))
        self.kernels = {True: module.get_function("kv_gather"), False: module.get_function("kv_scatter")}
        self.dirs = {True: _Direction(cp, streams), False: _Direction(cp, streams)}
        self.tables: OrderedDict[int, _Tables] = OrderedDict()  # by PagedKV.plan_key
        self.tables_lock = threading.Lock()  # both directions' batches look tables up
        self.external: dict[int, Any] = {}  # the engine's streams, as cupy streams


class PinnedHost:
    """The host mappings registered with CUDA, as ``(start, end)`` pieces (their lookup arrays
    built here, once per registration, not per batch)."""

    def __init__(self, cp: Any) -> None:
        self._rt = cp.cuda.runtime
        self.limits = Registrations()
        self._ours: list[int] = []  # starts of the pieces this process registered: unregistered at close

    def covers(self, address: int, nbytes: int) -> bool:
        return self.limits.covers(address, nbytes)

    def register(self, start: int, size: int, page_bytes: int) -> float:
        """Register ``[start, start + size)`` piece by piece; the seconds it took."""
        t0 = time.perf_counter()
        for a, b in registration_pieces(start, size, REGISTER_PIECE, page_bytes):
            if self.limits.covers(a, 1):
                continue
            try:
                self._rt.hostRegister(a, b - a, HOST_REGISTER_PORTABLE)
                self._ours.append(a)
            except self._rt.CUDARuntimeError as exc:  # registered by another engine of this process: used,
                if "AlreadyRegistered" not in str(exc):  # never unregistered here
                    raise
            self.limits.add(a, b)
        return time.perf_counter() - t0

    def close(self) -> None:
        ours, self._ours = self._ours, []
        self.limits.clear()
        for a in ours:
            self._rt.hostUnregister(a)


def _span(a: np.ndarray) -> tuple[int, int]:
    """(first byte address, size) of the whole buffer that ``a`` is a view of."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    start = int(a.__array_interface__["data"][0])
    return start, int(a.nbytes)


def _engine_stream(cp: Any, device: int, external: dict[int, Any]) -> Any:
    """The stream the engine's last writes of the cache were queued on: torch's current stream
    of this thread for ``device`` when torch drives the GPU here (wrapped once per stream in
    ``external``), else cupy's current stream."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        ptr = torch.cuda.current_stream(device).cuda_stream
        s = external.get(ptr)
        if s is None:
            s = external[ptr] = cp.cuda.ExternalStream(ptr, device)
        return s
    return cp.cuda.get_current_stream()


def _event(cp: Any, stream: Any) -> Any:
    ev = cp.cuda.Event(block=True, disable_timing=True)  # a blocking event: wait() sleeps instead of spinning
    ev.record(stream)
    return ev


class CupyTransfer:
    """GPU caches <-> pinned DRAM slots (see the module docstring). Never used on CPU."""

    name = "cupy"
    pins_host = True

    def __init__(self, streams: int = 2, chunk_blocks: int = CHUNK_BLOCKS, stage_bytes: int = STAGE_BYTES,
                 device: int | None = None) -> None:
        """``device``: the GPU whose context pins the host mappings (:meth:`register`); by default
        torch's current device when torch drives CUDA here (a vLLM rank's own), else cupy's."""
        self._cp = importlib.import_module("cupy")
        self._streams = streams
        self._chunk_blocks, self._stage_bytes = max(1, chunk_blocks), stage_bytes
        self._device = device
        self._devices: dict[int, _Device] = {}
        self._pinned = PinnedHost(self._cp)
        self._lock = threading.Lock()  # the pinned mappings, the per-device state, closing
        self._closed = False

    def register(self, host: Array, page_bytes: int = 0) -> None:
        """Pin the mapping behind ``host`` under this engine's device (no stray context on GPU 0
        for a rank on another), in registrations cut at multiples of ``page_bytes``."""
        start, size = _span(host)
        with self._cp.cuda.Device(self._pin_device()), self._lock:
            self._refuse_closed()
            seconds = self._pinned.register(start, size, page_bytes)
        log.info("pinned a host mapping of %.1f GiB for DMA in %.3f s", size / (1 << 30), seconds)

    def gather(self, kv: PagedKV, block_ids: BlockIdsLike, slots: Sequence[Array]) -> Completion:
        return self._move(kv, block_ids, slots, to_slots=True)

    def scatter(self, kv: PagedKV, block_ids: BlockIdsLike, slots: Sequence[Array]) -> Completion:
        return self._move(kv, block_ids, slots, to_slots=False)

    def close(self) -> None:
        """Refuse new batches, wait for every batch being queued and every transfer in flight,
        then unregister the mappings this engine pinned."""
        with self._lock:  # a batch takes its direction's lock under this one: none starts from here on
            self._closed = True
            for dev, state in self._devices.items():
                with self._cp.cuda.Device(dev):
                    for d in state.dirs.values():
                        with d.lock:  # a batch still queueing holds it
                            d.finish()
                    state.tables.clear()
            self._devices.clear()
            self._pinned.close()

    def _pin_device(self) -> int:
        if self._device is not None:
            return self._device
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            return int(torch.cuda.current_device())
        return int(self._cp.cuda.Device().id)

    def _refuse_closed(self) -> None:
        if self._closed:
            raise FailedPrecondition("cupy transfer: closed")

    # --- one batch --------------------------------------------------------------------------

    def _move(self, kv: PagedKV, block_ids: BlockIdsLike, slots: Sequence[Array], *, to_slots: bool) -> Completion:
        if not kv.on_device:
            raise InvalidArgument("cupy transfer: the cache is in host memory (use the 'numpy' transfer)")
        ids = as_ids(block_ids)  # once: checked, planned and uploaded from it
        addresses = slot_addresses(kv, ids, slots, writing=to_slots)
        if not len(ids):
            return _Events([], ())
        cp, bb, dev = self._cp, kv.spec.block_bytes, int(kv.planes[0][0].device.id)
        per_chunk = max(1, min(self._chunk_blocks, self._stage_bytes // bb))
        with cp.cuda.Device(dev):
            with self._lock:
                self._refuse_closed()
                plan = self._schedule(slots, addresses, bb, per_chunk)
                state = self._devices.get(dev) or self._devices.setdefault(dev, _Device(cp, self._streams))
                d = state.dirs[to_slots]
                d.lock.acquire()  # before close() can look: it waits for this batch to be queued
            try:
                return self._enqueue(state, d, kv, ids, plan, bb, per_chunk, to_slots)
            finally:
                d.lock.release()

    def _enqueue(self, state: _Device, d: _Direction, kv: PagedKV, block_ids: np.ndarray, plan: Schedule,
                 bb: int, per_chunk: int, to_slots: bool) -> Completion:
        """Queue one batch. On the first stream, in this order: a wait for the engine's stream, the
        plan's tables (uploaded there when new, else a wait for their upload when it was queued on
        another stream), the block ids, then the event every other stream of the batch waits on:
        whatever stream the engine computes on, nothing a kernel reads can land after it runs.
        Then per chunk, on stream ``chunk % streams``: its kernel and its DMAs
        (:func:`connector.transfer.plan.enqueue_steps`: what each one needs worked out for the whole
        batch with numpy, so the loop makes the CUDA calls and nothing else)."""
        cp = self._cp
        first = d.streams[0]
        d.engine_done.record(_engine_stream(cp, cp.cuda.Device().id, state.external))
        first.wait_event(d.engine_done)
        with first:
            tables = self._device_tables(state, kv, first)
            if tables.stream is not first:
                first.wait_event(tables.ready)
            ids = cp.asarray(block_ids)  # the batch's one upload
        if len(d.streams) > 1:
            d.uploaded.record(first)
            for s in d.streams[1:]:
                s.wait_event(d.uploaded)
        used = d.streams[: min(len(d.streams), plan.num_chunks)]  # a stream without a chunk has nothing to wait for
        steps = enqueue_steps(plan, d.buffers(len(used), per_chunk * bb), ids.data.ptr, to_slots)
        kernel, streams, block = state.kernels[to_slots], d.streams, (tables.threads,)
        grid_x, pitch, parts = tables.pieces * tables.parts, np.int64(bb), np.int64(tables.parts)
        src, stride, nbytes, off = tables.src, tables.stride, tables.nbytes, tables.off
        memcpy, kind = cp.cuda.runtime.memcpy2DAsync, _D2H if to_slots else _H2D
        try:
            for j, launch, dst, dpitch, from_, spitch, count, blocks, chunk_ids, stage in steps:
                s = streams[j]
                if launch and to_slots:  # gather: the chunk's kernel, then its DMAs
                    with s:
                        kernel((grid_x, blocks), block, (src, stride, nbytes, off, chunk_ids, stage, pitch, parts))
                memcpy(dst, dpitch, from_, spitch, bb, count, kind, s.ptr)
                if launch and not to_slots:  # scatter: the chunk's DMAs, then its kernel
                    with s:
                        kernel((grid_x, blocks), block, (src, stride, nbytes, off, chunk_ids, stage, pitch, parts))
        except BaseException:
            for s in d.streams:  # nothing queued may outlive the buffers it uses
                s.synchronize()
            raise
        return _Events([_event(cp, s) for s in used], (ids, tables))

    def _schedule(self, slots: Sequence[Array], addresses: np.ndarray, bb: int, per_chunk: int) -> Schedule:
        """The batch's schedule against the registrations, which checks every slot lies in one:
        when one does not (``schedule`` refuses it; before anything is registered, every slot),
        its mapping is pinned on the request's path and the batch scheduled again."""
        limits = self._pinned.limits
        if limits:
            try:
                return schedule(addresses, bb, per_chunk, limits)
            except InvalidArgument:
                pass
        self._pin_missing(slots, addresses, bb)
        return schedule(addresses, bb, per_chunk, self._pinned.limits)

    def _pin_missing(self, slots: Sequence[Array], addresses: np.ndarray, bb: int) -> None:
        for i in uncovered(addresses, bb, self._pinned.limits):
            if not self._pinned.covers(int(addresses[i]), bb):  # pinned by an earlier slot of this batch, else:
                log.warning("a slot outside every pinned mapping: pinning its whole mapping on the request's path"
                            " (call register() with the slab at start)")
                start, size = _span(slots[i])
                guard = read_only_at(start)  # (a slab attached read-only since start: writable to pin it)
                with guard.unprotected() if guard is not None else contextlib.nullcontext():
                    self._pinned.register(start, size, 0)

    def _device_tables(self, state: _Device, kv: PagedKV, stream: Any) -> _Tables:
        """The plan's tables on the device: cached per bound cache (by its plan's hash, computed
        once at binding), else uploaded on ``stream`` (the batch's first stream, current) with an
        event after the upload."""
        plan = kv.plan
        with state.tables_lock:
            t = state.tables.get(kv.plan_key)
            if t is not None and (t.plan is plan or t.plan == plan):
                state.tables.move_to_end(kv.plan_key)
                return t
            cp = self._cp
            threads, parts = launch_shape(plan)
            src, stride, nbytes, off = plan_tables(plan)
            t = _Tables(cp.asarray(src), cp.asarray(stride), cp.asarray(nbytes), cp.asarray(off), len(plan), threads,
                        parts, plan, stream, None)
            t.ready = _event(cp, stream)
            state.tables[kv.plan_key] = t
            while len(state.tables) > TABLES_KEPT:
                state.tables.popitem(last=False)
            return t


class _Events:
    """Done when every stream of the batch has passed its event; holds the batch's device buffers
    (ids, tables) until then."""

    def __init__(self, events: list[Any], keep: tuple[Any, ...]) -> None:
        self._events, self._keep = events, keep

    def done(self) -> bool:
        if all(e.done for e in self._events):
            self._keep = ()
            return True
        return False

    def wait(self) -> None:
        for e in self._events:
            e.synchronize()
        self._keep = ()
