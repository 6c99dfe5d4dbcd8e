"""The GPU half of ``kvstore bench transfer`` (see benchmarks/transfer.py): imported only with a device."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.common import Result
from benchmarks.transfer_shapes import BLOCK_TOKENS, MiB, best_of, random_ids, slab_slots, spec_of
from connector.transfer.engines import bind_caches, make_transfer
from kvstore.dram.slab import Slab

_D2H, _H2D = 2, 1
SLACK_US = 30.0  # one block may take its bytes at the raw rate plus this


def _timer(cp: Any, start: Callable[[], Any]) -> Callable[[], float]:
    """Wall time of ``start()`` and the wait for what it started (a Completion, or None)."""
    def go() -> float:
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        done = start()
        if done is not None:
            done.wait()
        cp.cuda.Device().synchronize()
        return time.perf_counter() - t0
    return go


def _raw(cp: Any, kinds: list[tuple[int, int, int, int]], streams: list[Any]) -> Callable[[], None]:
    """One cudaMemcpyAsync per ``(dst, src, nbytes, kind)`` (each on its own stream), the host pointer
    pinned (the slab's registered mapping)."""
    rt = cp.cuda.runtime

    def go() -> None:
        for (dst, src, n, kind), s in zip(kinds, streams):
            rt.memcpyAsync(dst, src, n, kind, s.ptr)
    return go


def gpu_shape(cp: Any, res: Result, shape: str, n: int, rounds: int) -> None:
    import torch

    spec = spec_of(shape, "vllm_gpu")
    bb = spec.block_bytes
    num_blocks = 2 * n
    caches = [torch.randn((2, num_blocks, spec.block_size, spec.kv_heads, spec.head_size), device="cuda",
                          dtype=torch.bfloat16) for _ in range(spec.num_layers)]
    kv = bind_caches(spec, caches)
    slab = Slab(2 * n * _slot(bb) + 2 * n * bb + 64 * MiB, page_bytes=max(32 * MiB, _slot(bb)),
                name_prefix="kvstore-bench-gpu")
    t = make_transfer("cupy")
    try:
        t.register(slab.buf, page_bytes=slab.page_bytes)
        raw_d2h, gather, raw_h2d, scatter, raw_both, ours_both, raw_one, one = _gpu_rounds(cp, t, kv, slab, n, rounds)
    finally:
        t.close()
        slab.close()
    gb = n * bb / 1e9
    res.figure(f"{shape}_raw_d2h_GBps", gb / raw_d2h, "GB/s")
    res.figure(f"{shape}_raw_h2d_GBps", gb / raw_h2d, "GB/s")
    res.figure(f"{shape}_gather_GBps", gb / gather, "GB/s")
    res.figure(f"{shape}_scatter_GBps", gb / scatter, "GB/s")
    res.figure(f"{shape}_raw_both_ways_GBps", 2 * gb / raw_both, "GB/s")
    res.figure(f"{shape}_both_ways_GBps", 2 * gb / ours_both, "GB/s")
    res.figure(f"{shape}_one_block_us", one * 1e6, "us")
    res.figure(f"{shape}_one_block_at_raw_rate_us", bb / (gb * 1e9 / raw_d2h) * 1e6, "us")
    res.figure(f"{shape}_one_block_raw_dma_us", raw_one * 1e6, "us")
    res.figure(f"{shape}_block_bytes", bb, "B")
    res.figure(f"{shape}_blocks", n, "blocks")
    res.ratio(f"{shape}_gather_vs_pcie", raw_d2h / gather)
    res.ratio(f"{shape}_scatter_vs_pcie", raw_h2d / scatter)
    res.ratio(f"{shape}_both_ways_vs_pcie", raw_both / ours_both)
    # >= 1: one block within its bytes at the raw rate + 30 us
    res.ratio(f"{shape}_one_block_vs_raw_plus_30us", (bb / (gb * 1e9 / raw_d2h) + SLACK_US * 1e-6) / one)


def _gpu_rounds(cp: Any, t: Any, kv: Any, slab: Slab, n: int, rounds: int) -> list[float]:
    """Best times of: raw D2H, gather, raw H2D, scatter, both raw at once, gather and scatter at
    once, one block raw, one block gathered (the views of the slab end with this call)."""
    bb = kv.spec.block_bytes
    save, load = slab_slots(slab, bb, n), slab_slots(slab, bb, n)
    dev = cp.empty(2 * n * bb, dtype=cp.uint8)
    h0 = int(slab.buf.ctypes.data) + slab.capacity_bytes - 2 * n * bb  # the same pinned mapping, clear of the slots
    d0 = int(dev.data.ptr)
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(2)]
    ids_a, ids_b = random_ids(n, kv.num_blocks, 1), random_ids(n, kv.num_blocks, 2)

    def both() -> Any:
        g = t.gather(kv, ids_a, save)
        s = t.scatter(kv, ids_b, load)
        g.wait()
        return s

    one_way = best_of(rounds, _timer(cp, _raw(cp, [(h0, d0, n * bb, _D2H)], streams)),
                    _timer(cp, lambda: t.gather(kv, ids_a, save)),
                    _timer(cp, _raw(cp, [(d0, h0, n * bb, _H2D)], streams)),
                    _timer(cp, lambda: t.scatter(kv, ids_b, load)))
    two_ways = best_of(rounds, _timer(cp, _raw(cp, [(h0, d0, n * bb, _D2H), (d0 + n * bb, h0 + n * bb, n * bb, _H2D)],
                                             streams)), _timer(cp, both))
    single = best_of(rounds * 5, _timer(cp, _raw(cp, [(h0, d0, bb, _D2H)], streams)),
                   _timer(cp, lambda: t.gather(kv, ids_a[:1], save[:1])))
    return one_way + two_ways + single


def _slot(bb: int) -> int:
    return 1 << (bb - 1).bit_length()


def _llama3_8b(max_tokens: int) -> Any:
    """A Llama-3-8B-shaped model built on the device with random weights (bf16, sdpa): no download."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=max_tokens + 16,
                         rope_theta=500000.0, attn_implementation="sdpa")
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        try:
            return LlamaForCausalLM(config).eval()
        finally:
            torch.set_default_dtype(torch.float32)


def reload_vs_recompute(cp: Any, res: Result, prompts: list[int], rounds: int) -> None:
    """Prefill of a Llama-3-8B-shaped model ÷ the reload of the same prefix's KV from the slab."""
    import torch

    t0 = time.perf_counter()
    model = _llama3_8b(max(prompts))
    res.figure("model_build_s", time.perf_counter() - t0, "s")
    spec = spec_of("llama3_8b", "vllm_gpu")
    most = max(prompts) // BLOCK_TOKENS
    caches = [torch.zeros((2, most, spec.block_size, spec.kv_heads, spec.head_size), device="cuda",
                          dtype=torch.bfloat16) for _ in range(spec.num_layers)]
    kv = bind_caches(spec, caches)
    slab = Slab(most * spec.block_bytes + 64 * MiB, page_bytes=32 * MiB, name_prefix="kvstore-bench-gpu")
    t = make_transfer("cupy")
    try:
        t.register(slab.buf, page_bytes=slab.page_bytes)
        for n, (recompute, reload) in zip(prompts, _reload_rounds(cp, model, t, kv, slab, prompts, rounds)):
            res.figure(f"recompute_{n}_ms", recompute * 1e3, "ms")
            res.figure(f"reload_{n}_ms", reload * 1e3, "ms")
            res.ratio(f"reload_vs_recompute_{n}", recompute / reload)
    finally:
        t.close()
        slab.close()
        torch.cuda.empty_cache()


def _reload_rounds(cp: Any, model: Any, t: Any, kv: Any, slab: Slab, prompts: list[int], rounds: int) -> list[Any]:
    """(recompute, reload) best times per prompt length; the slot views end with this call."""
    import torch

    slots = slab_slots(slab, kv.spec.block_bytes, kv.num_blocks)
    out = []
    for n in prompts:
        ids = torch.randint(0, model.config.vocab_size, (1, n), device="cuda")
        blocks = n // BLOCK_TOKENS
        order = [int(b) for b in np.random.default_rng(n).permutation(kv.num_blocks)[:blocks]]

        def prefill(ids: Any = ids) -> None:
            with torch.inference_mode():
                model(input_ids=ids, use_cache=True, logits_to_keep=1)

        def reload(order: list[int] = order, blocks: int = blocks) -> Any:
            return t.scatter(kv, order, slots[:blocks])

        out.append(best_of(max(2, rounds // 2), _timer(cp, prefill), _timer(cp, reload)))
    return out
