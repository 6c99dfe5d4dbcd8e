"""vLLM (CPU) with KV connectors: TTFT and request throughput when a long prefix was evicted from
vLLM's own cache, or when another vLLM instance computed it -- no connector (recompute) vs kvstore
vs vLLM's ExampleConnector vs MooncakeStoreConnector.

    kvstore bench vllm [--json] [--docs 6] [--prefix-tokens 768] [--configs ...] [--no-mooncake]

One run, one model (a random-weight Llama built here), the same prompts for every
configuration. Every vLLM instance runs in its own process (in-process engine,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, and ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` for all of them, so no
configuration gets more cores than another). The configurations (``--configs``):

* ``none``: no connector (the reference outputs, and recompute);
* ``kvstore``, ``example``, ``mooncake``: one instance (``kv_both``) stores and reloads;
  kvstore's block directory is on (its default), so a reload of blocks this process stored or
  looked up needs no call to the sidecar;
* ``kvstore_nodir``: the same with the directory off (``directory=false``): every lookup is an
  ``Acquire`` round trip to the sidecar;
* ``kvstore_pd``, ``example_pd``, ``mooncake_pd``: prefill -> decode. A ``kv_producer`` instance
  runs ``store`` in its own process, then a ``kv_consumer`` instance in another process runs
  every other phase, loading what the first stored. kvstore's decode instance runs with its
  directory off: each of its hits asks the sidecar.
* ``kvstore_xhost``: prefill -> decode across hosts (:class:`~kvstore.harness.cross_host.CrossHost`, needs root): the
  prefill instance and its sidecar on test host A, the decode instance and its sidecar on host
  B (network namespaces, private /dev/shm), one cluster through a redis-server on the bridge
  (the directory only). The decode instance runs ``repeat`` first, so each of those requests
  finds its blocks only on A: B's sidecar fetches them over the peer data path. Without root it
  is left out and the reason noted.

Phases, per configuration:

1. ``store``: each document's prompt (long prefix + question) runs once, so connectors store it;
2. ``floor``: the same prompts again with the prefix in vLLM's own cache (local hits);
3. ``repeat``: before each prompt, vLLM's cache is filled with fresh prompts (a small
   ``num_gpu_blocks_override``), then the same prompt runs alone: its KV must come from the
   connector (or be recomputed). Local hits are confirmed 0 by ``vllm:prompt_tokens_by_source``;
4. ``prefix``: the same, with a new question behind each prefix (a prefix cache hits, vLLM's
   ExampleConnector, which matches whole prompts only, does not);
5. ``batch``: cache filled again, then every ``repeat`` prompt in one ``generate`` call;
   ``--batch-rounds`` times: requests/s is the median over the rounds.

Every instance runs ``store`` at start-up, alone. From ``floor`` on the configurations take
turns: one request (its eviction fill, the idle gap and the request) or one batch round each,
the order rotating every round, while the others wait, alive and idle. Run one after another,
the configurations saw different loads on a shared 2-core machine.

TTFT is ``RequestOutput.metrics.first_token_latency``. Every configuration's generated tokens are
compared with the no-connector run. Ratios (higher is better), for kvstore's configuration
against its peers in the same setting (none: ``kvstore``, ``_nodir``: ``kvstore_nodir`` against
``example``/``mooncake``, ``_pd``: ``kvstore_pd`` against ``example_pd``/``mooncake_pd``):
``ttft{,_nodir,_pd}_vs_best_peer`` = the best peer's p50 TTFT on hits / kvstore's,
``throughput{,_nodir,_pd}_vs_best_peer`` = kvstore's requests/s / the best peer's;
``outputs_match`` = 1.0 when every configuration's outputs equal the no-connector outputs;
``ttft_xhost_vs_recompute`` = the no-connector p50 TTFT of ``repeat`` / ``kvstore_xhost``'s p50
TTFT of its ``repeat`` hits (decode side, blocks fetched from the other host).

Each vLLM instance is :class:`kvstore.harness.instance.Instance` (a process of its own, running
a JSON spec's phases), ``kvstore_xhost``'s two hosts :class:`kvstore.harness.cross_host.CrossHost`:
the harness ``kvstore demo --cross-host`` and the vLLM tests use too.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstore.harness.cross_host import CrossHost
from kvstore.harness.instance import Instance, kvstore_config
from kvstore.harness.phases import thread_cpu_seconds
from kvstore.harness.servers import free_port

# --- the benchmark --------------------------------------------------------------------------------

PEERS = ("example", "mooncake")
# what is compared: kvstore's configuration, its peers in the same setting, the ratios' infix
GROUPS = (
    ("kvstore", PEERS, ""),  # one instance stores and reloads (kv_both), block directory on (the default)
    ("kvstore_nodir", PEERS, "_nodir"),  # the same with kvstore's block directory off
    ("kvstore_pd", tuple(f"{p}_pd" for p in PEERS), "_pd"),  # a prefill instance stores, a decode instance loads
)
CONFIGS = ("none", "kvstore", "kvstore_nodir", "example", "mooncake", "kvstore_pd", "example_pd", "mooncake_pd",
           "kvstore_xhost")
REQUIRED = ("none", "kvstore", "kvstore_nodir", "kvstore_pd")  # a failure of one of these fails the run
XHOST = "kvstore_xhost"  # prefill on one test host, decode on another (CrossHost; needs root)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--docs", type=int, default=6, help="documents (long shared prefixes)")
    p.add_argument("--prefix-tokens", type=int, default=768)
    p.add_argument("--question-tokens", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--num-blocks", type=int, default=64, help="vLLM's KV pool (num_gpu_blocks_override)")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--gap", type=float, default=0.3,
                   help="idle seconds before each measured request (after the eviction prompts), same for all")
    p.add_argument("--batch-rounds", type=int, default=9, help="batch phase rounds (throughput: their median)")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"configurations to run, comma-separated, of {', '.join(CONFIGS)} (none always runs)")
    p.add_argument("--no-mooncake", action="store_true", help="skip the MooncakeStoreConnector peer (both settings)")
    p.add_argument("--no-example", action="store_true", help="skip vLLM's ExampleConnector peer (both settings)")


def _prompts(args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(0)

    def toks(n: int) -> list[int]:
        out: list[int] = rng.integers(4, vocab, n).tolist()
        return out

    prefixes = [toks(args.prefix_tokens) for _ in range(args.docs)]
    repeat = [p + toks(args.question_tokens) for p in prefixes]
    prefix = [p + toks(args.question_tokens) for p in prefixes]
    return {"repeat": repeat, "prefix": prefix, "fill": lambda: evict_prompts(toks, args.num_blocks, args.block_size)}


def evict_prompts(toks: Any, num_blocks: int, block_size: int, length: int = 1000) -> list[list[int]]:
    """Fresh prompts that together need more blocks than vLLM's pool: running them evicts
    everything vLLM had cached (its free queue is LRU)."""
    n = -(-num_blocks * block_size // length) + 1
    return [toks(length) for _ in range(n)]


def _phases(args: argparse.Namespace, pr: dict[str, Any]) -> list[dict[str, Any]]:
    """What every configuration runs (the same token ids); each eviction uses fresh prompts.
    ``store`` runs at start-up; every later request (or batch round) is one turn, taken in
    rotation with the other configurations'."""
    mt, n, gap = args.max_tokens, args.docs, args.gap
    fill = pr["fill"]
    return [
        {"name": "store", "prompts": pr["repeat"], "max_tokens": mt, "stats": False},
        {"name": "floor", "prompts": pr["repeat"], "max_tokens": mt, "warm": True, "gap_s": gap, "paced": True},
        {"name": "repeat", "prompts": pr["repeat"], "max_tokens": mt, "evict": [fill() for _ in range(n)], "gap_s": gap,
         "paced": True},
        {"name": "prefix", "prompts": pr["prefix"], "max_tokens": mt, "evict": [fill() for _ in range(n)], "gap_s": gap,
         "paced": True},
        {"name": "batch", "prompts": pr["repeat"], "max_tokens": mt, "batch": True, "gap_s": gap, "paced": True,
         "evict": [fill() for _ in range(args.batch_rounds)]},
    ]


def _p50(xs: list[float]) -> float:
    from benchmarks.common import percentile

    return percentile(xs, 50) if xs else float("nan")


@dataclasses.dataclass(frozen=True)
class Config:
    """One configuration: the vLLM instance that is measured (``kv``: its ``kv_transfer_config``)
    and, for prefill -> decode, the prefill instance (``producer``) that runs the ``store`` phase
    in its own process first; the measured instance is then the decode instance, which runs every
    other phase (its vLLM cache never held the prompts' KV but what it loaded). The prefill
    instance stays alive, idle, until the end (Mooncake keeps blocks in its clients' segments)."""

    kv: dict[str, Any] | None
    producer: dict[str, Any] | None = None
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    prefix: tuple[str, ...] = ()  # the measured instance's command prefix (Instance)
    producer_prefix: tuple[str, ...] = ()
    first: str = ""  # a phase the measured instance runs first
    cpu_pids: tuple[int, ...] = ()  # sidecars whose CPU time counts in its turns; empty: the shared one

    def specs(self, base: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        """(the prefill instance's spec or None, the measured instance's spec)."""
        if self.producer is None:
            return None, {**base, "kv_transfer_config": self.kv}
        store = [ph for ph in base["phases"] if ph["name"] == "store"]
        rest = [ph for ph in base["phases"] if ph["name"] != "store"]
        rest.sort(key=lambda ph: ph["name"] != self.first)  # stable: the others keep their order
        return ({**base, "kv_transfer_config": self.producer, "phases": store},
                {**base, "kv_transfer_config": self.kv, "phases": rest})


def _configs(
    args: argparse.Namespace, url: str, work: Path, stack: contextlib.ExitStack, notes: dict[str, Any],
    rigs: dict[str, CrossHost] | None = None,
) -> dict[str, Config]:
    """The configurations asked for. Each has its own store: kvstore's its own namespace in the one
    sidecar (``model_id``), ExampleConnector's its own directory, Mooncake's its own master. The
    decode instance of ``kvstore_pd`` runs with its block directory off: every hit it takes asks
    the sidecar (blocks another process stored), never places its own earlier lookups taught it.
    ``kvstore_xhost`` has two sidecars of its own on two test hosts (:class:`CrossHost`, kept in
    ``rigs``): its prefill instance stores on host A, its decode instance (directory off) runs on
    host B and runs ``repeat`` first, so each of those requests finds its blocks only on A (peer
    fetch); its later phases find them in B's own DRAM (the fetched replicas)."""
    wanted = {c.strip() for c in args.configs.split(",") if c.strip()} | {"none"}
    unknown = sorted(wanted - set(CONFIGS))
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; known: {', '.join(CONFIGS)}")
    skip = {p for p, off in (("example", args.no_example), ("mooncake", args.no_mooncake)) if off}
    wanted = {c for c in wanted if c.removesuffix("_pd") not in skip}

    def kvstore(name: str, role: str, **extra: Any) -> dict[str, Any]:
        return kvstore_config(url, role, model_id=f"bench-{name}", **extra)

    def example(name: str, role: str) -> dict[str, Any]:
        (work / name).mkdir(exist_ok=True)
        return {"kv_connector": "ExampleConnector", "kv_role": role,
                "kv_connector_extra_config": {"shared_storage_path": str(work / name)}}

    def xhost(name: str) -> Config | None:
        try:
            rig = stack.enter_context(CrossHost(work / name))
        except Exception as exc:  # noqa: BLE001 - not root, no iproute2: noted, the rest runs
            notes[name] = f"cannot run: {exc}"
            return None
        if rigs is not None:
            rigs[name] = rig
        return Config(kvstore_config(rig.url(1), "kv_consumer", model_id=f"bench-{name}", directory=False),
                      kvstore_config(rig.url(0), "kv_producer", model_id=f"bench-{name}"),
                      prefix=tuple(rig.nsenter(1)), producer_prefix=tuple(rig.nsenter(0)), first="repeat",
                      cpu_pids=rig.pids)

    def mooncake(name: str, pd: bool) -> Config | None:
        peer = MooncakePeer(work / name)
        stack.callback(peer.close)
        if peer.error:
            notes[name] = peer.error
            return None
        if pd:
            return Config(peer.transfer_config("kv_consumer"), peer.transfer_config("kv_producer"), peer.env)
        return Config(peer.transfer_config("kv_both"), env=peer.env)

    makers: dict[str, Callable[[], Config | None]] = {
        "none": lambda: Config(None),
        "kvstore": lambda: Config(kvstore("kvstore", "kv_both")),
        "kvstore_nodir": lambda: Config(kvstore("kvstore_nodir", "kv_both", directory=False)),
        "example": lambda: Config(example("example", "kv_both")),
        "mooncake": lambda: mooncake("mooncake", pd=False),
        "kvstore_pd": lambda: Config(kvstore("kvstore_pd", "kv_consumer", directory=False),
                                     kvstore("kvstore_pd", "kv_producer")),
        "example_pd": lambda: Config(example("example_pd", "kv_consumer"), example("example_pd", "kv_producer")),
        "mooncake_pd": lambda: mooncake("mooncake_pd", pd=True),
        XHOST: lambda: xhost(XHOST),
    }
    configs = {name: makers[name]() for name in CONFIGS if name in wanted}
    return {name: c for name, c in configs.items() if c is not None}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.common import Result, sidecar_process
    from kvstore.harness.tiny_model import build_tiny_llama

    res = Result("vllm")
    work = Path(tempfile.mkdtemp(prefix="kvstore-bench-vllm-"))
    try:
        model = build_tiny_llama(
            work / "model", hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
            num_hidden_layers=args.layers, num_attention_heads=args.hidden_size // 32, num_key_value_heads=2,
            head_dim=32,
        )
        pr = _prompts(args, vocab=512)
        base = {"model": str(model), "block_size": args.block_size, "num_blocks": args.num_blocks,
                "max_model_len": 1024, "dtype": "float32", "phases": _phases(args, pr)}
        with sidecar_process(1 << 30) as sc, contextlib.ExitStack() as stack:
            rigs: dict[str, CrossHost] = {}
            configs = _configs(args, sc.grpc, work, stack, res.notes, rigs)
            results = _run_interleaved(base, configs, res.notes, sidecar_pid=sc.proc.pid)
            for name, rig in rigs.items():  # where the decode host's blocks came from
                res.notes[f"{name}_cluster"] = {"prefill_host": rig.cluster(0), "decode_host": rig.cluster(1)}
        _summarise(res, results, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return res.as_dict()


def cpu_seconds(pid: int) -> float:
    """CPU time of process ``pid`` so far, all its threads; 0 where that cannot be read."""
    return sum(thread_cpu_seconds(pid).values())


def _run_interleaved(
    base: dict[str, Any], configs: dict[str, Config], notes: dict[str, Any], sidecar_pid: int = 0,
) -> dict[str, dict[str, Any]]:
    """Every configuration's instances start one after another (a prefill instance runs ``store``
    before its decode instance starts; a kv_both instance runs ``store`` itself); then the
    measured instances take turns, one request (or batch round) each, the order rotating every
    round, until all are done; shutdowns come only after that. A peer that fails is noted; the
    no-connector run and kvstore's must succeed. The sidecar's CPU time during each turn is kept
    (``sidecar_cpu_s``, one entry per turn): work a kvstore configuration has done outside vLLM."""
    timeout = 900.0
    with contextlib.ExitStack() as stack:
        live: dict[str, Instance] = {}
        producers: dict[str, Instance] = {}
        for name, config in configs.items():
            producer, measured = config.specs(base)
            if producer is not None:
                prod = stack.enter_context(Instance(producer, env=config.env, paced=True,
                                                    prefix=config.producer_prefix))
                if prod.signal(timeout) != b"D":
                    _failed(f"{name} (prefill instance)", prod, timeout, notes)
                    continue
                producers[name] = prod
            inst = stack.enter_context(Instance(measured, env=config.env, paced=True, prefix=config.prefix))
            if inst.signal(timeout) == b"R":
                live[name] = inst
            else:
                _failed(name, inst, timeout, notes)
        done: dict[str, Instance] = {}
        sidecar_cpu: dict[str, list[float]] = {name: [] for name in live}
        pids = {name: configs[name].cpu_pids or (sidecar_pid,) for name in live}
        r = 0
        while live:
            order = list(live)
            for name in order[r % len(order):] + order[: r % len(order)]:
                cpu = sum(cpu_seconds(p) for p in pids[name])
                said = live[name].turn(timeout)
                sidecar_cpu[name].append(sum(cpu_seconds(p) for p in pids[name]) - cpu)
                if said == b"D":
                    done[name] = live.pop(name)
                elif said != b"R":
                    _failed(name, live.pop(name), timeout, notes)
            r += 1
        results = {}
        for name, inst in done.items():
            try:
                results[name] = {**inst.result(timeout), "sidecar_cpu_s": sidecar_cpu[name]}
                if name in producers:
                    results[name]["producer"] = producers[name].result(timeout)
            except RuntimeError as exc:
                if name in REQUIRED:
                    raise
                notes[name] = f"failed to run: {str(exc)[-1500:]}"
                results.pop(name, None)
        return results


def _failed(name: str, inst: Instance, timeout: float, notes: dict[str, Any]) -> None:
    try:
        inst.result(timeout)
        why = "stopped answering"
    except RuntimeError as exc:
        why = str(exc)[-1500:]
    if name.split(" ")[0] in REQUIRED:
        raise RuntimeError(f"{name}: {why}")
    notes[name.split(" ")[0]] = f"failed to run: {why}"


def _phase(r: dict[str, Any], phase: str) -> dict[str, Any]:
    """A configuration's phase: ``store`` from its prefill instance when it has one."""
    source = r["producer"] if phase == "store" and "producer" in r else r
    ph: dict[str, Any] = source["phases"][phase]
    return ph


def _hit_ttfts(r: dict[str, Any], phase: str) -> list[float]:
    """TTFTs of the phase's requests that loaded KV from the connector."""
    return [q["ttft_s"] for q in _phase(r, phase)["requests"]
            if q["ttft_s"] is not None and q.get("by_source", {}).get("external_kv_transfer", 0) > 0]


def _hooks_p50(samples: list[dict[str, float]]) -> dict[str, float]:
    """Per hook and in total (``all``), the median over ``samples`` of milliseconds per hook."""
    names = sorted({k for x in samples for k in x})
    out = {k: round(_p50([x.get(k, 0.0) for x in samples]), 3) for k in names}
    return {**out, "all": round(_p50([sum(x.values()) for x in samples]), 3)} if samples else {}


def _summarise(res: Any, results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    ref = results["none"]
    match_all = True
    rps: dict[str, float] = {}
    ttfts: dict[str, dict[str, float]] = {}  # config -> phase -> p50 of all its requests
    for name, r in results.items():
        ttfts[name] = {}
        for phase in ("floor", "repeat", "prefix"):
            ttfts[name][phase] = _p50([q["ttft_s"] for q in _phase(r, phase)["requests"] if q["ttft_s"] is not None])
            res.figure(f"{name}_ttft_{phase}_p50", ttfts[name][phase] * 1e3, "ms")
        store = _phase(r, "store")
        res.figure(f"{name}_store_throughput", len(store["requests"]) / store["wall_s"], "req/s")
        batch = _phase(r, "batch")
        per_round = len(batch["requests"]) // len(batch["round_wall_s"])
        rounds = [per_round / w for w in batch["round_wall_s"]]
        rps[name] = _p50(rounds)
        res.notes[f"{name}_batch_rounds_rps"] = [round(x, 1) for x in rounds]
        res.figure(f"{name}_batch_throughput", rps[name], "req/s")
        for phase in ("repeat", "prefix"):
            reqs = _phase(r, phase)["requests"]
            ext = sum(q.get("by_source", {}).get("external_kv_transfer", 0) for q in reqs)
            local = sum(q.get("by_source", {}).get("local_cache_hit", 0) for q in reqs)
            res.notes[f"{name}_{phase}_tokens"] = {"external": ext, "local_hits": local}
        res.notes[f"{name}_batch_tokens"] = dict(batch["by_source"])
        if name != "none":  # time in the connector's hooks, p50 per request / per batch round
            repeat = _phase(r, "repeat")["requests"]
            res.notes[f"{name}_repeat_connector_ms"] = _hooks_p50([q["connector_ms"] for q in repeat])
            res.notes[f"{name}_batch_connector_ms"] = _hooks_p50(batch["round_connector_ms"])
        # CPU per batch round (p50): the vLLM instance's own, and the sidecar's during that turn
        # (its fill included; the sidecar is shared, so it also shows background work of others)
        res.notes[f"{name}_batch_cpu_ms"] = round(_p50(batch["round_cpu_s"]) * 1e3, 2)
        res.notes[f"{name}_batch_phase_thread_cpu_ms"] = {k: round(v * 1e3, 1) for k, v in batch["thread_cpu_s"].items()
                                                           if v >= 1e-3}
        turns = r.get("sidecar_cpu_s", [])[-len(batch["round_wall_s"]):]
        res.notes[f"{name}_batch_turn_sidecar_cpu_ms"] = round(_p50(turns) * 1e3, 2) if turns else None
        matches = all(
            [q["tokens"] for q in _phase(r, p)["requests"]] == [q["tokens"] for q in _phase(ref, p)["requests"]]
            for p in ("store", "floor", "repeat", "prefix", "batch")
        )
        res.notes[f"{name}_outputs_match"] = matches
        match_all = match_all and matches
        if name != "none":
            n_hits, n_reqs = len(_hit_ttfts(r, "repeat")), len(_phase(r, "repeat")["requests"])
            res.notes[f"{name}_repeat_requests_with_hits"] = f"{n_hits}/{n_reqs}"
        for role, rr in (("", r), ("_prefill", r.get("producer"))):
            if rr and rr.get("connector"):
                res.notes[f"{name}{role}_connector_stats"] = rr["connector"]
        res.notes[f"{name}_startup_s"] = round(r["startup_s"], 2)
    for ours, peers, infix in GROUPS:
        if ours in results:
            _compare(res, results, rps, ttfts, ours, [p for p in peers if p in results], infix)
    if "kvstore" in results:
        hits = _hit_ttfts(results["kvstore"], "repeat")
        res.ratio("ttft_vs_recompute", ttfts["none"]["repeat"] / (_p50(hits) if hits else float("nan")))
        res.ratio("throughput_vs_recompute", rps["kvstore"] / rps["none"])
    if XHOST in results:  # the decode host's repeat requests: every block fetched from the prefill host
        hits = _hit_ttfts(results[XHOST], "repeat")
        res.figure(f"{XHOST}_ttft_repeat_hits_p50", _p50(hits) * 1e3 if hits else float("nan"), "ms")
        res.ratio("ttft_xhost_vs_recompute", ttfts["none"]["repeat"] / (_p50(hits) if hits else float("nan")))
        if "kvstore_pd" in results and hits:
            pd = _hit_ttfts(results["kvstore_pd"], "repeat")
            res.ratio("ttft_xhost_vs_pd", _p50(pd) / _p50(hits) if pd else float("nan"))
    res.ratio("outputs_match", 1.0 if match_all else 0.0)
    res.notes["configs_run"] = list(results)
    res.notes["setup"] = (f"{args.docs} docs x {args.prefix_tokens}-token prefix + {args.question_tokens}-token "
                          "question, "
                          f"{args.max_tokens} new tokens, block {args.block_size}, vLLM pool {args.num_blocks} blocks, "
                          f"tiny Llama hidden {args.hidden_size} x {args.layers} layers fp32, in-process engine, "
                          f"VLLM_CPU_NUM_OF_RESERVED_CPU=1 everywhere, every request and batch round interleaved "
                          f"across configurations, batch throughput the median of {args.batch_rounds} rounds; "
                          f"*_pd: a kv_producer instance stores, a kv_consumer instance in its own process loads; "
                          f"{XHOST}: the same on two test hosts (network namespaces, private /dev/shm), one sidecar "
                          "each, one cluster (directory in a redis-server on the bridge), the decode host's "
                          "repeat phase first: its blocks come from the prefill host by peer fetch")


def _compare(res: Any, results: dict[str, dict[str, Any]], rps: dict[str, float], ttfts: dict[str, dict[str, float]],
             ours: str, peers: list[str], infix: str) -> None:
    """kvstore's configuration ``ours`` against the best of ``peers`` (higher is better):
    ``ttft{infix}_vs_best_peer`` = the best peer's p50 TTFT of hits in ``repeat`` / ours,
    ``throughput{infix}_vs_best_peer`` = our batch requests/s / the best peer's,
    ``ttft_prefix{infix}_vs_best_peer`` (a shared prefix under a new question: prefix caches only),
    ``ttft_over_floor{infix}_vs_best_peer`` (TTFT above the same instance's floor, the prefix in
    vLLM's own cache: what the connector adds)."""
    if not peers:
        return
    for phase, label in (("repeat", "ttft"), ("prefix", "ttft_prefix")):
        hits = {n: _p50(h) for n in [ours, *peers] if (h := _hit_ttfts(results[n], phase))}
        peer_hits = [v for n, v in hits.items() if n != ours]
        if ours in hits and peer_hits:
            res.ratio(f"{label}{infix}_vs_best_peer", min(peer_hits) / hits[ours])
    over = {n: max(ttfts[n]["repeat"] - ttfts[n]["floor"], 1e-4)
            for n in [ours, *peers] if _hit_ttfts(results[n], "repeat")}
    if ours in over and len(over) > 1:
        res.ratio(f"ttft_over_floor{infix}_vs_best_peer", min(v for n, v in over.items() if n != ours) / over[ours])
    res.ratio(f"throughput{infix}_vs_best_peer", rps[ours] / max(rps[n] for n in peers))
    res.notes[f"peers{infix}"] = peers


# --- the Mooncake peer ----------------------------------------------------------------------------


class MooncakePeer:
    """A local ``mooncake_master`` (RPC + HTTP metadata server on loopback, TCP transport) and the
    environment for vLLM's MooncakeStoreConnector (:meth:`transfer_config`); ``error`` says why not."""

    def __init__(self, work: Path) -> None:
        self.error = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self.env: dict[str, str] = {}
        try:
            import importlib.util

            if importlib.util.find_spec("mooncake") is None:
                raise RuntimeError(
                    "python package mooncake (pip install mooncake-transfer-engine-non-cuda) is not installed"
                )
            master = shutil.which("mooncake_master")
            if master is None:
                raise RuntimeError("mooncake_master is not on PATH")
            work.mkdir(parents=True, exist_ok=True)
            rpc, http, metrics = free_port(), free_port(), free_port()
            self.log = open(work / "mooncake_master.log", "wb")  # noqa: SIM115 - closed in close()
            self.proc = subprocess.Popen(
                [master, f"--rpc_port={rpc}", "--rpc_address=127.0.0.1", "--enable_http_metadata_server=true",
                 "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={http}",
                 f"--metrics_port={metrics}"],
                stdout=self.log, stderr=subprocess.STDOUT)
            _wait_port(http, self.proc, work / "mooncake_master.log")
            _wait_port(rpc, self.proc, work / "mooncake_master.log")
            config = {"metadata_server": f"http://127.0.0.1:{http}/metadata",
                      "master_server_address": f"127.0.0.1:{rpc}", "protocol": "tcp", "device_name": "",
                      "global_segment_size": "512MB", "local_buffer_size": "256MB"}
            (work / "mooncake.json").write_text(json.dumps(config))
            self.env = {"MOONCAKE_CONFIG_PATH": str(work / "mooncake.json"), "VLLM_HOST_IP": "127.0.0.1"}
        except Exception as exc:  # noqa: BLE001 - reported in the benchmark's notes
            self.error = f"{type(exc).__name__}: {exc}"
            self.close()

    @staticmethod
    def transfer_config(role: str) -> dict[str, Any]:
        """``kv_transfer_config`` for an instance in ``role`` (default extra config: asynchronous loads)."""
        return {"kv_connector": "MooncakeStoreConnector", "kv_role": role, "kv_connector_extra_config": {}}

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _wait_port(port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited {proc.returncode}: {log.read_text()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"mooncake_master: port {port} not open after {timeout}s")


def main(argv: list[str] | None = None) -> None:
    if argv is None:
        argv = sys.argv[1:]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    print(json.dumps(run(p.parse_args(argv)), indent=2))


if __name__ == "__main__":
    main()
