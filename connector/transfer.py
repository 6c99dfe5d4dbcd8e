"""Gather/scatter between an engine's paged KV cache and DRAM slots.

One copy algorithm, two array libraries. :func:`gather_block` / :func:`scatter_block` walk a
block's parts in slot order (see :mod:`connector.layout`) with plain ``dst[...] = src``
assignment, which numpy and cupy both implement:

* :class:`NumpyTransfer` (CPU caches: numpy arrays, or torch CPU tensors viewed zero-copy through
  ``Tensor.numpy()``) copies each part straight into / out of the slot. Synchronous. Slots that lie
  evenly spaced in one buffer (the sidecar hands out a batch's slots side by side) are moved as one
  array: one indexed copy per layer and plane for the whole run (:func:`slot_runs`).
* :class:`CupyTransfer` (GPU caches) runs the *same* functions on the device into a per-stream
  staging block, then moves the whole block with one DMA between the staging block and the slot,
  which is pinned once per shared-memory mapping with ``cudaHostRegister`` (and unregistered by
  :meth:`CupyTransfer.close`). Consecutive blocks alternate between streams so one block's DMA
  overlaps the next block's device-side gather; completion is a set of CUDA events. cupy is
  imported only when this class is built.

Choose by name with :func:`make_transfer` (``"numpy"`` or ``"cupy"``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from connector.layout import Array, KVSpec, slot_array
from kvstore.errors import InvalidArgument

LayerPlanes = list[list[Array]]  # [layer][plane] -> array with the block index first


@dataclass(slots=True, frozen=True)
class PagedKV:
    """An engine cache bound to its spec: every layer as raw-typed planes (views, no copies)."""

    spec: KVSpec
    planes: LayerPlanes

    @property
    def num_blocks(self) -> int:
        return int(self.planes[0][0].shape[0])


def bind_caches(spec: KVSpec, caches: Sequence[Any]) -> PagedKV:
    """Bind per-layer caches (numpy arrays, torch tensors or cupy arrays; ``(K, V)`` pairs for hf)."""
    if len(caches) != spec.num_layers:
        raise InvalidArgument(f"caches: {len(caches)} layers given, the spec has {spec.num_layers}")
    impl = spec.layout_impl
    planes: LayerPlanes = []
    for layer in caches:
        raw = [as_raw(t, spec) for t in layer] if isinstance(layer, (tuple, list)) else as_raw(layer, spec)
        planes.append(impl.planes(raw, spec))
    return PagedKV(spec, planes)


_TORCH_RAW = {1: "uint8", 2: "int16", 4: "int32"}


def as_raw(t: Any, spec: KVSpec) -> Array:
    """A zero-copy view of ``t`` as unsigned integers of the spec's element width."""
    if isinstance(t, np.ndarray):
        if t.itemsize != spec.itemsize:
            raise InvalidArgument(
                f"cache: element size {t.itemsize}, the spec's dtype {spec.dtype} has {spec.itemsize}"
            )
        return t.view(spec.raw_dtype)
    if hasattr(t, "element_size") and hasattr(t, "is_cuda"):  # torch.Tensor, without importing torch
        import torch

        if t.element_size() != spec.itemsize:
            raise InvalidArgument(
                f"cache: element size {t.element_size()}, the spec's dtype {spec.dtype} has {spec.itemsize}"
            )
        raw = t.detach().view(getattr(torch, _TORCH_RAW[spec.itemsize]))
        if t.is_cuda:
            cupy = importlib.import_module("cupy")
            return cupy.asarray(raw).view(spec.raw_dtype)
        return raw.numpy().view(spec.raw_dtype)
    if hasattr(t, "__cuda_array_interface__"):  # cupy.ndarray
        return t.view(spec.raw_dtype)
    raise InvalidArgument(f"cache: unsupported array type {type(t).__name__}")


# --- the shared copy logic ----------------------------------------------------------------------


def gather_block(planes: LayerPlanes, block: int, dst: Array) -> None:
    """Copy block ``block`` of every layer into ``dst`` (shape ``spec.slot_shape``)."""
    for layer, layer_planes in enumerate(planes):
        for p, plane in enumerate(layer_planes):
            dst[layer, p][...] = plane[block]


def scatter_block(planes: LayerPlanes, block: int, src: Array) -> None:
    """Copy ``src`` (shape ``spec.slot_shape``) into block ``block`` of every layer."""
    for layer, layer_planes in enumerate(planes):
        for p, plane in enumerate(layer_planes):
            plane[block][...] = src[layer, p]


def gather_batch(planes: LayerPlanes, block_ids: Sequence[int], out: Array) -> None:
    """Gather many blocks into one contiguous ``[n, *slot_shape]`` array (one indexed copy per plane)."""
    ids = np.asarray(block_ids, dtype=np.int64)
    for layer, layer_planes in enumerate(planes):
        for p, plane in enumerate(layer_planes):
            out[:, layer, p] = plane[ids]


def scatter_batch(planes: LayerPlanes, block_ids: Sequence[int], src: Array) -> None:
    """Scatter a contiguous ``[n, *slot_shape]`` array into many blocks."""
    ids = np.asarray(block_ids, dtype=np.int64)
    for layer, layer_planes in enumerate(planes):
        for p, plane in enumerate(layer_planes):
            plane[ids] = src[:, layer, p]


def _span(a: np.ndarray) -> tuple[int, int]:
    """(first byte address, end address) of the whole buffer that ``a`` is a view of."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    start = a.__array_interface__["data"][0]
    return start, start + a.nbytes


def slot_runs(slots: Sequence[np.ndarray], spec: KVSpec) -> list[tuple[int, Array]]:
    """Split ``slots`` (uint8 host buffers) into maximal runs that lie evenly spaced inside one
    buffer; each run is ``(index of its first slot, [n, *spec.slot_shape] view over the run)``, no
    copies. A writable slot's run holds only writable slots."""
    bb = spec.block_bytes
    addrs = [s.__array_interface__["data"][0] for s in slots]
    runs: list[tuple[int, Array]] = []
    i = 0
    while i < len(slots):
        first = slot_array(slots[i], spec)
        j, stride = i + 1, bb
        if j < len(slots) and addrs[j] - addrs[i] >= bb:
            stride = addrs[j] - addrs[i]
            lo, hi = _span(slots[i])
            writable = slots[i].flags.writeable
            while (j < len(slots) and addrs[j] == addrs[i] + (j - i) * stride and lo <= addrs[j] and addrs[j] + bb <= hi
                   and slots[j].nbytes >= bb and (slots[j].flags.writeable or not writable)):
                j += 1
        view = np.lib.stride_tricks.as_strided(first, (j - i, *first.shape), (stride, *first.strides),
                                               writeable=bool(first.flags.writeable))
        runs.append((i, view))
        i = j
    return runs


def _check_ids(kv: PagedKV, block_ids: Sequence[int], slots: Sequence[Array]) -> None:
    if len(block_ids) != len(slots):
        raise InvalidArgument(f"transfer: {len(block_ids)} block ids for {len(slots)} slots")
    n = kv.num_blocks
    for b in block_ids:
        if not 0 <= b < n:
            raise InvalidArgument(f"transfer: block id {b} is outside the cache (0..{n - 1})")


# --- completion -----------------------------------------------------------------------------------


class Completion(Protocol):
    def done(self) -> bool: ...

    def wait(self) -> None: ...


class Done:
    """An already finished transfer (the numpy path is synchronous)."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


DONE = Done()


class Transfer(Protocol):
    name: str

    def gather(self, kv: PagedKV, block_ids: Sequence[int], slots: Sequence[Array]) -> Completion:
        """Copy ``kv`` blocks ``block_ids[i]`` into writable slot buffers ``slots[i]`` (uint8)."""
        ...

    def scatter(self, kv: PagedKV, block_ids: Sequence[int], slots: Sequence[Array]) -> Completion:
        """Copy slot buffers ``slots[i]`` into ``kv`` blocks ``block_ids[i]``."""
        ...

    def close(self) -> None:
        """Wait for transfers in flight and release what the engine holds (pinned mappings)."""
        ...


class NumpyTransfer:
    name = "numpy"

    def gather(self, kv: PagedKV, block_ids: Sequence[int], slots: Sequence[Array]) -> Completion:
        _check_ids(kv, block_ids, slots)
        for i, run in slot_runs(slots, kv.spec):
            gather_batch(kv.planes, block_ids[i : i + len(run)], run)
        return DONE

    def scatter(self, kv: PagedKV, block_ids: Sequence[int], slots: Sequence[Array]) -> Completion:
        _check_ids(kv, block_ids, slots)
        for i, run in slot_runs(slots, kv.spec):
            scatter_batch(kv.planes, block_ids[i : i + len(run)], run)
        return DONE

    def close(self) -> None:
        return None  # synchronous, holds nothing


class CupyTransfer:
    """GPU caches <-> pinned DRAM slots, ``streams`` CUDA streams in flight (never used on CPU).

    Per block: the device-side parts are gathered into a staging block on stream ``i % streams``
    (the shared :func:`gather_block`), then one async DMA moves it to the slot; scatter is the
    mirror image. Work on one stream is ordered, so a staging block is reused only after its DMA.
    The engine's current stream is waited on first, so KV written by the forward pass is visible.
    """

    name = "cupy"

    def __init__(self, spec: KVSpec | None = None, streams: int = 2) -> None:
        self._cp = importlib.import_module("cupy")
        self._streams = [self._cp.cuda.Stream(non_blocking=True) for _ in range(max(1, streams))]
        self._staging: dict[tuple[tuple[int, ...], str], list[Array]] = {}
        self._pinned: set[int] = set()  # start addresses of the mappings seen, pinned by us or not
        self._registered: list[int] = []  # those this transfer registered: unregistered at close

    def pin(self, buf: Array) -> None:
        """Register the whole mapping behind ``buf`` (a numpy view of a slab) as pinned memory, once."""
        start, end = _span(buf)
        if start in self._pinned:
            return
        try:
            self._cp.cuda.runtime.hostRegister(start, end - start, 0)
            self._registered.append(start)
        except self._cp.cuda.runtime.CUDARuntimeError as exc:  # already registered elsewhere: fine
            if "AlreadyRegistered" not in str(exc):
                raise
        self._pinned.add(start)

    def close(self) -> None:
        """Wait for every transfer in flight, then unregister the mappings this transfer pinned."""
        for s in self._streams:
            s.synchronize()
        registered, self._registered = self._registered, []
        self._pinned.clear()
        self._staging.clear()
        for start in registered:
            self._cp.cuda.runtime.hostUnregister(start)

    def _stage(self, spec: KVSpec) -> list[Array]:
        key = (spec.slot_shape, spec.raw_dtype.str)
        if key not in self._staging:
            self._staging[key] = [self._cp.empty(spec.slot_shape, spec.raw_dtype) for _ in self._streams]
        return self._staging[key]

    def _start(self) -> None:
        ready = self._cp.cuda.get_current_stream().record()
        for s in self._streams:
            s.wait_event(ready)

    def gather(self, kv: PagedKV, block_ids: Sequence[int], slots: Sequence[Array]) -> Completion:
        _check_ids(kv, block_ids, slots)
        stage = self._stage(kv.spec)
        self._start()
        for i, (b, slot) in enumerate(zip(block_ids, slots)):
            self.pin(slot)
            j = i % len(self._streams)
            with self._streams[j]:
                gather_block(kv.planes, b, stage[j])
                stage[j].get(stream=self._streams[j], out=slot_array(slot, kv.spec), blocking=False)
        return _Events([s.record() for s in self._streams])

    def scatter(self, kv: PagedKV, block_ids: Sequence[int], slots: Sequence[Array]) -> Completion:
        _check_ids(kv, block_ids, slots)
        stage = self._stage(kv.spec)
        self._start()
        for i, (b, slot) in enumerate(zip(block_ids, slots)):
            self.pin(slot)
            j = i % len(self._streams)
            with self._streams[j]:
                stage[j].set(slot_array(slot, kv.spec), stream=self._streams[j])
                scatter_block(kv.planes, b, stage[j])
        return _Events([s.record() for s in self._streams])


class _Events:
    def __init__(self, events: list[Any]) -> None:
        self._events = events

    def done(self) -> bool:
        return all(e.done for e in self._events)

    def wait(self) -> None:
        for e in self._events:
            e.synchronize()


_TRANSFERS: dict[str, tuple[str, str]] = {
    "numpy": ("connector.transfer", "NumpyTransfer"),
    "cupy": ("connector.transfer", "CupyTransfer"),
}


def make_transfer(name: str, **kwargs: Any) -> Transfer:
    """The transfer engine called ``name``; optional dependencies load only when selected."""
    try:
        module, cls = _TRANSFERS[name]
    except KeyError:
        raise InvalidArgument(f"transfer: {name!r} is not one of {sorted(_TRANSFERS)}") from None
    factory: Callable[..., Transfer] = getattr(importlib.import_module(module), cls)
    return factory(**kwargs)
