"""Lookup leases end with the request: nothing stays pinned in the sidecar after a request, whether
its blocks were loaded, declined by the cost model, or never loaded (a real sidecar's /stats
``index.leases`` is the check)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from connector.cost import CostModel, ModelShape, TierRate
from connector.hf import HFConnector
from connector.roles import SchedulerConnector
from connector.roles.metadata import LoadResult
from kvstore.client import SyncClient

BS = 16
PROMPT = [(5 * i + 11) % 200 + 4 for i in range(5 * BS + 3)]


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def leases(client: SyncClient) -> int:
    return client.stats()["index"]["leases"]


def stored(model, client) -> HFConnector:
    writer = HFConnector(model, client, model_id="tiny-llama", block_size=BS)
    writer.prefill(PROMPT)
    assert leases(client) == 0
    return writer


def test_no_lease_stays_after_a_loaded_request(model, client) -> None:
    stored(model, client)
    conn = HFConnector(model, client, model_id="tiny-llama", block_size=BS)
    assert conn.sched.lease_ttl_ms > 0  # the default: a lease is taken at lookup
    gen = conn.generate(PROMPT, 2)
    assert gen.prefill.loaded_tokens == 5 * BS
    assert leases(client) == 0


def test_no_lease_stays_after_a_declined_load(model, client) -> None:
    stored(model, client)
    slow = CostModel(ModelShape.from_hf_config(model.config), flop_rate=1e15, tiers={"dram": TierRate.of(1e3, 1.0)})
    conn = HFConnector(model, client, model_id="tiny-llama", block_size=BS, cost=slow)
    pre = conn.prefill(PROMPT, save=False)
    assert pre.loaded_tokens == 0 and pre.decision is not None and pre.decision.kind == "recompute"
    assert leases(client) == 0


def test_scheduler_holds_the_lease_until_the_load_is_reported_or_the_request_ends(model, client) -> None:
    writer = stored(model, client)
    sched = SchedulerConnector(client, writer.ns, writer.spec)
    # held between lookup and load, then released by the worker's report
    assert sched.get_num_new_matched_tokens("a", PROMPT, 0) == 5 * BS
    assert leases(client) == 1
    sched.update_connector_output(load_results=[LoadResult("a", 5, (), None, 0.01, 0)])
    assert leases(client) == 0
    assert not sched.request_finished("a")
    # never loaded (e.g. aborted before allocation): released when the request finishes
    sched.get_num_new_matched_tokens("b", PROMPT, 0)
    assert leases(client) == 1
    sched.request_finished("b")
    assert leases(client) == 0
    # asked twice for one request: the first lookup's lease does not leak
    sched.get_num_new_matched_tokens("c", PROMPT, 0)
    sched.get_num_new_matched_tokens("c", PROMPT, 0)
    assert leases(client) == 1
    sched.request_finished("c")
    assert leases(client) == 0
    # all of the engine's own: nothing to look up or lease
    sched.get_num_new_matched_tokens("d", PROMPT, 5 * BS)
    assert leases(client) == 0
    sched.request_finished("d")
    assert not any(k.startswith("release.") for k in sched.stats.as_dict()["failures"])


def test_a_release_that_fails_is_not_an_error(model, client, sidecar_process) -> None:
    writer = stored(model, client)
    sched = SchedulerConnector(client, writer.ns, writer.spec)
    sched.get_num_new_matched_tokens("a", PROMPT, 0)
    sidecar_process.stop()
    assert sched.request_finished("a") is False  # the lease would expire with its TTL
    assert sum(v for k, v in sched.stats.as_dict()["failures"].items() if k.startswith("release.")) == 1
