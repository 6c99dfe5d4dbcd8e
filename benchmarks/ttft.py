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

The decision is what the connector's scheduler side chose (lookup + ``CostModel``) before the
cell was measured. The cost model is calibrated once at start, from measurements in the same
run: the FLOP rate from real prefills, each tier's bandwidth and per-request latency from a
two-point fit (1 block and many blocks loaded end to end through the connector, lookup
included). Rates are not updated during the run, so every cell is decided by the same model.

Ratios: ``reload_<tier>_<tokens>`` = recompute TTFT / reload TTFT (p50; > 1: reloading wins) and
``decision_accuracy`` = fraction of cells where the decision chose the option that measured
faster. Targets: ``reload_dram_8192`` >= 10, ``decision_accuracy`` >= 0.95.
"""

from __future__ import annotations

import argparse
import contextlib
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
    p.add_argument("--reps", type=int, default=0, help="measurements per way and cell (0: 5 short, 3 up to 2048, 2 above)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--intermediate-size", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: the sidecar gets the other core; 2 threads on a shared 2-core box are slower and noisier)")
    p.add_argument("--no-progress", action="store_true")


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
def reload(model: Any, conn: Any, prompt: list[int]) -> tuple[float, Any]:
    """TTFT through the connector: load what the sidecar has, compute the rest."""
    t0 = time.perf_counter()
    loaded = conn.load(prompt)
    model(input_ids=torch.tensor([prompt[loaded.tokens :]]), past_key_values=loaded.cache, use_cache=True)
    return time.perf_counter() - t0, loaded


def sidecar_env(tier: str, servers: dict[str, Any]) -> dict[str, str]:
    from kvstore.testing.servers import MOTO_CREDENTIALS

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
    from kvstore.testing.servers import moto_server, redis_server

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


def calibrate_tier(model: Any, conn: Any, place: Placement, prompt: list[int], bs: int) -> tuple[float, float]:
    """Bandwidth (bytes/s) and per-request latency (s) of loads from the tier, end to end through
    the connector (``HFConnector.load``: lookup, acquire with promotion, copy, cache assembly): a
    two-point fit of 1 block and all of ``prompt``'s blocks, best of 3 each. The lookup is part
    of the latency because the recompute baseline does not pay it."""
    keys = conn.sched.keys(prompt)
    small = prompt[: bs + 1]
    t1, tn, blocks = [], [], (len(prompt) - 1) // bs
    for _ in range(3):
        for target, out in ((small, t1), (prompt, tn)):
            place.evict(keys)
            t0 = time.perf_counter()
            loaded = conn.load(target)
            out.append(time.perf_counter() - t0)
            assert loaded.result is not None and loaded.result.failure is None
    b1, bn = place.block_bytes, blocks * place.block_bytes
    s1, sn = min(t1), min(tn)
    bandwidth = (bn - b1) / max(sn - s1, 1e-6)
    latency = max(s1 - b1 / bandwidth, 1e-5)
    return bandwidth, latency


def calibrate_flops(model: Any, lengths: list[int]) -> float:
    """FLOP/s of real prefills (the cost model's own FLOP count over the measured time)."""
    from connector.cost import ModelShape

    shape = ModelShape.from_hf_config(model.config)
    rates = []
    for n in lengths:
        prompt = prompt_of(n + 1, model.config.vocab_size)
        recompute(model, prompt)  # warm up
        s = min(recompute(model, prompt)[0] for _ in range(2))
        rates.append(shape.prefill_flops(0, n) / s)
    return statistics.median(rates)


def run(args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    from connector.cost import CostModel, ModelShape, TierRate
    from connector.hf import HFConnector, hf_spec
    from kvstore.client import SyncClient

    torch.set_num_threads(args.threads)
    bs = args.block_size
    lengths = sorted({*(k * bs + bs // 2 for k in args.small_blocks), *args.lengths})
    model = build_model(args, max(lengths))
    vocab = model.config.vocab_size
    reps = {n: args.reps or (5 if n < 512 else 3 if n <= 2048 else 2) for n in lengths}
    prompts = {n: prompt_of(n, vocab) for n in lengths}
    res = Result("ttft")
    cells: list[Cell] = []
    tiers: list[str] = list(args.tiers)

    flop_rate = calibrate_flops(model, [256, 1024])
    block_bytes = hf_spec(model.config, bs).block_bytes
    biggest = (max(lengths) // bs) * block_bytes
    total_steps = len(tiers) * (1 + sum(reps.values()))
    bar = tqdm(total=total_steps, desc="ttft", unit="step", disable=args.no_progress, file=sys.stderr)
    with tier_servers(tiers) as servers:
        for tier in tiers:
            if tier == "dram":
                dram = -(-sum(n // bs for n in lengths) * block_bytes * 5 // 4 // PAGE) * PAGE
            else:
                dram = -(-biggest * 5 // 4 // PAGE) * PAGE
            with sidecar_process(dram, env=sidecar_env(tier, servers)) as sc, SyncClient(sc.grpc) as client:
                cost = CostModel(ModelShape.from_hf_config(model.config), flop_rate=flop_rate,
                                 tiers={t: TierRate.of(1e9, 1e-3) for t in TIERS})
                plain = HFConnector(model, client, model_id="bench", block_size=bs)
                chooser = HFConnector(model, client, model_id="bench", block_size=bs, cost=cost)
                for conn in (plain, chooser):
                    conn.sched.lease_ttl_ms = 0  # no lookup leases: nothing else runs, and they would pin DRAM
                place = Placement(client, plain.ns, tier, block_bytes, dram)
                bar.set_postfix_str(f"{tier}: storing, calibrating")
                for n in lengths:  # store every prompt's full blocks, computed as a prefill does
                    _, cache = recompute(model, prompts[n])
                    plain.save(prompts[n], cache)
                    place.stored.update(plain.sched.keys(prompts[n]))
                cal_prompt = prompts[min((n for n in lengths if n >= 1024), default=max(lengths))]
                bw, lat = calibrate_tier(model, plain, place, cal_prompt, bs)
                cost.tiers[tier] = TierRate.of(bw, lat)
                res.notes.setdefault("calibration", {})[tier] = {"bandwidth_MBps": round(bw / 1e6, 1), "latency_ms": round(lat * 1e3, 3)}
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
                    decision = {"kind": d.kind, "load_blocks": d.load_blocks, "available": d.available,
                                "predicted_reload_ms": round(d.predicted_ttft_s * 1e3, 2) if d.load_blocks else None,
                                "predicted_recompute_ms": round(d.recompute_ttft_s * 1e3, 2)}
                    if d.load_blocks == 0:  # what loading everything would have been predicted at
                        k = d.max_blocks
                        decision["predicted_reload_ms"] = round(
                            (cost.load_time([tier] * k, block_bytes) + cost.prefill_time(k * bs, n - k * bs)) * 1e3, 2)
                    cell = Cell(tier, n, [], [], 0, decision)
                    bar.set_postfix_str(f"{tier} {n} tokens")
                    for _ in range(reps[n]):
                        cell.recompute_s.append(recompute(model, prompt)[0])
                        place.evict(keys)
                        t, loaded = reload(model, plain, prompt)
                        if loaded.result is None or loaded.result.failure is not None or set(loaded.tiers) != {tier}:
                            raise RuntimeError(f"{tier} {n}: reload did not load from {tier}: {loaded.result} {loaded.tiers}")
                        cell.reload_s.append(t)
                        cell.loaded_blocks = loaded.result.loaded
                        bar.update(1)
                    cells.append(cell)
                    res.figure(f"ttft_recompute_{tier}_{n}_p50", cell.recompute * 1e3, "ms")
                    res.figure(f"ttft_reload_{tier}_{n}_p50", cell.reload * 1e3, "ms")
                    res.ratio(f"reload_{tier}_{n}", cell.recompute / cell.reload)
    bar.close()
    correct = sum(c.chosen == c.faster for c in cells)
    res.ratio("decision_accuracy", correct / len(cells))
    res.notes["cells"] = [c.as_dict() for c in cells]
    res.notes["targets"] = {"reload_dram_8192": ">= 10", "decision_accuracy": ">= 0.95"}
    res.notes["model"] = {
        "layers": args.layers, "hidden": args.hidden_size, "heads": args.heads, "kv_heads": args.kv_heads,
        "head_dim": args.head_dim, "intermediate": args.intermediate_size, "dtype": "float32",
        "params": sum(p.numel() for p in model.parameters()), "threads": args.threads,
    }
    res.notes["block_size"] = bs
    res.notes["kv_block_bytes"] = block_bytes
    res.notes["flop_rate"] = flop_rate
    return res.as_dict()


def main(argv: list[str] | None = None) -> None:
    import json

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    print(json.dumps(run(p.parse_args(argv)), indent=2))


if __name__ == "__main__":
    main()
