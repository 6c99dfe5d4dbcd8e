"""Time to first token with a transformers model: recompute vs load from the sidecar's DRAM.

A random-weight Llama (built locally, float32) prefills prompts of several lengths. For each
length, three ways to the first token are timed in the same run, each ``--reps`` times:

* ``recompute``: one forward over the whole prompt, no connector -- the raw baseline;
* ``load``: the connector loads every cached full block (no cost model), computes the rest;
* ``cost``: the connector with a calibrated cost model decides how much to load.

Reported: p50 TTFT per mode and length, the ratio recompute / load (> 1: loading wins), and the
cost model's decisions. The sidecar runs as a subprocess (`kvstore serve`); blocks are stored
once by a prefill pass before timing.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from benchmarks.common import Result, percentile, sidecar_process


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1536])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)


def _ttft(fn, reps: int) -> list[float]:
    fn()  # warm up
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    from connector.cost import CostModel, ModelShape, calibrate_flop_rate, calibrate_memcpy_bandwidth
    from connector.hf import HFConnector
    from kvstore.client import SyncClient
    from kvstore.testing.tiny_model import build_tiny_llama

    res = Result("ttft")
    with tempfile.TemporaryDirectory(prefix="kvstore-ttft-") as d:
        path = build_tiny_llama(
            d, hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size, num_hidden_layers=args.layers,
            num_attention_heads=args.hidden_size // 32, num_key_value_heads=2, head_dim=32,
        )
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    with sidecar_process(1 << 30) as sc, SyncClient(sc.grpc) as client:
        cost = CostModel(ModelShape.from_hf_config(model.config), flop_rate=calibrate_flop_rate())
        cost.tiers["dram"].bandwidth.value = calibrate_memcpy_bandwidth()
        plain = HFConnector(model, client, model_id="bench", block_size=args.block_size)
        chooser = HFConnector(model, client, model_id="bench", block_size=args.block_size, cost=cost)
        for n in args.lengths:
            g = torch.Generator().manual_seed(n)
            prompt = torch.randint(4, vocab, (n,), generator=g).tolist()
            plain.prefill(prompt)  # store the blocks
            with torch.inference_mode():
                rec = _ttft(lambda: model(input_ids=torch.tensor([prompt]), use_cache=True), args.reps)
            load = _ttft(lambda: plain.prefill(prompt, save=False), args.reps)
            chosen = _ttft(lambda: chooser.prefill(prompt, save=False), args.reps)
            for name, samples in (("recompute", rec), ("load", load), ("cost", chosen)):
                res.figure(f"ttft_{name}_{n}_p50", percentile(samples, 50) * 1e3, "ms")
            res.ratio(f"recompute_vs_load_{n}", percentile(rec, 50) / percentile(load, 50))
            res.ratio(f"recompute_vs_cost_{n}", percentile(rec, 50) / percentile(chosen, 50))
        snap = cost.snapshot()
        res.notes["decisions"] = snap["decisions"]
        res.notes["flop_rate"] = snap["flop_rate"]
        res.notes["dram_bandwidth_bytes_per_s"] = snap["tiers"]["dram"]["bandwidth_bytes_per_s"]
        res.notes["kv_block_bytes"] = plain.spec.block_bytes
    return res.as_dict()


def main(argv: list[str] | None = None) -> None:
    import json

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    print(json.dumps(run(p.parse_args(argv)), indent=2))


if __name__ == "__main__":
    main()
