"""A decode worker in its own process: load a prompt's prefix KV from the sidecar into a
DynamicCache, compute the rest, decode greedily. Writes tokens, logits and stats with torch.save.

    python hf_decode_worker.py MODEL_DIR SIDECAR_URL PROMPT_JSON MAX_NEW OUT_PT
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import AutoModelForCausalLM

from connector.hf import HFConnector
from kvstore.client import SyncClient


def main(model_dir: str, url: str, prompt_json: str, max_new: str, out: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = json.loads(prompt_json)
    with SyncClient(url) as client:
        conn = HFConnector(model, client, model_id="tiny-llama", block_size=16)
        gen = conn.generate(prompt, int(max_new), save=False)
    torch.save(
        {
            "tokens": gen.tokens,
            "logits": gen.logits,
            "loaded_tokens": gen.prefill.loaded_tokens,
            "stats": conn.stats.as_dict(),
        },
        out,
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
