"""Failure behaviour against real servers: a lower tier that is down.

(A corrupted block and an unreachable sidecar are covered in test_connector_hf.py and
test_connector_sidecar.py.) Here the sidecar's only copy of a prompt's blocks is in Redis, and
redis-server is killed: the connector recomputes, the output is the same as a full recompute, and
both sides say what happened -- the connector's stats and log, the sidecar's ``/stats``.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from connector.hf import HFConnector, reference_generate
from connector.roles import Failure
from kvstore.client import SyncClient
from kvstore.harness.servers import RedisServer, redis_server
from kvstore.harness.sidecar import ServeProcess
from kvstore.keys import prefix_keys
from tests.connector.conftest import serve_args

BS = 16
NEW = 8
TEXT = "The quick brown fox jumps over the lazy dog. A cache key value block token prefix model layer tier store. " * 2
PAGE = 65536
SLOTS = 16  # DRAM: 4 pages of 64 KiB = 16 slots of one tiny-Llama block (16 KiB)


@pytest.fixture(scope="module")
def model_and_tok(tiny_model_dir: Path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


@pytest.fixture
def redis_sidecar(tmp_path: Path, redis: RedisServer) -> Iterator[ServeProcess]:
    """A sidecar whose only tier below its 16-slot DRAM is ``redis`` (no SSD)."""
    env = {
        "KVSTORE_SSD__ENABLED": "false",
        "KVSTORE_REDIS__ENABLED": "true",
        "KVSTORE_REDIS__URL": redis.url,
        "KVSTORE_REDIS__RETRIES": "0",
        "KVSTORE_REDIS__SOCKET_TIMEOUT_S": "0.5",
        "KVSTORE_DRAM__PAGE_BYTES": str(PAGE),
        "KVSTORE_DRAM__MIN_SLOT_BYTES": "4096",
    }
    sc = ServeProcess(serve_args(tmp_path / "kvstore-data", dram_bytes=4 * PAGE), env=env)
    yield sc
    sc.stop()


def http_stats(sc: ServeProcess) -> dict:
    with urllib.request.urlopen(f"http://{sc.http}/stats", timeout=10) as resp:
        return json.loads(resp.read())


def wait_until(predicate, what: str, attempts: int = 400) -> None:
    for _ in range(attempts):
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"never happened: {what}")


def test_tier_down_recomputes_and_says_so(model_and_tok, redis, redis_sidecar, caplog) -> None:
    model, tok = model_and_tok
    prompt = tok(TEXT)["input_ids"]
    with SyncClient(redis_sidecar.grpc) as client:
        writer = HFConnector(model, client, model_id="tiny-llama", block_size=BS)
        pre = writer.prefill(prompt)
        n = len(prompt) // BS
        assert pre.save is not None and pre.save.written == n >= 3
        block_bytes = writer.spec.block_bytes
        assert block_bytes == PAGE // 4

        # Push the prompt out of DRAM: a DRAM-full of other blocks demotes it to redis.
        filler = prefix_keys(writer.ns, list(range(10_000, 10_000 + SLOTS * BS)))
        client.put_blocks(writer.ns, filler, [np.zeros(block_bytes, np.uint8)] * SLOTS)
        keys = writer.sched.keys(prompt)
        wait_until(
            lambda: [t for t, _ in client.lookup(writer.ns, keys).blocks] == ["redis"] * n, "prompt only in redis"
        )
        wait_until(
            lambda: http_stats(redis_sidecar)["tiers"]["redis"]["bytes_in"] >= n * block_bytes, "demotions written"
        )
        assert redis.cli("DBSIZE").strip() != "0"

        redis.stop()
        reader = HFConnector(model, client, model_id="tiny-llama", block_size=BS)
        with caplog.at_level(logging.INFO, logger="connector.roles.ops"):
            gen = reader.generate(prompt, NEW, save=False)

        # recomputed, and the output is exactly a full recompute's
        assert reader.sched.stats["matched_blocks"] == n  # the lookup still saw them: redis not known down yet
        assert gen.prefill.loaded_tokens == 0 and gen.prefill.computed_tokens == len(prompt)
        tokens, logits = reference_generate(model, prompt, NEW)
        assert gen.tokens == tokens and torch.equal(gen.logits, logits)

        # the connector says so: stats and log (the sidecar could not promote: blocks are missing)
        load = gen.prefill.load
        assert load is not None and (load.loaded, load.failure) == (0, Failure.MISSING)
        assert load.failed_block_ids == tuple(range(min(n, (len(prompt) - 1) // BS)))
        assert reader.stats["load.missing"] == 1 and reader.stats["loaded_blocks"] == 0
        assert any("recomputing" in r.getMessage() and r.name == "connector.roles.ops" for r in caplog.records)

        # the sidecar says so: the tier is down, its errors counted, the fallback reported
        stats = http_stats(redis_sidecar)
        assert stats["tiers"]["redis"]["down"] is True and stats["tiers"]["redis"]["errors"] >= 1
        assert stats["decisions"]["counts"]["fallback"] == 1
        assert stats["decisions"]["recent"][-1]["outcome"] == "fallback:missing"

        # the next request: lookups now treat the down tier as a miss; plain recompute, no load
        again = HFConnector(model, client, model_id="tiny-llama", block_size=BS)
        gen2 = again.generate(prompt, NEW, save=False)
        assert again.sched.stats["matched_blocks"] == 0 and gen2.prefill.load is None
        assert gen2.tokens == tokens and torch.equal(gen2.logits, logits)
