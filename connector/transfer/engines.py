"""Gather/scatter between an engine's paged KV cache and DRAM slots, a batch at a time.

One copy plan, two engines. :func:`bind_caches` views an engine's cache as planes
(:mod:`connector.transfer.layout`) and derives the plan (:mod:`connector.transfer.plan`): which byte ranges
of a block go where in its slot. Both engines execute that plan:

* :class:`NumpyTransfer` (CPU caches: numpy arrays, or torch CPU tensors viewed zero-copy through
  ``Tensor.numpy()``): one native loop per batch over the pieces and blocks, a ``memcpy`` each,
  straight into / out of the slot (:mod:`connector.transfer.native`; streaming stores for a batch too
  large for the cache). Synchronous.
* :class:`connector.transfer.cuda.CupyTransfer` (GPU caches): one fused kernel per chunk of
  blocks into a device staging buffer, then one DMA per run of slots side by side, chunks
  pipelined on two streams per direction; the slab is pinned once, at start. cupy is imported
  only when that engine is built.

:func:`gather_block` / :func:`scatter_block` are the reference the plan is tested against: plain
``dst[...] = src`` assignment in slot order. Choose an engine by name with :func:`make_transfer`
(``"numpy"`` or ``"cupy"``).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from connector.transfer import native as native_copy
from connector.transfer.layout import Array, KVSpec
from connector.transfer.plan import Piece, PlaneGeometry, block_bytes, check_disjoint, pieces
from kvstore.dram.slab import attach, page_bytes_of, read_only
from kvstore.errors import InvalidArgument, KVStoreError

log = logging.getLogger(__name__)

LayerPlanes = list[list[Array]]  # [layer][plane] -> array with the block index first
BlockIdsLike = Sequence[int] | np.ndarray  # what the engines take as block ids (an int64 array: as it is)
_largest, _smallest = np.maximum.reduce, np.minimum.reduce  # ndarray.max/min less their Python wrapper


@dataclass(slots=True, frozen=True)
class PagedKV:
    """An engine cache bound to its spec: every layer as raw-typed planes (views, no copies), and
    the copy plan of one block over those planes' memory."""

    spec: KVSpec
    planes: LayerPlanes
    plan: tuple[Piece, ...]
    plan_key: int = field(init=False)  # the plan's hash, once: hashing thousands of pieces per batch is not free

    def __post_init__(self) -> None:
        object.__setattr__(self, "plan_key", hash(self.plan))

    @property
    def num_blocks(self) -> int:
        return int(self.planes[0][0].shape[0])

    @property
    def on_device(self) -> bool:
        return not isinstance(self.planes[0][0], np.ndarray)


def bind_caches(spec: KVSpec, caches: Sequence[Any]) -> PagedKV:
    """Bind per-layer caches (numpy arrays, torch tensors or cupy arrays; ``(K, V)`` pairs for hf)."""
    if len(caches) != spec.num_layers:
        raise InvalidArgument(f"caches: {len(caches)} layers given, the spec has {spec.num_layers}")
    impl = spec.layout_impl
    planes: LayerPlanes = []
    for layer in caches:
        raw = [as_raw(t, spec) for t in layer] if isinstance(layer, (tuple, list)) else as_raw(layer, spec)
        planes.append(impl.planes(raw, spec))
    counts = {int(p.shape[0]) for layer_planes in planes for p in layer_planes}
    if len(counts) > 1:  # the plan addresses every plane by one block id: a shorter plane would be overrun
        raise InvalidArgument(f"caches: the layers and planes hold different numbers of blocks {sorted(counts)}"
                              " (a sliding-window or hybrid cache is not supported)")
    kinds = {isinstance(p, np.ndarray) for layer_planes in planes for p in layer_planes}
    if len(kinds) > 1:
        raise InvalidArgument("caches: some layers are in host memory and some on a device")
    plan = pieces([geometry(p) for layer_planes in planes for p in layer_planes], f"{spec.layout} cache")
    if block_bytes(plan) != spec.block_bytes:  # the layout's planes disagree with its slot shape: a bug
        raise InvalidArgument(f"{spec.layout} cache: the copy plan moves {block_bytes(plan)} bytes a block,"
                              f" a slot holds {spec.block_bytes}")
    check_disjoint(plan, int(planes[0][0].shape[0]), f"{spec.layout} cache")
    return PagedKV(spec, planes, tuple(plan))


def geometry(plane: Array) -> PlaneGeometry:
    """Where a plane (block axis first; numpy or cupy) lies in memory."""
    face = plane.__array_interface__ if isinstance(plane, np.ndarray) else plane.__cuda_array_interface__
    return PlaneGeometry(address=int(face["data"][0]), block_stride=int(plane.strides[0]),
                         shape=tuple(int(n) for n in plane.shape[1:]),
                         strides=tuple(int(s) for s in plane.strides[1:]), itemsize=int(plane.itemsize))


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


def as_ids(block_ids: BlockIdsLike) -> np.ndarray:
    """Block ids as an int64 array: an int64 array as it is (no copy: read it, never write it),
    anything else converted once (``np.fromiter``: ~0.02-0.03 µs an id from a list, 0.6-0.9 of
    ``np.asarray``'s time)."""
    if isinstance(block_ids, np.ndarray):
        return block_ids if block_ids.dtype == np.int64 else block_ids.astype(np.int64)
    return np.fromiter(block_ids, np.int64, len(block_ids))


def slot_addresses(kv: PagedKV, block_ids: BlockIdsLike, slots: Sequence[Array], *,
                   writing: bool) -> np.ndarray:
    """The start address of each slot (1-D uint8 host buffers of at least a block, writable when
    ``writing``), after checking the ids against the cache: the plan is executed on raw
    addresses, so nothing out of bounds may reach it. Slots handed over as
    :class:`~kvstore.client.calls.SlotViews` (a lease's) are checked from their known addresses
    and lengths with numpy; others one by one. An int64 array (read it, never write it)."""
    if len(block_ids) != len(slots):
        raise InvalidArgument(f"transfer: {len(block_ids)} block ids for {len(slots)} slots")
    n = kv.num_blocks
    ids = as_ids(block_ids)
    if len(ids) and int(_largest(ids.view(np.uint64))) >= n:  # one reduction: a negative id is >= 2**63 as uint64
        bad = (ids < 0) | (ids >= n)
        raise InvalidArgument(f"transfer: block id {int(ids[int(np.argmax(bad))])} is outside the cache (0..{n - 1})")
    need = kv.spec.block_bytes
    known = getattr(slots, "addresses", None)
    if known is not None and len(known) == len(slots):
        return _known_addresses(slots, need, writing)
    out = []
    for i, s in enumerate(slots):
        if not isinstance(s, np.ndarray) or s.dtype != np.uint8 or s.ndim != 1:
            raise InvalidArgument(f"slot {i}: expected a 1-D uint8 buffer, got {getattr(s, 'dtype', type(s))}")
        if s.shape[0] < need:
            raise InvalidArgument(f"slot {i}: {s.shape[0]} bytes is smaller than a block ({need})")
        if s.strides[0] != 1:
            raise InvalidArgument(f"slot {i}: not contiguous")
        if writing and not s.flags.writeable:
            raise InvalidArgument(f"slot {i}: read-only, a gather writes into it")
        out.append(int(s.__array_interface__["data"][0]))
    return np.array(out, dtype=np.int64)


def _known_addresses(slots: Any, need: int, writing: bool) -> np.ndarray:
    if len(slots) and int(_smallest(slots.lengths)) < need:
        i = int(np.argmax(slots.lengths < need))
        raise InvalidArgument(f"slot {i}: {int(slots.lengths[i])} bytes is smaller than a block ({need})")
    if writing and not slots.writable and len(slots):
        raise InvalidArgument("slot 0: read-only, a gather writes into it")
    out: np.ndarray = slots.addresses
    return out


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
    pins_host: bool  # whether register() does anything (the host mapping must be pinned for DMA)

    def register(self, host: Array, page_bytes: int = 0) -> None:
        """Prepare the host mapping behind ``host`` (the slab, at start) for transfers: pinned on a
        GPU, in registrations cut at multiples of ``page_bytes``; nothing on CPU."""
        ...

    def gather(self, kv: PagedKV, block_ids: BlockIdsLike, slots: Sequence[Array]) -> Completion:
        """Copy ``kv`` blocks ``block_ids[i]`` into writable slot buffers ``slots[i]`` (uint8)."""
        ...

    def scatter(self, kv: PagedKV, block_ids: BlockIdsLike, slots: Sequence[Array]) -> Completion:
        """Copy slot buffers ``slots[i]`` into ``kv`` blocks ``block_ids[i]``."""
        ...

    def close(self) -> None:
        """Wait for transfers in flight and release what the engine holds (pinned mappings)."""
        ...


class NumpyTransfer:
    """CPU caches: the copy plan run by one native loop per batch (:mod:`connector.transfer.native`;
    without llvmlite, :func:`run_plan`: one ``memmove`` per piece and block from Python). No
    indexed array assignment, no temporaries: ``plane[ids] = ...`` per layer ran at 0.17 of a
    plain memcpy."""

    name = "numpy"
    pins_host = False

    def __init__(self, native: bool = True, stream_bytes: int | None = None) -> None:
        """``native=False``: the Python loop (:func:`run_plan`). ``stream_bytes``: a batch at least this
        long is written with streaming stores (default :data:`connector.transfer.native.STREAM_BYTES`)."""
        self.native = native and native_copy.available()
        self.stream_bytes = native_copy.STREAM_BYTES if stream_bytes is None else stream_bytes
        self._tables: dict[int, tuple[tuple[Piece, ...], np.ndarray]] = {}

    def register(self, host: Array, page_bytes: int = 0) -> None:
        return None  # nothing to pin on CPU

    def gather(self, kv: PagedKV, block_ids: BlockIdsLike, slots: Sequence[Array]) -> Completion:
        _on_host(kv)
        ids = as_ids(block_ids)  # once: checked and copied from it
        self._copy(kv, ids, slot_addresses(kv, ids, slots, writing=True), to_slots=True)
        return DONE

    def scatter(self, kv: PagedKV, block_ids: BlockIdsLike, slots: Sequence[Array]) -> Completion:
        _on_host(kv)
        ids = as_ids(block_ids)
        self._copy(kv, ids, slot_addresses(kv, ids, slots, writing=False), to_slots=False)
        return DONE

    def _copy(self, kv: PagedKV, block_ids: BlockIdsLike, addresses: np.ndarray, *, to_slots: bool) -> None:
        if not self.native:
            run_plan(kv.plan, as_ids(block_ids).tolist(), addresses.tolist(), to_slots=to_slots)  # ints for ctypes
            return
        stream = len(addresses) * kv.spec.block_bytes >= self.stream_bytes
        native_copy.run(self._table(kv), as_ids(block_ids), addresses, to_slots=to_slots,
                        stream=stream)

    def _table(self, kv: PagedKV) -> np.ndarray:
        """The plan's table, built once per plan (the same plan object: an identity check, no hash)."""
        hit = self._tables.get(kv.plan_key)
        if hit is not None and (hit[0] is kv.plan or hit[0] == kv.plan):
            return hit[1]
        if len(self._tables) >= 64:  # caches rebound over and over: start again rather than grow
            self._tables.clear()
        table = native_copy.plan_table(kv.plan)
        self._tables[kv.plan_key] = (kv.plan, table)
        return table

    def close(self) -> None:
        return None  # synchronous, holds nothing


def _on_host(kv: PagedKV) -> None:
    if kv.on_device:
        raise InvalidArgument("numpy transfer: the cache is in device memory (use the 'cupy' transfer)")


def run_plan(plan: Sequence[Piece], block_ids: Sequence[int], addresses: Sequence[int], *, to_slots: bool) -> None:
    """Execute ``plan`` on the host: block ``block_ids[i]`` <-> the slot at ``addresses[i]``. The
    caller has checked the ids against the cache and the slots' sizes (:func:`slot_addresses`).
    Piece by piece, every block of the batch in turn (the source walks one plane at a time)."""
    move = ctypes.memmove
    pairs = list(zip(block_ids, addresses))
    for p in plan:
        src, stride, n, off = p.src, p.stride, p.nbytes, p.slot_off
        if to_slots:
            for b, slot in pairs:
                move(slot + off, src + b * stride, n)
        else:
            for b, slot in pairs:
                move(src + b * stride, slot + off, n)


def register_slab(transfer: Transfer, client: object) -> str | None:
    """Register the sidecar's slab with ``transfer`` once, at the connector's start: ``client.hello()``
    names its segment, which is returned (None: nothing registered). A client without a local slab
    (a remote sidecar), or a transfer that pins nothing, registers nothing.

    A slab mapped read-only here (:mod:`kvstore.dram.protect`) is writable while it is pinned:
    pinning for a device's writes (a save's gather) needs write access to every page once; the
    CPU's mapping is read-only again after (a device writes the pinned pages, not through it)."""
    hello = getattr(client, "hello", None)
    if hello is None or not transfer.pins_host:
        return None
    try:
        segment: str = hello().segment
        if not segment:
            return None
        mem = attach(segment)
        guard = read_only(segment)
        with guard.unprotected() if guard is not None else contextlib.nullcontext():
            transfer.register(mem, page_bytes=page_bytes_of(segment))  # cut at the slab's pages
        return segment
    except (OSError, KVStoreError) as exc:  # no slab on this host: each mapping is pinned when first seen
        log.warning("transfer: the sidecar's slab could not be registered at start (%s)", exc)
        return None


_TRANSFERS: dict[str, tuple[str, str]] = {
    "numpy": ("connector.transfer.engines", "NumpyTransfer"),
    "cupy": ("connector.transfer.cuda", "CupyTransfer"),
}


def make_transfer(name: str, **kwargs: Any) -> Transfer:
    """The transfer engine called ``name``; optional dependencies load only when selected."""
    try:
        module, cls = _TRANSFERS[name]
    except KeyError:
        raise InvalidArgument(f"transfer: {name!r} is not one of {sorted(_TRANSFERS)}") from None
    factory: Callable[..., Transfer] = getattr(importlib.import_module(module), cls)
    return factory(**kwargs)
