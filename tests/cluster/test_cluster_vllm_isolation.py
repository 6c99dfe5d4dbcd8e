"""Isolation across a cluster of two sidecars (issue 38): a request stored through sidecar 1 under
salt A, LoRA adapter A or image A is never found through sidecar 2 under salt B, adapter B or
image B (nor without a salt, an adapter or an image): zero tokens offered and nothing fetched from
sidecar 1, whose directory records A's blocks; the same A requests through sidecar 2 find every
loadable block over the peer path, byte for byte.

Two real ``kvstore serve`` processes joined through one real redis-server directory; the vLLM side
is vLLM's own request objects through the real :class:`connector.vllm.KVStoreConnector`, both
roles, driven hook by hook without an engine (``tests/support/vllm_requests.py``, a process of its
own): a ``kv_producer`` on sidecar 1, a ``kv_consumer`` on sidecar 2. (Salts and adapters through
real vLLM instances on one sidecar: tests/vllm/test_vllm_namespaces.py, test_vllm_lora.py.)
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.client import SyncClient
from kvstore.harness.servers import RedisServer
from kvstore.harness.sidecar import ServeProcess
from tests.cluster.nodes import serve_args, serve_env
from tests.support.vllm_requests import run

BS = 32
TOKENS = 8 * BS + 5  # 8 full blocks, all loadable (the last prompt token is computed)
LOADABLE = (TOKENS - 1) // BS * BS
IMAGE_A = "a" * 63 + "1"  # vLLM's identifiers: content hashes or client UUIDs, never truncated
IMAGE_B = "b" * 64
IMAGE_A_LAST_DIFFERS = "a" * 63 + "2"


@pytest.fixture
def sidecars(tmp_path: Path, directory: RedisServer) -> Iterator[tuple[ServeProcess, ServeProcess]]:
    dram = {"dram__capacity_bytes": str(16 << 20)}  # 512 blocks of 32 KiB
    prefix = f"iso{abs(hash(tmp_path)) % 10**8}"
    with (ServeProcess(serve_args(tmp_path, "n1"), env=serve_env(directory, "n1", prefix, **dram)) as one,
          ServeProcess(serve_args(tmp_path, "n2"), env=serve_env(directory, "n2", prefix, **dram)) as two):
        yield one, two


def test_salt_adapter_and_image_a_are_never_found_as_b_on_another_sidecar(
    tmp_path: Path, sidecars: tuple[ServeProcess, ServeProcess]
) -> None:
    from kvstore.harness.tiny_model import build_tiny_llama, build_tiny_lora

    model = build_tiny_llama(tmp_path / "model", seed=0)
    lora_a = build_tiny_lora(tmp_path / "lora-a", model, seed=1)
    lora_b = build_tiny_lora(tmp_path / "lora-b", model, seed=2)
    lora_a_copy = Path(shutil.copytree(lora_a, tmp_path / "elsewhere" / "lora-a-copy"))
    one, two = sidecars

    def req(name: str, seed: int, **extra: Any) -> dict[str, Any]:
        return {"id": name, "seed": seed, "tokens": TOKENS, **extra}

    salt, lora, image = 1, 2, 3  # each kind's prompt (token ids) by seed
    stored = {
        "salt-a": req("salt-a", salt, salt="tenant-a"),
        "lora-a": req("lora-a", lora, adapter=["a", 1, str(lora_a)]),
        "image-a": req("image-a", image, images=[[IMAGE_A, 0, 50]]),  # blocks 0-1: every key of the chain
    }
    others = {  # never A's blocks: same token ids, another salt, adapter or image, or none
        "salt-b": req("salt-b", salt, salt="tenant-b"),
        "no-salt": req("no-salt", salt),
        "lora-b": req("lora-b", lora, adapter=["b", 1, str(lora_b)]),  # the id A has on sidecar 1
        "no-lora": req("no-lora", lora),
        "image-b": req("image-b", image, images=[[IMAGE_B, 0, 50]]),
        "image-a-last-char": req("image-a-last-char", image, images=[[IMAGE_A_LAST_DIFFERS, 0, 50]]),
        "image-a-moved": req("image-a-moved", image, images=[[IMAGE_A, BS, 50]]),
        "no-image": req("no-image", image),
    }
    again = {  # A again, through sidecar 2 (the adapter: A's files at another path, name and id)
        "salt-a": req("salt-a-2", salt, salt="tenant-a"),
        "lora-a": req("lora-a-2", lora, adapter=["a-copy", 7, str(lora_a_copy)]),
        "image-a": req("image-a-2", image, images=[[IMAGE_A, 0, 50]]),
    }
    ops = ([{"op": "store", "node": 0, "request": r} for r in stored.values()]
           + [{"op": "find", "node": 1, "request": r} for r in others.values()]
           + [{"op": "find", "node": 1, "request": r, "stored_by": a} for a, r in again.items()])
    results = run(model, [one.grpc, two.grpc], ops)
    saves, finds = results[: len(stored)], results[len(stored):]
    assert saves == [{"saved_blocks": TOKENS // BS}] * len(stored)  # none bypassed: each stored in full
    got = dict(zip([*others, *again], finds, strict=True))
    for name in others:
        assert got[name] == {"tokens": 0, "equal": False, "fetched": 0}, name  # no hit, no peer fetch
    for name in again:
        assert got[name] == {"tokens": LOADABLE, "equal": True, "fetched": LOADABLE // BS}, name  # the peer path
    with SyncClient(one.grpc) as c1, SyncClient(two.grpc) as c2:
        s1, s2 = c1.stats(), c2.stats()
    assert s1["index"]["blocks"] == len(stored) * (TOKENS // BS)  # sidecar 1: A's blocks, nothing else
    assert s2["index"]["blocks"] == len(again) * (LOADABLE // BS)  # sidecar 2: the replicas A fetched
    assert s2["cluster"]["blocks_fetched"] == len(again) * (LOADABLE // BS)
    assert s1["cluster"]["blocks_lent"] == len(again) * (LOADABLE // BS)  # sidecar 1 lent A's blocks to A only
