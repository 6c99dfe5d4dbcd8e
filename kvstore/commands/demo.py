"""`kvstore demo`: the prefill -> decode handoff of a tiny Llama through an embedded sidecar.

The command builds a small random-weight Llama and its tokenizer in a temporary directory (nothing
is downloaded), starts a sidecar inside this process (`kvstore.server.sidecar.Sidecar` on free loopback
ports), then runs two worker processes against it:

1. a **prefill worker** computes a prompt's KV with the transformers connector and stores its
   full blocks in the sidecar's shared-memory DRAM tier;
2. a **decode worker** -- another process, another copy of the model -- asks the sidecar for the
   prompt, lets the cost model decide how much to reload, loads those blocks, computes the rest
   and decodes greedily. It compares its output with a full recompute, times the first token
   both ways, then runs a second turn of the conversation that reuses turn 1's blocks (the
   prompt and the answer).

Workers are this module run as a script (``python -m kvstore.commands.demo ROLE SPEC_JSON``);
each prints one JSON line with what it did. See docs/demo.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstore.commands import Subparsers

MODEL: dict[str, Any] = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096}
MODEL_ID = "kvstore-demo-llama"
FOLLOW_UP = " Hello world, one two three four five: load save prompt request hit miss."


def register(sub: Subparsers) -> None:
    p = sub.add_parser("demo", help="prefill -> decode handoff of a tiny Llama through an embedded sidecar")
    p.add_argument("--tokens", type=int, default=1544, help="prompt length in tokens (default 1544)")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens to decode per turn")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--json", action="store_true", help="also print everything as one JSON line at the end")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvstore.util.tuning import tune_malloc

    tune_malloc()
    summary = asyncio.run(_demo(args))
    if args.json:
        print(json.dumps(summary))
    return 0 if summary["ok"] else 1


def _say(msg: str = "") -> None:
    print(msg, flush=True)


async def _worker(role: str, spec_path: Path) -> dict[str, Any]:
    import os

    from kvstore.util.tuning import ENV

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvstore.commands.demo", role, str(spec_path),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**os.environ, **ENV},
    )
    out, err = await proc.communicate()  # the sidecar keeps serving on this loop meanwhile
    if proc.returncode != 0:
        raise RuntimeError(f"{role} worker exited with {proc.returncode}:\n{err.decode()[-4000:]}")
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    result["pid"] = proc.pid
    return result


async def _demo(args: argparse.Namespace) -> dict[str, Any]:
    from kvstore.config import load_config
    from kvstore.server.sidecar import Sidecar
    from kvstore.testing.tiny_model import build_tiny_llama, generate_corpus

    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvstore-demo-") as tmp:
        d = Path(tmp)
        model_dir = await asyncio.to_thread(build_tiny_llama, d / "model", **MODEL)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        ids: list[int] = []
        for line in generate_corpus(seed=7, n_lines=2000):
            ids += tok(" " + line, add_special_tokens=False)["input_ids"]
            if len(ids) >= args.tokens:
                break
        prompt = [tok.bos_token_id, *ids[: args.tokens - 1]]
        follow_up = tok(FOLLOW_UP, add_special_tokens=False)["input_ids"]
        m = MODEL
        _say(f"kvstore demo: a random-weight Llama ({m['num_hidden_layers']} layers, hidden {m['hidden_size']}, "
             f"{m['num_attention_heads']} query / {m['num_key_value_heads']} KV heads, float32) built in {model_dir}")

        config = load_config(None, {
            "data_dir": str(d / "sidecar"), "server.grpc_address": "127.0.0.1:0", "server.http_address": "127.0.0.1:0",
            "dram.capacity_bytes": 64 << 20, "ssd.enabled": False, "log_level": "warning",
        })
        async with Sidecar(config) as sc:
            url = f"127.0.0.1:{sc.grpc_port}"
            _say(f"embedded sidecar: gRPC {url}, HTTP 127.0.0.1:{sc.http_port} (/stats), "
                 "DRAM slab 64 MiB in shared memory")
            spec = {"model_dir": str(model_dir), "url": url, "prompt": prompt, "follow_up": follow_up,
                    "new_tokens": args.new_tokens, "block_size": args.block_size}
            spec_path = d / "spec.json"
            spec_path.write_text(json.dumps(spec))
            bs = args.block_size
            _say(f"prompt: {len(prompt)} tokens = {len(prompt) // bs} full blocks of {bs} + {len(prompt) % bs}")
            _say()

            pre = await _worker("prefill", spec_path)
            _say(f"[prefill worker, pid {pre['pid']}] computed all {pre['computed_tokens']} prompt tokens in "
                 f"{pre['prefill_ms']:.0f} ms; stored {pre['saved_blocks']} blocks "
                 f"({pre['saved_bytes'] / 2**20:.1f} MiB) in {pre['save_ms']:.1f} ms")
            _say()

            dec = await _worker("decode", spec_path)
            d1, t2 = dec["turn1"], dec["turn2"]
            _say(f"[decode worker, pid {dec['pid']}] a separate process with its own copy of the model")
            _say(f"  decision: {d1['decision']}")
            _say(f"  loaded {d1['loaded_blocks']} blocks ({d1['loaded_tokens']} tokens) from {d1['tiers']} in "
                 f"{d1['load_ms']:.1f} ms, recomputed {d1['computed_tokens']} tokens")
            _say(f"  TTFT: reload {d1['ttft_reload_ms']:.1f} ms vs full recompute {d1['ttft_recompute_ms']:.1f} ms "
                 f"({d1['ttft_recompute_ms'] / d1['ttft_reload_ms']:.1f}x faster)")
            _say(f"  greedy outputs match full recompute: {'yes' if d1['match'] else 'NO'} "
                 f"({len(d1['tokens'])} tokens, max |logit difference| {d1['max_logit_diff']:.1e})")
            _say(f"  turn 2: {t2['prompt_tokens']}-token prompt (turn 1 + its answer + a follow-up): loaded "
                 f"{t2['loaded_tokens']} tokens ({t2['loaded_blocks']} blocks, turn 1's prompt and answer), "
                 f"recomputed {t2['computed_tokens']}; outputs match full recompute: {'yes' if t2['match'] else 'NO'}")
            _say()

            stats: dict[str, Any] = sc.store.snapshot()  # a JSON document
            lk = stats["lookups"]
            counts = {k: v for k, v in stats["decisions"]["counts"].items() if k != "total"}
            _say(f"sidecar /stats: {lk['calls']} lookups, {lk['blocks_hit']} of {lk['blocks_requested']} blocks hit "
                 f"({100 * lk['hit_rate']:.0f}%), decisions reported {counts}")
        ok = bool(d1["match"] and t2["match"] and d1["loaded_blocks"] > 0 and t2["loaded_blocks"] > 0)
        _say(f"outputs match full recompute: {'yes' if ok else 'NO'}; blocks loaded: "
             f"{d1['loaded_blocks']} + {t2['loaded_blocks']} (turn 2); {time.perf_counter() - t_start:.0f} s in all")
        return {"ok": ok, "prompt_tokens": len(prompt), "prefill": pre, "decode": dec, "sidecar_stats": {
            "lookups": lk, "decisions": stats["decisions"]["counts"]}}


# --- workers (separate processes) ------------------------------------------------------------


def _load_model(model_dir: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)  # the sidecar has the other core of a small machine
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def _prefill_worker(spec: dict[str, Any]) -> dict[str, Any]:
    from connector.hf import HFConnector
    from kvstore.client import SyncClient

    model = _load_model(spec["model_dir"])
    with SyncClient(spec["url"]) as client:
        conn = HFConnector(model, client, model_id=MODEL_ID, block_size=spec["block_size"])
        pre = conn.prefill(spec["prompt"])
    save = pre.save
    return {"computed_tokens": pre.computed_tokens, "prefill_ms": pre.prefill_s * 1e3,
            "saved_blocks": save.written if save else 0, "saved_bytes": save.nbytes if save else 0,
            "save_ms": save.seconds * 1e3 if save else 0.0}


def _decode_worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from connector.cost import CostModel, ModelShape, calibrate_memcpy_bandwidth
    from connector.hf import HFConnector, reference_generate
    from kvstore.client import SyncClient

    model = _load_model(spec["model_dir"])
    prompt, new, bs = spec["prompt"], spec["new_tokens"], spec["block_size"]

    @torch.inference_mode()
    def forward_s(ids: list[int]) -> float:
        t0 = time.perf_counter()
        model(input_ids=torch.tensor([ids]), use_cache=True)
        return time.perf_counter() - t0

    # The cost model's rates, measured here: a real prefill and a real memory copy.
    shape = ModelShape.from_hf_config(model.config)
    forward_s(prompt[:64])  # warm up
    warm = prompt[: len(prompt) // 2]
    cost = CostModel(shape, flop_rate=shape.prefill_flops(0, len(warm)) / min(forward_s(warm) for _ in range(2)))
    cost.tiers["dram"].bandwidth.value = calibrate_memcpy_bandwidth()
    ttft_recompute = min(forward_s(prompt) for _ in range(3))
    full_tokens, full_logits = reference_generate(model, prompt, new)

    with SyncClient(spec["url"]) as client:
        conn = HFConnector(model, client, model_id=MODEL_ID, block_size=bs, cost=cost)
        where = sorted(set(_tiers(client, conn, prompt)))
        # TTFT with every cached block reloaded (a connector without a cost model loads them all;
        # timing it through `conn` would feed these short prefills to the cost model's rates)
        plain = HFConnector(model, client, model_id=MODEL_ID, block_size=bs)
        ttft_reload = []
        for _ in range(3):
            t0 = time.perf_counter()
            plain.prefill(prompt, save=False)  # the first token's logits are ready when this returns
            ttft_reload.append(time.perf_counter() - t0)
        gen = conn.generate(prompt, new)  # and store turn 1's answer blocks for turn 2
        p = gen.prefill
        d = p.decision
        decision = "no cost model" if d is None else (
            f"{d.kind}: load {d.load_blocks} of {d.available} cached blocks "
            f"(predicted TTFT {d.predicted_ttft_s * 1e3:.1f} ms vs {d.recompute_ttft_s * 1e3:.1f} ms recomputing)")
        turn1 = {
            "decision": decision, "loaded_tokens": p.loaded_tokens, "loaded_blocks": p.loaded_tokens // bs,
            "computed_tokens": p.computed_tokens, "tiers": "/".join(where),
            "load_ms": p.load.seconds * 1e3 if p.load else 0.0,
            "ttft_reload_ms": min(ttft_reload) * 1e3, "ttft_recompute_ms": ttft_recompute * 1e3,
            "tokens": gen.tokens, "match": gen.tokens == full_tokens,
            "max_logit_diff": float((gen.logits - full_logits).abs().max()),
        }
        turn1["match"] = turn1["match"] and bool(torch.allclose(gen.logits, full_logits, atol=1e-4, rtol=1e-4))

        prompt2 = prompt + gen.tokens + spec["follow_up"]
        gen2 = conn.generate(prompt2, new)
        ref2_tokens, ref2_logits = reference_generate(model, prompt2, new)
        turn2 = {
            "prompt_tokens": len(prompt2), "loaded_tokens": gen2.prefill.loaded_tokens,
            "loaded_blocks": gen2.prefill.loaded_tokens // bs, "computed_tokens": gen2.prefill.computed_tokens,
            "tokens": gen2.tokens,
            "match": (gen2.tokens == ref2_tokens
                      and bool(torch.allclose(gen2.logits, ref2_logits, atol=1e-4, rtol=1e-4))),
        }
        stats = conn.stats.as_dict()
    return {"turn1": turn1, "turn2": turn2, "connector_stats": stats}


def _tiers(client: Any, conn: Any, prompt: list[int]) -> list[str]:
    """Where the sidecar holds the prompt's blocks now."""
    return [str(t) for t, _ in client.lookup(conn.ns, conn.sched.keys(prompt)).blocks]


def _worker_main(role: str, spec_path: str) -> None:
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    spec = json.loads(Path(spec_path).read_text())
    out = {"prefill": _prefill_worker, "decode": _decode_worker}[role](spec)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    _worker_main(*sys.argv[1:3])
