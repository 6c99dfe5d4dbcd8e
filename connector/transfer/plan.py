"""Which bytes of a paged KV cache go where in a slot, and which slots one DMA can move: pure functions.

A block's slot holds every layer's planes in slot order (:mod:`connector.transfer.layout`). In memory,
one block's part of one plane is a strided array; :func:`pieces` cuts it into the fewest
*pieces*, byte ranges that are contiguous both in the cache and in the slot, and merges pieces
that also follow each other in both (FlashInfer's block-first ``[blocks, 2, ...]`` gives one piece
for K and V together; a cross-layer contiguous cache gives one piece per block). Piece ``p`` of
block ``b`` is the bytes ``[src[p] + b * stride[p], + nbytes[p])`` of the cache and
``[slot_off[p], + nbytes[p])`` of the slot. Both transfer engines execute this one plan: the CPU
path as one ``memmove`` per piece and block, the GPU path as one fused kernel per chunk of blocks
(``connector/transfer/kernels/kv_copy.cu``), so the CPU tests check the plan the GPU runs, byte for byte.

:func:`dma_runs` groups a batch's slot addresses into runs that lie evenly spaced (the sidecar
hands a batch's slots out side by side): one 2-D DMA per run, split where a run would cross the
end of a registered piece of the host mapping.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import product, repeat
from typing import Any

import numpy as np

from kvstore.errors import InvalidArgument

NO_LIMIT = int(np.iinfo(np.int64).max)  # no registered pieces given: runs are not cut
PART_BYTES = 64 << 10  # a thread block of the fused kernel copies at most about this much of a piece
MAX_PITCH = (1 << 31) - 1  # cudaMemcpy2D refuses a pitch over the device's memPitch (2 GiB - 1 on current GPUs)


@dataclass(slots=True, frozen=True)
class PlaneGeometry:
    """One plane of one layer as memory: the address of block 0's part, the bytes between blocks,
    and the part's shape and strides in bytes (C order of the shape is the slot order)."""

    address: int
    block_stride: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int


@dataclass(slots=True, frozen=True)
class Piece:
    """A byte range contiguous in the cache and in the slot (see the module docstring)."""

    src: int  # address of block 0's bytes
    stride: int  # bytes between consecutive blocks
    nbytes: int
    slot_off: int


def _segments(g: PlaneGeometry, what: str) -> list[tuple[int, int]]:
    """The part as (offset from its start, bytes) runs in C order: the contiguous inner dims are
    one run, the outer dims enumerated."""
    if any(s < 0 for s in g.strides) or g.block_stride <= 0:
        raise InvalidArgument(f"{what}: negative or zero strides are not supported (block stride {g.block_stride},"
                              f" part strides {g.strides})")
    k, run = len(g.shape), g.itemsize  # run: bytes of the contiguous suffix shape[k:]
    while k > 0 and (g.shape[k - 1] == 1 or g.strides[k - 1] == run):
        run *= g.shape[k - 1]
        k -= 1
    outer = [range(n) for n in g.shape[:k]]
    return [(sum(i * s for i, s in zip(idx, g.strides[:k])), run) for idx in product(*outer)]


def pieces(planes: Sequence[PlaneGeometry], what: str = "cache") -> list[Piece]:
    """The copy plan of one block for ``planes`` in slot order (layer-major, then plane)."""
    out: list[Piece] = []
    off = 0
    for g in planes:
        for rel, n in _segments(g, what):
            last = out[-1] if out else None
            if last and last.stride == g.block_stride and last.src + last.nbytes == g.address + rel and \
                    last.slot_off + last.nbytes == off:
                out[-1] = Piece(last.src, last.stride, last.nbytes + n, last.slot_off)
            else:
                out.append(Piece(g.address + rel, g.block_stride, n, off))
            off += n
    return out


def plan_tables(plan: Sequence[Piece]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The plan as the fused kernel's four tables: piece addresses (uint64), block strides,
    lengths and slot offsets (int64), one entry per piece."""
    return (np.array([p.src for p in plan], np.uint64), np.array([p.stride for p in plan], np.int64),
            np.array([p.nbytes for p in plan], np.int64), np.array([p.slot_off for p in plan], np.int64))


def launch_shape(plan: Sequence[Piece], part_bytes: int = PART_BYTES) -> tuple[int, int]:
    """(threads per thread block, thread blocks per piece) of the fused kernel for ``plan``: enough
    threads for the largest piece's 16-byte words (32 to 256), and that piece cut into parts of at
    most ``part_bytes`` so a launch of few large pieces still fills the device."""
    biggest = max(p.nbytes for p in plan)
    words = biggest // 16
    threads = int(min(256, max(32, 1 << max(0, (words - 1).bit_length()))))
    return threads, max(1, -(-biggest // part_bytes))


def block_bytes(plan: Sequence[Piece]) -> int:
    return sum(p.nbytes for p in plan)


def check_disjoint(plan: Sequence[Piece], num_blocks: int, what: str = "cache") -> None:
    """Refuse a plan whose pieces of different blocks overlap in the cache (a scatter would write
    one block's bytes over another's): a plane whose block stride is smaller than the part."""
    for p in plan:
        if num_blocks > 1 and p.stride < p.nbytes:
            raise InvalidArgument(f"{what}: blocks overlap (a piece of {p.nbytes} bytes, {p.stride} bytes apart)")


@dataclass(slots=True)
class DmaRun:
    """``count`` blocks of ``width`` bytes: from position ``first`` of the batch (``first * width``
    into a staging buffer of the batch's blocks side by side) to ``host``, ``pitch`` bytes apart.
    (Not frozen, as :class:`Chunk`: a batch builds one or more per chunk, and a frozen dataclass
    costs 3.5 times as much to build, 1.6 against 0.4 µs; nothing changes one once built.)"""

    first: int
    count: int
    host: int
    pitch: int
    width: int


class Registrations:
    """The registered pieces of the host mappings, ``(start, end)``, sorted and not overlapping
    (distinct mappings, or one cut at its pages), kept as Python lists (one slot's lookup:
    :meth:`covers`) and numpy arrays (a batch's): built when a piece is added, at the connector's
    start, never per batch."""

    __slots__ = ("ends", "first", "last", "pieces", "starts")

    def __init__(self, pieces: Iterable[tuple[int, int]] = ()) -> None:
        self._set(list(pieces))

    def _set(self, pieces: list[tuple[int, int]]) -> None:
        self.pieces = sorted(pieces)
        self.first = [a for a, _ in self.pieces]
        self.last = [b for _, b in self.pieces]
        self.starts = np.array(self.first, dtype=np.int64)
        self.ends = np.array(self.last, dtype=np.int64)

    def add(self, start: int, end: int) -> None:
        self._set([*self.pieces, (start, end)])

    def clear(self) -> None:
        self._set([])

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(self.pieces)

    def __len__(self) -> int:
        return len(self.pieces)

    def covers(self, address: int, nbytes: int) -> bool:
        k = bisect_right(self.first, address) - 1
        return k >= 0 and address + nbytes <= self.last[k]

    def holding(self, a: np.ndarray, width: int) -> int | None:
        """The end of the one piece that holds every slot at ``a`` (``width`` bytes each), when one
        does (the common batch: slots of one slab page): two reductions, nothing per slot."""
        if not len(a) or not self.pieces:
            return None
        return self.holding_span(int(a.min()), int(a.max()), width)

    def holding_span(self, lo: int, hi: int, width: int) -> int | None:
        """The end of the one piece that holds ``[lo, hi + width)``, if one does."""
        k = bisect_right(self.first, lo) - 1
        return self.last[k] if k >= 0 and hi + width <= self.last[k] else None


Limits = Sequence[tuple[int, int]] | Registrations


def _registrations(limits: Limits) -> Registrations:
    return limits if isinstance(limits, Registrations) else Registrations(limits)


def dma_runs(addresses: Sequence[int] | np.ndarray, width: int, limits: Limits = (),
             max_pitch: int = MAX_PITCH) -> list[DmaRun]:
    """Group slot ``addresses`` (in batch order) into evenly spaced runs, one DMA each, no two
    slots of a run more than ``max_pitch`` apart: greedily, a run starts at a slot, takes the
    next one's distance as its pitch when that lies in ``[width, max_pitch]``, and goes on while
    the slots keep that pitch.

    ``limits``: the registered pieces of the host mappings as ``(start, end)`` (or
    :class:`Registrations`, their arrays built once); a run never crosses the end of one (a DMA
    must lie in one registration), and a slot that itself crosses one is refused (the
    registration is cut at slab page boundaries, so a slot never does).

    The readable form of :func:`_runs` (numpy only, nothing in Python per slot or per run)."""
    a = np.asarray(addresses, dtype=np.int64)
    first, pitch = _runs(a, width, _registrations(limits), max_pitch)
    count = np.diff(first, append=len(a))
    return [DmaRun(f, c, h, p, width) for f, c, h, p in
            zip(first.tolist(), count.tolist(), a[first].tolist(), pitch.tolist(), strict=True)]


_ONE_RUN = np.zeros(1, np.int64)
_ONE_RUN.flags.writeable = False


def _runs(a: np.ndarray, width: int, limits: Registrations,
          max_pitch: int = MAX_PITCH) -> tuple[np.ndarray, np.ndarray]:
    """:func:`dma_runs` as arrays: the batch position where each run starts, and its pitch (a
    run's length is up to the next one's start; a slot alone has the pitch ``width``).

    The greedy walk, with numpy: a *link* joins slot ``k`` to ``k + 1`` when their distance is a
    pitch a 2-D copy takes and slot ``k + 1`` ends within slot ``k``'s registration; a *segment*
    is a longest row of links of one distance. A run is a segment from its first slot to the one
    after its last link, except that a segment right after another (they share a slot: the
    distance changes there) starts one slot later, the shared slot going to the run before; a
    segment of one link so robbed has no run of its own, and gives the next one its slot back.
    Slots in no run are runs of one."""
    p = _one_run_pitch(a, width, limits, max_pitch)
    if p:
        return _ONE_RUN, _ONE_RUN + p
    return _split_runs(a, width, limits, max_pitch)


def _one_run_pitch(a: np.ndarray, width: int, limits: Registrations, max_pitch: int = MAX_PITCH) -> int:
    """The pitch of the common batch, slots side by side (evenly spaced at a pitch a 2-D copy
    takes, so ``a[0]`` and ``a[-1]`` are the ends) in one registration: one run. 0 when the batch
    is not one run (or is empty). One addition and a comparison of the bytes (cheaper than a
    difference, a comparison and a reduction), a bisect at the two ends."""
    n = len(a)
    if not n:
        return 0
    p = a.item(1) - a.item(0) if n > 1 else width
    if not width <= p <= max_pitch:
        return 0
    if n > 2 and (a[:-1] + p).tobytes() != a[1:].tobytes():
        return 0
    if limits and limits.holding_span(a.item(0), a.item(n - 1), width) is None:
        return 0
    return p


def _split_runs(a: np.ndarray, width: int, limits: Registrations,
                max_pitch: int = MAX_PITCH) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_runs` of a batch that is not one run (see there)."""
    n = len(a)
    d = a[1:] - a[:-1] if n > 1 else a[:0]
    ends = _limit_ends(a, width, limits)
    if n < 2:
        return _ONE_RUN[:n], _ONE_RUN[:n] + width
    link = (d >= width) & (d <= max_pitch)
    if not isinstance(ends, int):
        link &= a[1:] + width <= ends[:-1]
    goes_on = np.zeros(n, bool)  # goes_on[k]: link k continues link k - 1's segment
    goes_on[1:-1] = link[:-1] & link[1:] & (d[1:] == d[:-1])
    lo = (link & ~goes_on[:-1]).nonzero()[0]  # first and last link of each segment
    hi = (link & ~goes_on[1:]).nonzero()[0]
    size = hi - lo + 1
    after = np.zeros(len(lo), bool)  # right after the segment before: they share slot lo
    after[1:] = lo[1:] == hi[:-1] + 1
    # a segment starts one slot late when right after one that has a run; that depends on
    # the one before only through segments of one link, where it alternates from the last
    # segment that does not
    flips = after.copy()
    flips[1:] &= size[:-1] == 1
    idx = np.arange(len(lo))
    base = np.maximum.accumulate(np.where(flips, 0, idx))
    late = after[base] ^ ((idx - base) & 1).astype(bool)
    keep = size > late
    starts, stops = (lo + late)[keep], hi[keep] + 2
    covered = np.zeros(n + 1, np.int64)
    covered[starts] += 1
    covered[stops] -= 1
    first = covered[:n].cumsum() == 0
    first[starts] = True
    pitch = np.full(n, width, np.int64)
    pitch[starts] = d[lo[keep]]
    at = first.nonzero()[0]
    return at, pitch[at]


def _limit_ends(a: np.ndarray, width: int, limits: Registrations) -> int | np.ndarray:
    """Per slot, the end of the registration it lies in (one int when one holds them all; no
    limits: :data:`NO_LIMIT`); a slot in none, or crossing the end of its own, is refused."""
    if not limits:
        return NO_LIMIT
    end = limits.holding(a, width)
    if end is not None:
        return end
    k = np.searchsorted(limits.starts, a, side="right") - 1
    inside = (k >= 0) & (a < limits.ends[np.maximum(k, 0)])
    if not inside.all():
        bad = int(np.argmin(inside))
        raise InvalidArgument(f"slot at {int(a[bad]):#x} lies in no registered host mapping")
    ends = limits.ends[k]
    over = a + width > ends
    if over.any():
        bad = int(np.argmax(over))
        raise InvalidArgument(f"slot at {int(a[bad]):#x} ({width} bytes) crosses the end of a registered"
                              f" piece of the host mapping at {int(ends[bad]):#x}")
    out: np.ndarray = ends
    return out


def uncovered(addresses: Sequence[int] | np.ndarray, width: int, limits: Limits) -> list[int]:
    """Indices of the slots at ``addresses`` (``width`` bytes each) that lie whole in none of the
    registrations ``limits`` (numpy over the slots; two reductions when one piece holds them all)."""
    a = np.asarray(addresses, dtype=np.int64)
    regs = _registrations(limits)
    if not regs:
        return list(range(len(a)))
    if not len(a) or regs.holding(a, width) is not None:
        return []
    k = np.maximum(np.searchsorted(regs.starts, a, side="right") - 1, 0)
    out: list[int] = np.flatnonzero(~((a >= regs.starts[k]) & (a + width <= regs.ends[k]))).tolist()
    return out


def chunks(n: int, size: int) -> list[tuple[int, int]]:
    """``[0, n)`` in consecutive ``(start, end)`` chunks of at most ``size``."""
    return [(a, min(a + size, n)) for a in range(0, n, max(1, size))]


@dataclass(slots=True)
class Chunk:
    """Batch positions ``[start, end)`` staged together, and the DMAs that move them (the readable
    form of a :class:`Schedule`'s chunk)."""

    start: int
    end: int
    runs: list[DmaRun]


@dataclass(slots=True)
class Schedule:
    """A batch of ``n`` slots in chunks of ``step`` positions (chunk ``c``: ``[c * step, min(n,
    (c + 1) * step))``), and its DMAs in batch order, as arrays: DMA ``k`` moves ``count[k]``
    blocks of ``width`` bytes between positions ``first[k]..`` of the batch and the host at
    ``host[k]``, ``pitch[k]`` bytes apart; each lies in one chunk and one run of
    :func:`dma_runs` (a run that spans chunks is one DMA per chunk). ``run_pitch``: the pitch when
    the whole batch is one run (0 otherwise), so DMA ``k``'s host is ``host[0] + first[k] *
    run_pitch``. The arrays may be read-only and shared between schedules: read them, never write."""

    n: int
    step: int
    width: int
    first: np.ndarray
    count: np.ndarray
    host: np.ndarray
    pitch: np.ndarray
    run_pitch: int = 0

    @property
    def num_chunks(self) -> int:
        return -(-self.n // self.step)

    def chunks(self) -> list[Chunk]:
        """The chunks and their DMAs as objects (for reading and the tests; the engine reads the arrays)."""
        out = [Chunk(a, b, []) for a, b in chunks(self.n, self.step)]
        for f, c, h, p in zip(self.first.tolist(), self.count.tolist(), self.host.tolist(), self.pitch.tolist(),
                              strict=True):
            out[f // self.step].runs.append(DmaRun(f, c, h, p, self.width))
        return out


@lru_cache(maxsize=256)
def _one_run_dmas(n: int, step: int, pitch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A :class:`Schedule`'s ``first``, ``count`` and ``pitch`` for a batch of ``n`` slots in one
    run of ``pitch``, in chunks of ``step``: a DMA per chunk. They do not depend on the slots, so
    they are built once per batch size (read-only, shared by every such schedule)."""
    at = np.arange(0, n, step, dtype=np.int64)
    count = n - at
    np.minimum(count, step, out=count)
    pitches = np.full(len(at), pitch, np.int64)
    for x in (at, count, pitches):
        x.flags.writeable = False
    return at, count, pitches


def schedule(addresses: Sequence[int] | np.ndarray, width: int, per_chunk: int, limits: Limits = ()) -> Schedule:
    """A batch's chunks of at most ``per_chunk`` blocks and their DMAs: the runs of
    :func:`dma_runs` cut at every chunk's start. Numpy only: nothing in Python per slot, per
    run or per chunk."""
    a = np.asarray(addresses, dtype=np.int64)
    n, step = len(a), max(1, per_chunk)
    regs = _registrations(limits)
    p = _one_run_pitch(a, width, regs)
    if p:  # one run: a DMA per chunk, all but its host addresses known from the batch's size
        at, count, pitch = _one_run_dmas(n, step, p)
        return Schedule(n, step, width, at, count, a[::step], pitch, p)
    first, pitch = _split_runs(a, width, regs)
    if len(first) == 1:  # one run all the same (one slot wider than max_pitch): a DMA per chunk
        p = int(pitch[0])
        at, count, pitch = _one_run_dmas(n, step, p)
        return Schedule(n, step, width, at, count, a[::step], pitch, p)
    cut = np.zeros(n, bool)
    cut[first] = True
    cut[::step] = True
    at = cut.nonzero()[0]
    count = np.empty_like(at)
    count[:-1] = at[1:] - at[:-1]
    count[-1:] = n - at[-1:]
    return Schedule(n, step, width, at, count, a[at], pitch[first.searchsorted(at, side="right") - 1])


@lru_cache(maxsize=256)
def _chunk_steps(n: int, step: int, stages: tuple[int, ...]) -> tuple[list[int], list[int], list[np.uint64], list[int]]:
    """Per chunk of a batch of ``n`` blocks in chunks of ``step`` with a DMA each: its stream, its
    staging (an address, and as the kernel's ``numpy.uint64``) and its size. They depend on the
    batch's size and the staging only, so they are built once for each (shared lists: read them,
    never change them); the streams' staging in turn, lists repeated, no arithmetic per chunk."""
    chunks = -(-n // step)
    rounds = -(-chunks // len(stages))
    on = (list(range(len(stages))) * rounds)[:chunks]
    staged = (list(stages) * rounds)[:chunks]
    kernel_stages = ([np.uint64(a) for a in stages] * rounds)[:chunks]
    return on, staged, kernel_stages, [min(step, n - a) for a in range(0, n, step)]


def enqueue_steps(plan: Schedule, stages: Sequence[int], ids_ptr: int, to_slots: bool) -> Iterator[tuple[Any, ...]]:
    """Every DMA of ``plan`` as the GPU engine's enqueue loop makes it, worked out for the whole
    batch at once, as ``(stream, launch, dst, dst pitch, src, src pitch, blocks, chunk blocks,
    chunk ids, staging)``: ``launch`` is set on the DMA its chunk's kernel goes with (a gather's
    first, the kernel before it; a scatter's last, the kernel after it); the last two are the
    kernel's pointers, ``numpy.uint64`` (the block ids are an int64 array at ``ids_ptr``). Chunk
    ``c`` runs on stream ``c % len(stages)`` in that stream's staging at ``stages[c %
    len(stages)]``, its blocks side by side. Numpy only: nothing in Python per chunk or per DMA
    (a batch in one run: each chunk's stream, staging and size built once per batch size and
    staging, :func:`_chunk_steps`; its hosts a ``range`` by the run's pitch)."""
    step, width, first, p = plan.step, plan.width, plan.first, plan.run_pitch
    if p:  # one run: the chunks' host addresses step by its pitch
        h = plan.host.item(0)
        host, pitch = range(h, h + p * plan.n, p * step), repeat(p)
    else:
        host, pitch = plan.host.tolist(), plan.pitch.tolist()
    if len(first) == plan.num_chunks:  # a DMA per chunk (the batch is one run): the chunk's start, its size, launched
        on, staged, kernel_stages, count = _chunk_steps(plan.n, step, tuple(stages))
        ids = np.arange(ids_ptr, ids_ptr + 8 * plan.n, 8 * step, dtype=np.uint64)  # each chunk's first id
        moves = (host, pitch, staged, repeat(width)) if to_slots else (staged, repeat(width), host, pitch)
        return zip(on, repeat(True), *moves, count, count, ids, kernel_stages)
    count, streams = plan.count.tolist(), len(stages)
    chunk = first // step
    start = chunk * step
    k = chunk % streams
    at = first - start  # where in its chunk
    if to_slots:
        launch = at == 0
    else:
        end = at + plan.count
        launch = (end == step) | (end + start == plan.n)
    base = np.asarray(stages, dtype=np.int64)[k]
    at *= width
    at += base
    blocks = plan.n - start
    np.minimum(blocks, step, out=blocks)
    ids = start * 8  # the chunk's first id
    ids += ids_ptr
    staged = at.tolist()
    moves = (host, pitch, staged, repeat(width)) if to_slots else (staged, repeat(width), host, pitch)
    return zip(k.tolist(), launch.tolist(), *moves, count, blocks.tolist(), ids.astype(np.uint64),
               base.astype(np.uint64))


def registration_pieces(start: int, size: int, piece: int, page: int) -> list[tuple[int, int]]:
    """A host mapping ``[start, start + size)`` cut into registrations of at most ``piece`` bytes,
    each ending on a multiple of ``page`` from ``start`` (slots never straddle a page)."""
    step = max(page, piece - piece % page) if page > 0 else piece
    return [(start + o, start + min(o + step, size)) for o in range(0, size, step)]
