"""The tiered replay (``kvstore replay --tier dram=… --tier ssd=…``, kvstore/sim/replay.py) makes the
store's calls in the store's order, as the single-space replay does."""

from __future__ import annotations

import pytest

from kvstore.policy import policy_names
from kvstore.sim.replay import TierSpec, replay
from kvstore.sim.traces import multi_turn
from kvstore.store.books.index import TierId


@pytest.mark.parametrize("policy", policy_names())
def test_top_tier_alone_is_the_single_cache_replay(policy: str) -> None:
    # A tier below with no room keeps nothing, so the top space sees exactly the single-space
    # replay's calls: victims popped for all of a request's new blocks first, then inserted root
    # first, then access_many deepest first. `credit` tells the orders apart (the commit's access
    # orders, it is not a use): the tiered replay interleaved pops and inserts and made no commit
    # access, and scored differently from the single cache.
    t = multi_turn(sessions=150, seed=5)
    cap = t.unique_blocks() // 20
    ref = replay(t, cap, policy)
    run = replay(t, [TierSpec(TierId.DRAM, cap), TierSpec(TierId.SSD, 0)], policy)
    assert run.prefix_hits == ref.prefix_hits
    assert run.tier_prefix_hits == {"dram": ref.prefix_hits, "ssd": 0}


@pytest.mark.parametrize("policy", policy_names())
def test_lower_tier_holds_what_the_top_evicts(policy: str) -> None:
    # Inclusive tiers: with a tier below, hits only grow, and the total never passes one cache of
    # both capacities together (the lower tier adds a victim's copy, never a new block).
    t = multi_turn(sessions=150, seed=5)
    cap = t.unique_blocks() // 20
    top = replay(t, cap, policy)
    both = replay(t, [TierSpec(TierId.DRAM, cap), TierSpec(TierId.SSD, 3 * cap)], policy)
    whole = replay(t, 4 * cap, policy)
    assert top.prefix_hits < both.prefix_hits <= whole.prefix_hits
    assert both.tier_prefix_hits["ssd"] > 0
    assert sum(both.tier_prefix_hits.values()) == both.prefix_hits
