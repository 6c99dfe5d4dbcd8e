"""transformers adapter: a prompt's KV in a ``DynamicCache`` <-> the sidecar, for prefill/decode
handoff and multi-turn reuse.

    conn = HFConnector(model, SyncClient(url), model_id="tiny-llama", block_size=16)
    conn.prefill(prompt_ids)                       # prefill worker: compute, store full blocks
    out = conn.generate(prompt_ids, 20)            # decode worker: load the prefix, compute the
                                                   # rest, decode greedily, store the new blocks

It drives the framework-neutral core: :class:`~connector.roles.SchedulerConnector` decides how
many leading blocks to load (lookup + cost model); the transfers are
:func:`~connector.roles.load_blocks` / :func:`~connector.roles.save_blocks` over the ``hf`` layout,
reading a ``DynamicCache``'s tensors in place. The engine's "block table" is the identity: block
``i`` is tokens ``[i*B, (i+1)*B)``. Anything that goes wrong while loading (sidecar down, block
gone, checksum mismatch) shortens the loaded prefix; the rest is recomputed, so the output is the
same either way.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from connector.cost import CostModel, Decision
from connector.roles.client import ConnectorClient
from connector.roles.guard import checked
from connector.roles.hints import retain_ms
from connector.roles.metadata import LoadResult, SaveResult, SaveSpec
from connector.roles.ops import load_blocks, save_blocks
from connector.roles.report import DecisionReporter, decision_record
from connector.roles.scheduler import SchedulerConnector
from connector.roles.stats import ConnectorStats
from connector.transfer.engines import NumpyTransfer, Transfer, bind_caches, make_transfer, register_slab
from connector.transfer.layout import KVSpec
from kvstore.keys import Namespace

log = logging.getLogger(__name__)

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def hf_spec(config: Any, block_size: int, dtype: torch.dtype = torch.float32) -> KVSpec:
    """The ``hf`` layout spec of a decoder model's config."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    return KVSpec(
        layout="hf",
        num_layers=text.num_hidden_layers,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_size=getattr(text, "head_dim", None) or text.hidden_size // heads,
        block_size=block_size,
        dtype=_DTYPES[dtype],
    )


def hf_namespace(
    model_id: str, spec: KVSpec, *, revision: str = "", cache_salt: str = "", adapter: str = ""
) -> Namespace:
    return Namespace(
        model=model_id, kv_layout="hf", dtype=spec.dtype, block_size=spec.block_size,
        revision=revision, cache_salt=cache_salt, adapter=adapter,
    )


def cache_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``(K, V)`` of a transformers cache, in place."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))  # transformers < 4.56


@dataclass(slots=True)
class Loaded:
    cache: Any  # DynamicCache with the loaded prefix (possibly empty)
    tokens: int  # leading tokens it holds
    result: LoadResult | None  # None: nothing was worth loading
    decision: Decision | None
    cached_blocks: int  # leading blocks the sidecar had
    tiers: tuple[str, ...]  # where the loaded blocks were


@dataclass(slots=True)
class Prefill:
    cache: Any  # DynamicCache holding every prompt token
    logits: torch.Tensor  # [vocab], float32: the next-token logits after the prompt
    loaded_tokens: int  # leading tokens whose KV came from the sidecar
    computed_tokens: int  # tokens run through the model
    prefill_s: float  # wall time of the model forward
    decision: Decision | None = None
    load: LoadResult | None = None
    save: SaveResult | None = None


@dataclass(slots=True)
class Generation:
    tokens: list[int]  # new tokens, greedy
    logits: torch.Tensor  # [len(tokens), vocab]: logits that chose each token
    prefill: Prefill
    saves: list[SaveResult] = field(default_factory=list)


class HFConnector:
    def __init__(
        self,
        model: Any,
        client: ConnectorClient,
        *,
        model_id: str,
        block_size: int = 16,
        revision: str = "",
        cache_salt: str = "",
        cost: CostModel | None = None,
        transfer: Transfer | None = None,
        verify_checksums: bool = True,
        load_guard: str = "read_only",
    ) -> None:
        self.model = model
        self.client = client
        first = next(model.parameters())
        self.dtype, self.device = first.dtype, first.device
        self.spec = hf_spec(model.config, block_size, self.dtype)
        self.ns = hf_namespace(model_id, self.spec, revision=revision, cache_salt=cache_salt)
        self.cost = cost
        self.sched = SchedulerConnector(client, self.ns, self.spec, cost)
        self.transfer = transfer or default_transfer(self.device, client)
        self.verify = verify_checksums
        self.guard = checked(load_guard)  # how verify_checksums is kept (connector.roles.guard)
        self.stats = ConnectorStats()
        self.reporter = DecisionReporter(client)
        self._ids = itertools.count()

    # --- building blocks ----------------------------------------------------------------------

    def _empty_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def load(self, token_ids: Sequence[int]) -> Loaded:
        """A ``DynamicCache`` with the leading blocks worth loading (see :class:`Loaded`)."""
        from transformers import DynamicCache

        req = f"hf-{next(self._ids)}"
        n_tokens = self.sched.get_num_new_matched_tokens(req, token_ids, 0)
        decision = self.sched.decision(req)
        cached = self.sched.matched_blocks(req)
        n = n_tokens // self.spec.block_size
        if n == 0:
            self.sched.request_finished(req)
            return Loaded(self._empty_cache(), 0, None, decision, cached, ())
        s = self.spec
        bufs = [
            tuple(torch.empty(1, s.kv_heads, n * s.block_size, s.head_size, dtype=self.dtype, device=self.device)
                  for _ in range(2))
            for _ in range(s.num_layers)
        ]
        try:
            self.sched.update_state_after_alloc(req, list(range(n)), n_tokens)
            [spec] = self.sched.build_connector_meta().loads
            result = load_blocks(self.client, self.ns, bind_caches(s, bufs), self.transfer, spec, verify=self.verify,
                                 guard=self.guard)
            self.sched.update_connector_output(load_results=[result])  # ends the lookup's lease
        finally:
            self.sched.request_finished(req)
        self.stats.record_load(result)
        if self.cost is not None and result.loaded:
            per_tier: dict[str, int] = {}
            for t in spec.tiers[: result.loaded]:
                per_tier[t] = per_tier.get(t, 0) + s.block_bytes
            self.cost.observe_transfer(per_tier, result.seconds)
        m = result.loaded * s.block_size
        if m == 0:
            return Loaded(self._empty_cache(), 0, result, decision, cached, spec.tiers)
        data = [(k[:, :, :m], v[:, :, :m]) for k, v in bufs]
        cache = DynamicCache(ddp_cache_data=data, config=self.model.config)
        return Loaded(cache, m, result, decision, cached, spec.tiers)

    def save(self, token_ids: Sequence[int], cache: Any, *, retain_s: float | None = None) -> SaveResult | None:
        """Store the full blocks of ``token_ids`` whose KV is in ``cache`` (sidecar skips known ones).
        ``retain_s``: retain them that long (0: end their retention; None: say nothing;
        connector/roles/hints.py; ValueError naming it when bad)."""
        ms = retain_ms(retain_s, "retain_s")
        kv = cache_tensors(cache)
        held = kv[0][0].shape[2] if kv else 0
        n = min(len(token_ids), held) // self.spec.block_size
        if n == 0:
            return None
        keys = self.sched.keys(list(token_ids)[: n * self.spec.block_size])
        result = save_blocks(
            self.client,
            self.ns,
            bind_caches(self.spec, kv),
            self.transfer,
            SaveSpec("hf-save", tuple(keys), tuple(range(n)), ms),
        )
        self.stats.record_save(result)
        return result

    def calibrate(self, lengths: Sequence[int] = (16, 128, 512), repeats: int = 2) -> None:
        """Fit the cost model's prefill terms from real forwards of ``lengths`` tokens (start-up)."""
        from connector.cost import calibrate_prefill

        if self.cost is None:
            return
        vocab = self.model.config.vocab_size

        def forward(n: int) -> float:
            ids = [(7 * i + 3) % vocab for i in range(n)]
            t0 = time.perf_counter()
            self._forward(ids, self._empty_cache())
            return time.perf_counter() - t0

        calibrate_prefill(self.cost, forward, lengths, repeats)

    @torch.inference_mode()
    def _forward(self, token_ids: Sequence[int], cache: Any) -> torch.Tensor:
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
        logits: torch.Tensor = out.logits[0, -1].float()
        return logits

    # --- the two roles ------------------------------------------------------------------------

    def prefill(self, token_ids: Sequence[int], *, save: bool = True, retain_s: float | None = None) -> Prefill:
        """Load what is worth loading, compute the rest of the prompt, store its full blocks
        (retained for ``retain_s`` when it is more than 0: the conversation will come back; 0 ends
        their retention, after the load: the turn it continues has come back)."""
        if len(token_ids) == 0:
            raise ValueError("prefill: empty prompt")
        retain_ms(retain_s, "retain_s")  # refused before any work
        t_start = time.perf_counter()
        loaded = self.load(token_ids)
        cache, m, decision = loaded.cache, loaded.tokens, loaded.decision
        t0 = time.perf_counter()
        logits = self._forward(token_ids[m:], cache)
        prefill_s = time.perf_counter() - t0
        if self.cost is not None:
            self.cost.observe_prefill(m, len(token_ids) - m, prefill_s)
            if decision is not None:
                self.cost.observe_ttft(decision.id, time.perf_counter() - t_start)
        self.stats.add(prompt_tokens=len(token_ids), loaded_tokens=m, computed_tokens=len(token_ids) - m)
        if loaded.cached_blocks:
            self.reporter.add(
                decision_record(
                    self.ns.label, decision, prompt_blocks=len(token_ids) // self.spec.block_size,
                    cached_blocks=loaded.cached_blocks, tiers=loaded.tiers, load=loaded.result,
                    actual_s=0.0 if m else prefill_s,
                )
            )
        result = Prefill(cache, logits, m, len(token_ids) - m, prefill_s, decision, loaded.result)
        if save:
            result.save = self.save(token_ids, cache, retain_s=retain_s)
        self.reporter.flush()  # after the first token: off the TTFT path
        return result

    def generate(
        self, token_ids: Sequence[int], max_new_tokens: int, *, save: bool = True, retain_s: float | None = None
    ) -> Generation:
        """Greedy decoding after :meth:`prefill`; with ``save`` the generated tokens' full blocks
        are stored too, so the next turn of a conversation finds them; with ``retain_s`` the sidecar
        retains them that long from the end (an agent's turn that ends in a tool call); ``retain_s=0``
        on the next turn ends the retention of what it continues."""
        pre = self.prefill(token_ids, save=save, retain_s=retain_s)
        tokens: list[int] = []
        logits = [pre.logits]
        for step in range(max_new_tokens):
            tokens.append(int(torch.argmax(logits[-1])))
            if step + 1 < max_new_tokens:
                logits.append(self._forward(tokens[-1:], pre.cache))
        gen = Generation(tokens, torch.stack(logits[: len(tokens)]), pre)
        if pre.save is not None:
            gen.saves.append(pre.save)
        if save and tokens:
            fed = list(token_ids) + tokens[:-1]  # the last token's KV is not computed yet
            extra = self.save(fed, pre.cache, retain_s=retain_s)
            if extra is not None:
                gen.saves.append(extra)
        return gen


@torch.inference_mode()
def reference_generate(
    model: Any, token_ids: Sequence[int], max_new_tokens: int, *, split: int = 0, cache: Any = None
) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding with no connector: the whole prompt in one forward, or (``split`` > 0)
    ``token_ids[:split]`` then the rest behind it, or (``cache``) the tokens past what ``cache``
    already holds -- the same computations a connector run performs around its loaded prefix."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    if cache is None:
        cache = DynamicCache(config=model.config)
    held = cache.get_seq_length()
    parts = [token_ids[held:split], token_ids[split:]] if split > held else [token_ids[held:]]
    for part in parts:
        out = model(input_ids=torch.tensor([list(part)], device=device), past_key_values=cache, use_cache=True)
    logits: list[torch.Tensor] = [out.logits[0, -1].float()]
    tokens: list[int] = []
    for step in range(max_new_tokens):
        tokens.append(int(torch.argmax(logits[-1])))
        if step + 1 < max_new_tokens:
            out = model(input_ids=torch.tensor([[tokens[-1]]], device=device), past_key_values=cache, use_cache=True)
            logits.append(out.logits[0, -1].float())
    return tokens, torch.stack(logits[: len(tokens)])


def default_transfer(device: torch.device, client: ConnectorClient) -> Transfer:
    """The numpy engine for a model on the CPU; for one on a GPU the cupy engine, with the
    sidecar's slab pinned now, at start (``hello`` names it), not on a request's path."""
    if device.type != "cuda":
        return NumpyTransfer()
    transfer = make_transfer("cupy", device=device.index)  # pins under the model's GPU
    register_slab(transfer, client)
    return transfer


def as_token_list(ids: Any) -> list[int]:
    return [int(t) for t in np.asarray(ids).reshape(-1)]
