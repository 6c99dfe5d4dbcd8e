"""Prefill/decode handoff through a real sidecar with a tiny random-weight Llama (float32).

Logits are compared two ways:
* ``torch.equal`` against a reference that runs the same computation without the connector
  (the prefix's KV computed as its writer computed it -- one prompt forward, then decode steps --
  cut to the loaded length, then the rest behind it): loaded KV is byte-identical, so are the
  logits;
* ``torch.allclose(atol=1e-4, rtol=1e-4)`` against one forward over the whole prompt (a different
  matmul shape, so the last bits may differ); greedy tokens are identical.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from connector.cost import CostModel, ModelShape, TierRate
from connector.hf import HFConnector, cache_tensors, reference_generate
from connector.roles import Failure
from kvstore.client import SyncClient
from tests.support.corrupt import corrupt_dram_block

HERE = Path(__file__).resolve().parent
BS = 16
NEW = 12
TEXT_1 = (
    "The quick brown fox jumps over the lazy dog. A cache key value block token prefix model layer tier store. " * 2
)
TEXT_2 = " Hello world, one two three four five: load save prompt request hit miss."


@pytest.fixture(scope="module")
def model_and_tok(tiny_model_dir: Path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def connector(model, client, **kw) -> HFConnector:
    return HFConnector(model, client, model_id="tiny-llama", block_size=BS, **kw)


def writer_cache(model, prompt: list[int], new_tokens: int = 0):
    """The KV a writer without a connector computes: one forward over ``prompt``, then (when it
    generated) ``new_tokens - 1`` decode steps."""
    cache = DynamicCache(config=model.config)
    reference_generate(model, prompt, max(new_tokens, 1), cache=cache)
    return cache


def check_outputs(model, prompt: list[int], tokens: list[int], logits: torch.Tensor, loaded: int, ref_cache) -> None:
    """Exact against ``ref_cache`` (the writer's KV) cut to the loaded prefix; close to one forward."""
    ref_cache.crop(loaded)
    ref_tokens, ref_logits = reference_generate(model, prompt, len(tokens), cache=ref_cache)
    assert tokens == ref_tokens
    assert torch.equal(logits, ref_logits)
    full_tokens, full_logits = reference_generate(model, prompt, len(tokens))
    assert tokens == full_tokens
    assert torch.allclose(logits, full_logits, atol=1e-4, rtol=1e-4)


def test_handoff_to_a_decode_worker_process(model_and_tok, client, sidecar_process, tmp_path: Path) -> None:
    model, tok = model_and_tok
    prompt = tok(TEXT_1)["input_ids"]
    pre = connector(model, client).prefill(prompt)
    assert pre.save is not None and pre.save.written == len(prompt) // BS and pre.save.failure is None
    out = tmp_path / "decode.pt"
    subprocess.run(
        [sys.executable, str(HERE / "hf_decode_worker.py"), str(model.name_or_path), sidecar_process.url,
         json.dumps(prompt), str(NEW), str(out)],
        check=True,
    )
    res = torch.load(out)
    full_blocks = len(prompt) // BS
    expect_loaded = min(full_blocks, (len(prompt) - 1) // BS) * BS
    assert res["loaded_tokens"] == expect_loaded > 0
    assert res["stats"]["loaded_blocks"] == expect_loaded // BS
    check_outputs(model, prompt, res["tokens"], res["logits"], expect_loaded, writer_cache(model, prompt))
    # the prefill worker's own next-token logits agree with the decode worker's first step
    assert torch.allclose(pre.logits, res["logits"][0], atol=1e-4, rtol=1e-4)


def test_loaded_cache_is_byte_identical(model_and_tok, client) -> None:
    model, tok = model_and_tok
    prompt = tok(TEXT_1)["input_ids"]
    pre = connector(model, client).prefill(prompt)
    loaded = connector(model, client).load(prompt)
    cache, m, load = loaded.cache, loaded.tokens, loaded.result
    assert load is not None and load.loaded == m // BS and m > 0
    assert loaded.cached_blocks == len(prompt) // BS and set(loaded.tiers) == {"dram"}
    for (k0, v0), (k1, v1) in zip(cache_tensors(pre.cache), cache_tensors(cache)):
        assert torch.equal(k0[:, :, :m], k1) and torch.equal(v0[:, :, :m], v1)


def test_multi_turn_reuses_the_first_turn(model_and_tok, client) -> None:
    model, tok = model_and_tok
    conn = connector(model, client)
    p1 = tok(TEXT_1)["input_ids"]
    g1 = conn.generate(p1, NEW)
    assert g1.prefill.loaded_tokens == 0  # a cold cache
    assert sum(s.written for s in g1.saves) == (len(p1) + NEW - 1) // BS
    p2 = p1 + g1.tokens + tok(TEXT_2, add_special_tokens=False)["input_ids"]
    g2 = connector(model, client).generate(p2, NEW)
    reused = (len(p1) + NEW - 1) // BS * BS  # every full block of turn 1, its answer included
    assert g2.prefill.loaded_tokens == reused
    # turn 1's answer KV was computed a token at a time: the exact reference starts from it
    check_outputs(model, p2, g2.tokens, g2.logits, reused, writer_cache(model, p1, NEW))


def test_corrupted_block_is_recomputed(model_and_tok, client) -> None:
    model, tok = model_and_tok
    prompt = tok(TEXT_1)["input_ids"]
    writer = connector(model, client)
    writer.prefill(prompt)
    keys = writer.sched.keys(prompt)
    corrupt_dram_block(client, writer.ns, keys[3])
    reader = connector(model, client, load_guard="hash")  # (corrupted through another mapping: only a hash sees it)
    gen = reader.generate(prompt, NEW, save=False)
    assert gen.prefill.loaded_tokens == 3 * BS
    assert gen.prefill.load is not None and gen.prefill.load.failure is Failure.CHECKSUM
    assert reader.stats["load.checksum"] == 1
    check_outputs(model, prompt, gen.tokens, gen.logits, 3 * BS, writer_cache(model, prompt))


def test_unreachable_sidecar_recomputes(model_and_tok, sidecar_process) -> None:
    model, tok = model_and_tok
    prompt = tok(TEXT_1)["input_ids"]
    sidecar_process.stop()
    with SyncClient(sidecar_process.url) as dead:
        conn = connector(model, dead)
        gen = conn.generate(prompt, NEW)
    assert gen.prefill.loaded_tokens == 0
    assert conn.sched.stats["lookup.unavailable"] == 1
    assert conn.stats["save.unavailable"] == 2  # prompt blocks, then the answer's
    tokens, logits = reference_generate(model, prompt, NEW)
    assert gen.tokens == tokens and torch.equal(gen.logits, logits)


def test_cost_model_sees_real_transfers_and_prefills(model_and_tok, client) -> None:
    model, tok = model_and_tok
    prompt = tok(TEXT_1)["input_ids"]
    cost = CostModel(ModelShape.from_hf_config(model.config), flop_rate=1e9,
                     tiers={"dram": TierRate.of(1e9, 0.0)})
    connector(model, client, cost=cost).prefill(prompt)
    gen = connector(model, client, cost=cost).generate(prompt, 2, save=False)
    assert gen.prefill.decision is not None and gen.prefill.decision.load_blocks == gen.prefill.loaded_tokens // BS
    snap = cost.snapshot()
    assert snap["tiers"]["dram"]["samples"] == 1
    assert snap["flop_rate_samples"] == 2
    assert snap["recent"][-1]["actual_ttft_s"] is not None
    json.dumps(snap)
    decisions = client.stats()["decisions"]  # reported to the sidecar's /stats
    assert decisions["counts"]["loaded"] == 1
    [rec] = decisions["recent"]
    assert rec["loaded_blocks"] == gen.prefill.loaded_tokens // BS and rec["tier"] == "dram"
