"""The bypass reasons ``/stats`` and ``/metrics`` count are exactly those the vLLM connector gives
(issue 38): each of :data:`kvstore.stats.counters.BYPASS_REASONS` from a request vLLM can send
(prompt embeddings, a LoRA adapter without local files, a ``cache_salt`` longer than a namespace
field holds), and none other: a multimodal request is cached, its items in its keys (no
``multimodal`` reason, which was declared and never given). vLLM's own request objects through the
real :class:`connector.vllm.KVStoreConnector`, both roles, against a real sidecar
(``tests/support/vllm_requests.py``, a process of its own)."""

from __future__ import annotations

import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvstore.client import SyncClient
from kvstore.harness.sidecar import ServeProcess
from kvstore.stats.counters import BYPASS_REASONS
from tests.support.vllm_requests import run

BS, TOKENS = 32, 4 * 32 + 3


def test_every_bypass_reason_occurs_and_a_multimodal_request_is_cached(
    tiny_model_dir: Path, sidecar_process: ServeProcess
) -> None:
    requests = {
        "prompt_embeds": {"embeds": True},
        "lora": {"adapter": ["hub-adapter", 1, "someone/lora-on-a-hub"]},  # not a local directory
        "cache_salt": {"salt": "s" * 257},  # a namespace field holds 256 characters
        "image": {"images": [["c" * 64, 0, 40]]},
    }
    ops = [{"op": "store", "node": 0, "request": {"id": name, "seed": i, "tokens": TOKENS, **r}}
           for i, (name, r) in enumerate(requests.items())]
    saves = dict(zip(requests, run(tiny_model_dir, [sidecar_process.grpc], ops), strict=True))
    for reason in ("prompt_embeds", "lora", "cache_salt"):
        assert saves[reason] == {"saved_blocks": 0, f"bypassed_{reason}": 1}, reason
    assert saves["image"] == {"saved_blocks": TOKENS // BS}  # keyed with its image, not bypassed
    with SyncClient(sidecar_process.grpc) as c:
        bypasses = c.stats()["decisions"]["bypasses"]
    assert bypasses == {"prompt_embeds": 1, "lora": 1, "cache_salt": 1}
    assert set(bypasses) == set(BYPASS_REASONS)  # every declared reason occurs; none is declared in vain
    body = urllib.request.urlopen(f"http://{sidecar_process.http}/metrics").read().decode()
    shown = {s.labels["reason"]: s.value for f in text_string_to_metric_families(body) for s in f.samples
             if s.name == "kvstore_bypasses_total"}
    assert shown == {"prompt_embeds": 1, "lora": 1, "cache_salt": 1}
