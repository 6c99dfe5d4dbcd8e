"""What a retention hint may hold (kvstore/store/books/hint_budget.py): the retained blocks of a cache
within ``retained_fraction`` of it, a hint that does not fit shortened to its leading blocks or
refused, room made only from lower priorities (lowest first, earliest end first), and on a small
trace of agentic coding conversations, hints that no longer lower the hit rate."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from kvstore.cli import main
from kvstore.config import TenantsConfig
from kvstore.keys import NamespaceRoot
from kvstore.policy import make_policy
from kvstore.sim.coding_agents import Params, generate
from kvstore.sim.hints import RETAINED_FRACTION, TraceClock, parse_hints
from kvstore.sim.replay import ReplaySpace, TierSpec, replay
from kvstore.sim.traces import Trace
from kvstore.store.books.hint_budget import HintBudget
from kvstore.store.books.index import DRAM, SSD, Block, Index, State, TierId
from kvstore.store.books.retention import Retention

SIZE = 100


def budget(capacity: dict[str, int], fraction: float, adapt: bool = False) -> HintBudget:
    """The sidecar's budget over tiers of ``capacity`` (label -> bytes) at ``fraction`` (``adapt``
    False: the fixed share, whatever the hints were worth, for the tests of its mechanics)."""
    return HintBudget(TenantsConfig(retained_fraction=fraction).retained_totals(capacity), fraction, adapt)


def cache(capacity_blocks: int, fraction: float = 0.5) -> tuple[Retention, TraceClock, list[Block]]:
    """A retention with a budget over a DRAM of ``capacity_blocks`` blocks, and 12 DRAM blocks."""
    clock = TraceClock()
    retention = Retention(clock, budget=budget({"dram": capacity_blocks * SIZE}, fraction))
    index = Index()
    index.retained = retention.recount  # (as the store wires it: placement tells the retention)
    ns = index.namespace(NamespaceRoot(b"t"), "t")
    blocks = [index.add(ns, bytes([i]), bytes([i - 1]) if i else b"", SIZE, State.COMMITTED) for i in range(12)]
    for b in blocks:
        b.tiers = DRAM
    return retention, clock, blocks


def retained(blocks: list[Block], now: float) -> list[int]:
    return [i for i, b in enumerate(blocks) if b.retain_until > now]


def test_a_hint_past_the_budget_is_shortened_to_its_leading_blocks_then_refused() -> None:
    r, _, b = cache(10)  # 5 blocks may be retained
    r.retain(b[0:3], 60_000, 0)
    r.retain(b[3:7], 60_000, 0)  # 2 of its 4 fit: its leading 2
    assert retained(b, 0) == [0, 1, 2, 3, 4]
    r.retain(b[7:9], 60_000, 0)  # none fits
    assert retained(b, 0) == [0, 1, 2, 3, 4]
    r.retain(b[0:5], 120_000, 0)  # what it holds already costs nothing: extended
    assert all(x.retain_until == 120 for x in b[0:5])
    assert r.budget is not None and (r.budget.shortened, r.budget.refused) == (1, 1)
    budget = r.snapshot()["budget"]
    assert isinstance(budget, dict) and budget.pop("worth")["scale"] == 1.0
    assert budget == {"fraction": 0.5, "shortened": 1, "refused": 1}


def test_room_comes_back_when_a_retention_ends_runs_out_or_its_block_is_evicted() -> None:
    r, clock, b = cache(10)
    r.retain(b[0:5], 10_000, 0)
    r.retain(b[0:2], 0, 0)  # ended (the framework's Retain(keys, 0))
    r.retain(b[5:8], 60_000, 0)
    assert retained(b, 0) == [2, 3, 4, 5, 6]
    clock.now = 10.0  # 2..4 run out
    r.retain(b[7:10], 60_000, 0)
    assert retained(b, 10) == [5, 6, 7, 8, 9]
    b[9].tiers = 0  # evicted from the cache
    r.recount(b[9])  # (the index's placement news)
    r.retain(b[10:12], 60_000, 0)
    assert retained(b, 10) == [5, 6, 7, 8, 9, 10]  # (9's retention stays on the block, its bytes left DRAM)


def test_a_higher_priority_makes_room_from_the_lowest_priority_earliest_end_first() -> None:
    r, _, b = cache(10)
    r.retain(b[0:2], 30_000, 1)
    r.retain(b[2:4], 20_000, 0)
    r.retain(b[4:5], 10_000, 0)
    r.retain(b[5:7], 60_000, 0)  # equal priority: what is held stays, nothing fits
    assert retained(b, 0) == [0, 1, 2, 3, 4]
    r.retain(b[5:7], 60_000, 2)  # priority 2: ends 4 (priority 0, earliest end), then 2
    assert retained(b, 0) == [0, 1, 3, 5, 6]
    r.retain(b[7:10], 60_000, 1)  # priority 1: ends 3 (the last of priority 0), not 0 or 1
    assert retained(b, 0) == [0, 1, 5, 6, 7]


def test_every_bounded_tier_must_afford_the_hint_and_one_without_a_capacity_is_free() -> None:
    clock = TraceClock()
    r = Retention(clock, budget=budget({"dram": 10 * SIZE, "ssd": 4 * SIZE}, 0.5))
    index = Index()
    ns = index.namespace(NamespaceRoot(b"t"), "t")
    b = [index.add(ns, bytes([i]), b"", SIZE, State.COMMITTED) for i in range(6)]
    for x in b:
        x.tiers = DRAM | SSD
    r.retain(b[0:4], 60_000, 0)  # 2 blocks of SSD room
    assert retained(b, 0) == [0, 1]
    for x in b[2:]:
        x.tiers = DRAM | 4  # Redis: no capacity given, not bounded
    r.retain(b[2:5], 60_000, 0)
    assert retained(b, 0) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="retained_fraction"):
        HintBudget({"dram": 10}, 1.5)


def small_agents() -> Trace:
    """A small trace of agentic coding conversations (60 at once, prompts a quarter of the
    committed trace's), where retaining every hinted turn lowers the hit rate."""
    return generate(Params(seed=5, duration_s=120.0, overlapping=60, system_tokens=3072, task_tokens=12_500.0,
                           step_tokens=1250.0, compact_tokens=57_500, summary_tokens=10_000))


def test_hints_do_not_lower_the_hit_rate_on_agentic_conversations_where_they_did() -> None:
    t = small_agents()
    hints = parse_hints("until-returned:600")
    assert hints.retained_fraction == RETAINED_FRACTION < 1
    unique = t.unique_blocks()
    plain = replay(t, unique // 20, "credit").prefix_hits
    whole = replay(t, unique // 20, "credit", hints=replace(hints, retained_fraction=1.0)).prefix_hits
    assert whole < plain  # every hint kept (66d9839): hints hurt here
    for policy in ("credit", "lru"):
        for capacity in (unique // 100, unique // 20):
            plain = replay(t, capacity, policy).prefix_hits
            hinted = replay(t, capacity, policy, hints=hints)
            assert hinted.prefix_hits >= plain, (policy, capacity)
            assert hinted.retained_peak <= capacity * RETAINED_FRACTION


def test_the_replay_takes_the_fraction_and_rejects_a_bad_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "agents.jsonl"
    t = generate(Params(duration_s=20.0, overlapping=10, system_tokens=1024, task_tokens=2000.0, step_tokens=500.0))
    t.to_jsonl(path)
    for flags in (["--hints", "until-returned:600", "--retained-fraction", "1.5"], ["--retained-fraction", "0.5"]):
        assert main(["replay", str(path), "--capacity", "5%", *flags]) == 2
        assert "--retained-fraction" in capsys.readouterr().err
    assert main(["replay", str(path), "--capacity", "5%", "--hints", "until-returned:600", "--retained-fraction",
                 "0.25", "--policy", "lru", "--json", "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["retained_fraction"] == 0.25 and out["retained_adaptive"] is True  # (the default)
    assert out["policies"]["lru"]["hints"]["retained_peak_blocks"] <= out["capacity_blocks"] * 0.25
    assert main(["replay", str(path), "--capacity", "5%", "--adaptive-share"]) == 2  # (without --hints)
    assert "--adaptive-share" in capsys.readouterr().err
    assert main(["replay", str(path), "--capacity", "5%", "--hints", "until-returned:600", "--no-adaptive-share",
                 "--policy", "lru", "--json", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["retained_adaptive"] is False


def test_a_hint_judged_beside_many_retained_blocks_costs_its_own_blocks() -> None:
    """20,000 blocks retained fill the budget: a one-block hint of equal priority is refused and a
    higher one ends one retention (the earliest end) for its block, each judging its own block and
    a heap entry or two, not the 20,000 (the budget's counts are the retention's, kept as blocks
    are retained: no sum per hint)."""
    clock = TraceClock()
    r = Retention(clock, budget=budget({"dram": 40_002 * SIZE}, 0.5))
    index = Index()
    index.retained = r.recount
    ns = index.namespace(NamespaceRoot(b"t"), "t")
    blocks = [index.add(ns, i.to_bytes(4, "big"), b"", SIZE, State.COMMITTED) for i in range(20_003)]
    for x in blocks:
        x.tiers = DRAM
    for i, x in enumerate(blocks[:20_001]):
        r.retain([x], 60_000 + i, 0)
    assert r.count() == 20_001 and r.budget is not None
    before = dict(r.work)
    assert r.retain(blocks[20_001:20_002], 60_000, 0) == []  # equal priority: refused
    assert r.retain(blocks[20_002:], 60_000, 1) == blocks[20_002:]  # higher: room made
    assert blocks[0].retain_until == 0 and blocks[1].retain_until > 0  # the earliest end went
    assert r.work["summed"] - before["summed"] == 2
    assert r.work["examined"] - before.get("examined", 0) <= 2
    assert (r.budget.shortened, r.budget.refused) == (0, 1)


def test_a_retained_block_entering_a_full_tier_makes_room_from_lower_priorities_or_goes_unretained() -> None:
    """Not only hints: a retained block that enters a bounded tier (a demotion, a promotion, an
    adoption) is held to the same budget there, one block at a time: past it, it makes room from
    lower priorities (the earliest end first) or stays in the tier unretained."""
    clock = TraceClock()
    r = Retention(clock, budget=budget({"dram": 100 * SIZE, "ssd": 4 * SIZE}, 0.5))  # the SSD: 2 blocks
    index = Index()
    index.retained = r.recount
    ns = index.namespace(NamespaceRoot(b"t"), "t")
    b = [index.add(ns, bytes([i]), b"", SIZE, State.COMMITTED) for i in range(4)]
    for x in b:
        x.tiers = DRAM
    r.retain(b[0:2], 60_000, 0)
    r.retain(b[2:3], 60_000, 1)
    r.retain(b[3:4], 60_000, 0)
    for x in (b[0], b[1], b[3]):  # copied down to the SSD in turn: the third does not fit
        x.tiers |= SSD
        index.moved(x)
    assert retained(b, 0) == [0, 1, 2] and r.budget is not None and r.budget.refused == 1
    b[2].tiers |= SSD  # priority 1: the earliest end of priority 0 makes room
    index.moved(b[2])
    assert retained(b, 0) == [1, 2]
    assert r.by_tier() == {"dram": {"": 2 * SIZE}, "ssd": {"": 2 * SIZE}}


class Node:
    """One replayed node's DRAM of ``capacity`` blocks (the store's placement, LRU) with the
    sidecar's budget for hints, served the store's calls: hits used, new blocks stored."""

    def __init__(self, capacity: int, fraction: float = 0.5) -> None:
        self.clock = TraceClock()
        self.retention = Retention(self.clock, budget=budget({"dram": capacity * SIZE}, fraction, adapt=True))
        self.index = Index()
        self.index.retained = self.retention.recount
        self.ns = self.index.namespace(NamespaceRoot(b"t"), "t")
        self.space = ReplaySpace(TierSpec(TierId.DRAM, capacity), make_policy("lru"), self.index)

    def serve(self, keys: list[bytes]) -> list[Block]:
        """A request for ``keys`` (one prefix): its leading run used, the rest stored (victims
        popped by the store's soft pin). The request's blocks."""
        run = self.index.leading_run(self.ns, keys)
        self.space.policy.access_many(run[::-1])
        self.retention.used(run)
        new = []
        for i in range(len(run), len(keys)):
            while len(self.space.sizes) >= self.space.capacity:
                v = self.retention.pop_victim(self.space.policy, None)
                assert v is not None
                self.space.unplace(v)
            b = self.index.add(self.ns, keys[i], keys[i - 1] if i else b"", SIZE, State.COMMITTED, i + 1)
            self.space.place(b)
            new.append(b)
        self.space.policy.access_many(new[::-1])
        self.retention.stored(new)
        return run + new


def turn(n: int, length: int = 4) -> list[bytes]:
    return [f"turn{n}.{i}".encode() for i in range(length)]


def test_a_node_whose_retained_turns_never_come_back_ends_up_refusing_hints() -> None:
    """Each turn is retained for 10 s and never comes back, while a working set of 6 blocks the
    retained turns push out is asked for again and again: every retention runs out unused and
    every block of the working set pushed out is stored again, so the node's budget shrinks to
    nothing and a hint is refused, counted by turns, not time (before the budget adapted, every
    turn's hint held 4 of the 10 blocks' room for good)."""
    node = Node(10)
    work = [f"work{i}".encode() for i in range(6)]
    held = []
    for n in range(12):
        node.clock.now = 20.0 * n
        node.serve(work)
        held.append(len(node.retention.retain(node.serve(turn(n)), 10_000, 0)))
    assert held[0] == 4  # the whole bound at first: 5 of 10 blocks
    assert held[-3:] == [0, 0, 0]
    assert node.retention.budget is not None
    worth = node.retention.budget.worth
    assert worth.room < SIZE and worth.losses > 0  # not one block's room: every hint refused
    assert worth.judged["unused"] > 0  # (each retention ran out unused)


def test_a_node_whose_retained_turns_come_back_after_the_cache_turned_over_keeps_its_bound() -> None:
    """The same node, each turn retained for 30 s coming back (a hit, then its hint of 0) 20 s
    later, after 8 other blocks were stored, more than the room left unretained: the retention
    kept what the policy would have evicted, so the node keeps its whole bound and every turn's
    hint is held."""
    node = Node(10)
    held = []
    for n in range(12):
        node.clock.now = 20.0 * n
        node.serve([f"other{n}.{i}".encode() for i in range(8)])
        if n:
            node.serve([*turn(n - 1), f"turn{n - 1}.next".encode()])  # the turn returns: a hit
            node.retention.retain(node.index.leading_run(node.ns, turn(n - 1)), 0, 0)
        held.append(len(node.retention.retain(node.serve(turn(n)), 30_000, 0)))
    assert node.retention.budget is not None
    worth = node.retention.budget.worth
    assert held == [4] * 12 and worth.scale == 1.0 and worth.gains > 0


def test_a_node_whose_retained_turns_come_back_before_the_cache_turned_over_refuses_the_next_hint() -> None:
    """Each turn of 2 blocks is retained and comes back (a hit, then its hint of 0) after one other
    block was stored: the policy would have kept it anyway, so its room bought nothing (early). The
    priors weigh 1/64 and 1/32 of the bound, so the first such return takes the share to nothing
    and the second turn's hint is refused, counted by turns (before, with priors of the whole bound
    and 5/4 of it, the second turn still held a block: [2, 1, 0, ...])."""
    node = Node(10)
    held = []
    for n in range(4):
        node.clock.now = 20.0 * n
        if n:
            node.serve([*turn(n - 1, 2), f"turn{n - 1}.next".encode()])  # back at once: a hit
            node.retention.retain(node.index.leading_run(node.ns, turn(n - 1, 2)), 0, 0)
        held.append(len(node.retention.retain(node.serve(turn(n, 2)), 30_000, 0)))
        node.serve([f"other{n}".encode()])
    assert node.retention.budget is not None
    worth = node.retention.budget.worth
    assert held == [2, 0, 0, 0] and worth.judged["early"] == 2 and worth.scale == 0.0


def test_a_large_bound_refuses_hints_after_as_many_early_returns_as_a_long_turn_not_a_share_of_it() -> None:
    """On a bound of 2^20 blocks (a global cache, a big DRAM) every retained block comes back before
    the cache turned over (early): the priors are at most 256 blocks paid and 512 cost
    (:data:`~kvstore.store.books.hint_worth.PRIOR_BLOCKS`), so 3584 early blocks (a long turn or a few)
    take the share to nothing, as on a node of 256 x 64 blocks; with priors of 1/64 and 1/32 of the
    bound it took 2^18 of them (before, 3584 left the whole share)."""
    from kvstore.store.books.hint_worth import HintWorth

    _, _, blocks = cache(1)
    worth = HintWorth((1 << 20) * SIZE, (1 << 21) * SIZE)
    for _ in range(3583):
        worth.retained(blocks[0])
        worth.used([blocks[0]], 0)
    assert worth.judged["early"] == 3583 and 0.0 < worth.scale < 1.0
    worth.retained(blocks[0])
    worth.used([blocks[0]], 0)
    assert worth.scale == 0.0
