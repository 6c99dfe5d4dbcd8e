"""What both halves of ``kvstore bench transfer`` measure with: the model shapes, their block
specs, slots of a real ``Slab`` and the best-of-rounds timer. ``benchmarks.transfer`` (the suite
and its CPU half) and ``benchmarks.transfer_gpu`` (its GPU half) import it; neither imports the
other back (the suite loads the GPU half only with a device)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from connector.transfer.layout import KVSpec
from kvstore.dram.slab import Slab

SHAPES = {  # name -> (layers, kv heads, head size)
    "llama3_8b": (32, 8, 128),
    "qwen25_05b": (24, 2, 64),
    "llama3_70b_tp8": (80, 1, 128),
}
GPU_BLOCKS = {"llama3_8b": 256, "qwen25_05b": 1024, "llama3_70b_tp8": 256}
BLOCK_TOKENS = 16
MiB = 1 << 20


def best_of(rounds: int, *timed: Callable[[], float]) -> list[float]:
    """Each callable's best time over ``rounds`` rounds (one warm-up first), run back to back."""
    best = [float("inf")] * len(timed)
    for r in range(rounds + 1):
        for i, f in enumerate(timed):
            t = f()
            if r:
                best[i] = min(best[i], t)
    return best


def slab_slots(slab: Slab, block_bytes: int, n: int) -> list[np.ndarray]:
    slots = slab.take(slab.class_of(block_bytes), n)
    if len(slots) < n:
        raise RuntimeError(f"the slab holds {len(slots)} of {n} slots")
    return [slab.view(s, block_bytes) for s in slots]


def random_ids(n: int, num_blocks: int, seed: int) -> list[int]:
    return [int(b) for b in np.random.default_rng(seed).permutation(num_blocks)[:n]]


def spec_of(shape: str, layout: str) -> KVSpec:
    layers, heads, d = SHAPES[shape]
    return KVSpec(layout=layout, num_layers=layers, kv_heads=heads, head_size=d, block_size=BLOCK_TOKENS,
                  dtype="bfloat16")
