"""kvstore.dram.staging: the movers' pool of page-aligned buffers reuses them, and lets go of the
ones a burst left behind once steady use no longer needs them (the soak's sidecar kept the
2,300 extra buffers of one burst, +36 MiB of RSS, for the rest of its life)."""

from __future__ import annotations

import gc
import mmap
import weakref

from kvstore.dram.staging import StagingPool

SIZE = mmap.PAGESIZE
BURST = 1000
STEADY = 10_000  # takes: more than two trim periods of the default pool


def _alive(refs: list[weakref.ref[mmap.mmap]]) -> int:
    gc.collect()
    return sum(1 for r in refs if r() is not None)


def test_the_buffers_of_a_burst_are_let_go_once_steady_use_does_not_need_them():
    pool = StagingPool(BURST * SIZE)
    burst = [pool.take(SIZE) for _ in range(BURST)]
    assert all(got is not None for got in burst)
    refs = [weakref.ref(got[1]) for got in burst if got is not None]
    for got in burst:
        assert got is not None
        pool.give(got[1])
    del burst, got

    for _ in range(STEADY):  # steady use: one block in flight at a time
        data, buf = pool.take(SIZE) or (None, None)
        assert buf is not None
        pool.give(buf)
    del data, buf

    assert _alive(refs) <= 1  # the one steady use needs; the old pool kept all 1,000
    assert pool.used == 0


def test_buffers_in_steady_use_are_reused_not_made_again():
    pool = StagingPool(BURST * SIZE, trim_every=100)
    made: list[mmap.mmap] = []  # every buffer handed out, by identity (kept alive so ids stay unique)
    for _ in range(20):  # 20 trim periods of "64 in flight, then all back"
        got = [pool.take(SIZE) for _ in range(64)]
        for g in got:
            assert g is not None
            if not any(g[1] is m for m in made):
                made.append(g[1])
        for g in got:
            assert g is not None
            pool.give(g[1])
    assert len(made) == 64
    assert pool.pooled == 64 * SIZE


def test_the_limit_bounds_the_buffers_in_flight_not_the_pool():
    pool = StagingPool(4 * SIZE, trim_every=2)
    got = [pool.take(SIZE) for _ in range(4)]
    assert pool.take(SIZE) is None  # four in flight: the limit
    for g in got:
        assert g is not None
        pool.give(g[1])
    assert pool.used == 0
    data_buf = pool.take(SIZE + 1)  # two pages
    assert data_buf is not None and len(data_buf[1]) == 2 * SIZE and data_buf[0].size == SIZE + 1
