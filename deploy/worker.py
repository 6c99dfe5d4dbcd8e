"""Example prefill / decode workers for the compose topology (tiny random-weight Llama).

    python deploy/worker.py prefill --url grpc://kvstore:50051 --model-dir /models/tiny-llama
    python deploy/worker.py decode  --url grpc://kvstore:50051 --model-dir /models/tiny-llama --expect-hits
    python deploy/worker.py model   --model-dir /models/tiny-llama     # only build the model (for vLLM)

Both roles derive the same prompts from ``--seed`` (a shared system prompt plus a per-request
tail), so the decode worker finds the blocks the prefill worker stored. The prefill worker
computes each prompt and stores its full KV blocks in the sidecar; the decode worker loads the
cached prefix (through the shared-memory slab), computes the rest, decodes greedily and checks
the tokens against a run with no cache at all. One JSON line per prompt, then a summary line.

The bearer token comes from ``--token`` or ``KVSTORE_TOKEN``; ``grpcs://`` URLs use TLS with
``--ca`` as the root certificate. The model is built on first use (deterministic for a seed) and
shared by both roles through ``--model-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout too


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="kvstore example worker (prefill or decode)")
    p.add_argument("role", choices=("prefill", "decode", "model"))
    p.add_argument("--url", default=os.environ.get("KVSTORE_URL", "grpc://127.0.0.1:50051"))
    p.add_argument("--token", default=os.environ.get("KVSTORE_TOKEN", ""))
    p.add_argument("--ca", default=os.environ.get("KVSTORE_CA", ""), help="PEM root certificate for grpcs://")
    p.add_argument("--model-dir", type=Path, default=Path(os.environ.get("KVSTORE_MODEL_DIR", "/models/tiny-llama")))
    p.add_argument("--model-id", default="tiny-llama")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-new", type=int, default=8, help="decode: tokens to generate per prompt")
    p.add_argument("--wait-s", type=float, default=120.0, help="decode: how long to wait for the prefill's blocks")
    p.add_argument("--expect-hits", action="store_true", help="decode: exit 1 unless every prompt loaded a prefix")
    return p.parse_args(argv)


def ensure_model(model_dir: Path, seed: int = 0) -> Path:
    """Build the tiny model once; concurrent workers race safely (build aside, then rename)."""
    if (model_dir / "config.json").exists():
        return model_dir
    from kvstore.harness.tiny_model import build_tiny_llama

    model_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = model_dir.with_name(f"{model_dir.name}.tmp-{os.getpid()}")
    build_tiny_llama(tmp, seed=seed)
    try:
        os.rename(tmp, model_dir)
    except OSError:  # another worker finished first: same bytes, keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return model_dir


def make_prompts(n: int, seed: int, block_size: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(4, vocab) for _ in range(4 * block_size)]
    return [
        system + [rng.randrange(4, vocab) for _ in range(2 * block_size + rng.randrange(1, block_size))]
        for _ in range(n)
    ]


def wait_for_blocks(client: Any, conn: Any, prompt: list[int], deadline: float) -> int:
    """Poll (batched Lookup) until the prompt's full blocks are all in the sidecar or time is up."""
    n = len(prompt) // conn.spec.block_size
    keys = conn.sched.keys(prompt[: n * conn.spec.block_size])
    while True:
        matched = client.lookup(conn.ns, keys).matched
        if matched == len(keys) or time.monotonic() > deadline:
            return matched
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role == "model":  # the model directory for other services (the cluster profile's vLLM servers)
        print(json.dumps({"role": "model", "model_dir": str(ensure_model(args.model_dir, args.seed))}), flush=True)
        return 0
    from kvstore.util.tuning import tune_malloc

    tune_malloc()
    import torch
    from transformers import AutoModelForCausalLM

    from connector.hf import HFConnector, reference_generate
    from kvstore.client import SyncClient

    model_dir = ensure_model(args.model_dir, args.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = make_prompts(args.prompts, args.seed, args.block_size, model.config.vocab_size)
    kw: dict[str, Any] = {"token": args.token}
    if args.ca:
        kw["root_certificates"] = Path(args.ca).read_bytes()
    totals = {"prompts": 0, "prompt_tokens": 0, "loaded_tokens": 0, "computed_tokens": 0, "mismatches": 0, "misses": 0}
    with SyncClient(args.url, **kw) as client:
        client.wait_ready(args.wait_s)
        conn = HFConnector(model, client, model_id=args.model_id, block_size=args.block_size)
        deadline = time.monotonic() + args.wait_s
        for i, prompt in enumerate(prompts):
            line: dict[str, Any] = {"role": args.role, "prompt": i, "tokens": len(prompt)}
            if args.role == "prefill":
                pre = conn.prefill(prompt)
                line.update(loaded_tokens=pre.loaded_tokens, computed_tokens=pre.computed_tokens,
                            stored_blocks=pre.save.written if pre.save else 0)
            else:
                line["cached_blocks"] = wait_for_blocks(client, conn, prompt, deadline)
                gen = conn.generate(prompt, args.max_new, save=False)
                ref, _ = reference_generate(model, prompt, args.max_new)
                pre = gen.prefill
                line.update(loaded_tokens=pre.loaded_tokens, computed_tokens=pre.computed_tokens,
                            new_tokens=gen.tokens, matches_reference=gen.tokens == ref)
                totals["mismatches"] += gen.tokens != ref
                totals["misses"] += pre.loaded_tokens == 0
            totals["prompts"] += 1
            totals["prompt_tokens"] += len(prompt)
            totals["loaded_tokens"] += pre.loaded_tokens
            totals["computed_tokens"] += pre.computed_tokens
            print(json.dumps(line), flush=True)
    print(json.dumps({"role": args.role, "summary": totals}), flush=True)
    if totals["mismatches"] or (args.expect_hits and totals["misses"]):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
