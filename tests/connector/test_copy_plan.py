"""The copy plan both transfer engines execute (connector/transfer/plan.py), checked byte for byte on CPU.

The GPU engine runs the same plan (pieces -> one fused kernel per chunk; :func:`schedule` -> the
chunks and their DMAs); here the plan is executed with host copies and compared with the
reference, plain array assignment in slot order (:func:`connector.transfer.engines.gather_block`)."""

from __future__ import annotations

import ctypes
import itertools

import numpy as np
import pytest
import torch

from connector.transfer.engines import NumpyTransfer, bind_caches, gather_block, run_plan, scatter_block
from connector.transfer.layout import KVSpec, slot_array
from connector.transfer.plan import (
    DmaRun,
    PlaneGeometry,
    Registrations,
    dma_runs,
    enqueue_steps,
    pieces,
    registration_pieces,
    schedule,
    uncovered,
)
from kvstore.errors import InvalidArgument

L, H, BS, NB = 3, 2, 4, 7


def _spec(layout: str, d: int, dtype: str = "float16") -> KVSpec:
    heads = 1 if layout == "vllm_mla" else H  # MLA: one latent per token
    return KVSpec(layout=layout, num_layers=L, kv_heads=heads, head_size=d, block_size=BS, dtype=dtype)


def _caches(kind: str, d: int, dtype: torch.dtype, seed: int = 0, *, layers: int = L, heads: int = H, bs: int = BS,
            nb: int = NB) -> list:
    """Every cache shape the connector binds, as torch CPU tensors (any dtype, zero-copy)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g).to(dtype)

    if kind == "flash_attn":  # [2, blocks, bs, heads, d]
        return [rand(2, nb, bs, heads, d) for _ in range(layers)]
    if kind == "flashinfer_nhd":  # [blocks, 2, bs, heads, d]
        return [rand(nb, 2, bs, heads, d) for _ in range(layers)]
    if kind == "flashinfer_hnd":  # the same shape, HND in memory: [blocks, 2, heads, bs, d] permuted
        return [rand(nb, 2, heads, bs, d).permute(0, 1, 3, 2, 4) for _ in range(layers)]
    if kind == "cross_layer":  # every layer of a block side by side: one buffer, layer views
        whole = rand(nb, layers, 2, bs, heads, d)
        return [whole[:, i] for i in range(layers)]
    if kind == "vllm_cpu":
        return [rand(nb, heads, bs, 2 * d) for _ in range(layers)]
    if kind == "mla_cpu":  # vLLM's CPU MLA backends: [blocks, 1, bs, latent]
        return [rand(nb, 1, bs, d) for _ in range(layers)]
    if kind == "mla_gpu":  # the GPU MLA backends: [blocks, bs, latent]
        return [rand(nb, bs, d) for _ in range(layers)]
    if kind == "mla_padded":  # a latent row padded in memory (strided rows): the plan cuts per row
        return [rand(nb, bs, d + 2)[:, :, :d] for _ in range(layers)]
    return [(rand(1, heads, nb * bs + 3, d), rand(1, heads, nb * bs + 3, d)) for _ in range(layers)]  # hf


LAYOUT = {"flash_attn": "vllm_gpu", "flashinfer_nhd": "vllm_gpu", "flashinfer_hnd": "vllm_gpu",
          "cross_layer": "vllm_gpu", "vllm_cpu": "vllm_cpu", "hf": "hf", "mla_cpu": "vllm_mla",
          "mla_gpu": "vllm_mla", "mla_padded": "vllm_mla"}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "float8_e4m3": torch.float8_e4m3fn}


def _reference(spec: KVSpec, caches: list, ids: list[int]) -> list[bytes]:
    kv = bind_caches(spec, caches)
    out = []
    for b in ids:
        slot = np.zeros(spec.block_bytes, np.uint8)
        gather_block(kv.planes, b, slot_array(slot, spec))
        out.append(slot.tobytes())
    return out


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("kind", sorted(LAYOUT))
@pytest.mark.parametrize("d", [8, 3])  # 3: parts and pieces not a multiple of 16 bytes
def test_plan_moves_the_reference_bytes(kind: str, dtype: str, d: int) -> None:
    """Gather (ids out of order, an odd count) gives the reference's slot bytes; scatter of them
    into another cache writes exactly those blocks and nothing else."""
    spec = _spec(LAYOUT[kind], d, dtype)
    src, dst = _caches(kind, d, DTYPES[dtype], 1), _caches(kind, d, DTYPES[dtype], 2)
    ids = [5, 0, 6, 2, 3]
    slots = [np.zeros(spec.block_bytes, np.uint8) for _ in ids]
    NumpyTransfer().gather(bind_caches(spec, src), ids, slots)
    assert [s.tobytes() for s in slots] == _reference(spec, src, ids)

    expected = bind_caches(spec, [tuple(t.clone() for t in c) if isinstance(c, tuple) else c.clone() for c in dst])
    for b, s in zip(ids[::-1], slots):
        scatter_block(expected.planes, b, slot_array(s, spec))
    NumpyTransfer().scatter(bind_caches(spec, dst), ids[::-1], slots)
    got = bind_caches(spec, dst)
    for layer in range(L):
        for pg, pe in zip(got.planes[layer], expected.planes[layer]):
            assert np.array_equal(pg, pe)


@pytest.mark.parametrize(("kind", "per_block"), [
    ("flash_attn", 2 * L),  # K and V of each layer: two separate regions
    ("flashinfer_nhd", L),  # K then V of a block lie side by side: one piece a layer
    # one head's row of d elements at a time; K's last row and V's first lie side by side
    ("flashinfer_hnd", 2 * L * BS * H - L),
    ("cross_layer", 1),  # the whole block is one range
    ("vllm_cpu", L),
    ("mla_cpu", L),  # a block's latent rows are one range a layer
    ("mla_gpu", L),
    ("mla_padded", L * BS),  # one row at a time
    ("hf", 2 * L * H),  # a head's block_size tokens are contiguous, heads are a sequence apart
])
def test_plan_has_the_fewest_pieces(kind: str, per_block: int) -> None:
    spec = _spec(LAYOUT[kind], 8)
    plan = bind_caches(spec, _caches(kind, 8, torch.float16)).plan
    assert len(plan) == per_block
    assert sum(p.nbytes for p in plan) == spec.block_bytes
    assert [p.slot_off for p in plan] == list(np.cumsum([0] + [p.nbytes for p in plan[:-1]]))


def test_pieces_refuse_negative_strides_and_overlapping_blocks() -> None:
    with pytest.raises(InvalidArgument, match="negative or zero strides"):
        pieces([PlaneGeometry(0, 64, (4,), (-2,), 2)])
    spec = _spec("vllm_cpu", 8)
    base = torch.zeros(NB + 1, H, BS, 16, dtype=torch.float16)
    overlapping = [base.as_strided((NB, H, BS, 16), (16, BS * 16, 16, 1)) for _ in range(L)]
    with pytest.raises(InvalidArgument, match="blocks overlap"):
        bind_caches(spec, overlapping)


def test_two_block_gpu_cache_is_refused_as_ambiguous() -> None:
    with pytest.raises(InvalidArgument, match="ambiguous"):
        bind_caches(_spec("vllm_gpu", 8), [torch.zeros(2, 2, BS, H, 8, dtype=torch.float16) for _ in range(L)])


def test_gather_into_a_read_only_slot_is_refused() -> None:
    spec = _spec("vllm_cpu", 8)
    slot = np.zeros(spec.block_bytes, np.uint8)
    slot.flags.writeable = False
    with pytest.raises(InvalidArgument, match="read-only"):
        NumpyTransfer().gather(bind_caches(spec, _caches("vllm_cpu", 8, torch.float16)), [0], [slot])
    assert not slot.any()


# --- the batch's schedule: chunks and DMAs, as the GPU engine runs them ---------------------------


def test_dma_runs_group_evenly_spaced_slots() -> None:
    w = 100
    addrs = [1000, 1100, 1200, 1500, 1700, 1900, 1300, 50_000]
    assert dma_runs(addrs, w) == [DmaRun(0, 3, 1000, 100, w), DmaRun(3, 3, 1500, 200, w),
                                  DmaRun(6, 2, 1300, 48_700, w)]
    # cut where the registered pieces say: two mappings are never one DMA
    assert dma_runs(addrs, w, [(1000, 2000), (50_000, 50_100)])[2:] == [DmaRun(6, 1, 1300, w, w),
                                                                      DmaRun(7, 1, 50_000, w, w)]
    # a run never crosses the end of a registered piece; a slot outside every piece is refused
    assert dma_runs([0, 100, 200, 300], w, [(0, 200), (200, 400)]) == [
        DmaRun(0, 2, 0, 100, w), DmaRun(2, 2, 200, 100, w)]
    with pytest.raises(InvalidArgument, match="crosses the end"):
        dma_runs([150], w, [(0, 200), (200, 400)])
    with pytest.raises(InvalidArgument, match="no registered"):
        dma_runs([500], w, [(0, 200)])


def test_dma_runs_never_exceed_the_pitch_a_2d_copy_takes() -> None:
    w, far = 100, 3 << 30
    assert dma_runs([0, far, 2 * far], w) == [DmaRun(0, 1, 0, w, w), DmaRun(1, 1, far, w, w),
                                              DmaRun(2, 1, 2 * far, w, w)]
    assert dma_runs([0, 1000, 2000], w, max_pitch=999) == [DmaRun(i, 1, i * 1000, w, w) for i in range(3)]


def test_caches_whose_planes_hold_different_block_counts_are_refused() -> None:
    spec = _spec("hf", 8)
    caches = _caches("hf", 8, torch.float16)
    k, v = caches[1]
    caches[1] = (k, v[:, :, : 2 * BS])  # a V shorter than its K: block ids valid for K would overrun V
    with pytest.raises(InvalidArgument, match="different numbers of blocks"):
        bind_caches(spec, caches)


def test_registration_pieces_end_on_page_boundaries() -> None:
    assert registration_pieces(4096, 10_000, 4000, 1000) == [(4096, 8096), (8096, 12096), (12096, 14096)]
    assert registration_pieces(0, 300, 1 << 30, 64) == [(0, 300)]


@pytest.mark.parametrize("per_chunk", [1, 2, 3, 32])
@pytest.mark.parametrize("kind", ["flash_attn", "hf", "mla_cpu"])
def test_schedule_stages_and_moves_every_block_once(kind: str, per_chunk: int) -> None:
    """The GPU engine's batch, executed on the host: per chunk the plan into a staging buffer of
    blocks side by side (the kernel), then each run of the chunk from staging to its slots (the
    DMAs). Slots: runs that span chunks, gaps, a second mapping."""
    spec = _spec(LAYOUT[kind], 8)
    bb = spec.block_bytes
    kv = bind_caches(spec, _caches(kind, 8, torch.float16, 3))
    ids = [6, 1, 4, 0, 5, 2, 3]
    one, two = np.zeros(12 * bb, np.uint8), np.zeros(4 * bb, np.uint8)
    slots = [one[o * bb:][:bb] for o in (0, 1, 2, 3, 5, 7)] + [two[bb:][:bb]]
    addrs = [int(s.ctypes.data) for s in slots]
    limits = sorted((int(a.ctypes.data), int(a.ctypes.data) + a.nbytes) for a in (one, two))
    stage = np.zeros(per_chunk * bb, np.uint8)
    for chunk in schedule(addrs, bb, per_chunk, limits).chunks():
        n = chunk.end - chunk.start
        base = int(stage.ctypes.data)
        run_plan(kv.plan, ids[chunk.start:chunk.end], [base + i * bb for i in range(n)], to_slots=True)
        for r in chunk.runs:
            for k in range(r.count):
                ctypes.memmove(r.host + k * r.pitch, base + (r.first - chunk.start + k) * bb, r.width)
    assert [s.tobytes() for s in slots] == _reference(spec, _caches(kind, 8, torch.float16, 3), ids)


def _run_steps(kv_plan: tuple, ids: np.ndarray, plan: object, streams: int, bb: int, to_slots: bool) -> None:
    """The GPU engine's enqueue loop (``CupyTransfer._enqueue``) executed on the host, step by step:
    a launch is the copy plan run for the chunk's blocks between the cache and its stream's
    staging, blocks side by side; a DMA is ``count`` copies of a block, each side at its pitch."""
    stages = [np.zeros(plan.step * bb, np.uint8) for _ in range(streams)]  # type: ignore[attr-defined]
    bases = [int(b.ctypes.data) for b in stages]
    ids_ptr = int(ids.ctypes.data)
    steps = enqueue_steps(plan, bases, ids_ptr, to_slots)  # type: ignore[arg-type]

    def launch(ids_at: np.uint64, stage_at: np.uint64, blocks: int) -> None:
        a = (int(ids_at) - ids_ptr) // 8
        run_plan(kv_plan, ids[a:a + blocks].tolist(), [int(stage_at) + i * bb for i in range(blocks)],
                 to_slots=to_slots)

    for j, go, dst, dpitch, src, spitch, count, blocks, ids_at, stage_at in steps:
        assert isinstance(ids_at, np.uint64) and isinstance(stage_at, np.uint64)  # pointers as the kernel takes them
        assert int(stage_at) == bases[j]
        if go and to_slots:
            launch(ids_at, stage_at, blocks)
        for k in range(count):
            ctypes.memmove(dst + k * dpitch, src + k * spitch, bb)
        if go and not to_slots:
            launch(ids_at, stage_at, blocks)


@pytest.mark.parametrize("streams", [1, 2])
@pytest.mark.parametrize("per_chunk", [1, 2, 3, 32])
@pytest.mark.parametrize("order", ["side_by_side", "scattered"])
def test_the_gpu_engines_steps_gather_and_scatter_every_block_once(order: str, per_chunk: int, streams: int) -> None:
    """The kernels and DMAs the GPU engine enqueues for a batch (:func:`enqueue_steps`, worked out
    with numpy for the whole batch), executed on the host in their order: a gather fills each slot
    with its block; a scatter of those slots into a cleared cache gives the blocks back. Slots side
    by side (a DMA per chunk), or runs, gaps and a second mapping (DMAs that span chunks)."""
    kind = "flash_attn"
    spec = _spec(LAYOUT[kind], 8)
    bb = spec.block_bytes
    caches = _caches(kind, 8, torch.float16, 3)
    kv = bind_caches(spec, caches)
    ids = np.array([6, 1, 4, 0, 5, 2, 3], np.int64)
    one, two = np.zeros(12 * bb, np.uint8), np.zeros(4 * bb, np.uint8)
    at = range(7) if order == "side_by_side" else (0, 1, 2, 3, 5, 7)
    slots = [one[o * bb:][:bb] for o in at] + ([two[bb:][:bb]] if order == "scattered" else [])
    limits = sorted((int(a.ctypes.data), int(a.ctypes.data) + a.nbytes) for a in (one, two))
    plan = schedule([int(s.ctypes.data) for s in slots], bb, per_chunk, limits)
    _run_steps(kv.plan, ids, plan, streams, bb, to_slots=True)
    want = _reference(spec, _caches(kind, 8, torch.float16, 3), ids.tolist())
    assert [s.tobytes() for s in slots] == want
    for c in caches:
        c.zero_()
    _run_steps(kv.plan, ids, plan, streams, bb, to_slots=False)
    back = [np.zeros(bb, np.uint8) for _ in ids]
    NumpyTransfer(native=False).gather(kv, ids.tolist(), back)
    assert [b.tobytes() for b in back] == want


def _greedy_runs(addresses: list[int], width: int, limits: list[tuple[int, int]], max_pitch: int) -> list[DmaRun]:
    """The definition of dma_runs, slot by slot (as written before it was vectorised)."""
    def end_of(x: int) -> int:
        for a, b in limits:
            if a <= x < b:
                return b
        return 1 << 64

    runs, i, n = [], 0, len(addresses)
    while i < n:
        end = end_of(addresses[i])
        j, pitch = i + 1, width
        if j < n and width <= addresses[j] - addresses[i] <= max_pitch and addresses[j] + width <= end:
            pitch = addresses[j] - addresses[i]
            while j < n and addresses[j] == addresses[i] + (j - i) * pitch and addresses[j] + width <= end:
                j += 1
        runs.append(DmaRun(i, j - i, addresses[i], pitch, width))
        i = j
    return runs


@pytest.mark.parametrize("seed", range(60))
def test_dma_runs_match_the_slot_by_slot_definition(seed: int) -> None:
    """The vectorised grouping gives the greedy slot-by-slot runs: runs side by side, gaps, pitches
    that change, slots going back, repeats, pitches over the limit, registrations that cut runs."""
    rng = np.random.default_rng(seed)
    width = int(rng.choice([64, 100, 4096]))
    addresses: list[int] = []
    at = 1 << 30
    while len(addresses) < int(rng.integers(1, 200)):
        pitch = int(rng.choice([width, width + 36, 2 * width, 3 * width, width - 1, 0, -width, 1 << 20]))
        for _ in range(int(rng.integers(1, 3 if seed % 4 == 1 else 12))):  # 1-2: the pitch changes at every slot
            addresses.append(at)
            at += pitch
        at += int(rng.choice([0, width, 5 * width]))
    lo, hi = min(addresses), max(addresses) + width
    cuts = sorted({lo, *(int(c) for c in rng.integers(lo, hi, int(rng.integers(0, 4)))), hi})
    limits = list(itertools.pairwise(cuts)) if seed % 2 else []
    max_pitch = int(rng.choice([1 << 31, 3 * width]))
    try:
        want = _greedy_runs(addresses, width, limits, max_pitch)
    except InvalidArgument:
        want = None
    if want is None or any(not any(a <= x and x + width <= b for a, b in limits) for x in addresses if limits):
        with pytest.raises(InvalidArgument):
            dma_runs(addresses, width, limits, max_pitch)
    else:
        assert dma_runs(addresses, width, limits, max_pitch) == want


@pytest.mark.parametrize("seed", range(20))
def test_schedule_cuts_the_runs_at_every_chunk(seed: int) -> None:
    """Each chunk holds exactly the parts of the batch's runs that fall in it, in order; together
    they move every slot once."""
    rng = np.random.default_rng(100 + seed)
    width = 4096
    addresses = [int(x) for x in np.cumsum(rng.choice([width, 2 * width, 3 * width], int(rng.integers(1, 150))))]
    if seed % 3 == 0:  # a scattered batch: a run per slot
        addresses = [int(x) for x in rng.permutation(addresses)]
    per_chunk = int(rng.choice([1, 3, 32, 1000]))
    runs = dma_runs(addresses, width)
    got = schedule(addresses, width, per_chunk).chunks()
    assert [(c.start, c.end) for c in got] == [(a, min(a + per_chunk, len(addresses)))
                                               for a in range(0, len(addresses), per_chunk)]
    for c in got:
        want = []
        for r in runs:
            lo, hi = max(c.start, r.first), min(c.end, r.first + r.count)
            if lo < hi:
                want.append(DmaRun(lo, hi - lo, r.host + (lo - r.first) * r.pitch, r.pitch, width))
        assert c.runs == want
    moved = sorted(r.host + k * r.pitch for c in got for r in c.runs for k in range(r.count))
    assert moved == sorted(addresses)


@pytest.mark.parametrize("seed", range(30))
def test_registrations_find_the_slots_outside_them_as_one_by_one(seed: int) -> None:
    """``uncovered`` and ``Registrations.covers`` (the lookup arrays built once, the one-piece
    shortcut of two reductions) against the definition, slot by slot: slots inside one piece,
    across two, straddling an end, in a gap, before the first; a batch all in one piece."""
    rng = np.random.default_rng(300 + seed)
    width = int(rng.choice([64, 4096]))
    cuts = sorted({int(c) for c in rng.integers(1 << 20, 1 << 24, 2 * int(rng.integers(1, 5)))})
    pieces = [(a, b) for a, b in zip(cuts[::2], cuts[1::2], strict=False) if b > a]
    regs = Registrations(pieces[::-1])  # given in any order
    n = int(rng.integers(1, 60))
    if seed % 3 == 0:  # all in the first piece: the shortcut
        a, b = pieces[0]
        addresses = [int(x) for x in rng.integers(a, max(a + 1, b - width + 1), n)]
    else:
        addresses = [int(x) for x in rng.integers(pieces[0][0] - 2 * width, pieces[-1][1] + width, n)]
    want = [i for i, x in enumerate(addresses) if not any(a <= x and x + width <= b for a, b in pieces)]
    assert uncovered(addresses, width, regs) == want == uncovered(addresses, width, pieces)
    assert [regs.covers(x, width) for x in addresses] == [i not in want for i in range(len(addresses))]
    assert list(regs) == sorted(pieces) and uncovered(addresses, width, Registrations()) == list(range(len(addresses)))


@pytest.mark.parametrize("streams", [1, 2])
@pytest.mark.parametrize(("n", "per_chunk"), [(1, 32), (5, 2), (64, 32), (2048, 32), (100, 1000)])
def test_a_batch_in_one_run_reuses_what_does_not_depend_on_its_slots(n: int, per_chunk: int, streams: int) -> None:
    """The common batch, slots side by side in one registration: its chunks' starts, sizes and
    pitches depend on the batch's size only, so two batches of that size at different addresses
    share them, built once, read-only (before: built again for every batch); every step is still
    the one the definition gives for the batch's own slots, ids and staging."""
    width = 4096
    regs = Registrations([(1 << 30, (1 << 30) + (1 << 26)), (1 << 40, (1 << 40) + (1 << 26))])
    one, two = ((base + width * np.arange(n, dtype=np.int64)) for base in ((1 << 30) + width, 1 << 40))
    a, b = schedule(one, width, per_chunk, regs), schedule(two, width, per_chunk, regs)
    assert a.first is b.first and a.count is b.count and a.pitch is b.pitch
    for shared in (a.first, a.count, a.pitch):
        with pytest.raises(ValueError):
            shared[0] = 1
    for plan, addresses in ((a, one), (b, two)):
        stages = [int(x) << 20 for x in range(7, 7 + streams)]
        ids_ptr = int(addresses[0]) + (1 << 24)
        for to_slots in (True, False):
            want = []
            for c, start in enumerate(range(0, n, per_chunk)):
                blocks = min(per_chunk, n - start)
                host, stage = int(addresses[start]), stages[c % streams]
                moves = (host, width, stage, width) if to_slots else (stage, width, host, width)
                want.append((c % streams, True, *moves, blocks, blocks, np.uint64(ids_ptr + 8 * start),
                             np.uint64(stage)))
            got = list(enqueue_steps(plan, stages, ids_ptr, to_slots))
            assert got == want
            assert all(type(x) is type(y) for s, t in zip(got, want, strict=True) for x, y in zip(s, t, strict=True))
