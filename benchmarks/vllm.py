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
``outputs_match`` = 1.0 when every configuration's outputs equal the no-connector outputs.

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
from pathlib import Path
from typing import Any

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


def run_instance(spec: dict[str, Any], *, env: dict[str, str] | None = None, timeout: float = 600) -> dict[str, Any]:
    """Run one vLLM instance in a fresh process (see :func:`instance_main`); returns its results."""
    with Instance(spec, env=env) as inst:
        return inst.result(timeout)


class Instance:
    """One vLLM instance in its own process. With ``paced``, each request or batch round of its
    ``paced`` phases waits for :meth:`turn` (one byte each way on a pair of pipes): ``R`` = ready
    for the next, ``G`` = go, ``D`` = all its phases are done (the next ``G`` lets it shut down:
    :meth:`result`)."""

    def __init__(self, spec: dict[str, Any], *, env: dict[str, str] | None = None, paced: bool = False) -> None:
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
                [sys.executable, "-m", "benchmarks.vllm", "--instance", str(path)], cwd=REPO, pass_fds=fds,
                env={**os.environ, **VLLM_ENV, "PYTHONPATH": pythonpath, **(env or {})}, stdout=log,
                stderr=subprocess.STDOUT,
            )
        for fd in fds:
            os.close(fd)  # the child's ends

    def signal(self, timeout: float) -> bytes:
        """The instance's next byte (``R`` or ``D``); b"" if it exited or fell silent."""
        ready, _, _ = select.select([self._ready], [], [], timeout)
        return os.read(self._ready, 1) if ready else b""

    def turn(self, timeout: float) -> bytes:
        """Let it run one batch round; returns what it says afterwards."""
        os.write(self._go, b"G")
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
    round waits for its turn)}``, ``out``, ``pace`` (set by :class:`Instance`).
    """
    spec = json.loads(Path(spec_path).read_text())
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

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

    def gen(prompts: list[list[int]], max_tokens: int) -> tuple[list[Any], float]:
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return outs, time.perf_counter() - t

    def record(o: Any) -> dict[str, Any]:
        m = o.metrics
        return {"tokens": list(o.outputs[0].token_ids), "num_cached_tokens": o.num_cached_tokens,
                "ttft_s": getattr(m, "first_token_latency", None) if m is not None else None}

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
                before = _by_source(llm) if ph.get("stats", True) else {}
                hooks.take()
                [o], dt = gen([p], ph["max_tokens"])
                wall += dt
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
CONFIGS = ("none", "kvstore", "kvstore_nodir", "example", "mooncake", "kvstore_pd", "example_pd", "mooncake_pd")
REQUIRED = ("none", "kvstore", "kvstore_nodir", "kvstore_pd")  # a failure of one of these fails the run


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
        return rng.integers(4, vocab, n).tolist()

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

    def specs(self, base: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        """(the prefill instance's spec or None, the measured instance's spec)."""
        if self.producer is None:
            return None, {**base, "kv_transfer_config": self.kv}
        store = [ph for ph in base["phases"] if ph["name"] == "store"]
        rest = [ph for ph in base["phases"] if ph["name"] != "store"]
        return ({**base, "kv_transfer_config": self.producer, "phases": store},
                {**base, "kv_transfer_config": self.kv, "phases": rest})


def _configs(
    args: argparse.Namespace, url: str, work: Path, stack: contextlib.ExitStack, notes: dict[str, Any],
) -> dict[str, Config]:
    """The configurations asked for. Each has its own store: kvstore's its own namespace in the one
    sidecar (``model_id``), ExampleConnector's its own directory, Mooncake's its own master. The
    decode instance of ``kvstore_pd`` runs with its block directory off: every hit it takes asks
    the sidecar (blocks another process stored), never places its own earlier lookups taught it."""
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

    def mooncake(name: str, pd: bool) -> Config | None:
        peer = MooncakePeer(work / name)
        stack.callback(peer.close)
        if peer.error:
            notes[name] = peer.error
            return None
        if pd:
            return Config(peer.transfer_config("kv_consumer"), peer.transfer_config("kv_producer"), peer.env)
        return Config(peer.transfer_config("kv_both"), env=peer.env)

    makers = {
        "none": lambda: Config(None),
        "kvstore": lambda: Config(kvstore("kvstore", "kv_both")),
        "kvstore_nodir": lambda: Config(kvstore("kvstore_nodir", "kv_both", directory=False)),
        "example": lambda: Config(example("example", "kv_both")),
        "mooncake": lambda: mooncake("mooncake", pd=False),
        "kvstore_pd": lambda: Config(kvstore("kvstore_pd", "kv_consumer", directory=False),
                                     kvstore("kvstore_pd", "kv_producer")),
        "example_pd": lambda: Config(example("example_pd", "kv_consumer"), example("example_pd", "kv_producer")),
        "mooncake_pd": lambda: mooncake("mooncake_pd", pd=True),
    }
    configs = {name: makers[name]() for name in CONFIGS if name in wanted}
    return {name: c for name, c in configs.items() if c is not None}


def run(args: argparse.Namespace) -> dict:
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
            configs = _configs(args, sc.grpc, work, stack, res.notes)
            results = _run_interleaved(base, configs, res.notes, sidecar_pid=sc.proc.pid)
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
                prod = stack.enter_context(Instance(producer, env=config.env, paced=True))
                if prod.signal(timeout) != b"D":
                    _failed(f"{name} (prefill instance)", prod, timeout, notes)
                    continue
                producers[name] = prod
            inst = stack.enter_context(Instance(measured, env=config.env, paced=True))
            if inst.signal(timeout) == b"R":
                live[name] = inst
            else:
                _failed(name, inst, timeout, notes)
        done: dict[str, Instance] = {}
        sidecar_cpu: dict[str, list[float]] = {name: [] for name in live}
        r = 0
        while live:
            order = list(live)
            for name in order[r % len(order):] + order[: r % len(order)]:
                cpu = cpu_seconds(sidecar_pid)
                said = live[name].turn(timeout)
                sidecar_cpu[name].append(cpu_seconds(sidecar_pid) - cpu)
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
    if phase == "store" and "producer" in r:
        return r["producer"]["phases"]["store"]
    return r["phases"][phase]


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
    res.ratio("outputs_match", 1.0 if match_all else 0.0)
    res.notes["configs_run"] = list(results)
    res.notes["setup"] = (f"{args.docs} docs x {args.prefix_tokens}-token prefix + {args.question_tokens}-token "
                          "question, "
                          f"{args.max_tokens} new tokens, block {args.block_size}, vLLM pool {args.num_blocks} blocks, "
                          f"tiny Llama hidden {args.hidden_size} x {args.layers} layers fp32, in-process engine, "
                          f"VLLM_CPU_NUM_OF_RESERVED_CPU=1 everywhere, every request and batch round interleaved "
                          f"across configurations, batch throughput the median of {args.batch_rounds} rounds; "
                          f"*_pd: a kv_producer instance stores, a kv_consumer instance in its own process loads")


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
