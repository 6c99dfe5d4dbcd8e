"""Smoke test: ``benchmarks.lookup`` runs end to end with tiny sizes and returns its JSON shape
(including the blocking client over both transports, each lookup beside an echo over the same
transport). No timed assertions."""

from __future__ import annotations

import argparse
import itertools
import json

from benchmarks import lookup


def test_lookup_bench_shape() -> None:
    p = argparse.ArgumentParser()
    lookup.add_arguments(p)
    argv = ["--keys", "64", "--chains", "2", "--calls", "48", "--idle-calls", "2", "--idle-ms", "5"]
    result = lookup.run(p.parse_args(argv))
    json.dumps(result)
    assert result["suite"] == "lookup"
    series = ["lookup", "echo", *(f"sync_{t}_{op}" for t in ("grpc", "local") for op in ("lookup", "echo"))]
    for name in (*series, "sync_grpc_lookup_idle", "sync_local_lookup_idle"):
        assert result["figures"][f"{name}_p50"]["unit"] == "ms" and result["figures"][f"{name}_p50"]["value"] > 0
    for name in series:  # every kind of request was sent in every series
        for kind in lookup.KINDS:
            assert result["figures"][f"{name}_{kind}_p50"]["value"] > 0
    ratios = ("lookup_p50_vs_echo", "lookup_local_p50_vs_echo", "lookup_sync_grpc_p50_vs_echo", "local_vs_grpc_p50",
              "local_vs_grpc_idle_p50", *(f"lookup_{k}_p50_vs_echo" for k in lookup.KINDS))
    for ratio in ratios:
        assert result["ratios"][ratio] > 0
    assert result["figures"]["distinct_requests"]["value"] == 6


def test_requests_differ_call_to_call_and_mix_hits_partial_hits_and_misses() -> None:
    """No request follows an identical one (the store counts a run touched twice in a row once,
    which would skip the policy update), and each kind's keys match what it promises."""
    reqs = lookup.Requests(8, 3)
    sent = reqs.cycle(4 * len(reqs.mix) + 1)
    assert all(a[1] != b[1] for a, b in itertools.pairwise(sent))
    assert len({tuple(keys) for _, keys in reqs.mix}) == len(reqs.mix) == 9
    stored = {k for chain in reqs.stored for k in chain}
    for kind, keys in reqs.mix:
        assert len(keys) == 8
        leading = next((i for i, k in enumerate(keys) if k not in stored), len(keys))
        assert leading == reqs.matched(kind) == {"full": 8, "partial": 4, "miss": 0}[kind]
        assert set(keys[leading:]).isdisjoint(stored)
