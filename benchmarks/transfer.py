"""Transfer workers against the link: gather/scatter of paged KV through real slab slots.

On a GPU (cupy with a device): for each model shape, ``CupyTransfer`` moves a batch of blocks
(vLLM's FlashAttention layout, bf16, 16-token blocks, ids out of order) between the device cache
and slots of a real pinned ``Slab``, against one raw ``cudaMemcpyAsync`` of the same bytes between
device memory and the same pinned mapping: ``gather_vs_pcie``, ``scatter_vs_pcie``; one block's
time beside its bytes at the raw rate; a save's gather and a load's scatter of other blocks at
once against two raw DMAs at once (``both_ways_vs_pcie``); and, unless ``--no-reload``,
``reload_vs_recompute_{N}``: the prefill time of N tokens of a Llama-3-8B-shaped transformers
model built on the device with random weights ÷ the time to bring the prefix's KV back through
``CupyTransfer``.

Without a GPU: ``NumpyTransfer`` for the ``vllm_cpu`` layout (Llama-3-8B shape, blocks out of
order, slots of a real ``Slab``) against one plain memcpy of the same bytes into / out of the
same mapping, on one thread each: ``gather_vs_memcpy``, ``scatter_vs_memcpy``. And the GPU path's
host work per batch (:mod:`benchmarks.transfer_host`: ``CupyTransfer`` over a cupy that does
nothing, batches of 1 to 2,048 blocks of a lease's slots): ``host_us_per_batch_{n}``,
``host_plan_us_per_batch``, ``host_plan_vs_memcpy_per_block`` (÷ the memcpy of a block's bytes
above) and the rest listed there.

Every round times ours and the baseline back to back; each figure is the best round.
"""

from __future__ import annotations

import argparse
import importlib
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.common import Result
from benchmarks.transfer_host import host_plan
from benchmarks.transfer_shapes import GPU_BLOCKS, SHAPES, MiB, best_of, random_ids, slab_slots, spec_of
from connector.transfer.engines import PagedKV, bind_caches, make_transfer
from kvstore.dram.slab import Slab


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--shapes", default=",".join(SHAPES), help="model shapes, from " + ", ".join(SHAPES))
    p.add_argument("--blocks", type=int, default=0, help="blocks per batch (default: per shape on a GPU, 128 on CPU)")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds (after one warm-up); each figure is the best")
    p.add_argument("--no-reload", action="store_true", help="skip reload_vs_recompute (GPU)")
    p.add_argument("--prompts", default="1024,4096,16384", help="prompt lengths of reload_vs_recompute")


def _cupy() -> Any | None:
    try:
        cp = importlib.import_module("cupy")
        return cp if cp.cuda.runtime.getDeviceCount() > 0 else None
    except (ImportError, RuntimeError, OSError):  # no cupy, no driver, no device
        return None


def run(args: argparse.Namespace) -> dict:
    cp = _cupy() if args.device != "cpu" else None
    if args.device == "cuda" and cp is None:
        raise SystemExit("kvstore bench transfer: --device cuda needs cupy with a CUDA device")
    res = Result("transfer")
    shapes = [s for s in args.shapes.split(",") if s]
    for s in shapes:
        if s not in SHAPES:
            raise SystemExit(f"--shapes: {s!r} is not one of {sorted(SHAPES)}")
    if cp is None:
        res.notes["device"] = "cpu"
        for s in shapes:
            _cpu_shape(res, s, args.blocks or 128, args.rounds, args.blocks)
        return res.as_dict()
    res.notes["device"] = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    from benchmarks.transfer_gpu import gpu_shape, reload_vs_recompute

    for s in shapes:
        gpu_shape(cp, res, s, args.blocks or GPU_BLOCKS[s], args.rounds)
    if not args.no_reload:
        reload_vs_recompute(cp, res, [int(n) for n in args.prompts.split(",") if n], args.rounds)
    return res.as_dict()


def _timed(f: Callable[[], object]) -> Callable[[], float]:
    def go() -> float:
        t0 = time.perf_counter()
        f()
        return time.perf_counter() - t0
    return go


def _cpu_rounds(slab: Slab, kv: PagedKV, n: int, rounds: int) -> list[float]:
    """Best times of: memcpy into the mapping, gather, memcpy out of it, scatter (the views of the
    mapping end with this call, before the slab closes)."""
    bb = kv.spec.block_bytes
    slots = slab_slots(slab, bb, n)
    region = slab.buf[: n * bb]  # the baseline's side: the same mapping, the same bytes
    src = np.random.default_rng(0).integers(0, 255, n * bb, dtype=np.uint8)
    t = make_transfer("numpy")
    ids_g, ids_s = random_ids(n, kv.num_blocks, 1), random_ids(n, kv.num_blocks, 2)
    return best_of(rounds, _timed(lambda: np.copyto(region, src)), _timed(lambda: t.gather(kv, ids_g, slots)),
                 _timed(lambda: np.copyto(src, region)), _timed(lambda: t.scatter(kv, ids_s, slots)))


def _cpu_shape(res: Result, shape: str, n: int, rounds: int, n_plan: int = 0) -> None:
    import torch

    spec = spec_of(shape, "vllm_cpu")
    bb = spec.block_bytes
    num_blocks = 2 * n
    part = (spec.kv_heads, spec.block_size, 2 * spec.head_size)
    caches = [torch.randn((num_blocks, *part), dtype=torch.float32).to(torch.bfloat16) for _ in range(spec.num_layers)]
    kv = bind_caches(spec, caches)
    slab = Slab(n * bb * 2 + 64 * MiB, page_bytes=max(32 * MiB, bb), name_prefix="kvstore-bench-transfer")
    try:
        raw_in, gather, raw_out, scatter = _cpu_rounds(slab, kv, n, rounds)
    finally:
        slab.close()
    gb = n * bb / 1e9
    res.figure(f"{shape}_memcpy_GBps", gb / raw_in, "GB/s")
    res.figure(f"{shape}_gather_GBps", gb / gather, "GB/s")
    res.figure(f"{shape}_scatter_GBps", gb / scatter, "GB/s")
    res.figure(f"{shape}_block_bytes", bb, "B")
    res.figure(f"{shape}_blocks", n, "blocks")
    res.ratio(f"{shape}_gather_vs_memcpy", raw_in / gather)
    res.ratio(f"{shape}_scatter_vs_memcpy", raw_out / scatter)
    host_plan(res, shape, n_plan, rounds, raw_in / n)
