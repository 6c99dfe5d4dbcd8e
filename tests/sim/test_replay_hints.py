"""``kvstore replay --hints continuation[:SECONDS]`` (kvstore/sim/hints.py): which requests a later
one continues, and the replay keeping their blocks by the store's own soft pin
(kvstore/store/retention.py)."""

from __future__ import annotations

import json

import pytest

from kvstore.cli import main
from kvstore.errors import InvalidArgument
from kvstore.sim.cluster import replay_cluster
from kvstore.sim.hints import continuations, parse_hints
from kvstore.sim.replay import TierSpec, replay
from kvstore.sim.traces import Request, Trace
from kvstore.store.index import TierId

BT = 4  # tokens per block in these traces


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
    assert parse_hints("until-continued:5").until_continued and not parse_hints("continuation").until_continued
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
    kept = replay(t, 6, policy, hints=parse_hints("continuation:10"))
    lapsed = replay(t, 6, policy, hints=parse_hints("continuation:1"))  # ended before the others came
    assert plain.prefix_hits == 0
    assert kept.prefix_hits == 4 and kept.retained_peak == 4
    assert lapsed.prefix_hits == 0
    tiered = replay(t, [TierSpec(TierId.DRAM, 4), TierSpec(TierId.SSD, 6)], policy,
                    hints=parse_hints("continuation:10"))
    assert tiered.prefix_hits == 4 and tiered.tier_prefix_hits["ssd"] > 0  # demoted, and kept below


def test_until_continued_ends_the_retention_when_the_next_turn_arrives() -> None:
    t = agent_trace(5.0)
    t.requests[-1] = req(5.0, [1, 2, 3, 4, 5], 20, 8)  # the continuation; nothing continues it
    t.requests += [req(6 + 0.1 * i, [300 + 2 * i, 301 + 2 * i], 8, 0) for i in range(4)]  # 8 more blocks
    t.requests.append(req(9, [1, 2, 3, 4], 16, 0))  # the first turn's prompt again
    kept = replay(t, 6, "lru", hints=parse_hints("continuation:30"))
    ended = replay(t, 6, "lru", hints=parse_hints("until-continued:30"))
    assert kept.prefix_hits == 8  # the 4 blocks, twice: still retained at 9 s
    assert ended.prefix_hits == 4  # retained up to the continuation at 5 s only


def test_the_cluster_replay_keeps_a_retained_turn_on_its_node() -> None:
    t = agent_trace(5.0)
    hints = parse_hints("continuation:10")
    for mode in ("isolated", "cluster", "global"):
        plain = replay_cluster(t, 1, 6, mode, "round-robin", "lru")
        kept = replay_cluster(t, 1, 6, mode, "round-robin", "lru", hints=hints)
        assert (plain.prefix_hits, kept.prefix_hits) == (0, 4), mode


def test_the_json_has_hints_vs_none_per_policy(tmp_path, capsys) -> None:
    path = tmp_path / "agent.jsonl"
    agent_trace(5.0).to_jsonl(path)
    assert main(["replay", str(path), "--block-tokens", str(BT), "--capacity", "6", "--hints", "continuation:10",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for policy in ("lru", "credit"):
        r = out["policies"][policy]
        assert r["hints"]["hints"] == "continuation:10" and r["hints"]["retained_peak_blocks"] == 4
        assert r["hints_vs_none"] is None  # no hit at all without hints: no ratio
    assert main(["replay", str(path), "--block-tokens", str(BT), "--nodes", "2", "--capacity", "6",
                 "--hints", "continuation", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["policies"]["lru"]["hints_vs_none"]) == {"global", "round-robin", "prefix"}
