"""A small paged KV cache (vLLM's CPU layout) and a stored prompt, shared by the tests that move
blocks between it and a real sidecar with the worker and scheduler sides."""

from __future__ import annotations

import numpy as np

from connector.roles import SchedulerConnector, WorkerConnector
from connector.roles.block_directory import BlockDirectory
from connector.transfer.layout import KVSpec
from kvstore.client import SyncClient
from kvstore.keys import Namespace

SPEC = KVSpec(layout="vllm_cpu", num_layers=2, kv_heads=2, head_size=8, block_size=4, dtype="float32")
NS = Namespace(model="paged-test", kv_layout="vllm_cpu", dtype="float32", block_size=4)
PROMPT = list(range(4, 4 + 6 * 4 + 1))  # 6 full blocks and one more token
BLOCKS = 8


def caches(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((BLOCKS, 2, 4, 16)).astype(np.float32) for _ in range(SPEC.num_layers)]


def stored(client: SyncClient, directory: BlockDirectory | None = None) -> tuple[list[np.ndarray], list[int]]:
    """Store the prompt's 6 full blocks from engine blocks 7, 6, ..., 2."""
    src, ids = caches(1), [7, 6, 5, 4, 3, 2]
    writer = WorkerConnector(client, NS, SPEC, directory=directory)
    writer.register_kv_caches(src)
    sched = SchedulerConnector(client, NS, SPEC)
    sched.schedule_save("w", PROMPT, ids)
    writer.start(sched.build_connector_meta())
    assert [r.written for r in writer.wait_for_saves()] == [6]
    writer.close()
    return src, ids
