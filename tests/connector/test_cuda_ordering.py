"""When the GPU path enqueues what, checked on CPU: CupyTransfer driven through a recording model
of cupy's streams and events (tests/support/cuda_streams.py), with the engine computing on a side
stream while cupy's current stream is the legacy default one (vLLM's async scheduling, CUDA graphs,
``torch.cuda.stream(s)``). Everything a kernel reads -- the plan's tables, the block ids, the
staging a DMA filled -- must be ordered before it on the device, and so must the engine's own
writes of the cache. The same scenario on a real GPU: test_cuda_transfer.py."""

from __future__ import annotations

import types
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from connector.transfer.engines import PagedKV, bind_caches
from connector.transfer.layout import KVSpec
from tests.connector.test_copy_plan import LAYOUT, _caches
from tests.support.cuda_streams import DevicePlane, FakeArray, Gpu, Op, installed

L, H, BS, NB = 3, 2, 4, 7


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Gpu, types.ModuleType]]:
    with installed(monkeypatch) as pair:
        yield pair


def _kv(kind: str = "flash_attn") -> PagedKV:
    spec = KVSpec(layout=LAYOUT[kind], num_layers=L, kv_heads=H, head_size=8, block_size=BS, dtype="float16")
    host = bind_caches(spec, _caches(kind, 8, torch.float16))
    return PagedKV(spec, [[DevicePlane(NB)]], host.plan)  # the plan as the transfer sees it; no bytes move


def _engine_on(monkeypatch: pytest.MonkeyPatch, stream: object) -> None:
    """torch drives the GPU and its current stream (the engine's) is ``stream``."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(
        cuda_stream=stream.ptr))  # type: ignore[attr-defined]


def _kernels(g: Gpu) -> list[Op]:
    return [op for op in g.ops if op.kind == "kernel"]


@pytest.mark.parametrize("chunk_blocks", [1, 32])  # 1: chunks on both streams
def test_everything_a_kernel_reads_is_ordered_before_it(gpu: tuple[Gpu, types.ModuleType],
                                                        monkeypatch: pytest.MonkeyPatch, chunk_blocks: int) -> None:
    """The engine writes the cache on a side stream; cupy's current stream is the default one. A
    gather (the tables uploaded then), a scatter of the same cache (the tables reused by the other
    direction's streams) and a second gather: every kernel's tables, ids and staging, and the
    engine's write, are ordered before it."""
    g, cp = gpu
    from connector.transfer.cuda import CupyTransfer

    side = cp.cuda.Stream(non_blocking=True)
    _engine_on(monkeypatch, side)
    kv = _kv()
    cache = FakeArray(g, 1 << 20, "the engine's cache")
    host = np.zeros(3 * kv.spec.block_bytes, np.uint8)
    slots = [host[i * kv.spec.block_bytes:(i + 1) * kv.spec.block_bytes] for i in range(3)]
    t = CupyTransfer(chunk_blocks=chunk_blocks)
    try:
        t.register(host)
        for move in (t.gather, t.scatter, t.gather):
            forward = g.log("write", side, writes=[cache])
            before = len(_kernels(g))
            move(kv, [5, 0, 6], slots).wait()
            batch = _kernels(g)[before:]
            assert batch and all(g.before(forward, k) for k in batch), "a kernel may run before the engine's write"
        assert len(_kernels(g)) == 3 * (3 if chunk_blocks == 1 else 1)
        assert {op.stream for op in _kernels(g)} != {side.sid}
        assert g.unordered_reads() == []
    finally:
        t.close()
