"""The scheduler/worker core against a real sidecar (`kvstore serve` subprocess, shared memory),
for the vLLM layouts, with torch tensors of every element width."""

from __future__ import annotations

import pytest
import torch

from connector.roles import Failure, SchedulerConnector, WorkerConnector
from connector.transfer.layout import KVSpec
from kvstore.client import SyncClient
from kvstore.keys import Namespace

BS, L, H, D, NB = 16, 4, 2, 32, 24
TOKENS = list(range(1000, 1000 + 7 * BS + 5))  # 7 full blocks
SRC = [3, 20, 7, 1, 15, 9, 11]
DST = [0, 5, 22, 14, 2, 17, 8, 4]


def make_cache(layout: str, dtype: torch.dtype, seed: int | None) -> list[torch.Tensor]:
    shape = (NB, H, BS, 2 * D) if layout == "vllm_cpu" else (2, NB, BS, H, D)
    if seed is None:
        return [torch.zeros(shape, dtype=dtype) for _ in range(L)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(L)]


def block(cache: torch.Tensor, layout: str, b: int) -> torch.Tensor:
    return cache[b] if layout == "vllm_cpu" else cache[:, b]


SPEC = KVSpec("vllm_cpu", num_layers=L, kv_heads=H, head_size=D, block_size=BS, dtype="float32")
NS = Namespace(model="toy", kv_layout="vllm_cpu", dtype="float32", block_size=BS)


def stored(client: SyncClient, seed: int) -> tuple[WorkerConnector, SchedulerConnector]:
    """TOKENS' 7 blocks saved from engine blocks SRC of a random float32 vllm_cpu cache."""
    worker = WorkerConnector(client, NS, SPEC)
    worker.register_kv_caches(make_cache("vllm_cpu", torch.float32, seed=seed))
    sched = SchedulerConnector(client, NS, SPEC)
    sched.schedule_save("p", TOKENS, SRC)
    worker.start(sched.build_connector_meta())
    worker.wait_for_saves()
    return worker, sched


@pytest.mark.parametrize("layout", ["vllm_cpu", "vllm_gpu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_engine_to_decode_engine(client: SyncClient, layout: str, dtype: torch.dtype) -> None:
    name = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]
    spec = KVSpec(layout, num_layers=L, kv_heads=H, head_size=D, block_size=BS, dtype=name)
    ns = Namespace(model="toy", kv_layout=layout, dtype=name, block_size=BS)

    src_kv = make_cache(layout, dtype, seed=1)
    p_sched, p_worker = SchedulerConnector(client, ns, spec), WorkerConnector(client, ns, spec)
    p_worker.register_kv_caches(src_kv)
    assert p_sched.schedule_save("p", TOKENS, SRC) == 7
    p_worker.start(p_sched.build_connector_meta())
    [saved] = p_worker.wait_for_saves()
    assert (saved.written, saved.failure) == (7, None)

    dst_kv = make_cache(layout, dtype, seed=None)
    d_sched, d_worker = SchedulerConnector(client, ns, spec), WorkerConnector(client, ns, spec)
    d_worker.register_kv_caches(dst_kv)
    n = d_sched.get_num_new_matched_tokens("d", TOKENS, 0)
    assert n == 7 * BS
    d_sched.update_state_after_alloc("d", DST, n)
    d_worker.start(d_sched.build_connector_meta())
    [res] = d_worker.wait_for_loads()
    assert (res.loaded, res.failure, res.failed_block_ids) == (7, None, ())
    for s, d in zip(src_kv, dst_kv):
        for i in range(7):
            assert torch.equal(block(s, layout, SRC[i]).view(torch.uint8), block(d, layout, DST[i]).view(torch.uint8))
        assert not block(d, layout, DST[7]).any()
    p_worker.close()
    d_worker.close()


def test_other_namespace_sees_nothing(client: SyncClient) -> None:
    worker, _ = stored(client, seed=2)
    salted = Namespace(model="toy", kv_layout="vllm_cpu", dtype="float32", block_size=BS, cache_salt="tenant-b")
    assert SchedulerConnector(client, salted, SPEC).get_num_new_matched_tokens("d", TOKENS, 0) == 0
    assert SchedulerConnector(client, NS, SPEC).get_num_new_matched_tokens("d", TOKENS, 0) == 7 * BS
    worker.close()


def test_sidecar_gone_between_lookup_and_load(client: SyncClient, sidecar_process) -> None:
    worker, sched = stored(client, seed=3)
    n = sched.get_num_new_matched_tokens("d", TOKENS, 0)
    sidecar_process.stop()
    sched.update_state_after_alloc("d", DST, n)
    worker.start(sched.build_connector_meta())
    [res] = worker.wait_for_loads()
    assert (res.loaded, res.failure) == (0, Failure.UNAVAILABLE)
    assert worker.get_block_ids_with_load_errors() == set(DST[:7])
    worker.close()
