"""GhostSpan: the time to live of the counts a node leaves in the cluster's ghost."""

from __future__ import annotations

import pytest

from kvstore.policy.ghost import MIN_TTL_S, RATE_TAU_S, GhostSpan


def test_ttl_is_the_ghosts_size_over_the_let_go_rate() -> None:
    span = GhostSpan()
    assert span.ttl_s(1000, 3600) == 3600  # no rate yet: the ceiling
    for t in range(int(10 * RATE_TAU_S)):  # 10 blocks a second, long enough for the average to settle
        span.let_go(10, float(t))
    assert span.rate == pytest.approx(10, rel=0.05)
    assert span.ttl_s(1000, 3600) == pytest.approx(100, rel=0.05)  # 1000 counts at 10 a second
    assert span.ttl_s(1000, 60) == 60  # never past the ceiling
    assert span.ttl_s(1, 3600) == MIN_TTL_S  # nor under the floor
    assert span.ttl_s(0, 3600) == 0  # a space with no ghost keeps nothing


def test_rate_follows_the_turnover_down() -> None:
    span = GhostSpan()
    for t in range(int(10 * RATE_TAU_S)):
        span.let_go(10, float(t))
    fast = span.ttl_s(1000, 3600)
    for t in range(int(10 * RATE_TAU_S), int(20 * RATE_TAU_S)):  # then 1 block a second
        span.let_go(1, float(t))
    assert span.ttl_s(1000, 3600) == pytest.approx(10 * fast, rel=0.1)


def test_a_clock_that_steps_back_changes_nothing_but_the_count() -> None:
    span = GhostSpan()
    span.let_go(5, 100.0)
    span.let_go(5, 99.0)  # an earlier time (another thread's stamp): counted, no decay, no rewind
    assert (span.at, span.seen_s) == (100.0, 0.0)
    assert span.rate == pytest.approx(10 / RATE_TAU_S)
