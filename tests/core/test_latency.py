"""Latency histograms (kvstore/stats/latency.py): the buckets and percentiles, and every RPC
timed by transport, method and outcome through a real sidecar, on /stats and /metrics."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.client import KVStoreClient
from kvstore.commands.stats import render, seconds
from kvstore.keys import Namespace, prefix_keys
from kvstore.server.sidecar import Sidecar
from kvstore.stats.latency import BOUNDS_S, FAMILIES, Histogram, Latencies, quantile
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.conftest import small_config


def test_buckets_run_from_50_us_to_10_s_and_a_bound_belongs_to_its_own_bucket():
    assert BOUNDS_S[0] == 50e-6 and BOUNDS_S[-1] == 10.0 and list(BOUNDS_S) == sorted(BOUNDS_S)
    h = Histogram()
    for s in (0.0, 50e-6, 50.1e-6, 1e-3, 10.0, 10.5):
        h.observe(s)
    assert h.counts[0] == 2  # 0 and exactly 50 µs: le="5e-05"
    assert h.counts[1] == 1 and h.counts[BOUNDS_S.index(1e-3)] == 1
    assert h.counts[-2] == 1 and h.counts[-1] == 1  # 10 s: le="10"; past it: +Inf
    assert h.sum == pytest.approx(0.0 + 50e-6 + 50.1e-6 + 1e-3 + 10.0 + 10.5)


def test_quantiles_are_histogram_quantiles():
    counts = [0] * (len(BOUNDS_S) + 1)
    assert quantile(counts, 0.5) == 0.0
    counts[BOUNDS_S.index(2e-3)] = 100  # all in (1 ms, 2 ms]
    assert quantile(counts, 0.5) == pytest.approx(1.5e-3)
    assert quantile(counts, 0.99) == pytest.approx(1.99e-3)
    counts[0] = 100  # half of them in [0, 50 µs]
    assert quantile(counts, 0.25) == pytest.approx(25e-6)
    assert quantile(counts, 0.5) == pytest.approx(50e-6)
    counts[-1] = 1000  # most past 10 s: the highest finite bound, as Prometheus says
    assert quantile(counts, 0.99) == 10.0


def test_a_series_has_its_familys_labels():
    lat = Latencies()
    with pytest.raises(ValueError, match="rpc"):
        lat.histogram("rpc", ("grpc", "Lookup"))
    with pytest.raises(ValueError, match="promotion"):
        lat.histogram("promotion", ("ssd",))  # (tier, outcome): every call is timed, a failed one too
    lat.histogram("promotion", ("ssd", "ok")).observe(0.003)
    [row] = lat.snapshot()["promotion"]
    assert row["tier"] == "ssd" and row["outcome"] == "ok"
    assert row["count"] == 1 and row["buckets"][BOUNDS_S.index(5e-3)] == 1
    assert set(lat.snapshot()) == {"bounds_s", *FAMILIES}


def test_the_directory_familys_help_names_every_op_the_operations_guide_lists():
    """/metrics' HELP line of ``kvstore_directory_duration_seconds`` and docs/operations.md's
    table of latency families name the same round trips (op="forget_members" was in the guide
    only: a scrape's reader could not tell what it was)."""
    guide = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    [row] = [line for line in guide.splitlines() if line.strip().startswith("| `directory` | `op` (")]
    listed = re.findall(r"`(\w+)`", row.split("`op` (", 1)[1].split(")", 1)[0])
    assert "heartbeat" in listed and "forget_members" in listed
    helped = set(re.findall(r"\w+", FAMILIES["directory"][1]))
    assert [op for op in listed if op not in helped] == []


NS = Namespace(model="tiny-llama", kv_layout="raw", dtype="float16", block_size=16)


def rpc_rows(doc: dict) -> dict[tuple[str, str, str], dict]:
    return {(r["transport"], r["method"], r["outcome"]): r for r in doc["latency"]["rpc"]}


def scrape(http_port: int) -> dict[str, dict[tuple, float]]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics").read().decode()
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


async def test_every_rpc_is_timed_by_transport_method_and_outcome(tmp_path):
    keys = prefix_keys(NS, list(range(3 * NS.block_size)))
    data = [np.full(4096, i, dtype=np.uint8).tobytes() for i in range(3)]
    async with Sidecar(small_config(tmp_path)) as sc:
        async with KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}", local=False) as c:
            await c.put_blocks(NS, keys, data)
            for _ in range(5):
                await c.lookup(NS, keys)
        async with KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:  # the local socket
            await c.lookup(NS, keys)
            assert c.transport == "local"
            await c.lookup(NS, keys)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sc.grpc_port}") as ch:
            stub = pb_grpc.KVStoreStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Commit(pb.CommitRequest())  # no allocation_id
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            await stub.Echo(pb.EchoRequest(payload=b"x"))
        doc = sc.store.snapshot()
        rows = rpc_rows(doc)
        assert rows[("grpc", "Lookup", "ok")]["count"] == 5
        assert rows[("local", "Lookup", "ok")]["count"] == 2
        assert rows[("grpc", "Allocate", "ok")]["count"] == rows[("grpc", "Commit", "ok")]["count"] == 1
        assert rows[("grpc", "Commit", "INVALID_ARGUMENT")]["count"] == 1
        assert not any(m == "Echo" for _, m, _ in rows)  # the benchmarks' baseline: not timed
        look = rows[("grpc", "Lookup", "ok")]
        assert sum(look["buckets"]) == 5 and 0 < look["p50_s"] <= look["p99_s"] <= 10.0
        assert look["sum_s"] > 0

        m = await asyncio.to_thread(scrape, sc.http_port)  # (the sidecar serves on this loop)
        key = (("method", "Lookup"), ("outcome", "ok"), ("transport", "grpc"))
        assert m["kvstore_rpc_duration_seconds_count"][key] == 5
        assert m["kvstore_rpc_duration_seconds_bucket"][(("le", "+Inf"), *key)] == 5
        buckets = sorted(
            (float(dict(k)["le"]), v)
            for k, v in m["kvstore_rpc_duration_seconds_bucket"].items()
            if dict(k)["method"] == "Lookup" and dict(k)["transport"] == "grpc"
        )
        assert [le for le, _ in buckets] == [*BOUNDS_S, float("inf")]
        assert [v for _, v in buckets] == sorted(v for _, v in buckets)  # cumulative
        bad = (("method", "Commit"), ("outcome", "INVALID_ARGUMENT"), ("transport", "grpc"))
        assert m["kvstore_rpc_duration_seconds_count"][bad] == 1

        shown = render(doc).splitlines()  # `kvstore stats`
        line = next(x for x in shown if x.startswith("rpc") and "grpc Lookup ok" in x)
        assert line.split()[-5:] == ["5", *seconds(look["p50_s"]).split(), *seconds(look["p99_s"]).split()]


def test_latencies_are_shown_in_us_ms_and_s():
    assert [seconds(x) for x in (25e-6, 999.4e-6, 1.5e-3, 0.25, 3.0)] == [
        "25.0 µs",
        "999 µs",
        "1.50 ms",
        "250 ms",
        "3.00 s",
    ]


def test_a_tie_rounds_up_as_the_pages_javascript_does():
    """The dashboard page writes latencies with JavaScript's toFixed (a tie goes to the larger
    number) and the browser test compares them with `kvstore stats`: 162.5 µs is "163 µs" in both
    (Python's format alone wrote "162 µs": the fresh-clone run's failure)."""
    assert [seconds(x) for x in (162.5e-6, 0.0125, 2.5)] == ["163 µs", "12.5 ms", "2.50 s"]
    assert seconds(0.5e-6 * 325) == "163 µs"
