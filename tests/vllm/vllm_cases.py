"""Prompts and helpers shared by the vLLM tests (imported as ``vllm_cases``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

BS = 32  # vLLM block size (smallest the CPU attention kernel takes)
POOL = 64  # vLLM's KV pool in blocks (num_gpu_blocks_override): 2048 tokens
NEW = 8  # generated tokens per request
WINDOW = 64  # the sliding window (tokens) of the tiny sliding-window model's windowed layer
# A tensor-parallel instance's worker processes (the in-process engine runs TP 1 only), one core each.
TP_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(4, 512, n).tolist()


# Prompts shared by every test (and by the reference run): two documents, a follow-up question
# on the first one's first 8 blocks, and a third prompt for the failure tests.
DOC_1 = tokens(1, 300)
DOC_2 = tokens(2, 333)
FOLLOW_UP = DOC_1[: 8 * BS] + tokens(3, 40)
DOC_3 = tokens(4, 290)
PROMPTS = [DOC_1, DOC_2, FOLLOW_UP, DOC_3]


def fill(seed: int) -> list[list[int]]:
    """Fresh prompts that need more blocks than vLLM's pool: running them evicts its cache."""
    from benchmarks.vllm import evict_prompts

    rng = np.random.default_rng(1000 + seed)
    return evict_prompts(lambda n: rng.integers(4, 512, n).tolist(), POOL, BS)


def instance(
    model: Path, kv: dict[str, Any] | None, phases: list[dict[str, Any]], env: dict[str, str] | None = None,
    **spec_extra: Any,
) -> dict[str, Any]:
    """One vLLM instance's results; ``spec_extra``: more of its spec over the defaults here
    (kvstore/harness/phases.py), e.g. ``kv_cache_dtype``, ``dtype``, ``tensor_parallel_size``."""
    from kvstore.harness.instance import run_instance

    spec = {"model": str(model), "block_size": BS, "num_blocks": POOL, "max_model_len": 1024, "dtype": "float32",
            "kv_transfer_config": kv, "phases": phases, **spec_extra}
    return run_instance(spec, env=env, timeout=600)


def outputs(result: dict[str, Any], phase: str) -> list[list[int]]:
    return [r["tokens"] for r in result["phases"][phase]["requests"]]


def loadable(prompt: list[int], bs: int = BS) -> int:
    """Tokens the connector can load of ``prompt``: its full blocks of ``bs`` tokens, keeping the
    last prompt token to compute."""
    return (len(prompt) - 1) // bs * bs


def by_source(result: dict[str, Any], phase: str) -> list[dict[str, int]]:
    """Where each request of a phase got its prompt tokens (``local_cache_hit``, ``external_kv_transfer``, ...)."""
    return [r["by_source"] for r in result["phases"][phase]["requests"]]


def index(url: str) -> dict[str, int]:
    """The sidecar's index counts (``namespaces``, ``blocks``, ``allocations``, ``leases``)."""
    from kvstore.client import SyncClient

    with SyncClient(url) as c:
        return dict(c.stats()["index"])


def stop_tqdm_monitors() -> None:
    """Stop the monitor thread tqdm starts with its first progress bar (building the tiny model
    shows one): nothing of the build is left running in the test process."""
    import threading

    from tqdm._monitor import TMonitor

    for t in threading.enumerate():
        if isinstance(t, TMonitor):
            t.exit()
