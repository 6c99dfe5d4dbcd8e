"""Retention hints from the engines (connector/roles/hints.py) to a real sidecar process: the HF
connector's ``retain_s`` argument, and vLLM's ``kv_transfer_params`` ``{"kvstore_retain_s": 60}``
through the scheduler side's save specs (the connector metadata) to the worker's saves."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from connector.hf import HFConnector
from connector.roles import SchedulerConnector, WorkerConnector
from connector.roles.hints import retain_ms_of_params
from connector.transfer.layout import KVSpec
from connector.vllm import request_retain_ms
from kvstore.client import SyncClient
from kvstore.keys import Namespace

BS, L, H, D, NB = 4, 2, 2, 8, 16
SPEC = KVSpec("vllm_cpu", num_layers=L, kv_heads=H, head_size=D, block_size=BS, dtype="float32")
NS = Namespace(model="m", kv_layout="vllm_cpu", dtype="float32", block_size=BS)
TOKENS = list(range(100, 123))  # 5 full blocks + 3 tokens


def retained(client: SyncClient) -> int:
    return int(client.stats()["retained"]["blocks"])


def test_hf_generate_retains_the_turn_it_saves(tiny_model_dir: Path, client: SyncClient) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    hf = HFConnector(model, client, model_id="tiny-llama", block_size=16)
    prompt = [(7 * i + 3) % 200 for i in range(50)]  # 3 full blocks
    with pytest.raises(ValueError, match="retain_s: -1 is outside"):
        hf.generate(prompt, 4, retain_s=-1)
    assert client.stats()["index"]["blocks"] == 0  # refused before any work
    gen = hf.generate(prompt, 20, retain_s=30)  # prompt + output: 69 tokens, 4 full blocks
    assert [s.retained for s in gen.saves] == [3, 4]
    assert retained(client) == 4
    hf.generate([(5 * i + 1) % 200 for i in range(40)], 2)  # no hint: nothing more retained
    assert retained(client) == 4


def test_kv_transfer_params_hint_reaches_the_sidecar_through_the_save_specs(client: SyncClient, caplog) -> None:
    request = SimpleNamespace(request_id="agent-1", kv_transfer_params={"kvstore_retain_s": 60})
    ms = request_retain_ms(request)
    assert ms == 60_000
    sched = SchedulerConnector(client, NS, SPEC)
    worker = WorkerConnector(client, NS, SPEC)
    rng = np.random.default_rng(1)
    worker.register_kv_caches([rng.standard_normal((NB, H, BS, 2 * D)).astype(np.float32) for _ in range(L)])
    try:
        sched.schedule_save("agent-1", TOKENS, [7, 3, 11, 0, 5], ms)
        meta = sched.build_connector_meta()
        assert [s.retain_ms for s in meta.saves] == [60_000]
        worker.start(meta)
        worker.wait_for_saves()
    finally:
        worker.close()
    assert retained(client) == 5
    with caplog.at_level(logging.WARNING, logger="connector.vllm"):
        assert request_retain_ms(SimpleNamespace(request_id="r", kv_transfer_params={"kvstore_retain_s": "1m"})) is None
    assert "kv_transfer_params.kvstore_retain_s: want a number of seconds" in caplog.text
    assert retain_ms_of_params(None) is None and retain_ms_of_params({"other": 1}) is None
    with pytest.raises(ValueError, match="kvstore_retain_s: 100000 is outside"):
        retain_ms_of_params({"kvstore_retain_s": 100_000})


def test_hf_next_turn_with_a_hint_of_zero_ends_the_retention_it_continues(
    tiny_model_dir: Path, client: SyncClient
) -> None:
    """The next turn, sent once the tool call returned, says ``retain_s=0``: the turn it continues
    is retained no longer (the rule ``kvstore replay --hints until-continued`` measures); a turn
    that says nothing leaves the retention as it was."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    hf = HFConnector(model, client, model_id="tiny-llama", block_size=16)
    prompt = [(7 * i + 3) % 200 for i in range(50)]
    first = hf.generate(prompt, 20, retain_s=30)  # 69 tokens: 4 full blocks retained
    assert retained(client) == 4
    turn = prompt + first.tokens + [(3 * i + 2) % 200 for i in range(20)]  # the tool's answer appended
    hf.generate(turn, 2)  # no hint: the retention stays
    assert retained(client) == 4
    second = hf.generate(turn, 2, retain_s=0)
    assert retained(client) == 0
    assert all(s.retained == 0 and s.failure is None for s in second.saves)
    assert second.prefill.loaded_tokens >= 64  # it read the first turn's blocks back


def test_kv_transfer_params_hint_of_zero_ends_the_retention_through_the_save_specs(client: SyncClient) -> None:
    sched = SchedulerConnector(client, NS, SPEC)
    worker = WorkerConnector(client, NS, SPEC)
    rng = np.random.default_rng(2)
    worker.register_kv_caches([rng.standard_normal((NB, H, BS, 2 * D)).astype(np.float32) for _ in range(L)])
    try:
        turns = (("turn-1", {"kvstore_retain_s": 60}), ("turn-2", {}), ("turn-3", {"kvstore_retain_s": 0}))
        for req_id, params in turns:
            ms = request_retain_ms(SimpleNamespace(request_id=req_id, kv_transfer_params=params))
            sched.schedule_save(req_id, TOKENS, [7, 3, 11, 0, 5], ms)
            meta = sched.build_connector_meta()
            assert [s.retain_ms for s in meta.saves] == [{"turn-1": 60_000, "turn-2": None, "turn-3": 0}[req_id]]
            worker.start(meta)
            worker.wait_for_saves()
            assert retained(client) == {"turn-1": 5, "turn-2": 5, "turn-3": 0}[req_id]
    finally:
        worker.close()


def test_a_hint_of_zero_ends_the_retention_even_when_its_save_fails(client: SyncClient, caplog) -> None:
    """The end of a retention does not depend on the next turn's own blocks being stored: a save
    that fails (here engine block ids past the registered caches: an error on the worker) still
    ends the retention of the blocks it names."""
    sched = SchedulerConnector(client, NS, SPEC)
    worker = WorkerConnector(client, NS, SPEC)
    rng = np.random.default_rng(3)
    worker.register_kv_caches([rng.standard_normal((NB, H, BS, 2 * D)).astype(np.float32) for _ in range(L)])
    try:
        sched.schedule_save("turn-1", TOKENS, [7, 3, 11, 0, 5], 60_000)
        worker.start(sched.build_connector_meta())
        worker.wait_for_saves()
        assert retained(client) == 5
        turn = [*TOKENS[:20], 200, 201, 202, 203]  # turn 1's 5 blocks, then a new one, from a bad engine block
        sched.schedule_save("turn-2", turn, [7, 3, 11, 0, 5, NB + 50], 0)
        worker.start(sched.build_connector_meta())
        with caplog.at_level(logging.WARNING):
            [done] = worker.wait_for_saves()
        assert done.failure is not None and done.written == 0
        assert retained(client) == 0
    finally:
        worker.close()
