"""The namespace dtype and k/v scale source of a vLLM cache (connector/vllm/cache_dtype.py), from vLLM's
own config values: every ``CacheDType`` vLLM 0.32.0 lists is either named exactly or refused,
naming the field -- never ``uint8``, the tensor dtype vLLM gives every fp8 cache."""

from __future__ import annotations

import typing

import pytest
from vllm.config import CacheConfig
from vllm.config.cache import CacheDType
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

from connector.vllm.cache_dtype import kv_cache_dtype, kv_scales_source, torch_name

pytestmark = pytest.mark.vllm

NAMED = {"auto": "float32", "float16": "float16", "bfloat16": "bfloat16", "fp8": "float8_e4m3",
         "fp8_e4m3": "float8_e4m3", "fp8_e5m2": "float8_e5m2"}


def spec_dtype(cache_dtype: str) -> str:
    """The torch name of the cache tensor vLLM allocates for ``cache_dtype`` (a float32 model)."""
    return "float32" if cache_dtype == "auto" else torch_name(STR_DTYPE_TO_TORCH_DTYPE[cache_dtype])


@pytest.mark.parametrize("cache_dtype", sorted(NAMED))
def test_each_supported_cache_dtype_is_named_as_configured(cache_dtype: str) -> None:
    configured = CacheConfig(cache_dtype=cache_dtype).cache_dtype
    assert kv_cache_dtype(configured, spec_dtype(configured), "float8_e4m3fn") == NAMED[cache_dtype]


def test_the_three_fp8_dtypes_share_one_tensor_dtype_but_not_a_name() -> None:
    assert {spec_dtype(d) for d in ("fp8", "fp8_e4m3", "fp8_e5m2")} == {"uint8"}  # what the defect read
    names = {d: kv_cache_dtype(d, "uint8", "float8_e4m3fn") for d in ("fp8", "fp8_e4m3", "fp8_e5m2")}
    assert names == {"fp8": "float8_e4m3", "fp8_e4m3": "float8_e4m3", "fp8_e5m2": "float8_e5m2"}


def test_fp8_on_a_platform_whose_e4m3_is_fnuz_is_not_e4m3fn() -> None:
    assert kv_cache_dtype("fp8", "uint8", "float8_e4m3fnuz") == "float8_e4m3fnuz"  # ROCm MI300: other bytes
    assert kv_cache_dtype("fp8_e5m2", "uint8", "float8_e4m3fnuz") == "float8_e5m2"


@pytest.mark.parametrize("cache_dtype", sorted(set(typing.get_args(CacheDType)) - set(NAMED)))
def test_every_other_cache_dtype_is_refused_naming_it(cache_dtype: str) -> None:
    with pytest.raises(NotImplementedError, match=f"cache_dtype '{cache_dtype}' is not supported"):
        kv_cache_dtype(cache_dtype, "uint8", "float8_e4m3fn")


def test_an_unquantized_cache_of_an_unknown_element_type_is_refused() -> None:
    with pytest.raises(NotImplementedError, match="cache_dtype 'auto' with a uint8 cache"):
        kv_cache_dtype("auto", "uint8", "float8_e4m3fn")


def test_scale_source_is_unit_without_a_quantization_config() -> None:
    assert kv_scales_source(None) == "unit"
    assert kv_scales_source("compressed-tensors") == "checkpoint:compressed-tensors"
