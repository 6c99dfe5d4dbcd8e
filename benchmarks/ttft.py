"""Time to first token: full recompute against reload from each tier, and the cost model's choice.

A random-weight Llama built from a config (float32, GQA with one KV head, so an 8192-token
prompt's KV is 16 MiB while its prefill takes seconds on this CPU) prefills prompts of
``--lengths`` tokens, plus short prompts of one and two blocks (``--small-blocks``), where
recompute should win on slow tiers. Every cell (prompt length x tier) is measured both ways,
interleaved, ``reps`` times each:

* ``recompute``: one forward over the whole prompt, no connector -- the raw baseline;
* ``reload``: the transformers connector loads every cached full block (``HFConnector.load``:
  lookup, acquire, copy into a DynamicCache), then computes the remaining tokens.

The blocks are placed **only** in the measured tier: one sidecar per tier (``kvstore serve`` in
its own process) whose chain below DRAM is just that tier, with a DRAM just big enough for the
largest prompt. Before every reload, a DRAM-full of filler blocks pushes the prompt out of DRAM
(demoting it on the first round) and is deleted again, so the reload promotes from the tier
into empty DRAM slots. Redis (redis-server) and S3 (moto's server) run on free loopback ports.

The decision is what the connector's scheduler side chose (lookup + ``CostModel``) for the cell
**before** any of the cell's measurements, from a model fed only with measurements of this run:

* at start, ``calibrate_prefill``: real forwards of 16, 64, 256, 1024 and 2048 tokens (two each)
  fit the per-forward overhead and the matmul and attention FLOP rates;
* per tier, before its cells: end-to-end loads through the connector (``HFConnector.load``:
  lookup, acquire with promotion, copy, cache assembly -- everything the recompute baseline
  does not pay) of 1, 4, 16, 64 and 256 blocks, two each, fit the tier's per-request latency and
  bandwidth (none of these sizes is a cell's; the loads also warm the tier);
* after each cell, the cell's own measurements (forwards and loads) are fed to the model, as a
  deployment keeps it current from real traffic; they can inform later cells only.

A cell's ``faster`` option is the one with the lower median of its ``reps`` measurements; the
two options are measured alternately (recompute first on even repetitions, reload first on odd
ones) so drift in the machine's load hits both alike. The lookup leases the decisions take are
released by the connector (no workaround); the sidecar's open lease count after each tier is
recorded in ``notes.leases_open``.

Both sides run on the same CPUs: at start every thread of this process is pinned to ``--cpus``
(default: every CPU this process may use), and everything started after it inherits that set --
each sidecar, redis-server, moto's server. The recompute runs torch on ``--threads`` threads
(default: one per CPU of the set); the reload runs the same torch threads plus the sidecar (and
the tier's server) on the same CPUs, so the sidecar's work competes with the model's for the
same cores instead of getting a core of its own. ``notes.cpus`` states the split, with the CPU
sets read back from each process.

Ratios: ``reload_<tier>_<tokens>`` = recompute TTFT / reload TTFT (p50; > 1: reloading wins) and
``decision_accuracy`` = fraction of cells where the decision chose the option that measured
faster. Targets: ``reload_dram_8192`` >= 10, ``decision_accuracy`` >= 0.95.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from benchmarks.common import Result, sidecar_process

TIERS = ("dram", "ssd", "redis", "s3")
PAGE = 4 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192], help="prompt lengths (tokens)")
    p.add_argument("--small-blocks", type=int, nargs="*", default=[1, 2],
                   help="also prompts of this many full blocks (+ half a block): recompute should win on slow tiers")
    p.add_argument("--tiers", nargs="+", choices=TIERS, default=list(TIERS))
    p.add_argument("--reps", type=int, default=0, help="measurements per way and cell (0: 5 short, 3 otherwise)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--intermediate-size", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--cpus", default="",
                   help="CPUs for every process of the run, both sides alike (e.g. 0 or 0-1,3; default: all allowed)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: one per CPU of --cpus)")
    p.add_argument("--no-progress", action="store_true")


def parse_cpus(spec: str) -> set[int]:
    """``0-1,3`` -> {0, 1, 3}; "" -> every CPU this process may use."""
    if not spec.strip():
        return set(os.sched_getaffinity(0))
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def pin(cpus: set[int]) -> None:
    """Every thread of this process on ``cpus``; threads and processes started later inherit it."""
    os.sched_setaffinity(0, cpus)
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cpus)


def affinity(pid: int) -> list[int]:
    """The CPUs every thread of process ``pid`` may run on (their union)."""
    cpus: set[int] = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):
            cpus |= os.sched_getaffinity(int(tid))
    return sorted(cpus)


@dataclass
class Cell:
    tier: str
    tokens: int
    recompute_s: list[float]
    reload_s: list[float]
    loaded_blocks: int
    decision: dict[str, Any]

    @property
    def recompute(self) -> float:
        return statistics.median(self.recompute_s)

    @property
    def reload(self) -> float:
        return statistics.median(self.reload_s)

    @property
    def faster(self) -> str:
        return "reload" if self.reload < self.recompute else "recompute"

    @property
    def chosen(self) -> str:
        return "recompute" if self.decision["load_blocks"] == 0 else "reload"

    def as_dict(self) -> dict[str, Any]:
        return {
            "tier": self.tier, "tokens": self.tokens, "loaded_blocks": self.loaded_blocks,
            "recompute_ms": round(self.recompute * 1e3, 2), "reload_ms": round(self.reload * 1e3, 2),
            "faster": self.faster, "chosen": self.chosen, "correct": self.chosen == self.faster,
            "decision": self.decision,
        }


def build_model(args: argparse.Namespace, max_tokens: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, max_position_embeddings=max_tokens + 64, tie_word_embeddings=False,
    )
    state = torch.random.get_rng_state()
    torch.manual_seed(0)
    try:
        model = LlamaForCausalLM(config).eval()
    finally:
        torch.random.set_rng_state(state)
    return model


def prompt_of(n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(4, vocab, (n,), generator=g).tolist()


@torch.inference_mode()
def recompute(model: Any, prompt: list[int]) -> tuple[float, Any]:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    t0 = time.perf_counter()
    model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
    return time.perf_counter() - t0, cache


@torch.inference_mode()
def reload(model: Any, conn: Any, prompt: list[int]) -> tuple[float, float, Any]:
    """TTFT through the connector: load what the sidecar has, compute the rest. Returns the TTFT,
    the load's share of it (lookup to assembled cache) and what was loaded."""
    t0 = time.perf_counter()
    loaded = conn.load(prompt)
    t1 = time.perf_counter()
    model(input_ids=torch.tensor([prompt[loaded.tokens :]]), past_key_values=loaded.cache, use_cache=True)
    return time.perf_counter() - t0, t1 - t0, loaded


def sidecar_env(tier: str, servers: dict[str, Any]) -> dict[str, str]:
    from kvstore.harness.servers import MOTO_CREDENTIALS

    env = {"KVSTORE_SSD__ENABLED": str(tier == "ssd").lower(), "KVSTORE_LOG_LEVEL": "warning"}
    if tier == "redis":
        # redis-py 8's connection pool allows 100 connections, and the sidecar runs one demotion or
        # promotion per block concurrently: an 8192-token prompt (512 blocks) would mark the tier
        # down with "Too many connections". Raise the pool's limit through the URL.
        env |= {"KVSTORE_REDIS__ENABLED": "true", "KVSTORE_REDIS__URL": servers["redis"].url + "?max_connections=4096"}
    if tier == "s3":
        env |= {"KVSTORE_S3__ENABLED": "true", "KVSTORE_S3__ENDPOINT_URL": servers["s3"].url,
                **{k.upper(): v for k, v in MOTO_CREDENTIALS.items()}}
    return env


@contextlib.contextmanager
def tier_servers(tiers: list[str]) -> Iterator[dict[str, Any]]:
    from kvstore.harness.servers import moto_server, redis_server

    with contextlib.ExitStack() as stack:
        servers: dict[str, Any] = {}
        if "redis" in tiers:
            servers["redis"] = stack.enter_context(redis_server())
        if "s3" in tiers:
            servers["s3"] = stack.enter_context(moto_server())
        yield servers


class Placement:
    """Keeps a sidecar's blocks only in its one lower tier (see the module doc)."""

    def __init__(self, client: Any, ns: Any, tier: str, block_bytes: int, dram_bytes: int) -> None:
        from kvstore.keys import prefix_keys

        self.client, self.ns, self.tier, self.block_bytes = client, ns, tier, block_bytes
        slots = dram_bytes // block_bytes
        self.filler = prefix_keys(ns, [3] * (slots * ns.block_size))  # a token the prompts never hold
        self.filler_data = [np.zeros(block_bytes, np.uint8)] * slots
        self.stored: set[bytes] = set()  # every block stored: each reaches the tier once

    def evict(self, keys: list[bytes]) -> None:
        if self.tier == "dram":
            return
        self.client.put_blocks(self.ns, self.filler, self.filler_data)  # every other block leaves DRAM
        want = len(self.stored) * self.block_bytes
        for _ in range(6000):  # demotions of blocks that were only in DRAM finish in the background
            st = self.client.stats()["tiers"][self.tier]
            if st["down"]:
                raise RuntimeError(f"{self.tier}: the sidecar marked the tier down ({st['errors']} errors)")
            if st["bytes_in"] >= want:
                break
            time.sleep(0.01)
        else:
            raise RuntimeError(f"{self.tier}: demotions did not finish")
        self.client.delete(self.ns, self.filler)
        placed = {t for t, _ in self.client.lookup(self.ns, keys).blocks}
        if placed != {self.tier}:
            raise RuntimeError(f"blocks expected only in {self.tier}, found in {placed}")


CAL_BLOCKS = (1, 4, 16, 64, 256)
CAL_PREFILL = (16, 64, 256, 1024, 2048)


def calibrate_tier(cost: Any, conn: Any, place: Placement, prompt: list[int], bs: int, repeats: int = 2) -> None:
    """Feed ``cost`` end-to-end loads from the tier (``HFConnector.load``: lookup, acquire with
    promotion, copy, cache assembly) of ``CAL_BLOCKS`` blocks of ``prompt``, ``repeats`` each; its
    fit gives the tier's per-request latency and bandwidth. The lookup is part of the latency
    because the recompute baseline does not pay it."""
    keys = conn.sched.keys(prompt)
    sizes = [b for b in CAL_BLOCKS if b * bs < len(prompt)]
    for _ in range(repeats):
        for b in sizes:
            place.evict(keys)
            t0 = time.perf_counter()
            loaded = conn.load(prompt[: b * bs + 1])
            seconds = time.perf_counter() - t0
            assert loaded.result is not None and loaded.result.failure is None and loaded.result.loaded == b
            cost.observe_transfer({place.tier: b * place.block_bytes}, seconds)


def run(args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    from connector.cost import CostModel, ModelShape, TierRate, calibrate_prefill
    from connector.hf import HFConnector, hf_spec
    from kvstore.client import SyncClient

    cpus = parse_cpus(args.cpus)
    pin(cpus)  # before torch starts its threads and before any server or sidecar starts
    threads = args.threads or len(cpus)
    torch.set_num_threads(threads)
    bs = args.block_size
    lengths = sorted({*(k * bs + bs // 2 for k in args.small_blocks), *args.lengths})
    model = build_model(args, max(lengths))
    vocab = model.config.vocab_size
    reps = {n: args.reps or (5 if n < 512 else 3) for n in lengths}
    prompts = {n: prompt_of(n, vocab) for n in lengths}
    res = Result("ttft")
    res.notes["cpus"] = {
        "set": sorted(cpus), "torch_threads": threads,
        "recompute": f"this process: torch on {threads} thread(s), on CPUs {sorted(cpus)}",
        "reload": f"this process (the same torch threads) + the sidecar + the tier's server, on CPUs {sorted(cpus)}",
        "this_process": affinity(os.getpid()), "sidecars": {}, "servers": {},
    }
    cells: list[Cell] = []
    tiers: list[str] = list(args.tiers)

    block_bytes = hf_spec(model.config, bs).block_bytes
    biggest = (max(lengths) // bs) * block_bytes
    # one model for the whole run: the prefill fit is shared, each tier gets its own transfer fit
    cost = CostModel(ModelShape.from_hf_config(model.config), flop_rate=1e10,
                     tiers={t: TierRate.of(1e9, 1e-3) for t in TIERS})
    calibrate_prefill(cost, lambda n: recompute(model, prompt_of(n + 1, vocab)[:n])[0], CAL_PREFILL)
    res.notes["calibration"] = {"prefill": {k: v for k, v in cost.snapshot()["prefill"].items()}}
    total_steps = len(tiers) * (1 + sum(reps.values()))
    bar = tqdm(total=total_steps, desc="ttft", unit="step", disable=args.no_progress, file=sys.stderr)
    with tier_servers(tiers) as servers:
        res.notes["cpus"]["servers"] = {name: affinity(s.proc.pid) for name, s in servers.items() if s.proc is not None}
        for tier in tiers:
            if tier == "dram":
                dram = -(-sum(n // bs for n in lengths) * block_bytes * 5 // 4 // PAGE) * PAGE
            else:
                dram = -(-biggest * 5 // 4 // PAGE) * PAGE
            with sidecar_process(dram, env=sidecar_env(tier, servers)) as sc, SyncClient(sc.grpc) as client:
                res.notes["cpus"]["sidecars"][tier] = affinity(sc.proc.pid)
                plain = HFConnector(model, client, model_id="bench", block_size=bs)
                chooser = HFConnector(model, client, model_id="bench", block_size=bs, cost=cost)
                place = Placement(client, plain.ns, tier, block_bytes, dram)
                bar.set_postfix_str(f"{tier}: storing, calibrating")
                for n in lengths:  # store every prompt's full blocks, computed as a prefill does
                    _, cache = recompute(model, prompts[n])
                    plain.save(prompts[n], cache)
                    place.stored.update(plain.sched.keys(prompts[n]))
                calibrate_tier(cost, plain, place, prompts[max(lengths)], bs)
                rate = cost.tiers[tier]
                res.notes["calibration"][tier] = {"bandwidth_MBps": round(rate.bandwidth.value / 1e6, 1),
                                                  "latency_ms": round(rate.latency.value * 1e3, 3)}
                bar.update(1)
                for n in lengths:
                    prompt = prompts[n]
                    keys = plain.sched.keys(prompt)
                    place.evict(keys)
                    req = f"decide-{tier}-{n}"
                    chooser.sched.get_num_new_matched_tokens(req, prompt, 0)
                    d = chooser.sched.decision(req)
                    chooser.sched.request_finished(req)
                    assert d is not None
                    k = d.max_blocks  # what loading everything is predicted at
                    decision = {"kind": d.kind, "load_blocks": d.load_blocks, "available": d.available,
                                "predicted_reload_ms": round((cost.load_time([tier] * k, block_bytes)
                                                              + cost.prefill_time(k * bs, n - k * bs)) * 1e3, 2),
                                "predicted_recompute_ms": round(d.recompute_ttft_s * 1e3, 2)}
                    cell = Cell(tier, n, [], [], 0, decision)
                    bar.set_postfix_str(f"{tier} {n} tokens")
                    seen: list[tuple[str, float, float, int]] = []  # fed to the model after the cell
                    for i in range(reps[n]):
                        for way in (("recompute", "reload") if i % 2 == 0 else ("reload", "recompute")):
                            if way == "recompute":
                                t = recompute(model, prompt)[0]
                                cell.recompute_s.append(t)
                                seen.append(("prefill", t, 0.0, 0))
                                continue
                            place.evict(keys)
                            t, load_s, loaded = reload(model, plain, prompt)
                            if (
                                loaded.result is None
                                or loaded.result.failure is not None
                                or set(loaded.tiers) != {tier}
                            ):
                                raise RuntimeError(
                                    f"{tier} {n}: reload did not load from {tier}: {loaded.result} {loaded.tiers}"
                                )
                            cell.reload_s.append(t)
                            cell.loaded_blocks = loaded.result.loaded
                            seen.append(("reload", t - load_s, load_s, loaded.tokens))
                        bar.update(1)
                    for what, fwd_s, load_s, m in seen:
                        cost.observe_prefill(m, n - m, fwd_s)
                        if what == "reload":
                            cost.observe_transfer({tier: (m // bs) * block_bytes}, load_s)
                    cells.append(cell)
                    res.figure(f"ttft_recompute_{tier}_{n}_p50", cell.recompute * 1e3, "ms")
                    res.figure(f"ttft_reload_{tier}_{n}_p50", cell.reload * 1e3, "ms")
                    res.ratio(f"reload_{tier}_{n}", cell.recompute / cell.reload)
                res.notes.setdefault("leases_open", {})[tier] = client.stats()["index"]["leases"]
    bar.close()
    correct = sum(c.chosen == c.faster for c in cells)
    res.ratio("decision_accuracy", correct / len(cells))
    res.notes["cells"] = [c.as_dict() for c in cells]
    res.notes["targets"] = {"reload_dram_8192": ">= 10", "decision_accuracy": ">= 0.95"}
    res.notes["model"] = {
        "layers": args.layers, "hidden": args.hidden_size, "heads": args.heads, "kv_heads": args.kv_heads,
        "head_dim": args.head_dim, "intermediate": args.intermediate_size, "dtype": "float32",
        "params": sum(p.numel() for p in model.parameters()), "threads": threads,
    }
    res.notes["block_size"] = bs
    res.notes["kv_block_bytes"] = block_bytes
    res.notes["cost_model_at_end"] = {k: v for k, v in cost.snapshot().items() if k != "recent"}
    return res.as_dict()


def main(argv: list[str] | None = None) -> None:
    import json

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    print(json.dumps(run(p.parse_args(argv)), indent=2))


if __name__ == "__main__":
    main()
