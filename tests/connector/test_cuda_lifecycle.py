"""CupyTransfer's life around its batches, checked on CPU through the recording model of cupy
(tests/support/cuda_streams.py): which device pins the slab, registrations cut at the slab's own
pages, close() against a batch being queued, and constructor arguments it does not use refused."""

from __future__ import annotations

import threading
import types
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from connector.transfer import cuda as cuda_transfer
from connector.transfer.engines import make_transfer, register_slab
from kvstore.dram.slab import Slab, page_bytes_of
from kvstore.errors import FailedPrecondition
from tests.connector.test_cuda_ordering import _kv
from tests.support.cuda_streams import Gpu, installed

MiB = 1 << 20


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gpu]:
    with installed(monkeypatch) as (g, _):
        yield g


def test_register_pins_under_the_engines_device(gpu: Gpu, monkeypatch: pytest.MonkeyPatch) -> None:
    """The device named at construction, else torch's current device (a rank's own), pins the
    mapping -- not whatever cupy's current device is (0: a stray context on GPU 0 per rank)."""
    buf = np.zeros(MiB, np.uint8)
    t = make_transfer("cupy", device=3)
    t.register(buf)
    t.close()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    t = make_transfer("cupy")
    t.register(buf)
    t.close()
    assert [dev for _, dev in gpu.registered_on] == [3, 2]


def test_arguments_it_does_not_use_are_refused(gpu: Gpu) -> None:
    with pytest.raises(TypeError, match="spec"):
        make_transfer("cupy", spec=_kv().spec)


def test_register_slab_cuts_registrations_at_the_slabs_pages(gpu: Gpu, monkeypatch: pytest.MonkeyPatch) -> None:
    """A slab of 3 MiB pages registered in pieces of at most 4 MiB: every piece starts on a page
    (the slab records its page size in its header, the worker reads it), so no slot straddles two
    registrations and a DMA never crosses one."""
    monkeypatch.setattr(cuda_transfer, "REGISTER_PIECE", 4 * MiB)
    slab = Slab(12 * MiB, page_bytes=3 * MiB, prefault=False, name_prefix="kvstore-pages-test")
    t = make_transfer("cupy")
    try:
        assert page_bytes_of(slab.name) == 3 * MiB
        register_slab(t, types.SimpleNamespace(hello=lambda: types.SimpleNamespace(segment=slab.name)))
        start = int(slab.buf.ctypes.data)
        offsets = [a - start for a, _ in gpu.registered_on]
        assert offsets == [0, 3 * MiB, 6 * MiB, 9 * MiB, 12 * MiB]
    finally:
        t.close()
        slab.close()


def test_close_waits_for_a_batch_being_queued_and_refuses_later_ones(gpu: Gpu) -> None:
    """close() while a batch is between its first and last launch: it returns only after the
    batch is queued and unregisters the slab after the batch's DMAs; a batch or a register()
    after it is refused, nothing re-pinned."""
    kv = _kv()
    host = np.zeros(4 * kv.spec.block_bytes, np.uint8)
    slots = [host[i * kv.spec.block_bytes:(i + 1) * kv.spec.block_bytes] for i in range(4)]
    t = make_transfer("cupy", chunk_blocks=1)
    t.register(host)
    inside, go = threading.Event(), threading.Event()

    def hold() -> None:
        if not inside.is_set():
            inside.set()
            assert go.wait(30)

    gpu.on_kernel = hold
    batch = threading.Thread(target=lambda: t.gather(kv, [0, 1, 2, 3], slots).wait())
    closer = threading.Thread(target=t.close)
    batch.start()
    assert inside.wait(30)
    closer.start()
    closer.join(0.5)
    alive = closer.is_alive()
    go.set()
    batch.join(30)
    closer.join(30)
    assert alive, "close() returned while a batch was being queued"
    kinds = [op.kind for op in gpu.ops]
    assert kinds.count("kernel") == 4 and kinds[-1] == "unregister"
    assert max(i for i, k in enumerate(kinds) if k == "dma") < kinds.index("unregister")
    with pytest.raises(FailedPrecondition, match="closed"):
        t.gather(kv, [0], slots[:1])
    with pytest.raises(FailedPrecondition, match="closed"):
        t.register(host)
    assert len(gpu.registered_on) == 1


def test_a_slot_of_a_mapping_nobody_registered_is_pinned_when_first_seen(gpu: Gpu,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """A batch with slots in the registered slab and in another mapping: the other mapping is
    pinned once, on the request's path, with a warning; every slot is moved (a DMA each, the two
    mappings never one DMA); a second batch pins nothing more."""
    kv = _kv()
    bb = kv.spec.block_bytes
    one, two = np.zeros(4 * bb, np.uint8), np.zeros(4 * bb, np.uint8)
    slots = [one[:bb], one[bb:2 * bb], two[:bb], two[bb:2 * bb]]
    t = make_transfer("cupy")
    try:
        t.register(one)
        with caplog.at_level("WARNING", logger="connector.transfer.cuda"):
            t.gather(kv, [0, 1, 2, 3], slots).wait()
        assert "request's path" in caplog.text
        assert [a for a, _ in gpu.registered_on] == [int(one.ctypes.data), int(two.ctypes.data)]
        dmas = [op.detail for op in gpu.ops if op.kind == "dma"]
        assert sorted((dst, height) for dst, _, _, height, _ in dmas) == sorted([(int(one.ctypes.data), 2),
                                                                                 (int(two.ctypes.data), 2)])
        t.gather(kv, [0, 1, 2, 3], slots).wait()
        assert len(gpu.registered_on) == 2
    finally:
        t.close()
