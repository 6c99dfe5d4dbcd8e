"""Cluster replay (kvstore/sim/cluster.py) and KV-aware ranking (kvstore/routing.py) on traces small
enough to follow by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstore.cli import main
from kvstore.routing import load_cap, rank
from kvstore.sim.cluster import compare, replay_cluster
from kvstore.sim.replay import replay
from kvstore.sim.traces import Request, Trace, multi_turn


def trace(*prompts: list[int]) -> Trace:
    return Trace("hand", [Request(i, tuple(keys), 512) for i, keys in enumerate(prompts)])


# Two nodes, round-robin, 3 blocks each. Node 0 serves requests 0 and 2, node 1 requests 1 and 3.
#   isolated: node 1 has never seen [1, 2] when request 1 comes: 0 + 0 + 2 + 2 = 4 prefix hits
#   cluster:  request 1 fetches 1, 2 from node 0 (2 peer hits):  0 + 2 + 2 + 2 = 6
#   global (one cache of 6 blocks): 0 + 2 + 2 + 2 = 6
SHARED = trace([1, 2, 3], [1, 2, 4], [1, 2, 5], [1, 2, 6])


@pytest.mark.parametrize("policy", ["lru", "credit"])
def test_shared_prefix_isolated_misses_cluster_hits(policy: str) -> None:
    iso = replay_cluster(SHARED, 2, 3, "isolated", "round-robin", policy)
    clu = replay_cluster(SHARED, 2, 3, "cluster", "round-robin", policy)
    glob = replay_cluster(SHARED, 2, 3, "global", policy=policy)
    assert (iso.references, iso.prefix_hits, iso.peer_hits) == (12, 4, 0)
    assert (clu.prefix_hits, clu.peer_hits, clu.replicas) == (6, 2, 2)
    assert (glob.prefix_hits, glob.capacity, glob.requests) == (6, 6, [4])
    assert iso.requests == clu.requests == [2, 2]


def test_eviction_drops_a_replica_before_a_last_copy() -> None:
    # 2 nodes x 2 blocks, round-robin. Request 2 puts a replica of block 2 on node 0 (beside block
    # 1, its only copy). Request 4 needs room on node 0: LRU alone would evict block 1 (older), the
    # cluster evicts the replica of 2, so request 5 still finds block 1 on node 0.
    t = trace([1], [2], [2], [9], [5], [1])
    clu = replay_cluster(t, 2, 2, "cluster", "round-robin", "lru")
    assert (clu.prefix_hits, clu.peer_hits) == (2, 2)
    no_preference = replay_cluster(t, 2, 2, "cluster", "round-robin", "lru", prefer_replicas=False)
    assert (no_preference.prefix_hits, no_preference.peer_hits) == (1, 1)


def test_cluster_ghost_carries_a_count_to_the_next_node() -> None:
    # 2 nodes x 2 blocks, round-robin (node 0: even requests, node 1: odd), one request a millisecond.
    # Block 1 is stored on node 0 and hit there (2 uses), then evicted from it (request 6). Request
    # 7 stores it again on node 1, which resumes its count from the cluster's ghost (3 with the
    # store itself). Request 9 hits 7 on node 1, so when request 11 needs room there, without the
    # count block 1 (older, 1 use) goes, and with it 7 goes: request 13 hits block 1 only with the
    # cluster's ghost, and only if the ghost still holds the count a millisecond after it was left.
    t = trace([1], [9], [1], [8], [2], [7], [3], [1], [4], [7], [5], [6], [10], [1])
    with_ghost = replay_cluster(t, 2, 2, "cluster", "round-robin", "credit")
    without = replay_cluster(t, 2, 2, "cluster", "round-robin", "credit", ghost_ttl_s=0)
    expired = replay_cluster(t, 2, 2, "cluster", "round-robin", "credit", ghost_ttl_s=0.001)
    assert (with_ghost.prefix_hits, without.prefix_hits, expired.prefix_hits) == (3, 2, 2)
    assert replay_cluster(t, 2, 2, "cluster", "round-robin", "credit", ghost_ttl_s=0.002).prefix_hits == 3
    lru = replay_cluster(t, 2, 2, "cluster", "round-robin", "lru")  # LRU keeps no count
    assert lru.prefix_hits == 2
    # isolated nodes share nothing, the ghost included
    assert replay_cluster(t, 2, 2, "isolated", "round-robin", "credit").prefix_hits == 2


def test_cluster_ghost_forgets_after_its_ttl() -> None:
    from kvstore.policy.ghost import GhostSpan
    from kvstore.sim.cluster import Directory

    d = Directory(ghost_ttl_s=1.0)  # a node that has not let go for long: the ceiling, 1 s
    d.spans.append(GhostSpan())
    d.let_go(b"a", 0, 2, entries=8)
    d.now_ms = 500
    d.let_go(b"b", 0, 3, entries=8)
    d.let_go(b"z", 0, 0, entries=8)  # 0 uses: nothing to keep
    d.let_go(b"y", 0, 2, entries=0)  # a space with no ghost (LRU): nothing to keep
    d.now_ms = 1000  # a's second is up
    assert (d.add(b"a", 0), d.add(b"b", 1)) == (0, 3)
    assert not d.ghost  # b was taken
    assert Directory().add(b"c", 0) == 0  # no ghost: nothing kept


def test_imbalance_is_busiest_over_mean() -> None:
    t = trace(*[[100 + i] for i in range(7)])
    run = replay_cluster(t, 3, 4, "isolated", "round-robin")
    assert run.requests == [3, 2, 2]
    assert run.imbalance == pytest.approx(3 / (7 / 3))
    assert run.to_json()["imbalance"] == round(9 / 7, 4)


def test_prefix_routing_follows_the_prefix() -> None:
    # 8 one-block fillers (4 per node), then a conversation: its first turn goes to node 0 (a tie:
    # the least loaded, lowest index), its second to node 0 again, where its prefix is. Round-robin
    # sends the second turn (request 9) to node 1, which never saw it.
    t = trace(*[[100 + i] for i in range(8)], [1, 2], [1, 2, 3])
    pre = replay_cluster(t, 2, 8, "isolated", "prefix")
    rr = replay_cluster(t, 2, 8, "isolated", "round-robin")
    assert pre.requests == [6, 4]
    assert (pre.prefix_hits, rr.prefix_hits) == (2, 0)


def test_tie_seed_draws_each_tie_at_random() -> None:
    # The trace above: every filler is a tie of score (nothing cached) and, at every other request,
    # of load. By index, node 0 takes each tie; with a seed, each tie is drawn, so which node takes
    # the conversation's first turn varies with the seed, but its second turn still follows its
    # prefix (2 hits under every draw), and a seed gives the same run again.
    t = trace(*[[100 + i] for i in range(8)], [1, 2], [1, 2, 3])
    assert replay_cluster(t, 2, 8, "cluster", "prefix").requests == [6, 4]
    runs = {s: replay_cluster(t, 2, 8, "cluster", "prefix", tie_seed=s) for s in range(8)}
    assert {r.prefix_hits for r in runs.values()} == {2}
    assert {tuple(r.requests) for r in runs.values()} == {(6, 4), (4, 6)}  # the conversation's node drawn
    assert all(replay_cluster(t, 2, 8, "cluster", "prefix", tie_seed=s).requests == r.requests
               for s, r in runs.items())


def test_prefix_routing_keeps_the_busiest_node_under_the_cap() -> None:
    # Every request shares one long prefix. Without the cap, the first node holds it and wins
    # every request; with it, requests spill to the others, which then hold the prefix too.
    t = trace(*[[1, 2, 3, 1000 + i] for i in range(200)])
    for mode in ("isolated", "cluster"):
        assert replay_cluster(t, 4, 64, mode, "prefix", max_imbalance=10.0).requests[0] == 200
        assert replay_cluster(t, 4, 64, mode, "prefix").imbalance <= 1.25


def test_rank_weighs_tiers_and_load() -> None:
    # node 1 holds 4 blocks in DRAM, node 0 the same 4 only through peers, node 2 nothing
    prefixes = [{"peer": 4}, {"dram": 4}, {"dram": 0}]
    assert rank(prefixes, [0, 0, 0]) == [1, 0, 2]
    # a tie goes to the least loaded node
    assert rank([{"dram": 1}, {"dram": 1}], [5, 3]) == [1, 0]
    # a tie of score and load goes to the lower index, or by ``tie``
    assert rank([{"dram": 1}, {"dram": 1}, {}], [3, 3, 3]) == [0, 1, 2]
    assert rank([{"dram": 1}, {"dram": 1}, {}], [3, 3, 3], tie=[0.9, 0.1, 0.5].__getitem__) == [1, 0, 2]
    # node 1 is at the cap (1.25 x the mean after this request): ranked last despite its prefix
    loads = [10, 14, 10]
    assert load_cap(loads) == pytest.approx(1.25 * 35 / 3)
    assert rank(prefixes, loads)[-1] == 1
    with pytest.raises(ValueError, match="unknown tier 'gpu'"):
        rank([{"gpu": 1}], [0])
    with pytest.raises(ValueError, match="2 prefixes for 1 loads"):
        rank([{}, {}], [0])


@pytest.mark.parametrize("policy", ["lru", "credit"])
def test_one_node_is_the_single_cache_replay(policy: str) -> None:
    # The cluster model of one node makes the store's calls in the store's order, as the
    # single-space replay does (victims popped at allocation, commit inserts root first, then
    # access_many deepest first): the same hits to the block. `credit` tells the orders apart (its
    # commit access is ordering, not a use); before the cluster replay followed it, one node
    # scored more than the single cache with `credit` (0.0615 vs 0.0567 on conversation at 1%).
    t = multi_turn(sessions=150, seed=5)
    cap = t.unique_blocks() // 20
    ref = replay(t, cap, policy)
    for mode in ("isolated", "cluster"):  # (the cluster's ghost off: it would outlast the node's own)
        run = replay_cluster(t, 1, cap, mode, "round-robin", policy, ghost_ttl_s=0)
        assert (run.prefix_hits, run.block_hits, run.references) == (ref.prefix_hits, ref.block_hits, ref.references)
    glob = replay_cluster(t, 4, cap // 4, "global", policy=policy)
    assert glob.prefix_hits == replay(t, 4 * (cap // 4), policy).prefix_hits


def test_compare_json_shape() -> None:
    out = compare(SHARED, 2, 3, ["round-robin", "random"], "lru")
    assert out["global"] == {"capacity_blocks": 6, "prefix_hit_rate": 0.5, "block_hit_rate": 0.5}
    rr = out["routing"]["round-robin"]  # type: ignore[index]  # compare() is typed dict[str, object]
    assert rr["isolated"] == {"prefix_hit_rate": round(4 / 12, 6), "block_hit_rate": round(4 / 12, 6),
                              "imbalance": 1.0, "requests_per_node": [2, 2]}
    assert rr["cluster"]["peer_hit_rate"] == round(2 / 12, 6)
    assert rr["cluster_vs_isolated"] == 1.5
    assert rr["cluster_vs_global"] == 1.0
    assert rr["imbalance"] == 1.0
    assert set(out["routing"]) == {"round-robin", "random"}  # type: ignore[arg-type]  # a dict, typed object


def test_command_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    SHARED.to_jsonl(path)
    assert main(["replay", str(path), "--nodes", "2", "--capacity", "3", "--policy", "lru", "--json",
                 "--routing", "round-robin", "--routing", "prefix"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out["nodes"], out["capacity_blocks"], out["unique_blocks"], out["references"]) == (2, 3, 6, 12)
    pol = out["policies"]["lru"]
    assert pol["global"]["prefix_hit_rate"] == 0.5
    assert list(pol["routing"]) == ["round-robin", "prefix"]
    assert pol["routing"]["round-robin"]["cluster_vs_isolated"] == 1.5
    assert out["tie_seed"] is None and out["ghost_ttl_s"] == 3600
    # the table, without --json
    assert main(["replay", str(path), "--nodes", "2", "--capacity", "3", "--policy", "lru"]) == 0
    assert "round-robin" in capsys.readouterr().out


def test_command_rejects_bad_cluster_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    SHARED.to_jsonl(path)
    assert main(["replay", str(path), "--nodes", "2", "--tier", "dram=3"]) == 2
    assert "--tier" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["replay", str(path), "--nodes", "0"])
    assert "nodes '0' must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["replay", str(path), "--nodes", "2", "--routing", "sticky"])
    assert main(["replay", str(path), "--nodes", "2", "--ghost-ttl", "-1"]) == 2
    assert "--ghost-ttl" in capsys.readouterr().err


def test_capacity_total_splits_the_capacity_over_the_nodes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    SHARED.to_jsonl(path)
    for flags, per_node, of in (([], 6, "node"), (["--capacity-total"], 3, "cluster")):
        assert main(["replay", str(path), "--nodes", "2", "--capacity", "6", "--policy", "lru", "--json", *flags]) == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        got = (out["capacity_blocks"], out["capacity_total_blocks"], out["capacity_of"])
        assert got == (per_node, 2 * per_node, of)
        assert out["policies"]["lru"]["global"]["capacity_blocks"] == 2 * per_node
    assert main(["replay", str(path), "--nodes", "4", "--capacity", "50%", "--capacity-total", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["capacity_blocks"] == 0  # 3 blocks over 4
    assert main(["replay", str(path), "--capacity", "6", "--capacity-total"]) == 2  # not without --nodes
    assert "--capacity-total" in capsys.readouterr().err
