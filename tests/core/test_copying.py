"""kvstore.dram.copying: the client's copy of blocks into slots, split over threads when large."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvstore.dram import copying


def _pairs(n: int, size: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(np.zeros(size, dtype=np.uint8), rng.integers(0, 256, size, dtype=np.uint8)) for _ in range(n)]


@pytest.fixture
def seen_threads(monkeypatch):
    """Names of the threads each destination was written on."""
    names: list[str] = []
    real = copying._run

    def spy(part):
        names.append(threading.current_thread().name)
        real(part)

    monkeypatch.setattr(copying, "_run", spy)
    return names


def test_a_small_batch_is_copied_on_the_callers_thread(seen_threads):
    pairs = _pairs(3, 4096, 1)
    copying.copy_blocks(pairs)
    assert all(np.array_equal(d, s) for d, s in pairs)
    assert seen_threads == [threading.current_thread().name]


@pytest.mark.skipif(copying.COPY_THREADS < 2, reason="one CPU: there is no second thread to split onto")
async def test_a_large_batch_is_split_over_the_copy_threads(seen_threads):
    n = 5
    pairs = _pairs(n, -(-copying.SPLIT_BYTES // n), 2)  # just over SPLIT_BYTES in all
    await copying.copy_blocks_async(pairs)
    assert all(np.array_equal(d, s) for d, s in pairs)
    assert len(seen_threads) == copying.COPY_THREADS
    assert all(name.startswith("kvstore-copy") for name in seen_threads)


def test_a_failed_copy_raises_after_every_thread_is_done(monkeypatch):
    monkeypatch.setattr(copying, "SPLIT_BYTES", 1)
    pairs = _pairs(4, 4096, 3)
    pairs[0] = (np.zeros(10, dtype=np.uint8), pairs[0][1])  # wrong size: numpy refuses the copy
    with pytest.raises(ValueError):
        copying.copy_blocks(pairs)
    # the other thread's run (the last two pairs) was not abandoned
    assert all(np.array_equal(d, s) for d, s in pairs[2:])
