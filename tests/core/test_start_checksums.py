"""``start_checksums``: a batch hashed on the checksum pool while the caller does other work
(a load's copy); what no pool thread has started when the caller joins is hashed by the caller."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvstore import checksum as cs


def buffers(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(n)
    return [rng.integers(0, 255, 4096 + i, dtype=np.uint8) for i in range(n)]


def test_the_checksums_come_back_in_order() -> None:
    views = buffers(9)
    assert cs.start_checksums(views)() == [cs.checksum(v) for v in views]
    assert cs.start_checksums([])() == []


def test_a_busy_pool_does_not_hold_the_caller_up() -> None:
    """Every pool thread is busy: the join hashes the batch itself instead of waiting."""
    release, started = threading.Event(), threading.Semaphore(0)

    def occupy() -> None:
        started.release()
        release.wait(30)

    blockers = [cs._pool.submit(occupy) for _ in range(cs.HASH_THREADS)]
    try:
        for _ in blockers:
            assert started.acquire(timeout=30)
        views = buffers(5)
        join = cs.start_checksums(views)
        assert join() == [cs.checksum(v) for v in views]  # returns while every pool thread is still held
        assert not any(b.done() for b in blockers)
    finally:
        release.set()
        for b in blockers:
            b.result(timeout=30)


def test_a_failure_is_raised_once_every_part_is_done() -> None:
    views: list[object] = [*buffers(3), "not a buffer"]
    with pytest.raises(TypeError):
        cs.start_checksums(views)()  # type: ignore[arg-type]
