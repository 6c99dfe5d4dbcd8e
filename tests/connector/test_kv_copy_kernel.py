"""The fused kernel's own source (connector/transfer/kernels/kv_copy.cu), compiled for the host with a shim for
CUDA's thread and block indices (tests/support/kv_copy_host.cpp) and launched as the GPU engine
launches it, chunk by chunk: every cache layout, head sizes whose pieces are not multiples of 16
bytes, staging at every alignment, 32- to 256-thread blocks, pieces split into several parts,
chunks of 1, 2 and 32 blocks -- byte for byte against the copy plan run on the host
(NumpyTransfer). And the word width: a copy uses the widest alignment both ends share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from connector.transfer.engines import NumpyTransfer, PagedKV, bind_caches
from connector.transfer.layout import KVSpec
from connector.transfer.plan import Piece, chunks, launch_shape
from tests.connector.test_copy_plan import DTYPES, LAYOUT, _caches, _spec
from tests.support.kernel_host import HostKernel


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostKernel]:
    yield HostKernel(Path(tmp_path_factory.mktemp("kv_copy")))


def _buffer(nbytes: int, skew: int) -> np.ndarray:
    """``nbytes`` of zeros starting ``skew`` bytes past a 64-byte boundary."""
    raw = np.zeros(nbytes + 64 + skew, np.uint8)
    at = (-raw.ctypes.data) % 64 + skew
    return raw[at:at + nbytes]


def _run(kernel: HostKernel, kv: PagedKV, ids: list[int], slots: list[np.ndarray], gather: bool, per_chunk: int,
         shape: tuple[int, int], skew: int) -> None:
    """The engine's batch with the host kernel: per chunk, a staging buffer of the chunk's blocks
    side by side (reused, as a stream's is), one launch, and the copy between staging and slots
    that the DMAs make."""
    bb = kv.spec.block_bytes
    stage = _buffer(per_chunk * bb, skew)
    threads, parts = shape
    for a, b in chunks(len(ids), per_chunk):
        chunk_ids = np.array(ids[a:b], np.int64)
        if not gather:
            for i in range(a, b):
                stage[(i - a) * bb:(i - a + 1) * bb] = slots[i]
        kernel.launch(gather, kv.plan, chunk_ids, stage.ctypes.data, bb, threads, parts)
        if gather:
            for i in range(a, b):
                slots[i][:] = stage[(i - a) * bb:(i - a + 1) * bb]


def _bytes(caches: list) -> list[bytes]:
    flat = [t for c in caches for t in (c if isinstance(c, tuple) else (c,))]
    return [t.contiguous().view(torch.uint8).numpy().tobytes() for t in flat]


def _check(kernel: HostKernel, kind: str, spec: KVSpec, make: object, shape: tuple[int, int] | None,
           skews: tuple[int, ...] = (0, 5), per_chunks: tuple[int, ...] = (1, 2, 32)) -> None:
    src = make(1)  # type: ignore[operator]
    kv_src = bind_caches(spec, src)
    ids_src, ids_dst = [5, 0, 6, 2, 3], [1, 4, 0, 6, 2]
    ref = [np.zeros(spec.block_bytes, np.uint8) for _ in ids_src]
    NumpyTransfer().gather(kv_src, ids_src, ref)
    want = make(2)  # type: ignore[operator]
    NumpyTransfer().scatter(bind_caches(spec, want), ids_dst, ref)
    launch = shape or launch_shape(kv_src.plan)
    for per_chunk in per_chunks:
        for skew in skews:
            slots = [np.full(spec.block_bytes, 0xAB, np.uint8) for _ in ids_src]
            _run(kernel, kv_src, ids_src, slots, True, per_chunk, launch, skew)
            assert [s.tobytes() for s in slots] == [r.tobytes() for r in ref], (kind, launch, per_chunk, skew)
            got = make(2)  # type: ignore[operator]
            _run(kernel, bind_caches(spec, got), ids_dst, ref, False, per_chunk, launch, skew)
            assert _bytes(got) == _bytes(want), (kind, launch, per_chunk, skew)


@pytest.mark.parametrize("shape", [None, (32, 1), (256, 3), (64, 7)])  # None: the engine's own launch_shape
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3", "float32"])
@pytest.mark.parametrize("d", [8, 3])  # 3: pieces of 3, 6 or 12 bytes, at every alignment
@pytest.mark.parametrize("kind", sorted(LAYOUT))
def test_kernel_moves_the_plans_bytes(kernel: HostKernel, kind: str, d: int, dtype: str,
                                      shape: tuple[int, int] | None) -> None:
    """Gather of 5 blocks out of order, in chunks of 1, 2 and 32, into staging 64-byte aligned and
    5 bytes off, gives the plan's slot bytes; scatter of them writes the plan's blocks and nothing else."""
    spec = _spec(LAYOUT[kind], d, dtype)  # 3 layers, 2 heads (MLA: 1 latent), blocks of 4, as _caches
    _check(kernel, kind, spec, lambda seed: _caches(kind, d, DTYPES[dtype], seed), shape)


@pytest.mark.parametrize("kind,heads,d,threads,parts", [
    ("flash_attn", 2, 128, 256, 1),  # 8 KiB pieces: 256-thread blocks
    ("flashinfer_nhd", 2, 128, 256, 1),  # K and V merged: 16 KiB pieces
    ("cross_layer", 4, 128, 256, 2),  # one 96 KiB piece a block: split in two parts
    ("cross_layer", 12, 72, 256, 3),  # 162 KiB, heads of 144 bytes: three parts, not multiples of 16 words
])
def test_large_pieces_use_256_threads_and_split_into_parts(kernel: HostKernel, kind: str, heads: int, d: int,
                                                           threads: int, parts: int) -> None:
    """Real-sized pieces (16-token blocks): the engine's launch shape is 256-thread blocks, and a
    piece over 64 KiB is cut into parts; the kernel moves the plan's bytes with them."""
    spec = KVSpec(layout=LAYOUT[kind], num_layers=3, kv_heads=heads, head_size=d, block_size=16, dtype="bfloat16")

    def make(seed: int) -> list:
        return _caches(kind, d, torch.bfloat16, seed, heads=heads, bs=16)

    assert launch_shape(bind_caches(spec, make(0)).plan) == (threads, parts)
    _check(kernel, kind, spec, make, None, skews=(0, 8), per_chunks=(2, 32))


@pytest.mark.parametrize("src_skew,dst_skew,width", [
    (0, 0, 16), (4, 4, 16), (13, 13, 16), (8, 0, 8), (3, 11, 8), (4, 0, 4), (6, 0, 2), (1, 0, 1), (0, 7, 1)])
@pytest.mark.parametrize("n", [1, 15, 16, 1000, 70_001])
@pytest.mark.parametrize("parts", [1, 3])
def test_a_piece_moves_in_words_of_the_widest_common_alignment(kernel: HostKernel, src_skew: int, dst_skew: int,
                                                               width: int, n: int, parts: int) -> None:
    """One piece whose two ends agree modulo 16 (after a head) moves in 16-byte words, modulo 8 in
    8-byte words, and so on; every byte arrives, none around it is touched."""
    stride = (n + 31) // 16 * 16  # block 1 of the "cache" keeps block 0's alignment
    src, stage = _buffer(stride + n, src_skew), _buffer(n + 64, dst_skew)
    src[:] = np.random.default_rng(n).integers(0, 256, src.size, dtype=np.uint8)
    stage[:] = 0xAB
    plan = [Piece(src=src.ctypes.data, stride=stride, nbytes=n, slot_off=16)]
    kernel.reset()
    kernel.launch(True, plan, np.array([1], np.int64), stage.ctypes.data, n + 64, 64, parts)
    assert stage[16:16 + n].tobytes() == src[stride:].tobytes()
    assert (stage[:16] == 0xAB).all() and (stage[16 + n:] == 0xAB).all()
    wide = {16: kernel.moved_by(16), 8: kernel.moved_by(8)}
    for w in (16, 8):
        if w == width:
            assert wide[w] >= n - 2 * (w - 1), (wide, n)
        else:
            assert wide[w] == 0, wide
