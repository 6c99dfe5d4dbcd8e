"""``kvstore replay --hints continuation[:SECONDS]`` (kvstore/sim/hints.py): which requests a later
one continues, and the replay keeping their blocks by the store's own soft pin
(kvstore/store/books/retention.py)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvstore.cli import main
from kvstore.errors import InvalidArgument
from kvstore.sim.cluster import replay_cluster
from kvstore.sim.hints import Hinting, Hints, continuations, parse_hints
from kvstore.sim.replay import TierSpec, index_keys, replay
from kvstore.sim.traces import Request, Trace
from kvstore.store.books.index import DRAM, TierId

BT = 4  # tokens per block in these traces


def whole(text: str) -> Hints:
    """The hints of ``text`` on a sidecar whose hints may hold a whole tier (retained_fraction 1):
    these tests take the hints' ends and the soft pin apart from the budget (tests/sim/test_hint_budget.py)."""
    return replace(parse_hints(text), retained_fraction=1.0)


def req(ts_s: float, keys: list[int], input_length: int, output_length: int) -> Request:
    return Request(int(ts_s * 1000), tuple(keys), input_length - (len(keys) - 1) * BT, output_length)


def test_a_request_is_continued_when_a_later_prompt_holds_its_whole_turn() -> None:
    t = Trace("t", [
        req(0, [1, 2, 3], 10, 4),  # 2 full blocks (the third holds 2 tokens); its turn is 14 tokens
        req(1, [1, 2, 9, 10], 14, 0),  # its full blocks, and its 14 tokens: continued, 2 blocks
        req(2, [1, 2, 3], 10, 100),  # its turn: 110 tokens
        req(3, [1, 2, 3, 4], 16, 0),  # shares its prompt but not its turn: not a continuation
        req(4, [7], 3, 1),  # no full block: nothing to retain
        req(5, [7, 8], 5, 0),
    ], BT)
    assert continuations(t) == [2, 0, 0, 0, 0, 0]


def test_hints_parse_with_a_default_and_bad_ones_name_the_flag() -> None:
    assert parse_hints("continuation").seconds == 60.0
    assert parse_hints("continuation:2.5").retain_ms == 2500
    assert parse_hints("until-continued:5").end == "next-turn" and parse_hints("until-returned").end == "origin"
    assert not parse_hints("continuation").end
    for bad in ("keepall", "continuation:x", "continuation:0", "continuation:-1"):
        with pytest.raises(InvalidArgument, match="--hints"):
            parse_hints(bad)


def agent_trace(gap_s: float) -> Trace:
    """An agent's turn of 4 full blocks, then from 1.5 s 8 other prompts of 2 blocks (through a
    6-block cache), then the agent's next turn ``gap_s`` after the first."""
    reqs = [req(0, [1, 2, 3, 4], 16, 0)]
    reqs += [req(1.5 + 0.1 * i, [100 + 2 * i, 101 + 2 * i], 8, 0) for i in range(1, 9)]
    reqs.append(req(gap_s, [1, 2, 3, 4, 5], 20, 0))
    return Trace("agent", reqs, BT)


@pytest.mark.parametrize("policy", ["lru", "credit"])
def test_the_continued_turn_is_kept_until_its_retention_ends(policy: str) -> None:
    t = agent_trace(5.0)
    plain = replay(t, 6, policy)
    kept = replay(t, 6, policy, hints=whole("continuation:10"))
    lapsed = replay(t, 6, policy, hints=whole("continuation:1"))  # ended before the others came
    assert plain.prefix_hits == 0
    assert kept.prefix_hits == 4 and kept.retained_peak == 4
    assert lapsed.prefix_hits == 0
    tiered = replay(t, [TierSpec(TierId.DRAM, 4), TierSpec(TierId.SSD, 6)], policy,
                    hints=whole("continuation:10"))
    assert tiered.prefix_hits == 4 and tiered.tier_prefix_hits["ssd"] > 0  # demoted, and kept below


def test_until_continued_ends_the_retention_when_the_next_turn_arrives() -> None:
    t = agent_trace(5.0)
    t.requests[-1] = req(5.0, [1, 2, 3, 4, 5], 20, 8)  # the continuation; nothing continues it
    t.requests += [req(6 + 0.1 * i, [300 + 2 * i, 301 + 2 * i], 8, 0) for i in range(4)]  # 8 more blocks
    t.requests.append(req(9, [1, 2, 3, 4], 16, 0))  # the first turn's prompt again
    kept = replay(t, 6, "lru", hints=whole("continuation:30"))
    ended = replay(t, 6, "lru", hints=whole("until-continued:30"))
    assert kept.prefix_hits == 8  # the 4 blocks, twice: still retained at 9 s
    assert ended.prefix_hits == 4  # retained up to the continuation at 5 s only


def test_until_continued_ends_the_retention_as_the_sidecar_does_shared_blocks_too() -> None:
    """The framework's ``Retain(keys, 0)`` for a turn that came back ends the retention of all its
    blocks, also of a shared prefix that another conversation's hint extended: the sidecar keeps
    one retention per block (kvstore/store/books/retention.py), and the replay does what it does."""
    t = Trace("common-prefix", [
        req(0, [1, 2, 3, 4], 16, 0),  # agent A: 4 full blocks, continued at 5 s
        req(1, [1, 2], 8, 16),  # agent C: A's first 2 blocks, retained to 31 s; continued at 20 s
        req(5, [1, 2, 3, 4, 5], 20, 0),  # A comes back: A's retention ends, on [1, 2] too
        *[req(6 + 0.1 * i, [100 + 2 * i, 101 + 2 * i], 8, 0) for i in range(8)],  # 16 other blocks
        req(20, [1, 2, 9, 10, 11, 12], 24, 0),  # C comes back
    ], BT)
    assert continuations(t)[:3] == [4, 2, 0]
    kept = replay(t, 6, "lru", hints=whole("continuation:30"))
    assert kept.prefix_hits == 2 + 4 + 2  # C finds [1, 2]; A its turn; C its turn, [1, 2]
    for kind in ("until-continued", "until-returned"):  # (one cache: the next turn's, the earlier one's)
        ended = replay(t, 6, "lru", hints=whole(f"{kind}:30"))
        assert ended.prefix_hits == 2 + 4, kind  # [1, 2] went with A's retention, unretained, before C came


@pytest.mark.parametrize("kind", ["until-continued", "until-returned"])
def test_a_turn_whose_next_turn_came_leaves_nothing_behind(kind: str) -> None:
    """What a hint that ends keeps per turn (its keys, the cache that served it) goes when the
    next turn ends the retention: a long trace's replay holds only the turns still awaited."""
    t = agent_trace(5.0)  # the first request is continued by the last; none other is continued
    hinting = Hinting(t, whole(f"{kind}:30"))
    retention = hinting.retention({DRAM: 6})
    for i, r in enumerate(t.requests):
        hinting.at(r, i)
        hinting.retain(retention, i, {}, index_keys(r), DRAM)
        if i == 0:
            assert list(hinting.held) == [0]  # awaiting its next turn
    assert hinting.held == {} and hinting.origin == {}


def test_the_cluster_replay_keeps_a_retained_turn_on_its_node() -> None:
    t = agent_trace(5.0)
    hints = whole("continuation:10")
    for mode in ("isolated", "cluster", "global"):
        plain = replay_cluster(t, 1, 6, mode, "round-robin", "lru")
        kept = replay_cluster(t, 1, 6, mode, "round-robin", "lru", hints=hints)
        assert (plain.prefix_hits, kept.prefix_hits) == (0, 4), mode


def test_until_continued_ends_the_retention_only_on_the_node_the_next_turn_reaches() -> None:
    """The next turn's ``Retain(keys, 0)`` reaches the sidecar that serves it: routed to another
    node, it ends nothing on the node that retained the earlier turn, whose copies keep their
    retention until it runs out (docs/architecture.md, "Retention hints")."""
    fill = [req(6 + 0.1 * i, [100 + 2 * i, 101 + 2 * i], 8, 0) for i in range(8)]  # 2 blocks each
    t = Trace("two-nodes", [
        req(0, [1, 2, 3, 4], 16, 0),  # A, on node 0: 4 full blocks, continued by B, retained to 30 s
        req(5, [1, 2, 3, 4, 5], 20, 0),  # B, A's next turn, on node 1 (round-robin)
        *[r for pair in zip(fill[::2], fill[1::2]) for r in pair],  # 4 prompts to each node
        req(10, [1, 2, 3, 4, 9], 20, 0),  # D, on node 0: A's prompt, another question
    ], BT)
    assert continuations(t)[:2] == [4, 0]
    kept = replay_cluster(t, 2, 6, "isolated", "round-robin", "lru", hints=whole("continuation:30"))
    ended = replay_cluster(t, 2, 6, "isolated", "round-robin", "lru", hints=whole("until-continued:30"))
    assert kept.prefix_hits == 4  # D finds A's blocks, kept on node 0 by A's retention
    assert ended.prefix_hits == 4  # B's Retain(keys, 0) went to node 1: node 0 kept them too
    returned = replay_cluster(t, 2, 6, "isolated", "round-robin", "lru", hints=whole("until-returned:30"))
    assert returned.prefix_hits == 0  # the framework's Retain(keys, 0) went to node 0, which served A


def test_the_json_has_hints_vs_none_per_policy(tmp_path, capsys) -> None:
    path = tmp_path / "agent.jsonl"
    agent_trace(5.0).to_jsonl(path)
    assert main(["replay", str(path), "--block-tokens", str(BT), "--capacity", "6", "--hints", "continuation:10",
                 "--retained-fraction", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for policy in ("lru", "credit"):
        r = out["policies"][policy]
        assert r["hints"]["hints"] == "continuation:10" and r["hints"]["retained_peak_blocks"] == 4
        assert r["hints_vs_none"] is None  # no hit at all without hints: no ratio
    assert main(["replay", str(path), "--block-tokens", str(BT), "--nodes", "2", "--capacity", "6",
                 "--hints", "continuation", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["policies"]["lru"]["hints_vs_none"]) == {"global", "round-robin", "prefix"}


@pytest.mark.parametrize("policy", ["lru", "credit"])
def test_a_retained_spare_copy_hands_its_retention_to_the_copy_left_in_the_cluster(policy: str) -> None:
    # 2 nodes x 3 blocks, round-robin (node 0: even requests, node 1: odd). Request 1 fetches 1, 2
    # from node 0 and retains its replicas (request 5 continues it); node 0's copies are not
    # retained. Request 3 needs a slot on node 1: its spare copy of 2 goes first (node 0 holds it
    # too). Request 4 needs a slot on node 0, where 2 is now the last copy: without the retention
    # handed on, the policy's victim is 2 and request 5 finds only block 1; with it, 10 goes instead.
    t = Trace("spare", [
        req(0.0, [1, 2], 8, 100),  # not continued: no later prompt holds its 108 tokens
        req(0.1, [1, 2], 8, 0),  # continued by request 5: retains 1, 2 on node 1
        req(0.2, [10], 4, 100),
        req(0.3, [20, 21], 8, 100),
        req(0.4, [30], 4, 100),
        req(0.5, [1, 2, 40], 12, 0),
    ], BT)
    hints = whole("continuation:10")
    plain = replay_cluster(t, 2, 3, "cluster", "round-robin", policy)
    kept = replay_cluster(t, 2, 3, "cluster", "round-robin", policy, hints=hints)
    assert (plain.prefix_hits, kept.prefix_hits) == (3, 4)
    assert kept.retained_peak == 2


@pytest.mark.parametrize("policy", ["lru", "credit"])
def test_spare_copies_go_in_the_policys_order_retained_or_not(policy: str) -> None:
    # 2 nodes x 3 blocks, round-robin. Node 1 fetches 1 (retained: request 7 continues request 1)
    # and then 2 from node 0: two spare copies, 1 the older. Request 5 needs a slot on node 1: the
    # policy's victim among spare copies is 1, retained or not (node 0 still holds it, and takes
    # its retention), so the hinted run evicts what the plain one does and request 7 finds 1 on
    # node 0, a peer hit, as without hints. (Kept by the soft pin among spare copies, 1 stayed
    # on node 1 and 2 went in its place: other blocks' hits moved and none gained, docs/eviction.md.)
    t = Trace("spares", [
        req(0.0, [1], 4, 100),
        req(0.1, [1], 4, 0),  # continued by request 7: retains its copy of 1 on node 1
        req(0.2, [2], 4, 100),
        req(0.3, [2], 4, 100),
        req(0.4, [60], 4, 100),
        req(0.5, [70, 71], 8, 100),
        req(0.6, [80], 4, 100),
        req(0.7, [1, 90], 8, 0),
    ], BT)
    plain = replay_cluster(t, 2, 3, "cluster", "round-robin", policy)
    kept = replay_cluster(t, 2, 3, "cluster", "round-robin", policy, hints=whole("continuation:10"))
    assert (plain.prefix_hits, plain.peer_hits) == (3, 3)
    assert (kept.prefix_hits, kept.peer_hits) == (3, 3)
