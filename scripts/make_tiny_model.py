#!/usr/bin/env python3
"""Create a tiny random-weight Llama model + local BPE tokenizer (no downloads).

Usage: python scripts/make_tiny_model.py OUT_DIR [--seed N] [--dtype float32|bfloat16]

The logic lives in kvstore.harness.tiny_model.build_tiny_llama.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstore.harness.tiny_model import build_tiny_llama


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--max-position-embeddings", type=int, default=4096)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = p.parse_args(argv)
    out = build_tiny_llama(
        args.out_dir,
        seed=args.seed,
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers,
        max_position_embeddings=args.max_position_embeddings,
        dtype=args.dtype,
    )
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
