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
* ``kvstore_xhost``: prefill -> decode across hosts (:class:`CrossHost`, needs root): the
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

The same module runs one vLLM instance from a JSON spec (``python -m benchmarks.vllm --instance
SPEC``); the vLLM tests use it too (:func:`run_instance`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from kvstore.testing.servers import free_port
from kvstore.util.tuning import ENV as MALLOC_ENV

REPO = Path(__file__).resolve().parents[1]

VLLM_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
    **MALLOC_ENV,
}


# --- one vLLM instance (child process) ----------------------------------------------------------


def kvstore_config(url: str, role: str = "kv_both", **extra: Any) -> dict[str, Any]:
    """``kv_transfer_config`` for the kvstore connector."""
    return {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "connector.vllm", "kv_role": role,
            "kv_connector_extra_config": {"url": url, **extra}}


def run_instance(
    spec: dict[str, Any], *, env: dict[str, str] | None = None, timeout: float = 600, prefix: Sequence[str] = (),
) -> dict[str, Any]:
    """Run one vLLM instance in a fresh process (see :func:`instance_main`); returns its results."""
    with Instance(spec, env=env, prefix=prefix) as inst:
        return inst.result(timeout)


class Instance:
    """One vLLM instance in its own process. With ``paced``, each request or batch round of its
    ``paced`` phases waits for :meth:`turn` (one byte each way on a pair of pipes): ``R`` = ready
    for the next, ``G`` = go, ``D`` = all its phases are done (the next ``G`` lets it shut down:
    :meth:`result`). ``prefix``: the command line starts with it, e.g. ``["nsenter", "-t", PID,
    "-m", "-n"]`` to run the instance on a test host, in its sidecar's namespaces
    (:meth:`CrossHost.nsenter`)."""

    def __init__(
        self, spec: dict[str, Any], *, env: dict[str, str] | None = None, paced: bool = False,
        prefix: Sequence[str] = (),
    ) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="kvstore-vllm-")
        path = Path(self._dir.name) / "spec.json"
        self.out = Path(self._dir.name) / "out.json"
        self.log = Path(self._dir.name) / "log.txt"
        fds: tuple[int, ...] = ()
        self._go: int | None = None
        if paced:
            go_r, self._go = os.pipe()
            self._ready, ready_w = os.pipe()
            spec = {**spec, "pace": {"in": go_r, "out": ready_w}}
            fds = (go_r, ready_w)
        path.write_text(json.dumps({**spec, "out": str(self.out)}))
        pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [*prefix, sys.executable, "-m", "benchmarks.vllm", "--instance", str(path)], cwd=REPO, pass_fds=fds,
                env={**os.environ, **VLLM_ENV, "PYTHONPATH": pythonpath, **(env or {})}, stdout=log,
                stderr=subprocess.STDOUT,
            )
        for fd in fds:
            os.close(fd)  # the child's ends

    def signal(self, timeout: float) -> bytes:
        """The instance's next byte (``R`` or ``D``); b"" if it exited or fell silent."""
        ready, _, _ = select.select([self._ready], [], [], timeout)
        return os.read(self._ready, 1) if ready else b""

    def go(self) -> None:
        """Let it run its next request (or batch round), without waiting: :meth:`signal` says
        when it is done."""
        assert self._go is not None, "not a paced instance"
        os.write(self._go, b"G")

    def turn(self, timeout: float) -> bytes:
        """Let it run one request or batch round; returns what it says afterwards."""
        self.go()
        return self.signal(timeout)

    def result(self, timeout: float) -> dict[str, Any]:
        if self._go is not None:
            with contextlib.suppress(OSError):  # a paced instance waits for leave to shut down
                os.write(self._go, b"G")
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        log = self.log.read_text(errors="replace")
        if code != 0 or not self.out.exists():
            raise RuntimeError(f"vLLM instance exited {code}:\n{log[-6000:]}")
        return {**json.loads(self.out.read_text()), "log": log}

    def __enter__(self) -> Instance:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self._go is not None:
            os.close(self._go)
            os.close(self._ready)
        self._dir.cleanup()


class CrossHost:
    """Two separate hosts on this machine, one sidecar each, one cache: the cross-host P/D rig.

    Two network namespaces with private ``/dev/shm`` on a bridge (:class:`kvstore.testing.hosts.Hosts`),
    a ``kvstore serve`` on each (its own TOML config, gRPC/HTTP/peer ports on its host's address),
    forming one cluster through a ``redis-server`` on the bridge (the directory). With
    ``redis_tier="redis"``, that redis-server is also a Redis tier both sidecars write through to
    (``tiering.write_through = ["redis"]``); with ``redis_tier="cluster"`` a 3-master Redis Cluster on
    the bridge is both the directory and that shared tier; with ``None`` blocks move between the
    hosts only by peer fetch. A vLLM instance runs on host ``i`` with ``Instance(..., prefix=rig.nsenter(i))`` and
    reaches its sidecar at :meth:`url`. Needs root (namespaces); raises RuntimeError saying why not."""

    TOKEN = "kvstore-cross-host"

    def __init__(self, work: Path, *, redis_tier: Literal["redis", "cluster"] | None = None,
                 dram_bytes: int = 256 << 20, lease_ms: int = 3000, heartbeat_ms: int = 500) -> None:
        from kvstore.testing.hosts import Hosts
        from kvstore.testing.servers import RedisCluster, RedisServer, redis_cluster, redis_server

        self._stack = contextlib.ExitStack()
        self.work = work
        work.mkdir(parents=True, exist_ok=True)
        try:
            if os.geteuid() != 0:
                raise RuntimeError("needs root: it creates network namespaces (ip netns) and mounts a /dev/shm "
                                   "per host")
            missing = [t for t in ("ip", "nsenter", "unshare") if shutil.which(t) is None]
            if missing:
                raise RuntimeError(f"needs {', '.join(missing)} (util-linux, iproute2) on PATH")
            self.hosts = self._stack.enter_context(Hosts(2, prefix="kvx"))
            bridge = self.hosts.bridge_ip
            self.redis: RedisServer | RedisCluster
            if redis_tier == "cluster":
                self.redis = self._stack.enter_context(redis_cluster(3, host=bridge))
            else:
                self.redis = self._stack.enter_context(redis_server(host=bridge))
            self.procs: list[subprocess.Popen[str]] = []
            self.ready: list[dict[str, str]] = []
            for i, name in enumerate(("a", "b")):
                self._start(i, name, redis_tier, dram_bytes, lease_ms, heartbeat_ms)
            time.sleep(2 * heartbeat_ms / 1000)  # each node has heard of the other
        except BaseException:
            self.close()
            raise

    def _start(self, i: int, name: str, redis_tier: Literal["redis", "cluster"] | None, dram_bytes: int,
               lease_ms: int, heartbeat_ms: int) -> None:
        host = self.hosts[i]
        cluster = "true" if redis_tier == "cluster" else "false"
        tier = f"""
[redis]
enabled = true
url = "{self.redis.url}"
cluster = {cluster}
key_prefix = "xhost-tier"
[tiering]
write_through = ["redis"]
""" if redis_tier else ""
        config = self.work / f"sidecar-{name}.toml"
        config.write_text(f"""data_dir = "{self.work / f"sidecar-{name}"}"
log_level = "warning"
[server]
grpc_address = "{host.ip}:0"
http_address = "{host.ip}:0"
[dram]
capacity_bytes = {dram_bytes}
[ssd]
enabled = false
[cluster]
enabled = true
directory_url = "{self.redis.url}"
directory_cluster = {cluster}
key_prefix = "xhost"
node_id = "{name}"
peer_address = "{host.ip}:0"
token = "{self.TOKEN}"
lease_ms = {lease_ms}
heartbeat_ms = {heartbeat_ms}
fetch_timeout_s = 2.0
{tier}""")
        log = (self.work / f"sidecar-{name}.log").open("a")
        self._stack.callback(log.close)
        pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        proc: subprocess.Popen[str] = host.popen(
            [sys.executable, "-m", "kvstore", "serve", "--config", str(config)], stdout=subprocess.PIPE, stderr=log,
            text=True, cwd=REPO, env={**os.environ, **MALLOC_ENV, "PYTHONPATH": pythonpath},
        )
        self.procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            log.flush()
            raise RuntimeError(f"sidecar {name} on {host.name} exited {proc.wait()}: "
                               f"{(self.work / f'sidecar-{name}.log').read_text()[-3000:]}")
        self.ready.append(json.loads(line))

    def url(self, i: int) -> str:
        """Host ``i``'s sidecar's gRPC address (reachable from that host; the connector then finds
        the sidecar's Unix socket and shared memory there)."""
        return self.ready[i]["grpc"]

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(p.pid for p in self.procs)

    def nsenter(self, i: int) -> list[str]:
        """The command prefix that runs a program on host ``i``, in its sidecar's network and mount
        namespaces (its address, its /dev/shm)."""
        return ["nsenter", "-t", str(self.procs[i].pid), "-m", "-n", f"--wd={REPO}"]

    def stats(self, i: int) -> dict[str, Any]:
        """Host ``i``'s sidecar's ``/stats`` (over the bridge, from this namespace)."""
        import urllib.request

        with urllib.request.urlopen(f"http://{self.ready[i]['http']}/stats", timeout=10) as r:
            doc: dict[str, Any] = json.loads(r.read())
        return doc

    def cluster(self, i: int) -> dict[str, int]:
        """Host ``i``'s sidecar's cluster counters (blocks_fetched, blocks_lent, blocks_adopted, ...)."""
        return dict(self.stats(i).get("cluster", {}))

    def kill(self, i: int) -> None:
        """kill -9 host ``i``'s sidecar."""
        proc = self.procs[i]
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)

    def close(self) -> None:
        for proc in getattr(self, "procs", []):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()
        self._stack.close()  # redis-server, then the hosts

    def __enter__(self) -> CrossHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _by_source(llm: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in llm.get_metrics():
        if m.name == "vllm:prompt_tokens_by_source":
            out[m.labels.get("source", "")] = int(m.value)
        elif m.name == "vllm:external_prefix_cache_hits":
            out["external_hits"] = int(m.value)
    return out


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items()}


def _connectors(llm: Any) -> dict[str, Any]:
    """The engine's KV connector objects by role (in-process engine only; none without one)."""
    from vllm.distributed.kv_transfer import (
        get_kv_transfer_group,
        has_kv_transfer_group,
    )

    conns: dict[str, Any] = {}
    if has_kv_transfer_group():
        conns["worker"] = get_kv_transfer_group()
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    sched = getattr(getattr(core, "scheduler", None), "connector", None)
    if sched is not None:
        conns["scheduler"] = sched
    return conns


HOOKS = ("on_new_request", "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
         "update_connector_output", "request_finished", "start_load_kv", "wait_for_layer_load", "save_kv_layer",
         "wait_for_save", "get_finished")


class HookTimes:
    """Wall time the engine spends in its connector's hooks (both roles), per hook: every
    connector's instance methods are wrapped in a timer, the same for every configuration."""

    def __init__(self, conns: dict[str, Any]) -> None:
        self._s: dict[str, float] = {}
        for conn in conns.values():
            for name in HOOKS:
                if hasattr(conn, name):
                    setattr(conn, name, self._timed(name, getattr(conn, name)))

    def _timed(self, name: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._s[name] = self._s.get(name, 0.0) + time.perf_counter() - t

        return timed

    def take(self) -> dict[str, float]:
        """Milliseconds per hook since the last call."""
        out, self._s = {k: round(v * 1e3, 4) for k, v in self._s.items()}, {}
        return out


def _shutdown(llm: Any) -> dict[str, Any]:
    """Shut the engine down (connectors finish their saves) and return the kvstore connector
    counters of both roles (in-process engine only)."""
    stats: dict[str, Any] = {}
    try:
        conns = _connectors(llm)
        llm.llm_engine.engine_core.shutdown()
        for role, conn in conns.items():
            if conn is not None and hasattr(conn, "kvstore_stats"):
                stats[role] = conn.kvstore_stats()
                stats["namespace"] = dataclasses.asdict(conn.ns)
    except Exception as exc:  # noqa: BLE001 - informational
        stats["error"] = repr(exc)
    return stats


def instance_main(spec_path: str) -> None:
    """Child process: build ``vllm.LLM`` from the spec, run its phases, write the results JSON.

    Spec: ``model``, ``block_size``, ``num_blocks``, ``max_model_len``, ``dtype``,
    ``kv_transfer_config`` (dict or null), ``phases``: list of ``{name, prompts: [[token ids]],
    max_tokens, batch: bool, evict: [[token ids]] (run before each prompt, or before the batch),
    stats: bool (per-request prompt_tokens_by_source deltas), paced: bool (each request or batch
    round waits for its turn), handoff_out: DIR (after request i, its output's
    ``kv_transfer_params`` go to DIR/i.json), handoff_in: DIR (request i is sent with the
    ``kv_transfer_params`` in DIR/i.json, as a P/D proxy passes a prefill's on to the decode
    request), skip_cache: bool (``skip_reading_prefix_cache``: nothing is loaded, neither from
    vLLM's own cache nor from the connector -- a recompute)}``, ``out``, ``pace`` (set by
    :class:`Instance`).
    """
    spec = json.loads(Path(spec_path).read_text())
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    t_import = time.perf_counter() - t0
    kv = spec.get("kv_transfer_config")
    t1 = time.perf_counter()
    llm = LLM(
        model=spec["model"], tokenizer=spec["model"], dtype=spec.get("dtype", "float32"), enforce_eager=True,
        max_model_len=spec.get("max_model_len", 1024), max_num_batched_tokens=spec.get("max_model_len", 1024),
        max_num_seqs=spec.get("max_num_seqs", 4), block_size=spec.get("block_size", 32),
        num_gpu_blocks_override=spec.get("num_blocks", 64), enable_prefix_caching=True,
        disable_log_stats=False, seed=0, kv_transfer_config=KVTransferConfig(**kv) if kv else None,
    )
    startup = time.perf_counter() - t1
    hooks = HookTimes(_connectors(llm))  # per measured request or batch round: "connector_ms"

    def gen(
        prompts: list[list[int]], max_tokens: int, params: dict[str, Any] | None = None, skip: bool = False,
    ) -> tuple[list[Any], float]:
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            extra_args={"kv_transfer_params": params} if params else None,
                            skip_reading_prefix_cache=True if skip else None)
        t = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        return outs, time.perf_counter() - t

    def record(o: Any) -> dict[str, Any]:
        m = o.metrics
        return {"tokens": list(o.outputs[0].token_ids), "num_cached_tokens": o.num_cached_tokens,
                "ttft_s": getattr(m, "first_token_latency", None) if m is not None else None,
                "kv_transfer_params": o.kv_transfer_params}

    phases: dict[str, Any] = {}
    for ph in spec["phases"]:
        evict = ph.get("evict") or []  # fresh prompts per use: [[prompt, ...] per request or batch]
        reqs: list[dict[str, Any]] = []
        before_phase = _by_source(llm)
        pace = spec.get("pace") if ph.get("paced") else None
        if ph.get("batch"):
            walls, round_hooks, round_cpu = [], [], []
            threads_before = thread_cpu_seconds(os.getpid())
            for fill in evict or [[]]:  # one round per eviction fill
                _await_turn(pace)
                if fill:
                    gen(fill, 1)
                time.sleep(ph.get("gap_s", 0.0))
                hooks.take()
                cpu = time.process_time()
                outs, dt = gen(ph["prompts"], ph["max_tokens"])
                round_cpu.append(time.process_time() - cpu)
                round_hooks.append(hooks.take())
                reqs += [record(o) for o in outs]
                walls.append(dt)
            wall = sum(walls)
        else:
            wall = 0.0
            for i, p in enumerate(ph["prompts"]):
                _await_turn(pace)
                if evict:
                    gen(evict[i], 1)
                if ph.get("warm"):
                    gen([p], ph["max_tokens"])  # the prompt is now in vLLM's own cache
                time.sleep(ph.get("gap_s", 0.0))  # idle time before the request arrives
                params = read_handoff(ph["handoff_in"], i) if ph.get("handoff_in") else None
                before = _by_source(llm) if ph.get("stats", True) else {}
                hooks.take()
                [o], dt = gen([p], ph["max_tokens"], params, bool(ph.get("skip_cache")))
                wall += dt
                if ph.get("handoff_out"):
                    write_handoff(ph["handoff_out"], i, o.kv_transfer_params)
                r = {**record(o), "connector_ms": hooks.take()}
                if ph.get("stats", True):
                    r["by_source"] = _delta(_by_source(llm), before)
                reqs.append(r)
        phases[ph["name"]] = {"requests": reqs, "wall_s": wall, "by_source": _delta(_by_source(llm), before_phase)}
        if ph.get("batch"):
            phases[ph["name"]]["round_wall_s"] = walls
            phases[ph["name"]]["round_connector_ms"] = round_hooks
            phases[ph["name"]]["round_cpu_s"] = round_cpu  # the instance's CPU time, all its threads
            threads = thread_cpu_seconds(os.getpid())  # over the whole phase, fills and gaps included
            phases[ph["name"]]["thread_cpu_s"] = {k: v - threads_before.get(k, 0.0) for k, v in threads.items()}
    if spec.get("pace"):  # all done: shut down only when told, not during another's turn
        os.write(spec["pace"]["out"], b"D")
        os.read(spec["pace"]["in"], 1)
    result = {"import_s": t_import, "startup_s": startup, "phases": phases, "connector": _shutdown(llm)}
    Path(spec["out"]).write_text(json.dumps(result))
    os._exit(0)  # the engine is shut down; skip the interpreter's slow teardown


def write_handoff(directory: str | Path, i: int, params: dict[str, Any] | None) -> None:
    """Request ``i``'s ``kv_transfer_params`` for the other side of a handoff (see :func:`read_handoff`)."""
    path = Path(directory, f"{i}.json")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(params))
    tmp.replace(path)  # whole or not at all


def read_handoff(directory: str | Path, i: int) -> dict[str, Any] | None:
    """What :func:`write_handoff` wrote for request ``i`` (None: nothing, or no file)."""
    path = Path(directory, f"{i}.json")
    params: dict[str, Any] | None = json.loads(path.read_text()) if path.exists() else None
    return params


def _await_turn(pace: dict[str, int] | None) -> None:
    """A paced instance says it is ready and waits for its turn."""
    if pace:
        os.write(pace["out"], b"R")
        if os.read(pace["in"], 1) != b"G":
            raise RuntimeError("the benchmark went away")


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
    from kvstore.testing.tiny_model import build_tiny_llama

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


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU time of process ``pid`` so far, per thread name (``/proc/PID/task/*/schedstat``, ns);
    empty where that cannot be read."""
    out: dict[str, float] = {}
    try:
        for task in os.scandir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                name = Path(task.path, "comm").read_text().strip()
                out[name] = out.get(name, 0.0) + int(Path(task.path, "schedstat").read_text().split()[0]) / 1e9
    except OSError:
        return {}
    return out


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
    if argv[:1] == ["--instance"]:
        instance_main(argv[1])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    print(json.dumps(run(p.parse_args(argv)), indent=2))


if __name__ == "__main__":
    main()
