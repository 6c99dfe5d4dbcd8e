"""CupyTransfer on a GPU, byte for byte against the numpy path, through real slab slots.

Every test here is ``gpu``-marked and skips where there is no CUDA device; ``scripts/gpu-check``
runs them on a GPU machine. The plan they execute is tested on CPU in test_copy_plan.py."""

from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

from connector.transfer.engines import NumpyTransfer, bind_caches, make_transfer
from connector.transfer.layout import KVSpec
from kvstore.dram.slab import Slab
from tests.connector.test_copy_plan import DTYPES, LAYOUT, _caches

pytestmark = pytest.mark.gpu
pytest_plugins = ["pytester"]

L, H, BS = 3, 2, 4
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cp() -> ModuleType:
    """cupy with a CUDA device; the test is skipped where there is none."""
    try:
        cupy = importlib.import_module("cupy")
        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy
    except (ImportError, RuntimeError, OSError):  # no cupy, no driver, no device
        pass
    pytest.skip("needs CUDA (cupy with a GPU)")


@pytest.fixture
def two_slabs() -> Iterator[list[Slab]]:
    """Two real sidecar slabs: two shared-memory mappings."""
    slabs = [Slab(8 << 20, page_bytes=1 << 20, prefault=False, name_prefix="kvstore-gpu-test") for _ in range(2)]
    yield slabs
    for slab in slabs:
        slab.close()


def _spec(kind: str, d: int, dtype: str) -> KVSpec:
    return KVSpec(layout=LAYOUT[kind], num_layers=L, kv_heads=H, head_size=d, block_size=BS, dtype=dtype)


def _to(caches: list, device: str) -> list:
    """The caches on ``device`` with the same strides and the same sharing of storage (cross-layer
    views of one buffer stay views of one buffer, so their plan merges across layers)."""
    bases: dict[int, torch.Tensor] = {}

    def move(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in bases:
            flat = torch.empty(t.untyped_storage().nbytes() // t.element_size(), dtype=t.dtype)
            flat.untyped_storage().copy_(t.untyped_storage())
            bases[key] = flat.to(device)
        return torch.as_strided(bases[key], t.shape, t.stride(), t.storage_offset())

    return [tuple(move(t) for t in c) if isinstance(c, tuple) else move(c) for c in caches]


def _cache_bytes(caches: list) -> list[bytes]:
    flat = [t for c in caches for t in (c if isinstance(c, tuple) else (c,))]
    return [t.cpu().contiguous().view(torch.uint8).numpy().tobytes() for t in flat]


def _slots(slabs: list[Slab], spec: KVSpec, n: int) -> list[np.ndarray]:
    """``n`` slots, the first half side by side in one slab, the rest in the other."""
    out = []
    for i in range(n):
        slab = slabs[0] if i < n // 2 + 1 else slabs[1]
        slot = slab.try_alloc(slab.class_of(spec.block_bytes))
        assert slot is not None
        out.append(slab.view(slot, spec.block_bytes))
    return out


@pytest.mark.parametrize("chunk_blocks", [2, 32])
@pytest.mark.parametrize("d", [8, 3])  # 3: pieces not a multiple of 16 bytes (the kernel's byte tail)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("kind", sorted(k for k in LAYOUT if k != "vllm_cpu"))
def test_kernels_match_the_numpy_path(cp: ModuleType, two_slabs: list[Slab], kind: str, dtype: str, d: int,
                                      chunk_blocks: int) -> None:
    """Gather of an odd count of blocks, ids out of order, into slots of two mappings, chunks of 2
    (runs that span chunks) or one chunk: the slots get the numpy path's bytes; scatter of them
    leaves the device cache as the numpy path leaves a host cache."""
    spec = _spec(kind, d, dtype)
    host_src, host_dst = _caches(kind, d, DTYPES[dtype], 1), _caches(kind, d, DTYPES[dtype], 2)
    ids_src, ids_dst = [5, 0, 6, 2, 3], [1, 4, 0, 6, 2]
    ref = [np.zeros(spec.block_bytes, np.uint8) for _ in ids_src]
    NumpyTransfer().gather(bind_caches(spec, host_src), ids_src, ref)
    dev_src, dev_dst = _to(host_src, "cuda"), _to(host_dst, "cuda")
    NumpyTransfer().scatter(bind_caches(spec, host_dst), ids_dst, ref)

    slots = _slots(two_slabs, spec, len(ids_src))
    t = make_transfer("cupy", chunk_blocks=chunk_blocks)
    try:
        for slab in two_slabs:
            t.register(slab.buf, page_bytes=1 << 20)
        t.gather(bind_caches(spec, dev_src), ids_src, slots).wait()
        assert [s.tobytes() for s in slots] == [r.tobytes() for r in ref]
        t.scatter(bind_caches(spec, dev_dst), ids_dst, slots).wait()
        assert _cache_bytes(dev_dst) == _cache_bytes(host_dst)
    finally:
        t.close()


def test_an_engine_on_a_side_stream_while_the_default_stream_is_busy(cp: ModuleType, two_slabs: list[Slab]) -> None:
    """The engine writes its cache on a side stream while the legacy default stream (cupy's current
    one) is kept busy: the first gather of a bound cache (its plan tables uploaded then) and a
    scatter whose tables a gather uploaded on the other direction's stream, both issued from the
    side stream, move the right bytes -- nothing a kernel reads is queued behind the busy stream
    (CPU twin: test_cuda_ordering.py). A warm-up batch first, so nothing the first batch of an
    engine does (compiling, loading the module) waits for the busy stream and hides the race."""
    spec = _spec("flashinfer_hnd", 8, "bfloat16")
    host_src = _caches("flashinfer_hnd", 8, torch.bfloat16, 7)
    host_dst = _caches("flashinfer_hnd", 8, torch.bfloat16, 8)
    ids_src, ids_dst = [4, 1, 6], [0, 5, 2]
    ref = [np.zeros(spec.block_bytes, np.uint8) for _ in ids_src]
    NumpyTransfer().gather(bind_caches(spec, host_src), ids_src, ref)
    NumpyTransfer().scatter(bind_caches(spec, host_dst), ids_dst, ref)
    empty_src = [torch.zeros_like(t) for t in _to(host_src, "cuda")]
    dev_dst = _to(host_dst, "cuda")
    slots = _slots(two_slabs, spec, len(ids_src))
    t = make_transfer("cupy", chunk_blocks=1)
    side = torch.cuda.Stream()
    try:
        for slab in two_slabs:
            t.register(slab.buf, page_bytes=1 << 20)
        t.gather(bind_caches(spec, dev_dst), ids_dst, slots).wait()  # compiled, streams made, dev_dst's tables up
        torch.cuda.synchronize()
        busy = torch.cuda.default_stream()  # the legacy default stream: cupy's current stream here
        with torch.cuda.stream(busy):
            torch.cuda._sleep(1 << 31)  # ~1 s
        with torch.cuda.stream(side):
            for dst, src in zip(empty_src, _to(host_src, "cuda")):  # the "forward pass" writes the cache here
                dst.copy_(src)
            t.gather(bind_caches(spec, empty_src), ids_src, slots).wait()
            assert [s.tobytes() for s in slots] == [r.tobytes() for r in ref]
            with torch.cuda.stream(busy):
                torch.cuda._sleep(1 << 31)
            t.scatter(bind_caches(spec, dev_dst), ids_dst, slots).wait()
            side.synchronize()
        assert _cache_bytes(dev_dst) == _cache_bytes(host_dst)
    finally:
        torch.cuda.synchronize()
        t.close()


def test_gathers_and_scatters_from_threads_at_once(cp: ModuleType, two_slabs: list[Slab]) -> None:
    """Saves and loads issued from pool threads (whose current device and stream are their own),
    several at once on one engine: every slot and every block gets its own bytes."""
    from concurrent.futures import ThreadPoolExecutor

    spec = _spec("flash_attn", 8, "bfloat16")
    host = _caches("flash_attn", 8, torch.bfloat16, 5)
    src, dst = _to(host, "cuda"), _to(_caches("flash_attn", 8, torch.bfloat16, 6), "cuda")
    ids = [[6, 1], [0, 4], [5, 2]]
    slots = _slots(two_slabs, spec, 6)
    t = make_transfer("cupy", chunk_blocks=1)
    try:
        for slab in two_slabs:
            t.register(slab.buf, page_bytes=1 << 20)
        kv_src, kv_dst = bind_caches(spec, src), bind_caches(spec, dst)
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda i: t.gather(kv_src, ids[i], slots[2 * i:2 * i + 2]).wait(), range(3)))
            list(pool.map(lambda i: t.scatter(kv_dst, ids[i], slots[2 * i:2 * i + 2]).wait(), range(3)))
        ref = [np.zeros(spec.block_bytes, np.uint8) for _ in range(6)]
        NumpyTransfer().gather(bind_caches(spec, host), [b for pair in ids for b in pair], ref)
        assert [s.tobytes() for s in slots] == [r.tobytes() for r in ref]
        got, want = bind_caches(spec, dst), bind_caches(spec, src)
        for layer in range(L):
            for pg, pw in zip(got.planes[layer], want.planes[layer]):
                for b in (6, 1, 0, 4, 5, 2):
                    assert bool((pg[b] == pw[b]).all())
    finally:
        t.close()


def test_the_slab_is_pinned_at_register_and_released_at_close(cp: ModuleType, two_slabs: list[Slab],
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """register() pins each mapping once; a slot of a mapping nobody registered is pinned when
    first seen, with a warning; close() unregisters exactly what the engine pinned."""
    rt = cp.cuda.runtime
    spec = _spec("flash_attn", 8, "float16")
    src = _to(_caches("flash_attn", 8, torch.float16), "cuda")
    slots = _slots(two_slabs, spec, 4)
    starts = [int(s.buf.ctypes.data) for s in two_slabs]
    t = make_transfer("cupy")
    try:
        t.register(two_slabs[0].buf)
        assert rt.pointerGetAttributes(starts[0]).type == rt.memoryTypeHost
        assert rt.pointerGetAttributes(starts[1]).type == rt.memoryTypeUnregistered
        with caplog.at_level(logging.WARNING, logger="connector.transfer.cuda"):
            t.gather(bind_caches(spec, src), [0, 1, 2, 3], slots).wait()
        assert "request's path" in caplog.text
        assert all(rt.pointerGetAttributes(a).type == rt.memoryTypeHost for a in starts)
    finally:
        t.close()
    assert all(rt.pointerGetAttributes(a).type == rt.memoryTypeUnregistered for a in starts)


def test_a_host_cache_is_refused(cp: ModuleType) -> None:
    spec = _spec("flash_attn", 8, "float16")
    t = make_transfer("cupy")
    try:
        with pytest.raises(Exception, match="host memory"):
            t.gather(bind_caches(spec, _caches("flash_attn", 8, torch.float16)), [0], [np.zeros(spec.block_bytes,
                                                                                            np.uint8)])
    finally:
        t.close()


LEAKY_GPU = textwrap.dedent('''
    import os
    import cupy
    import pytest

    LEFT = []

    @pytest.mark.gpu
    def test_cuda_alone():
        a = cupy.arange(1 << 20)
        s = cupy.cuda.Stream(non_blocking=True)
        with s:
            (a * 2).sum()
        s.synchronize()

    @pytest.mark.gpu
    def test_cuda_and_a_real_leak():
        cupy.arange(10).sum()
        LEFT.append(open(os.devnull))
''')


def test_leak_check_ignores_the_driver_and_still_catches_a_leak(cp: ModuleType, pytester: Any,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The leak check's "before" holds the CUDA driver's descriptors, so a test using CUDA passes;
    a descriptor a GPU test really leaves still fails it, by name."""
    monkeypatch.setenv("KVSTORE_LEAK_GRACE_S", "0.5")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    pytester.makeini("[pytest]\nmarkers =\n    gpu: needs CUDA\n")
    pytester.makepyfile(test_gpu_leaks=LEAKY_GPU)
    result = pytester.runpytest_subprocess("-p", "tests.leaks", "-p", "no:cacheprovider", "-rfE", timeout=300)
    out = result.stdout.str()
    assert "test_cuda_alone" not in out.split("short test summary")[-1], out
    assert "/dev/null" in out, out
    result.assert_outcomes(passed=2, errors=1)


def test_demo_on_the_gpu_matches_full_recompute(cp: ModuleType) -> None:
    """`kvstore demo --device cuda`: prefill and decode workers run the model on the GPU, the HF
    connector moves KV with the cupy engine, and the decode worker's outputs equal a full recompute."""
    out = subprocess.run([sys.executable, "-m", "kvstore", "demo", "--device", "cuda", "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["ok"] and summary["device"] == "cuda"
    assert summary["decode"]["transfer"] == "cupy"
    assert summary["decode"]["turn1"]["loaded_blocks"] > 0 and summary["decode"]["turn1"]["match"]
