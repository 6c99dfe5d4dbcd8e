"""vLLM's connector hooks driven by hand, in a process of its own (:func:`run`).

No engine runs: the process builds a real ``VllmConfig`` for the tiny Llama and, per sidecar, the
real :class:`connector.vllm.KVStoreConnector` in both roles (a ``kv_producer`` on the first URL, a
``kv_consumer`` on each other one), then calls the hooks vLLM's scheduler and worker call, in
vLLM's order, with vLLM's own objects (``Request`` with its ``cache_salt``, ``LoRARequest``,
``MultiModalFeatureSpec``; ``KVCacheBlocks``, ``SchedulerOutput``, ``KVConnectorOutput``):

* ``{"op": "store", "node": 0, "request": R}``: the request's prompt is "computed" into engine
  blocks 0.. of that node's KV caches (random bytes, other ones per store) and saved; returns once
  its saves are done (on a ``kv_producer``: listed in the cluster directory).
* ``{"op": "find", "node": 1, "request": R, "stored_by": ID}``: a new request on that node: the
  tokens its connector offers, which are loaded into engine blocks 0.. and compared byte for byte
  with those request ``ID``'s store computed, and the blocks the node's sidecar fetched from peers
  meanwhile.

``R``: ``{"id", "seed", "tokens", "salt", "adapter": [name, id, path], "images": [[identifier,
offset, length]], "embeds": bool}`` (all but ``id`` optional). Prints one JSON line: a result per op. Run in its
own process (as every vLLM instance in these tests), so no vLLM state reaches pytest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np
import torch

BS = 32  # vLLM block size (the CPU attention kernel's smallest)
NUM_BLOCKS = 64  # each engine's KV pool
SAVE_WAIT_S = 120  # a store's saves are waited for this long before the probe gives up


def prompt(r: dict[str, Any]) -> list[int]:
    return np.random.default_rng(r.get("seed", 0)).integers(4, 500, r.get("tokens", 8 * BS + 5)).tolist()


def request(r: dict[str, Any]) -> Any:
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    images = [MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                    mm_position=PlaceholderRange(offset=offset, length=length))
              for ident, offset, length in r.get("images", ())]
    lora = LoRARequest(*r["adapter"]) if r.get("adapter") else None
    tokens: list[int] | None = prompt(r)
    embeds = None
    if r.get("embeds"):  # sent as prompt embeddings, one per token, instead of token ids
        embeds, tokens = torch.randn(len(tokens or ()), 8, generator=torch.Generator().manual_seed(0)), None
    return Request(r["id"], tokens, SamplingParams(max_tokens=1), None, prompt_embeds=embeds,
                   mm_features=images or None, lora_request=lora, cache_salt=r.get("salt"))


class Node:
    """One engine on one sidecar: the connector's scheduler and worker roles, and its KV caches."""

    def __init__(self, model: str, url: str, role: str) -> None:
        from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

        from connector.vllm import KVStoreConnector

        mc = ModelConfig(model=model, tokenizer=model, dtype="float32")
        kv = KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="connector.vllm",
                              kv_role=role, kv_connector_extra_config={"url": url})
        config = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=BS), kv_transfer_config=kv)
        hf = mc.hf_config
        heads, head_size = hf.num_key_value_heads, hf.hidden_size // hf.num_attention_heads
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=heads, head_size=head_size, dtype=torch.float32)
        layers = [f"model.layers.{i}.self_attn.attn" for i in range(hf.num_hidden_layers)]
        kcc = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                            kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
        self.sched = KVStoreConnector(config, KVConnectorRole.SCHEDULER, kcc)
        self.worker = KVStoreConnector(config, KVConnectorRole.WORKER, kcc)
        self.caches = {name: torch.zeros((NUM_BLOCKS, heads, BS, 2 * head_size)) for name in layers}
        self.worker.register_kv_caches(self.caches)
        self.stored: dict[str, list[torch.Tensor]] = {}  # request id -> the blocks its store computed, per layer

    def fetched(self) -> int:
        return int(self.sched.client.stats()["cluster"]["blocks_fetched"])

    def step(self, req: Any, computed: int, blocks: list[int]) -> None:
        """One scheduler step that schedules the rest of ``req``'s prompt on ``blocks``, ``computed``
        tokens of it loaded by the connector; the worker runs the step's loads and saves."""
        from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

        req.num_computed_tokens = computed
        n = req.num_tokens - computed
        out = SchedulerOutput(scheduled_new_reqs=[NewRequestData.from_request(req, (blocks,))],
                              scheduled_cached_reqs=CachedRequestData.make_empty(),
                              num_scheduled_tokens={req.request_id: n}, total_num_scheduled_tokens=n,
                              scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(),
                              free_encoder_mm_hashes=[])
        self.worker.bind_connector_metadata(self.sched.build_connector_meta(out))
        self.worker.start_load_kv(None)  # type: ignore[arg-type]  # no forward context: nothing reads it
        self.worker.wait_for_save()
        self.worker.clear_connector_metadata()

    def ask(self, req: Any) -> int:
        """What vLLM's scheduler does with a new request first: the tokens the connector offers."""
        self.sched.on_new_request(req)
        n, asynchronous = self.sched.get_num_new_matched_tokens(req, 0)
        assert n is not None and not asynchronous
        return n

    def store(self, req: Any) -> dict[str, Any]:
        from vllm.v1.outputs import KVConnectorOutput

        before = self.worker.kvstore_stats()
        assert self.ask(req) == 0  # a kv_producer never loads
        blocks = self.allocate(req, 0)
        g = torch.Generator().manual_seed(len(self.stored))  # "computing" the prompt: other bytes per request
        for cache in self.caches.values():
            cache.copy_(torch.randn(cache.shape, generator=g))
        self.stored[req.request_id] = [cache[: len(blocks)].clone() for cache in self.caches.values()]
        self.step(req, 0, blocks)
        delay, _ = self.sched.request_finished(req, blocks)
        deadline, finished, done = time.monotonic() + SAVE_WAIT_S, {req.request_id}, set()
        while delay and not done:  # what vLLM's engine loop does until finished_sending names it
            assert time.monotonic() < deadline, f"{req.request_id}: saves not done after {SAVE_WAIT_S} s"
            done = self.worker.get_finished(finished)[0] or set()
            finished = set()
            time.sleep(0.01)
        self.sched.update_connector_output(KVConnectorOutput(finished_sending=done))
        after = self.worker.kvstore_stats()
        delta = {k: v - before.get(k, 0) for k, v in after.items() if isinstance(v, int)}
        bypassed = {k: n for k, n in delta.items() if k.startswith("bypassed_") and n}
        return {"saved_blocks": delta.get("saved_blocks", 0), **bypassed}

    def allocate(self, req: Any, n: int) -> list[int]:
        """Engine blocks 0.. for the whole prompt, told to the scheduler side as vLLM does."""
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.core.kv_cache_utils import KVCacheBlock

        blocks = list(range(-(-req.num_tokens // BS)))
        self.sched.update_state_after_alloc(req, KVCacheBlocks((tuple(KVCacheBlock(b) for b in blocks),)), n)
        return blocks

    def find(self, req: Any, stored: list[torch.Tensor] | None) -> dict[str, Any]:
        """``stored``: the blocks the request is to find (another request's store), per layer."""
        before = self.fetched()
        n = self.ask(req)
        blocks = self.allocate(req, n)
        for cache in self.caches.values():
            cache.zero_()
        self.step(req, n, blocks)
        assert not self.worker.get_block_ids_with_load_errors()
        self.sched.request_finished(req, blocks)
        loaded = n // BS
        caches = zip(self.caches.values(), stored or (), strict=False)
        equal = stored is not None and all(torch.equal(c[:loaded], want[:loaded]) for c, want in caches)
        return {"tokens": n, "equal": equal, "fetched": self.fetched() - before}

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()


def main(spec: dict[str, Any]) -> list[dict[str, Any]]:
    nodes = [Node(spec["model"], url, "kv_producer" if i == 0 else "kv_consumer") for i, url in enumerate(spec["urls"])]
    try:
        out = []
        for op in spec["ops"]:
            node, req = nodes[op["node"]], request(op["request"])
            if op["op"] == "store":
                out.append(node.store(req))
            else:
                out.append(node.find(req, nodes[0].stored.get(op.get("stored_by", ""))))
        return out
    finally:
        for node in nodes:
            node.close()


def run(model: str | os.PathLike[str], urls: list[str], ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`main` in a process of its own (vLLM's environment of the tests' instances); its results."""
    from kvstore.harness.instance import VLLM_ENV, repo_pythonpath

    spec = json.dumps({"model": str(model), "urls": urls, "ops": ops})
    done = subprocess.run([sys.executable, __file__, spec], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **VLLM_ENV, "PYTHONPATH": repo_pythonpath()})
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-5000:]
    [line] = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULTS ")]
    results: list[dict[str, Any]] = json.loads(line.removeprefix("RESULTS "))
    return results


if __name__ == "__main__":
    print("RESULTS " + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
