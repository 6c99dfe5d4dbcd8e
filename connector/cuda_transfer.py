"""GPU caches <-> pinned DRAM slots at the link's rate: a fused kernel per chunk, DMAs per run.

A gather of ``n`` blocks is cut into chunks of at most ``chunk_blocks`` blocks (and
``stage_bytes`` of staging). Per chunk, on one of two streams: one launch of ``kv_gather``
(``connector/kernels/kv_copy.cu``) copies every piece of every layer and plane of the chunk's
blocks into a device staging buffer, blocks side by side; then one 2-D DMA per run of evenly
spaced slots (:func:`connector.copy_plan.dma_runs`) moves the chunk to the pinned slab. The next
chunk's kernel runs on the other stream while this chunk's DMA is on the copy engine. A scatter
is the mirror image (DMA in, then ``kv_scatter``). Saves and loads have their own streams and
staging, so a save's gather and a load's scatter run at once, one per copy direction.

What is uploaded when: the plan's device tables (piece addresses, strides, lengths, offsets) once
per bound cache (kept for the last few caches), the block ids once per batch. The slab is
registered with ``cudaHostRegister`` once, by :meth:`CupyTransfer.register` at the connector's
start, in pieces of at most ``REGISTER_PIECE`` bytes (one registration fails at >= 512 GiB); a
slot outside every registration is pinned when first seen, with a warning (that costs ~0.1 s a GB
on the request's path). The engine's current stream is waited on first, so KV written by the
forward pass is visible; completion is a set of CUDA events.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from connector.copy_plan import Chunk, Piece, registration_pieces, schedule
from connector.layout import Array, KVSpec
from connector.transfer import Completion, PagedKV, slot_addresses
from kvstore.errors import InvalidArgument

log = logging.getLogger(__name__)

KERNEL_SOURCE = Path(__file__).with_name("kernels") / "kv_copy.cu"
REGISTER_PIECE = 64 << 30
CHUNK_BLOCKS = 32
STAGE_BYTES = 64 << 20  # per stream
TABLES_KEPT = 8
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


class _Direction:
    """Streams and staging buffers of one copy direction."""

    def __init__(self, cp: Any, streams: int) -> None:
        self.streams = [cp.cuda.Stream(non_blocking=True) for _ in range(max(1, streams))]
        self.stage: list[Any] = [None] * len(self.streams)
        self.lock = threading.Lock()  # one batch enqueued at a time: chunks of two would share staging
        self._cp = cp

    def buffer(self, j: int, nbytes: int) -> Any:
        """Stream ``j``'s staging buffer, at least ``nbytes``; a smaller one is let go only after
        its stream has finished with it."""
        buf = self.stage[j]
        if buf is None or buf.nbytes < nbytes:
            self.streams[j].synchronize()
            buf = self.stage[j] = self._cp.empty(nbytes, dtype=self._cp.uint8)
        return buf


class PinnedHost:
    """The host mappings registered with CUDA, as ``(start, end)`` pieces."""

    def __init__(self, cp: Any) -> None:
        self._rt = cp.cuda.runtime
        self.limits: list[tuple[int, int]] = []
        self._ours: list[int] = []  # starts of the pieces this process registered: unregistered at close

    def covers(self, address: int, nbytes: int) -> bool:
        return any(a <= address and address + nbytes <= b for a, b in self.limits)

    def register(self, start: int, size: int, page_bytes: int) -> float:
        """Register ``[start, start + size)`` piece by piece; the seconds it took."""
        t0 = time.perf_counter()
        for a, b in registration_pieces(start, size, REGISTER_PIECE, page_bytes):
            if any(x <= a < y for x, y in self.limits):
                continue
            try:
                self._rt.hostRegister(a, b - a, 0)
                self._ours.append(a)
            except self._rt.CUDARuntimeError as exc:  # registered by another engine of this process: fine
                if "AlreadyRegistered" not in str(exc):
                    raise
            self.limits.append((a, b))
        self.limits.sort()
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


class CupyTransfer:
    """GPU caches <-> pinned DRAM slots (see the module docstring). Never used on CPU."""

    name = "cupy"
    pins_host = True

    def __init__(self, spec: KVSpec | None = None, streams: int = 2, chunk_blocks: int = CHUNK_BLOCKS,
                 stage_bytes: int = STAGE_BYTES) -> None:
        cp = self._cp = importlib.import_module("cupy")
        module = cp.RawModule(code=KERNEL_SOURCE.read_text(), options=("--std=c++14",))
        self._kernels = {True: module.get_function("kv_gather"), False: module.get_function("kv_scatter")}
        self._dirs = {True: _Direction(cp, streams), False: _Direction(cp, streams)}
        self._chunk_blocks, self._stage_bytes = max(1, chunk_blocks), stage_bytes
        self._tables: OrderedDict[tuple[Piece, ...], _Tables] = OrderedDict()
        self._pinned = PinnedHost(cp)
        self._lock = threading.Lock()

    def register(self, host: Array, page_bytes: int = 0) -> None:
        start, size = _span(host)
        seconds = self._pinned.register(start, size, page_bytes)
        log.info("pinned a host mapping of %.1f GiB for DMA in %.3f s", size / (1 << 30), seconds)

    def gather(self, kv: PagedKV, block_ids: Sequence[int], slots: Sequence[Array]) -> Completion:
        return self._move(kv, block_ids, slots, to_slots=True)

    def scatter(self, kv: PagedKV, block_ids: Sequence[int], slots: Sequence[Array]) -> Completion:
        return self._move(kv, block_ids, slots, to_slots=False)

    def close(self) -> None:
        """Wait for every transfer in flight, then unregister the mappings this engine pinned."""
        for d in self._dirs.values():
            for s in d.streams:
                s.synchronize()
            d.stage = [None] * len(d.streams)
        self._tables.clear()
        self._pinned.close()

    # --- one batch --------------------------------------------------------------------------

    def _move(self, kv: PagedKV, block_ids: Sequence[int], slots: Sequence[Array], *, to_slots: bool) -> Completion:
        if not kv.on_device:
            raise InvalidArgument("cupy transfer: the cache is in host memory (use the 'numpy' transfer)")
        addresses = slot_addresses(kv, block_ids, slots, writing=to_slots)
        if not block_ids:
            return _Events([], ())
        bb = kv.spec.block_bytes
        cp, d = self._cp, self._dirs[to_slots]
        per_chunk = max(1, min(self._chunk_blocks, self._stage_bytes // bb))
        with self._lock:  # pinning and the tables: shared by both directions
            self._pin_missing(slots, addresses, bb)
            plan = schedule(addresses, bb, per_chunk, self._pinned.limits)
            tables = self._device_tables(kv.plan)
        with d.lock:
            ids = cp.asarray(np.asarray(block_ids, dtype=np.int64))  # the batch's one upload, on the current stream
            ready = cp.cuda.get_current_stream().record()
            for s in d.streams:
                s.wait_event(ready)
            for c, chunk in enumerate(plan):
                j = c % len(d.streams)
                stage = d.buffer(j, max(self._stage_bytes, per_chunk * bb))
                self._chunk(tables, ids, chunk, bb, stage, d.streams[j], to_slots)
            return _Events([s.record() for s in d.streams], (ids, tables))

    def _chunk(self, t: _Tables, ids: Any, chunk: Chunk, bb: int, stage: Any, stream: Any, to_slots: bool) -> None:
        rt = self._cp.cuda.runtime
        a, b, runs = chunk.start, chunk.end, chunk.runs
        base = int(stage.data.ptr)
        args = (t.src, t.stride, t.nbytes, t.off, np.uint64(int(ids.data.ptr) + 8 * a), np.uint64(base), np.int64(bb))
        launch = self._kernels[to_slots]
        if not to_slots:
            for r in runs:
                rt.memcpy2DAsync(base + (r.first - a) * bb, bb, r.host, r.pitch, bb, r.count, _H2D, stream.ptr)
        with stream:
            launch((t.pieces, b - a), (t.threads,), args)
        if to_slots:
            for r in runs:
                rt.memcpy2DAsync(r.host, r.pitch, base + (r.first - a) * bb, bb, bb, r.count, _D2H, stream.ptr)

    def _pin_missing(self, slots: Sequence[Array], addresses: Sequence[int], bb: int) -> None:
        for s, addr in zip(slots, addresses):
            if not self._pinned.covers(addr, bb):
                log.warning("a slot outside every pinned mapping: pinning its whole mapping on the request's path"
                            " (call register() with the slab at start)")
                self.register(s)

    def _device_tables(self, plan: tuple[Piece, ...]) -> _Tables:
        t = self._tables.get(plan)
        if t is not None:
            self._tables.move_to_end(plan)
            return t
        cp = self._cp
        words = max(p.nbytes for p in plan) // 16
        threads = int(min(256, max(32, 1 << max(0, (words - 1).bit_length()))))
        t = _Tables(cp.asarray(np.array([p.src for p in plan], np.uint64)),
                    cp.asarray(np.array([p.stride for p in plan], np.int64)),
                    cp.asarray(np.array([p.nbytes for p in plan], np.int64)),
                    cp.asarray(np.array([p.slot_off for p in plan], np.int64)), len(plan), threads)
        self._tables[plan] = t
        while len(self._tables) > TABLES_KEPT:
            self._tables.popitem(last=False)
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
