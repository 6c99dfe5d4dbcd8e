"""Scheduler and worker sides against an in-process sidecar double: decisions, transfers, failures."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from connector_fakes import FakeClient

from connector.cost import CostModel, ModelShape, TierRate
from connector.roles import (
    ConnectorMetadata,
    Failure,
    Role,
    SchedulerConnector,
    WorkerConnector,
)
from connector.transfer.layout import KVSpec
from kvstore.keys import Namespace

BS, L, H, D, NB = 4, 2, 2, 8, 16
SPEC = KVSpec("vllm_cpu", num_layers=L, kv_heads=H, head_size=D, block_size=BS, dtype="float32")
NS = Namespace(model="m", kv_layout="vllm_cpu", dtype="float32", block_size=BS)


def caches(seed: int | None) -> list[np.ndarray]:
    if seed is None:
        return [np.zeros((NB, H, BS, 2 * D), np.float32) for _ in range(L)]
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((NB, H, BS, 2 * D)).astype(np.float32) for _ in range(L)]


class Engine:
    """A toy engine: one scheduler side, one worker side, its own paged cache."""

    def __init__(self, client: FakeClient, seed: int | None = None, cost: CostModel | None = None) -> None:
        self.kv = caches(seed)
        self.sched = SchedulerConnector(client, NS, SPEC, cost)
        self.worker = WorkerConnector(client, NS, SPEC, cost=cost)
        self.worker.register_kv_caches(self.kv)

    def step(self) -> ConnectorMetadata:
        meta = self.sched.build_connector_meta()
        self.worker.start(meta)
        return meta

    def save(self, req: str, tokens: list[int], block_ids: list[int]) -> None:
        self.sched.schedule_save(req, tokens, block_ids)
        self.step()
        self.worker.wait_for_saves()

    def load(self, req: str, tokens: list[int], block_ids: list[int], computed: int = 0) -> int:
        n = self.sched.get_num_new_matched_tokens(req, tokens, computed)
        self.sched.update_state_after_alloc(req, block_ids, n)
        self.step()
        self.worker.wait_for_loads()
        return n

    def close(self) -> None:
        self.worker.close()


TOKENS = list(range(100, 123))  # 23 tokens: 5 full blocks + 3
SRC_BLOCKS = [7, 3, 11, 0, 5]
DST_BLOCKS = [2, 9, 4, 13, 8, 6]


@pytest.fixture
def client() -> FakeClient:
    return FakeClient()


@pytest.fixture
def prefill(client: FakeClient):
    eng = Engine(client, seed=1)
    eng.save("p", TOKENS, SRC_BLOCKS)
    yield eng
    eng.close()


def same_block(a: Engine, ia: int, b: Engine, ib: int) -> bool:
    return all(np.array_equal(x[ia], y[ib]) for x, y in zip(a.kv, b.kv))


def test_roles() -> None:
    assert SchedulerConnector.role is Role.SCHEDULER and WorkerConnector.role is Role.WORKER


def test_save_then_load_into_other_engine(client: FakeClient, prefill: Engine) -> None:
    assert prefill.worker.stats["saved_blocks"] == 5
    dec = Engine(client)
    try:
        assert dec.load("d", TOKENS, DST_BLOCKS) == 5 * BS
        for i in range(5):
            assert same_block(prefill, SRC_BLOCKS[i], dec, DST_BLOCKS[i])
        assert not dec.kv[0][DST_BLOCKS[5]].any()  # the partial block is not loaded
        assert dec.worker.get_block_ids_with_load_errors() == set()
        assert dec.worker.stats["loaded_blocks"] == 5
    finally:
        dec.close()


def test_metadata_is_handed_over_once(client: FakeClient, prefill: Engine) -> None:
    dec = Engine(client)
    n = dec.sched.get_num_new_matched_tokens("d", TOKENS, 0)
    dec.sched.update_state_after_alloc("d", DST_BLOCKS, n)
    meta = dec.sched.build_connector_meta()
    assert [(s.req_id, s.block_ids, s.first_block) for s in meta.loads] == [("d", tuple(DST_BLOCKS[:5]), 0)]
    assert not dec.sched.build_connector_meta()
    dec.close()


def test_saving_again_copies_nothing(client: FakeClient, prefill: Engine) -> None:
    prefill.save("p2", TOKENS, SRC_BLOCKS)
    assert prefill.worker.stats["saved_blocks"] == 5
    assert prefill.worker.stats["save_present_blocks"] == 5


def test_block_aligned_prompt_leaves_the_last_block(client: FakeClient, prefill: Engine) -> None:
    dec = Engine(client)
    assert dec.load("d", TOKENS[:20], DST_BLOCKS) == 4 * BS
    dec.close()


def test_engine_local_hits_are_not_loaded_again(client: FakeClient, prefill: Engine) -> None:
    dec = Engine(client)
    assert dec.load("d", TOKENS, DST_BLOCKS, computed=2 * BS) == 3 * BS
    assert not dec.kv[0][DST_BLOCKS[0]].any() and not dec.kv[0][DST_BLOCKS[1]].any()
    assert all(same_block(prefill, SRC_BLOCKS[i], dec, DST_BLOCKS[i]) for i in (2, 3, 4))
    dec.close()


def test_cost_model_recomputes_from_a_slow_tier(client: FakeClient, prefill: Engine) -> None:
    for k in list(client.blocks):
        client.tier[k[1]] = "s3"
    shape = ModelShape(params=1000, layers=L, q_heads=H, head_dim=D)
    slow = CostModel(shape, flop_rate=1e9, tiers={"s3": TierRate.of(1e6, 0.05)})
    dec = Engine(client, cost=slow)
    assert dec.load("d", TOKENS, DST_BLOCKS) == 0
    assert client.calls["acquire"] == 0
    assert slow.snapshot()["decisions"]["recompute"] == 1
    assert dec.sched.stats["decided_recompute_blocks"] == 5
    dec.close()


def test_observed_load_updates_the_cost_model(client: FakeClient, prefill: Engine) -> None:
    shape = ModelShape(params=1000, layers=L, q_heads=H, head_dim=D)
    fast = CostModel(shape, flop_rate=1e3, tiers={"dram": TierRate.of(1e9, 0.0)})
    dec = Engine(client, cost=fast)
    assert dec.load("d", TOKENS, DST_BLOCKS) == 5 * BS
    assert fast.tiers["dram"].bandwidth.samples == 1
    dec.close()


def test_unreachable_sidecar_at_lookup_means_recompute(client: FakeClient, prefill: Engine, caplog) -> None:
    client.down.add("lookup")
    dec = Engine(client)
    with caplog.at_level(logging.WARNING):
        assert dec.load("d", TOKENS, DST_BLOCKS) == 0
    assert dec.sched.stats["lookup.unavailable"] == 1
    assert "recomputing" in caplog.text
    dec.close()


def test_unreachable_sidecar_at_load_reports_every_block(client: FakeClient, prefill: Engine) -> None:
    dec = Engine(client)
    n = dec.sched.get_num_new_matched_tokens("d", TOKENS, 0)
    client.down.add("acquire")
    dec.sched.update_state_after_alloc("d", DST_BLOCKS, n)
    dec.step()
    [res] = dec.worker.wait_for_loads()
    assert (res.loaded, res.failure) == (0, Failure.UNAVAILABLE)
    assert dec.worker.get_block_ids_with_load_errors() == set(DST_BLOCKS[:5])
    assert dec.worker.get_block_ids_with_load_errors() == set()  # drained
    assert dec.worker.stats["load.unavailable"] == 1
    dec.close()


def test_corrupted_block_is_recomputed_from_there(client: FakeClient, prefill: Engine) -> None:
    keys = prefill.sched.keys(TOKENS)
    client.corrupt(NS, keys[3])
    dec = Engine(client)
    n = dec.sched.get_num_new_matched_tokens("d", TOKENS, 0)
    dec.sched.update_state_after_alloc("d", DST_BLOCKS, n)
    dec.step()
    [res] = dec.worker.wait_for_loads()
    assert (res.loaded, res.failure) == (3, Failure.CHECKSUM)
    assert dec.worker.get_block_ids_with_load_errors() == {DST_BLOCKS[3], DST_BLOCKS[4]}
    assert all(same_block(prefill, SRC_BLOCKS[i], dec, DST_BLOCKS[i]) for i in range(3))
    assert not dec.kv[0][DST_BLOCKS[3]].any()  # corrupted bytes never reach the engine
    assert dec.worker.stats["load.checksum"] == 1
    dec.close()


def test_block_evicted_after_lookup(client: FakeClient, prefill: Engine) -> None:
    dec = Engine(client)
    n = dec.sched.get_num_new_matched_tokens("d", TOKENS, 0)
    client.evict(NS, prefill.sched.keys(TOKENS)[2])
    dec.sched.update_state_after_alloc("d", DST_BLOCKS, n)
    dec.step()
    [res] = dec.worker.wait_for_loads()
    assert (res.loaded, res.failure, res.failed_block_ids) == (2, Failure.MISSING, tuple(DST_BLOCKS[2:5]))
    dec.close()


def test_failed_save_is_dropped_and_counted(client: FakeClient) -> None:
    client.down.add("commit")
    eng = Engine(client, seed=2)
    eng.save("p", TOKENS, SRC_BLOCKS)
    assert eng.worker.stats["save.unavailable"] == 1 and eng.worker.stats["saved_blocks"] == 0
    assert client.aborted == 1 and not client.blocks
    eng.close()


def test_async_completion_tracking(client: FakeClient, prefill: Engine) -> None:
    dec = Engine(client)
    n = dec.sched.get_num_new_matched_tokens("d", TOKENS, 0)
    dec.sched.update_state_after_alloc("d", DST_BLOCKS, n)
    dec.sched.schedule_save("s", TOKENS, DST_BLOCKS)
    dec.step()
    assert dec.sched.request_finished("s") is True  # save in flight: keep its blocks
    saved: set[str] = set()
    loaded: set[str] = set()
    while saved != {"s"} or loaded != {"d"}:
        s, ld = dec.worker.get_finished()
        saved |= s
        loaded |= ld
    dec.sched.update_connector_output(finished_saving=saved)
    assert dec.sched.request_finished("s") is False
    assert dec.worker.get_finished() == (set(), set())
    dec.close()


def test_update_state_rejects_more_than_offered(client: FakeClient, prefill: Engine) -> None:
    dec = Engine(client)
    dec.sched.get_num_new_matched_tokens("d", TOKENS, 0)
    with pytest.raises(ValueError, match="were offered"):
        dec.sched.update_state_after_alloc("d", DST_BLOCKS, 6 * BS)
    dec.close()


def test_stats_are_json(client: FakeClient, prefill: Engine) -> None:
    import json

    d = prefill.worker.stats.as_dict()
    json.dumps(d)
    assert d["saved_bytes"] == 5 * SPEC.block_bytes


def test_outcomes_are_reported_to_the_sidecar(client: FakeClient, prefill: Engine) -> None:
    keys = prefill.sched.keys(TOKENS)
    client.corrupt(NS, keys[4])
    dec = Engine(client)
    dec.load("d", TOKENS, DST_BLOCKS)
    dec.close()  # flushes
    [rec] = client.reports
    assert rec["outcome"] == "fallback:checksum"
    assert (rec["loaded_blocks"], rec["cached_blocks"], rec["tier"], rec["namespace"]) == (4, 5, "dram", "m")


def test_reports_are_dropped_when_the_sidecar_is_down(client: FakeClient, prefill: Engine) -> None:
    client.down.add("report")
    dec = Engine(client)
    dec.load("d", TOKENS, DST_BLOCKS)
    dec.close()
    assert dec.worker.reporter.dropped == 1 and not client.reports


def test_slowest_tier() -> None:
    from connector.roles.report import slowest_tier

    assert slowest_tier(["dram", "s3", "ssd"]) == "s3"
    assert slowest_tier(["dram", "tape"]) == "tape"
    assert slowest_tier([]) == ""
