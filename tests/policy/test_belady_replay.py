"""Belady against brute force on tiny traces; the replay's LRU against an independent plain LRU."""

from __future__ import annotations

import gzip
import itertools
import json
import random
from collections import OrderedDict
from pathlib import Path

import pytest

from kvstore.errors import InvalidArgument
from kvstore.sim.belady import NEVER, belady, next_uses
from kvstore.sim.replay import replay
from kvstore.sim.traces import load_trace, parse_records

# Mooncake's traces, in the repository (gzip-compressed; source and licence in their README)
TRACES = Path(__file__).resolve().parents[2] / "data" / "traces"


def brute_best_block_hits(reqs: list[list[int]], cap: int) -> int:
    """Exhaustive optimum: after each request the cache is any subset (<= cap) of what it held
    plus that request's blocks."""
    best: dict[frozenset, int] = {frozenset(): 0}
    for keys in reqs:
        nxt: dict[frozenset, int] = {}
        for state, score in best.items():
            s = score + sum(1 for k in keys if k in state)
            pool = sorted(state | set(keys))
            for r in range(min(cap, len(pool)) + 1):
                for sub in itertools.combinations(pool, r):
                    f = frozenset(sub)
                    if nxt.get(f, -1) < s:
                        nxt[f] = s
        best = nxt
    return max(best.values())


def naive_belady(reqs: list[list[int]], cap: int) -> tuple[int, int]:
    """The same rule by linear scans, no heap."""
    nxt = next_uses(reqs)
    res: dict[int, int] = {}
    prefix = hits = p = 0
    for keys in reqs:
        lead = True
        for i, k in enumerate(keys):
            if k in res:
                hits += 1
                prefix += lead
                res[k] = nxt[p + i]
            else:
                lead = False
        for i, k in enumerate(keys):
            nu = nxt[p + i]
            if k in res or nu == NEVER:
                continue
            if len(res) >= cap:
                v = max(res, key=lambda x: res[x])
                if res[v] <= nu:
                    continue
                del res[v]
            res[k] = nu
        p += len(keys)
    return prefix, hits


def tiny_traces(n: int = 40):
    rng = random.Random(7)
    for _ in range(n):
        reqs = []
        for _ in range(rng.randint(2, 5)):
            stem = rng.choice([[1, 2, 3], [1, 4], [5, 6], [7]])
            reqs.append(stem[: rng.randint(1, len(stem))] + ([rng.randint(8, 10)] if rng.random() < 0.4 else []))
        yield reqs, rng.randint(1, 3)


def test_belady_block_hits_are_optimal() -> None:
    for reqs, cap in tiny_traces():
        assert belady(reqs, cap).block_hits == brute_best_block_hits(reqs, cap), (reqs, cap)


def test_belady_matches_naive_scan() -> None:
    for reqs, cap in tiny_traces(200):
        r = belady(reqs, cap)
        assert (r.prefix_hits, r.block_hits) == naive_belady(reqs, cap), (reqs, cap)


def test_belady_bypass() -> None:
    # cap 1: block 1 is used again soon, 2 never: 2 must not displace 1
    r = belady([[1], [2], [1]], 1)
    assert (r.prefix_hits, r.references) == (1, 3)


def plain_lru(reqs: list[tuple[int, ...]], cap: int) -> tuple[int, int]:
    """Independent leaves-first LRU over a prefix cache, in the store's call order: the hit run
    refreshed deepest first; victims popped for the new blocks (the oldest block without a
    resident child); commit: new blocks linked root first (to their parent when it is resident),
    then refreshed deepest first."""
    cache: OrderedDict[int, None] = OrderedDict()  # oldest first
    parent: dict[int, int | None] = {}
    kids: dict[int, int] = {}
    prefix = hits = 0
    for keys in reqs:
        n = 0
        while n < len(keys) and keys[n] in cache:
            n += 1
        prefix += n
        hits += n
        for k in reversed(keys[:n]):
            cache.move_to_end(k)
        new: list[tuple[int, int | None]] = []
        seen: set[int] = set()
        for i in range(n, len(keys)):
            k = keys[i]
            if k in cache or k in seen:
                hits += k in cache
                continue
            seen.add(k)
            if len(cache) + len(new) >= cap:
                if not cache:
                    continue
                v = next(x for x in cache if x not in kids)
                del cache[v]
                p = parent.pop(v)
                if p is not None:
                    kids[p] -= 1
                    if not kids[p]:
                        del kids[p]
            new.append((k, keys[i - 1] if i else None))
        for k, p in new:  # commit: root first
            if p is not None and p not in cache:
                p = None
            cache[k] = None
            parent[k] = p
            if p is not None:
                kids[p] = kids.get(p, 0) + 1
        for k, _ in reversed(new):
            cache.move_to_end(k)
    return prefix, hits


def test_replay_lru_matches_plain_lru_small() -> None:
    rng = random.Random(3)
    recs = []
    for t in range(600):
        stem = rng.randrange(12)
        ids = [stem] + [100 + 10 * stem + j for j in range(rng.randint(0, 4))]
        if rng.random() < 0.3:
            ids.append(1000 + t)  # a one-shot tail
        recs.append({"timestamp": t, "input_length": 512 * len(ids), "hash_ids": ids})
    trace = parse_records(recs, "tiny")
    for cap in (3, 10, 40):
        r = replay(trace, cap, "lru")
        assert (r.prefix_hits, r.block_hits) == plain_lru([q.keys for q in trace.requests], cap), cap


@pytest.mark.parametrize(
    ("name", "lru_ref", "bound_ref"), [("conversation", 0.195, 0.366), ("synthetic", 0.155, 0.396)]
)
def test_replay_lru_matches_plain_lru_on_mooncake(name: str, lru_ref: float, bound_ref: float) -> None:
    """The replay's LRU is exactly the independent leaves-first LRU above, and both sit on the
    published reference points (data/traces/README.md), read from the repository's copies."""
    trace = load_trace(TRACES / f"{name}_trace.jsonl.gz")
    assert trace.name == name
    cap = int(0.05 * trace.unique_blocks())
    r = replay(trace, cap, "lru")
    assert (r.prefix_hits, r.block_hits) == plain_lru([q.keys for q in trace.requests], cap)
    assert abs(r.prefix_hit_rate - lru_ref) < 0.002
    assert abs(belady([q.keys for q in trace.requests], cap).prefix_hit_rate - bound_ref) < 0.001


def _records_text(n: int = 50) -> str:
    return "".join(json.dumps({"timestamp": i, "input_length": 1500, "output_length": 1,
                               "hash_ids": [0, 1 + i % 3, 10 + i % 5]}) + "\n" for i in range(n))


def test_gzip_trace_reads_as_its_plain_text(tmp_path: Path) -> None:
    plain, packed = tmp_path / "t_trace.jsonl", tmp_path / "t_trace.jsonl.gz"
    plain.write_text(_records_text())
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    a, b = load_trace(plain), load_trace(packed)
    assert (a.name, b.name) == ("t", "t")
    assert a.requests == b.requests and len(a.requests) == 50


def test_broken_gzip_trace_is_a_clear_error(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl.gz"
    p.write_bytes(gzip.compress(_records_text().encode())[:-20])  # truncated
    with pytest.raises(InvalidArgument, match=r"t\.jsonl\.gz is not a readable gzip file"):
        load_trace(p)
    p.write_bytes(gzip.compress(b"\xff\xfe not text\n"))
    with pytest.raises(InvalidArgument, match=r"t\.jsonl\.gz is not UTF-8 text"):
        load_trace(p)


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_cli_json(tmp_path: Path, capsys: pytest.CaptureFixture[str], suffix: str) -> None:
    from kvstore.cli import main

    p = tmp_path / f"t{suffix}"
    data = _records_text().encode()
    p.write_bytes(gzip.compress(data) if suffix.endswith(".gz") else data)
    assert main(["replay", str(p), "--capacity", "4", "--policy", "lru", "--policy", "credit", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["capacity_blocks"] == 4 and set(out["policies"]) == {"lru", "credit"}
    assert 0 <= out["policies"]["lru"]["prefix_hit_rate"] <= out["belady"]["prefix_hit_rate"] + 1e-9
    assert {"trace", "unique_blocks", "references", "default_policy"} <= set(out)
