"""A recording stand-in for the part of cupy that ``connector/transfer/cuda.py`` calls, for CPU tests
of *when* the GPU path enqueues what: streams, events, uploads, kernel launches and DMAs.

It executes nothing on a device. Every operation is logged with the stream it was queued on and a
vector clock, so a test can ask whether one operation is ordered before another by CUDA's rules:
operations of one stream run in order; ``stream.wait_event(e)`` orders what the stream queues next
after everything queued before ``e.record(...)`` on the recording stream; a host-side
``synchronize()`` orders everything queued later after what it waited for. Streams created
``non_blocking=True`` (the transfer's own) get no implicit ordering with the legacy default
stream, and the model gives none to any stream: an upload on cupy's current stream is unordered
with a kernel on another stream unless an event joins them.

Install with :func:`install` (it replaces ``sys.modules["cupy"]``, the transfer's one import of
cupy); :class:`Gpu` is the log. Device memory is modelled by address: each array gets a range of
fake device addresses, and a kernel's pointer arguments are resolved to the arrays they fall in.
"""

from __future__ import annotations

import itertools
import sys
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Op:
    """One enqueued operation: what, on which stream, its vector clock, the arrays it reads/writes."""

    kind: str  # upload | kernel | dma | write | unregister
    stream: int
    clock: dict[int, int]
    reads: list[Any] = field(default_factory=list)
    writes: list[Any] = field(default_factory=list)
    detail: Any = None


class Gpu:
    """The model's state: streams' clocks, the host's clock, the log, the live arrays."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.arrays: list[FakeArray] = []
        self.host: dict[int, int] = {}  # what the host has waited for
        self.clocks: dict[int, dict[int, int]] = {}
        self.lock = threading.RLock()
        self.on_kernel: Callable[[], None] | None = None  # a hook a test uses to stop a batch mid-way
        self._next_ptr = itertools.count(0x7000_0000_0000, 1 << 32)
        self._next_stream = itertools.count(1)
        self.local = threading.local()
        self.null = Stream(self, ptr=0)
        self.events: list[Event] = []  # every event made, in order
        self.registered_on: list[tuple[int, int]] = []  # (address, current device) of each hostRegister
        self.devices = 1

    def device(self) -> int:
        """cupy's current device of this thread."""
        stack = getattr(self.local, "devices", None)
        return stack[-1] if stack else 0

    # --- clocks -----------------------------------------------------------------------------

    def new_stream(self) -> int:
        sid = next(self._next_stream)
        self.clocks[sid] = {}
        return sid

    def tick(self, sid: int) -> dict[int, int]:
        with self.lock:
            c = self.clocks.setdefault(sid, {})
            _merge(c, self.host)
            c[sid] = c.get(sid, 0) + 1
            return dict(c)

    def log(self, kind: str, stream: Stream, reads: list[Any] = (), writes: list[Any] = (),  # type: ignore[assignment]
            detail: Any = None) -> Op:
        op = Op(kind, stream.sid, self.tick(stream.sid), list(reads), list(writes), detail)
        with self.lock:
            self.ops.append(op)
        return op

    @staticmethod
    def before(a: Op, b: Op) -> bool:
        """Whether ``a`` is ordered before ``b`` on the device."""
        return a.clock[a.stream] <= b.clock.get(a.stream, 0) and a is not b

    def current(self) -> Stream:
        return getattr(self.local, "stream", None) or self.null

    def array_at(self, ptr: int) -> FakeArray | None:
        for a in self.arrays:
            if a.ptr <= ptr < a.ptr + max(1, a.nbytes):
                return a
        return None

    def last_write(self, a: FakeArray, upto: Op) -> Op | None:
        """The last operation before ``upto`` in the log that wrote ``a``."""
        found = None
        for op in self.ops:
            if op is upto:
                break
            if a in op.writes:
                found = op
        return found

    def unordered_reads(self) -> list[str]:
        """Every kernel or DMA read of an array whose last write is not ordered before it."""
        bad = []
        for op in self.ops:
            for a in op.reads:
                w = self.last_write(a, op)
                if w is not None and not self.before(w, op):
                    bad.append(f"{op.kind} on stream {op.stream} reads {a.name}, written by {w.kind} on stream"
                               f" {w.stream} without an order between them")
        return bad


def _merge(into: dict[int, int], other: dict[int, int]) -> None:
    for k, v in other.items():
        if v > into.get(k, 0):
            into[k] = v


class FakeArray:
    """Device memory: a range of fake addresses, and a name for messages."""

    def __init__(self, gpu: Gpu, nbytes: int, name: str) -> None:
        self.nbytes, self.name = nbytes, name
        self.ptr = next(gpu._next_ptr)
        self.data = types.SimpleNamespace(ptr=self.ptr)
        gpu.arrays.append(self)


class Stream:
    def __init__(self, gpu: Gpu, non_blocking: bool = False, ptr: int | None = None) -> None:
        self.gpu = gpu
        self.sid = gpu.new_stream()
        self.ptr = self.sid if ptr is None else ptr
        self.non_blocking = non_blocking
        self._outer: list[Any] = []

    def __enter__(self) -> Stream:
        self._outer.append(getattr(self.gpu.local, "stream", None))
        self.gpu.local.stream = self
        return self

    def __exit__(self, *exc: object) -> None:
        self.gpu.local.stream = self._outer.pop()

    def wait_event(self, ev: Event) -> None:
        with self.gpu.lock:
            _merge(self.gpu.clocks[self.sid], ev.clock)

    def synchronize(self) -> None:
        with self.gpu.lock:
            _merge(self.gpu.host, self.gpu.clocks[self.sid])

    def record(self, ev: Event | None = None) -> Event:
        ev = ev or Event(self.gpu)
        ev.record(self)
        return ev


class Event:
    def __init__(self, gpu: Gpu, block: bool = False, disable_timing: bool = False) -> None:
        self.gpu, self.block = gpu, block
        self.clock: dict[int, int] = {}
        self.recorded = self.waited = False
        gpu.events.append(self)

    def record(self, stream: Stream | None = None) -> None:
        s = stream or self.gpu.current()
        self.recorded = True
        with self.gpu.lock:
            self.clock = dict(self.gpu.clocks[s.sid])

    @property
    def done(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.waited = True
        with self.gpu.lock:
            _merge(self.gpu.host, self.clock)


class CudaRuntimeError(RuntimeError):
    pass


def install(gpu: Gpu) -> types.ModuleType:
    """A module that answers like cupy for the calls the transfer makes, logging into ``gpu``."""
    cp = types.ModuleType("cupy")
    cp.uint8 = np.uint8  # type: ignore[attr-defined]
    registered: dict[int, int] = {}

    def asarray(a: Any) -> FakeArray:
        a = np.asarray(a)
        out = FakeArray(gpu, a.nbytes, f"upload of {a.dtype}[{a.size}]")
        gpu.log("upload", gpu.current(), writes=[out])
        return out

    def empty(n: int, dtype: Any = np.uint8) -> FakeArray:
        return FakeArray(gpu, int(n) * np.dtype(dtype).itemsize, f"buffer of {n}")

    def launch(name: str) -> Callable[..., None]:
        def kernel(grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...]) -> None:
            if gpu.on_kernel is not None:
                gpu.on_kernel()
            ptrs = [a for a in args if isinstance(a, FakeArray)]
            ptrs += [x for x in (gpu.array_at(int(v)) for v in args if isinstance(v, np.uint64)) if x is not None]
            stage = ptrs[-1] if name == "kv_gather" else None
            reads = [p for p in ptrs if p is not stage]
            gpu.log("kernel", gpu.current(), reads=reads, writes=[stage] if stage else [], detail=(name, grid, block))
        return kernel

    class RawModule:
        def __init__(self, code: str = "", options: tuple[str, ...] = ()) -> None:
            self.code = code

        def get_function(self, name: str) -> Callable[..., None]:
            return launch(name)

    def memcpy2DAsync(dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, kind: int,
                      stream_ptr: int) -> None:
        s = next(x for x in _streams if x.ptr == stream_ptr)
        d, r = gpu.array_at(dst), gpu.array_at(src)
        gpu.log("dma", s, reads=[r] if r else [], writes=[d] if d else [], detail=(dst, src, width, height, kind))

    def hostRegister(ptr: int, size: int, flags: int) -> None:
        registered[ptr] = size
        gpu.registered_on.append((ptr, gpu.device()))

    def hostUnregister(ptr: int) -> None:
        registered.pop(ptr)
        with gpu.lock:
            gpu.ops.append(Op("unregister", 0, dict(gpu.host), detail=ptr))

    _streams: list[Stream] = [gpu.null]

    def make_stream(non_blocking: bool = False) -> Stream:
        s = Stream(gpu, non_blocking)
        _streams.append(s)
        return s

    def external(ptr: int, device: int = 0) -> Stream:
        return next(x for x in _streams if x.ptr == ptr)

    class Device:
        def __init__(self, dev: int | None = None) -> None:
            self.id = gpu.device() if dev is None else dev

        def __enter__(self) -> Device:
            if not hasattr(gpu.local, "devices"):
                gpu.local.devices = []
            gpu.local.devices.append(self.id)
            return self

        def __exit__(self, *exc: object) -> None:
            gpu.local.devices.pop()

    runtime = types.SimpleNamespace(hostRegister=hostRegister, hostUnregister=hostUnregister,
                                    memcpy2DAsync=memcpy2DAsync, CUDARuntimeError=CudaRuntimeError,
                                    registered=registered, getDeviceCount=lambda: gpu.devices, free=lambda ptr: None)
    cp.asarray = asarray  # type: ignore[attr-defined]
    cp.empty = empty  # type: ignore[attr-defined]
    cp.RawModule = RawModule  # type: ignore[attr-defined]
    cp.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
        Stream=make_stream, ExternalStream=external, Event=lambda **kw: Event(gpu, **kw), Device=Device,
        runtime=runtime, get_current_stream=gpu.current, streams=_streams)
    return cp


@contextmanager
def installed(monkeypatch: Any) -> Iterator[tuple[Gpu, types.ModuleType]]:
    gpu = Gpu()
    cp = install(gpu)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    yield gpu, cp


class DevicePlane:
    """A plane of a cache "on the device" for :class:`connector.transfer.engines.PagedKV`: its block count and
    device."""

    def __init__(self, blocks: int) -> None:
        self.shape = (blocks,)
        self.device = types.SimpleNamespace(id=0)
