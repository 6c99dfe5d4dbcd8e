"""Inside one vLLM instance's process (started by :class:`kvstore.harness.instance.Instance` as
``python -m kvstore.harness.phases SPEC``): build ``vllm.LLM`` from a JSON spec, run its phases,
write the results JSON.

Spec: ``model``, ``block_size``, ``num_blocks``, ``max_model_len``, ``dtype``, ``kv_cache_dtype`` (vLLM's
``--kv-cache-dtype``, default ``auto``), ``enable_prompt_embeds``, ``enable_lora`` (with ``max_lora_rank``,
default 8), ``kv_transfer_config``
(dict or null), ``phases``: list of ``{name, prompts: [[token ids]], max_tokens, batch: bool, evict:
[[token ids]] (run before each prompt, or before the batch), stats: bool (per-request
prompt_tokens_by_source deltas), paced: bool (each request or batch round waits for its turn),
handoff_out: DIR (after request i, its output's ``kv_transfer_params`` go to DIR/i.json),
handoff_in: DIR (request i is sent with the ``kv_transfer_params`` in DIR/i.json, as a P/D proxy
passes a prefill's on to the decode request), params: [dict or null] (request i's own
``kv_transfer_params``, a retention hint), skip_cache: bool (``skip_reading_prefix_cache``:
nothing is loaded, neither from vLLM's own cache nor from the connector -- a recompute), salts: [str or
null] (request i's ``cache_salt``), adapters: [[name, id, path] or null] (request i's LoRA adapter, as
vLLM's ``LoRARequest(name, id, path)``; needs ``enable_lora``), embeds: bool (each request is sent as
random prompt embeddings, one per token of its prompt)}``, ``tensor_parallel_size`` (optional),
``max_num_batched_tokens`` (optional: prompts are computed in chunks of it), ``speculative_config``
(optional: vLLM's, a dict), ``out``,
``pace`` (set by :class:`~kvstore.harness.instance.Instance`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from kvstore.harness.handoff import read_handoff, write_handoff


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


def _parallel(spec: dict[str, Any]) -> dict[str, Any]:
    """``tensor_parallel_size`` (ranks in worker processes of their own, vLLM's ``mp`` executor:
    the connector's counters then stay in those processes, and ``connector`` reports none)."""
    tp = int(spec.get("tensor_parallel_size", 1))
    return {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"} if tp > 1 else {}


class _Engine:
    """This process's ``vllm.LLM`` (how long importing vLLM and starting it took), the timers on
    its connector's hooks, and greedy generation of token-id prompts, timed."""

    def __init__(self, spec: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        from vllm import LLM, SamplingParams
        from vllm.config import KVTransferConfig
        from vllm.inputs import TokensPrompt

        self.import_s = time.perf_counter() - t0
        self._params, self._prompt = SamplingParams, TokensPrompt
        kv = spec.get("kv_transfer_config")
        t1 = time.perf_counter()
        self.llm = LLM(
            model=spec["model"], tokenizer=spec["model"], dtype=spec.get("dtype", "float32"), enforce_eager=True,
            max_model_len=spec.get("max_model_len", 1024),
            max_num_batched_tokens=spec.get("max_num_batched_tokens", spec.get("max_model_len", 1024)),
            max_num_seqs=spec.get("max_num_seqs", 4), block_size=spec.get("block_size", 32),
            num_gpu_blocks_override=spec.get("num_blocks", 64), enable_prefix_caching=True,
            kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
            enable_prompt_embeds=bool(spec.get("enable_prompt_embeds", False)),
            **({"enable_lora": True, "max_lora_rank": spec.get("max_lora_rank", 8), "max_loras": 2}
               if spec.get("enable_lora") else {}),
            disable_log_stats=False, seed=0, kv_transfer_config=KVTransferConfig(**kv) if kv else None,
            **({"speculative_config": spec["speculative_config"]} if spec.get("speculative_config") else {}),
            **_parallel(spec),
        )
        self.startup_s = time.perf_counter() - t1
        self.hooks = HookTimes(_connectors(self.llm))  # per measured request or batch round: "connector_ms"

    def gen(
        self, prompts: list[list[int]], max_tokens: int, params: dict[str, Any] | None = None, skip: bool = False,
        salt: str | None = None, embeds: bool = False, adapter: list[Any] | None = None,
    ) -> tuple[list[Any], float]:
        sp = self._params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          extra_args={"kv_transfer_params": params} if params else None,
                          skip_reading_prefix_cache=True if skip else None)
        inputs: list[Any] = [self._embeds(i, len(p)) if embeds else self._prompt(prompt_token_ids=p)
                             for i, p in enumerate(prompts)]
        if salt:
            for prompt in inputs:
                prompt["cache_salt"] = salt
        t = time.perf_counter()
        lora = None
        if adapter:
            from vllm.lora.request import LoRARequest

            lora = LoRARequest(str(adapter[0]), int(adapter[1]), str(adapter[2]))
        outs = self.llm.generate(inputs, sp, use_tqdm=False, lora_request=lora)
        return outs, time.perf_counter() - t


    def _embeds(self, seed: int, n: int) -> Any:
        """A prompt of ``n`` random token embeddings (seeded by ``seed``)."""
        import torch
        from vllm.inputs import EmbedsPrompt

        hidden = self.llm.llm_engine.model_config.get_hidden_size()
        gen = torch.Generator().manual_seed(seed)
        return EmbedsPrompt(prompt_embeds=torch.randn(n, hidden, generator=gen))


def _record(o: Any) -> dict[str, Any]:
    m = o.metrics
    return {"tokens": list(o.outputs[0].token_ids), "num_cached_tokens": o.num_cached_tokens,
            "ttft_s": getattr(m, "first_token_latency", None) if m is not None else None,
            "kv_transfer_params": o.kv_transfer_params}


def _await_turn(pace: dict[str, int] | None) -> None:
    """A paced instance says it is ready and waits for its turn."""
    if pace:
        os.write(pace["out"], b"R")
        if os.read(pace["in"], 1) != b"G":
            raise RuntimeError("the benchmark went away")


def _requests(eng: _Engine, ph: dict[str, Any], pace: dict[str, int] | None) -> tuple[list[dict[str, Any]], float]:
    """A phase of single requests: each after its eviction fill and idle gap; its results and
    the phase's wall time (the requests' own)."""
    evict = ph.get("evict") or []  # fresh prompts per request: [prompt, ...] each
    reqs: list[dict[str, Any]] = []
    wall = 0.0
    for i, p in enumerate(ph["prompts"]):
        _await_turn(pace)
        if evict:
            eng.gen(evict[i], 1)
        if ph.get("warm"):
            eng.gen([p], ph["max_tokens"])  # the prompt is now in vLLM's own cache
        time.sleep(ph.get("gap_s", 0.0))  # idle time before the request arrives
        params = ph["params"][i] if ph.get("params") else None  # its own kv_transfer_params
        if ph.get("handoff_in"):  # a prefill's handoff params, with the request's own beside them
            params = {**(params or {}), **(read_handoff(ph["handoff_in"], i) or {})} or None
        before = _by_source(eng.llm) if ph.get("stats", True) else {}
        eng.hooks.take()
        salt = ph["salts"][i] if ph.get("salts") else None
        adapter = ph["adapters"][i] if ph.get("adapters") else None
        [o], dt = eng.gen([p], ph["max_tokens"], params, bool(ph.get("skip_cache")), salt, bool(ph.get("embeds")),
                          adapter)
        wall += dt
        if ph.get("handoff_out"):
            write_handoff(ph["handoff_out"], i, o.kv_transfer_params)
        r = {**_record(o), "connector_ms": eng.hooks.take()}
        if ph.get("stats", True):
            r["by_source"] = _delta(_by_source(eng.llm), before)
        reqs.append(r)
    return reqs, wall


def _batch_rounds(
    eng: _Engine, ph: dict[str, Any], pace: dict[str, int] | None,
) -> tuple[list[dict[str, Any]], dict[str, list[Any]]]:
    """A batch phase: every prompt in one ``generate`` call, one round per eviction fill; its
    results and, per round, wall time, time in the connector's hooks and this process's CPU time."""
    reqs: list[dict[str, Any]] = []
    walls: list[float] = []
    round_hooks: list[dict[str, float]] = []
    round_cpu: list[float] = []
    for fill in ph.get("evict") or [[]]:  # one round per eviction fill
        _await_turn(pace)
        if fill:
            eng.gen(fill, 1)
        time.sleep(ph.get("gap_s", 0.0))
        eng.hooks.take()
        cpu = time.process_time()
        outs, dt = eng.gen(ph["prompts"], ph["max_tokens"])
        round_cpu.append(time.process_time() - cpu)
        round_hooks.append(eng.hooks.take())
        reqs += [_record(o) for o in outs]
        walls.append(dt)
    return reqs, {"round_wall_s": walls, "round_connector_ms": round_hooks, "round_cpu_s": round_cpu}


def _phase(eng: _Engine, ph: dict[str, Any], pace: dict[str, int] | None) -> dict[str, Any]:
    before = _by_source(eng.llm)
    if not ph.get("batch"):
        reqs, wall = _requests(eng, ph, pace)
        return {"requests": reqs, "wall_s": wall, "by_source": _delta(_by_source(eng.llm), before)}
    threads_before = thread_cpu_seconds(os.getpid())
    reqs, rounds = _batch_rounds(eng, ph, pace)
    out = {"requests": reqs, "wall_s": sum(rounds["round_wall_s"]), "by_source": _delta(_by_source(eng.llm), before),
           **rounds}  # round_cpu_s: the instance's CPU time, all its threads
    threads = thread_cpu_seconds(os.getpid())  # over the whole phase, fills and gaps included
    out["thread_cpu_s"] = {k: v - threads_before.get(k, 0.0) for k, v in threads.items()}
    return out


def main(spec_path: str) -> None:
    """Run the spec at ``spec_path`` (see the module's docstring) and write its results to its ``out``."""
    spec = json.loads(Path(spec_path).read_text())
    eng = _Engine(spec)
    phases = {ph["name"]: _phase(eng, ph, spec.get("pace") if ph.get("paced") else None) for ph in spec["phases"]}
    if spec.get("pace"):  # all done: shut down only when told, not during another's turn
        os.write(spec["pace"]["out"], b"D")
        os.read(spec["pace"]["in"], 1)
    result = {"import_s": eng.import_s, "startup_s": eng.startup_s, "phases": phases, "connector": _shutdown(eng.llm)}
    Path(spec["out"]).write_text(json.dumps(result))
    os._exit(0)  # the engine is shut down; skip the interpreter's slow teardown


if __name__ == "__main__":
    main(sys.argv[1])
