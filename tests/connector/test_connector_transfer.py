"""Byte-exact round trips between paged KV caches and slots, for every layout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from connector.transfer.engines import (
    NumpyTransfer,
    bind_caches,
    gather_block,
    make_transfer,
    scatter_block,
)
from connector.transfer.layout import LAYOUTS, KVSpec, slot_array
from kvstore.errors import InvalidArgument

L, H, D, BS, NB = 3, 2, 8, 4, 6
ROOT = Path(__file__).resolve().parents[2]


def _spec(layout: str, dtype: str = "float32") -> KVSpec:
    heads = 1 if layout == "vllm_mla" else H  # one latent per token
    return KVSpec(layout=layout, num_layers=L, kv_heads=heads, head_size=D, block_size=BS, dtype=dtype)


def _random_caches(layout: str, rng: np.random.Generator, dtype=np.float32, num_blocks: int = NB) -> list:
    def rand(*shape):
        return rng.standard_normal(shape).astype(dtype)

    if layout == "vllm_cpu":
        return [rand(num_blocks, H, BS, 2 * D) for _ in range(L)]
    if layout == "vllm_gpu":
        return [rand(2, num_blocks, BS, H, D) for _ in range(L)]
    if layout == "vllm_mla":  # vLLM's CPU MLA cache: [blocks, 1, block_size, latent]
        return [rand(num_blocks, 1, BS, D) for _ in range(L)]
    # hf: one sequence of num_blocks full blocks plus a partial trailing block
    return [(rand(1, H, num_blocks * BS + 1, D), rand(1, H, num_blocks * BS + 1, D)) for _ in range(L)]


def _zeros_like(caches: list) -> list:
    return [tuple(np.zeros_like(t) for t in c) if isinstance(c, tuple) else np.zeros_like(c) for c in caches]


def _slots(spec: KVSpec, n: int, pad: int = 0) -> list[np.ndarray]:
    return [np.zeros(spec.block_bytes + pad, dtype=np.uint8) for _ in range(n)]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_round_trip_each_layout(layout: str) -> None:
    rng = np.random.default_rng(1)
    spec = _spec(layout)
    src, dst = _random_caches(layout, rng), _random_caches(layout, rng)
    ids_src, ids_dst = [4, 0, 2], [1, 5, 3]
    slots = _slots(spec, 3, pad=100)
    t = NumpyTransfer()
    t.gather(bind_caches(spec, src), ids_src, slots).wait()
    assert all(not s[spec.block_bytes :].any() for s in slots)  # nothing written past the block
    t.scatter(bind_caches(spec, dst), ids_dst, slots).wait()
    a, b = bind_caches(spec, src), bind_caches(spec, dst)
    for layer in range(L):
        for pa, pb in zip(a.planes[layer], b.planes[layer]):
            for i, j in zip(ids_src, ids_dst):
                assert pa[i].tobytes() == pb[j].tobytes()


def test_untouched_blocks_keep_their_bytes() -> None:
    rng = np.random.default_rng(2)
    spec = _spec("vllm_cpu")
    src, dst = _random_caches("vllm_cpu", rng), _random_caches("vllm_cpu", rng)
    before = [c.copy() for c in dst]
    slots = _slots(spec, 1)
    t = NumpyTransfer()
    t.gather(bind_caches(spec, src), [2], slots)
    t.scatter(bind_caches(spec, dst), [3], slots)
    for c, c0, s in zip(dst, before, src):
        assert np.array_equal(c[3], s[2])
        keep = [i for i in range(NB) if i != 3]
        assert np.array_equal(c[keep], c0[keep])


def test_slot_byte_order_is_layer_plane_part() -> None:
    rng = np.random.default_rng(3)
    spec = _spec("vllm_gpu")
    caches = _random_caches("vllm_gpu", rng)
    slot = _slots(spec, 1)[0]
    NumpyTransfer().gather(bind_caches(spec, caches), [1], [slot])
    expected = b"".join(caches[layer][kv, 1].tobytes() for layer in range(L) for kv in (0, 1))
    assert slot.tobytes() == expected
    assert spec.block_bytes == L * 2 * BS * H * D * 4


def test_hf_slot_holds_token_block() -> None:
    rng = np.random.default_rng(4)
    spec = _spec("hf")
    caches = _random_caches("hf", rng)
    slot = _slots(spec, 1)[0]
    NumpyTransfer().gather(bind_caches(spec, caches), [2], [slot])
    expected = b"".join(
        np.ascontiguousarray(caches[layer][kv][0, :, 2 * BS : 3 * BS, :]).tobytes()
        for layer in range(L)
        for kv in (0, 1)
    )
    assert slot.tobytes() == expected


def test_hf_planes_are_views() -> None:
    spec = _spec("hf")
    caches = _random_caches("hf", np.random.default_rng(5))
    kv = bind_caches(spec, caches)
    assert kv.num_blocks == NB  # the trailing partial block is not addressable
    for layer, planes in enumerate(kv.planes):
        for p, plane in enumerate(planes):
            assert np.shares_memory(plane, caches[layer][p])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn])
def test_torch_tensors_zero_copy_any_dtype(layout: str, dtype: torch.dtype) -> None:
    name = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
            torch.float8_e4m3fn: "float8_e4m3"}[dtype]
    spec = _spec(layout, name)
    g = torch.Generator().manual_seed(6)

    def make():
        caches = _random_caches(layout, np.random.default_rng(0))
        conv = lambda a: torch.randn(a.shape, generator=g).to(dtype)  # noqa: E731
        return [tuple(conv(t) for t in c) if isinstance(c, tuple) else conv(c) for c in caches]

    src, dst = make(), make()
    slots = _slots(spec, 2)
    t = NumpyTransfer()
    t.gather(bind_caches(spec, src), [0, 5], slots)
    t.scatter(bind_caches(spec, dst), [3, 1], slots)
    for cs, cd in zip(src, dst):
        for a, b in zip(cs if isinstance(cs, tuple) else [cs], cd if isinstance(cd, tuple) else [cd]):
            if layout == "hf":
                a_blk = lambda x, i: x[0, :, i * BS : (i + 1) * BS]  # noqa: E731
            elif layout == "vllm_gpu":
                a_blk = lambda x, i: x[:, i]  # noqa: E731
            else:
                a_blk = lambda x, i: x[i]  # noqa: E731
            for i, j in ((0, 3), (5, 1)):
                assert torch.equal(a_blk(a, i).view(torch.uint8), a_blk(b, j).view(torch.uint8))


def _slab_slots(spec: KVSpec, offsets: list[int]) -> tuple[np.ndarray, list[np.ndarray]]:
    """Slots cut out of one buffer the way the client does: a fresh array over it per slot."""
    buf = np.zeros(max(offsets) + spec.block_bytes, dtype=np.uint8)
    return buf, [np.frombuffer(memoryview(buf), dtype=np.uint8)[o : o + spec.block_bytes] for o in offsets]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_runs_of_slots_round_trip_like_single_slots(layout: str) -> None:
    rng = np.random.default_rng(9)
    spec = _spec(layout)
    bb = spec.block_bytes
    src = _random_caches(layout, rng)
    ids = [5, 1, 3, 0, 4]
    buf, slots = _slab_slots(spec, [bb + 8, 2 * bb + 8, 3 * bb + 8, 6 * bb, 0])
    NumpyTransfer().gather(bind_caches(spec, src), ids, slots)
    alone = _slots(spec, len(ids))
    for b, slot in zip(ids, alone):  # one slot at a time: the reference
        NumpyTransfer().gather(bind_caches(spec, src), [b], [slot])
    assert [s.tobytes() for s in slots] == [s.tobytes() for s in alone]
    buf.flags.writeable = False
    dst = _zeros_like(src)
    NumpyTransfer().scatter(
        bind_caches(spec, dst),
        ids,
        [np.frombuffer(memoryview(buf), np.uint8)[s.ctypes.data - buf.ctypes.data :][:bb] for s in slots],
    )
    a, b = bind_caches(spec, src), bind_caches(spec, dst)
    for layer in range(L):
        for pa, pb in zip(a.planes[layer], b.planes[layer]):
            assert np.array_equal(pa[ids], pb[ids])
            assert not pb[2].any()  # a block outside the load stays untouched


def test_read_only_slot_can_be_scattered() -> None:
    spec = _spec("vllm_cpu")
    src = _random_caches("vllm_cpu", np.random.default_rng(8))
    slot = _slots(spec, 1)[0]
    NumpyTransfer().gather(bind_caches(spec, src), [2], [slot])
    slot.flags.writeable = False
    dst = _zeros_like(src)
    NumpyTransfer().scatter(bind_caches(spec, dst), [0], [slot])
    assert all(np.array_equal(d[0], s[2]) for d, s in zip(dst, src))


def test_errors_name_the_problem() -> None:
    spec = _spec("vllm_cpu")
    caches = _random_caches("vllm_cpu", np.random.default_rng(9))
    t = NumpyTransfer()
    with pytest.raises(InvalidArgument, match="outside the cache"):
        t.gather(bind_caches(spec, caches), [NB], _slots(spec, 1))
    with pytest.raises(InvalidArgument, match="smaller than a block"):
        t.gather(bind_caches(spec, caches), [0], [np.zeros(10, np.uint8)])
    with pytest.raises(InvalidArgument, match="expected"):
        bind_caches(spec, _random_caches("vllm_gpu", np.random.default_rng(0)))
    with pytest.raises(InvalidArgument, match="layers given"):
        bind_caches(spec, caches[:1])
    with pytest.raises(InvalidArgument, match="element size"):
        bind_caches(_spec("vllm_cpu", "float16"), caches)
    with pytest.raises(InvalidArgument, match="kv_layout"):
        KVSpec("paged", 1, 1, 1, 1, "float32")
    with pytest.raises(InvalidArgument, match="not one of"):
        make_transfer("opencl")


def test_the_mla_layout_takes_one_latent_per_token_and_says_what_it_expected() -> None:
    """vLLM's MLA caches (CPU ``[blocks, 1, bs, latent]``, GPU ``[blocks, bs, latent]``) hold the
    same slot bytes; a cache of K/V heads, or a spec with more than one head, is refused."""
    spec = _spec("vllm_mla")
    cpu = _random_caches("vllm_mla", np.random.default_rng(11))
    gpu = [np.ascontiguousarray(c[:, 0]) for c in cpu]
    slots = [_slots(spec, 2), _slots(spec, 2)]
    for caches, out in zip((cpu, gpu), slots):
        NumpyTransfer().gather(bind_caches(spec, caches), [4, 1], out)
    assert [s.tobytes() for s in slots[0]] == [s.tobytes() for s in slots[1]]
    assert slots[0][0].view(np.float32).tolist() == cpu[0][4, 0].ravel().tolist() + cpu[1][4, 0].ravel().tolist() \
        + cpu[2][4, 0].ravel().tolist()
    with pytest.raises(InvalidArgument, match=r"vllm_mla layout: a layer's cache has shape \(6, 2, 4, 16\), "
                                              r"expected \('\*', 1, 4, 8\)"):
        bind_caches(spec, _random_caches("vllm_cpu", np.random.default_rng(0)))
    with pytest.raises(InvalidArgument, match="vllm_mla layout: kv_heads must be 1"):
        bind_caches(KVSpec("vllm_mla", L, 2, D, BS, "float32"), cpu)


def test_slot_array_shape() -> None:
    spec = _spec("vllm_cpu", "bfloat16")
    arr = slot_array(np.zeros(spec.block_bytes, np.uint8), spec)
    assert arr.shape == (L, 1, H, BS, 2 * D) and arr.dtype == np.uint16


def test_cupy_is_not_imported_on_cpu() -> None:
    # a fresh interpreter: another test of this process may have imported cupy on a GPU host
    code = ("import sys; from connector.transfer.engines import make_transfer; make_transfer('numpy'); "
            "print('cupy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    assert out.strip() == "False"


# --- gather_block / scatter_block: the per-block copy the cupy path runs on the device ------------

NP_DTYPES = {"float32": np.float32, "float16": np.float16, "int8": np.int8}


@pytest.mark.parametrize("dtype", sorted(NP_DTYPES))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_block_copies_match_the_numpy_path(layout: str, dtype: str) -> None:
    """gather_block into a slot-shaped array gives the bytes NumpyTransfer puts in a slot, and
    scatter_block of those bytes leaves a cache exactly as NumpyTransfer's scatter does."""
    spec = _spec(layout, dtype)
    src = _random_caches(layout, np.random.default_rng(10), NP_DTYPES[dtype])
    ids_src, ids_dst = [5, 0, 3, 1], [2, 4, 0, 5]
    ref_slots = _slots(spec, len(ids_src))
    NumpyTransfer().gather(bind_caches(spec, src), ids_src, ref_slots)
    staged = []
    for b, ref in zip(ids_src, ref_slots):
        out = np.zeros(spec.slot_shape, spec.raw_dtype)
        gather_block(bind_caches(spec, src).planes, b, out)
        assert out.tobytes() == ref.tobytes(), b
        staged.append(out)
    ref_dst, dst = _zeros_like(src), _zeros_like(src)
    NumpyTransfer().scatter(bind_caches(spec, ref_dst), ids_dst, ref_slots)
    for b, block in zip(ids_dst, staged):
        scatter_block(bind_caches(spec, dst).planes, b, block)
    assert _cache_bytes(dst) == _cache_bytes(ref_dst)  # the blocks written, and the untouched (1, 3)
    assert _cache_bytes(dst) != _cache_bytes(_zeros_like(src))  # something was written


def _cache_bytes(caches: list) -> list[bytes]:
    return [t.tobytes() for c in caches for t in (c if isinstance(c, tuple) else (c,))]
