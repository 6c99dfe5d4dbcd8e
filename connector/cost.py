"""Reload-or-recompute: how many cached leading blocks to load so that TTFT is smallest.

Prefill of ``S`` new tokens behind ``C`` tokens already in the engine's cache costs::

    flops(C, S) = 2·P·S + 2·L·Hq·d·[(C+S)(C+S+1) − C(C+1)]

(P parameters, L layers, Hq query heads, d head dim: the weight matmuls plus causal attention
scores and values), divided by a measured FLOP rate. Loading blocks from tier ``t`` costs
``bytes_t / bandwidth_t + latency_t`` (one request per tier touched). For every candidate ``k``
(blocks the engine already holds .. blocks available, leaving at least one token to compute,
since the engine needs the last token's logits) the model predicts
``TTFT(k) = load(k) + prefill(C=k·B, S=N−k·B)`` and picks the smallest; ties go to loading more.

Rates are measured, not assumed: :func:`calibrate_flop_rate` runs a short real matmul at start,
and :meth:`CostModel.observe_prefill` / :meth:`CostModel.observe_transfer` keep both rates current
with an exponentially weighted moving average. :meth:`CostModel.snapshot` is the ``/stats`` view.
A tier the model has no rate for is treated as unreachable: no block at or past it is loaded.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

MB = 1e6


@dataclass(slots=True, frozen=True)
class ModelShape:
    params: int  # P: parameters touched per token (weights of the matmuls)
    layers: int  # L
    q_heads: int  # Hq
    head_dim: int  # d

    @classmethod
    def from_hf_config(cls, config: Any, params: int | None = None) -> ModelShape:
        """From a transformers config; ``params`` defaults to the config's non-embedding weights."""
        hidden, layers = config.hidden_size, config.num_hidden_layers
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if params is None:
            attn = hidden * head_dim * (2 * heads + 2 * kv_heads)
            mlp = 3 * hidden * config.intermediate_size
            params = layers * (attn + mlp) + hidden * config.vocab_size  # + lm head
        return cls(params=params, layers=layers, q_heads=heads, head_dim=head_dim)

    def prefill_flops(self, cached: int, new: int) -> float:
        c, s = cached, new
        attn = 2 * self.layers * self.q_heads * self.head_dim * ((c + s) * (c + s + 1) - c * (c + 1))
        return float(2 * self.params * s + attn)


@dataclass(slots=True)
class Ewma:
    value: float
    alpha: float = 0.2
    samples: int = 0

    def update(self, x: float) -> None:
        if x > 0 and np.isfinite(x):
            self.value = x if self.samples == 0 else (1 - self.alpha) * self.value + self.alpha * x
            self.samples += 1


@dataclass(slots=True)
class TierRate:
    bandwidth: Ewma  # bytes / s, engine memory <- tier, end to end
    latency: Ewma  # s per request

    @classmethod
    def of(cls, bandwidth: float, latency: float, alpha: float = 0.2) -> TierRate:
        return cls(Ewma(bandwidth, alpha), Ewma(latency, alpha))

    def time(self, nbytes: int) -> float:
        return nbytes / self.bandwidth.value + self.latency.value


# Priors, replaced by measurements as soon as transfers are observed.
DEFAULT_TIERS: dict[str, tuple[float, float]] = {
    "dram": (4000 * MB, 0.0005),
    "ssd": (1000 * MB, 0.002),
    "redis": (500 * MB, 0.002),
    "s3": (100 * MB, 0.03),
}


def tier_name(tier: object) -> str:
    """``"dram"`` for ``"DRAM"``, ``"TIER_DRAM"`` or the proto enum value's name."""
    name = getattr(tier, "name", tier)
    return str(name).lower().removeprefix("tier_")


@dataclass(slots=True, frozen=True)
class Decision:
    id: int
    available: int  # leading cached blocks the sidecar has
    computed: int  # leading blocks already in the engine's own cache
    blocks: int  # leading blocks after the decision: load blocks [computed, blocks)
    block_size: int
    prompt_tokens: int
    predicted_load_s: float
    predicted_prefill_s: float
    recompute_ttft_s: float  # prediction for loading nothing

    @property
    def load_blocks(self) -> int:
        return self.blocks - self.computed

    @property
    def load_tokens(self) -> int:
        return self.load_blocks * self.block_size

    @property
    def predicted_ttft_s(self) -> float:
        return self.predicted_load_s + self.predicted_prefill_s

    @property
    def kind(self) -> str:
        if self.load_blocks == 0:
            return "recompute"
        return "load_all" if self.blocks == self.max_blocks else "partial"

    @property
    def max_blocks(self) -> int:
        return max(self.computed, min(self.available, (self.prompt_tokens - 1) // self.block_size))


@dataclass(slots=True)
class _Record:
    decision: Decision
    actual_ttft_s: float | None = None


@dataclass
class CostModel:
    shape: ModelShape
    flop_rate: float  # FLOP/s at start; kept current by observe_prefill
    tiers: dict[str, TierRate] = field(default_factory=dict)
    alpha: float = 0.2
    history: int = 64

    def __post_init__(self) -> None:
        if not self.tiers:
            self.tiers = {n: TierRate.of(bw, lat, self.alpha) for n, (bw, lat) in DEFAULT_TIERS.items()}
        self._flops = Ewma(self.flop_rate, self.alpha)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._recent: deque[_Record] = deque(maxlen=self.history)
        self._by_id: dict[int, _Record] = {}
        self._counts = {"recompute": 0, "partial": 0, "load_all": 0}
        self._abs_err = 0.0
        self._err_n = 0

    # --- predictions ----------------------------------------------------------------------

    def prefill_time(self, cached: int, new: int) -> float:
        return self.shape.prefill_flops(cached, new) / self._flops.value

    def load_time(self, tiers: Sequence[str], block_bytes: int | Sequence[int]) -> float:
        per_tier: dict[str, int] = {}
        for i, t in enumerate(tiers):
            nb = block_bytes if isinstance(block_bytes, int) else block_bytes[i]
            per_tier[tier_name(t)] = per_tier.get(tier_name(t), 0) + nb
        total = 0.0
        for t, nb in per_tier.items():
            rate = self.tiers.get(t)
            if rate is None:
                return float("inf")
            total += rate.time(nb)
        return total

    def choose_blocks(
        self,
        tiers: Sequence[object],
        block_bytes: int | Sequence[int],
        block_size: int,
        prompt_tokens: int,
        computed_tokens: int = 0,
    ) -> Decision:
        """Pick how many leading blocks to have before prefill (see module doc).

        ``tiers[i]`` is where cached block ``i`` is (from the sidecar's lookup, counting from the
        prompt's first block); ``computed_tokens`` are already in the engine's cache.
        """
        computed = computed_tokens // block_size
        limit = max(computed, min(len(tiers), (prompt_tokens - 1) // block_size))
        names = [tier_name(t) for t in tiers]
        with self._lock:
            best_k, best_load = computed, 0.0
            best_prefill = recompute = self.prefill_time(computed * block_size, prompt_tokens - computed * block_size)
            used: dict[str, int] = {}
            for k in range(computed + 1, limit + 1):
                t = names[k - 1]
                if t not in self.tiers:
                    break
                used[t] = used.get(t, 0) + (block_bytes if isinstance(block_bytes, int) else block_bytes[k - 1])
                load = sum(self.tiers[n].time(nb) for n, nb in used.items())
                prefill = self.prefill_time(k * block_size, prompt_tokens - k * block_size)
                if load + prefill <= best_load + best_prefill:
                    best_k, best_load, best_prefill = k, load, prefill
            d = Decision(
                id=next(self._ids),
                available=len(tiers),
                computed=computed,
                blocks=best_k,
                block_size=block_size,
                prompt_tokens=prompt_tokens,
                predicted_load_s=best_load,
                predicted_prefill_s=best_prefill,
                recompute_ttft_s=recompute,
            )
            self._remember(d)
        return d

    def _remember(self, d: Decision) -> None:
        if len(self._recent) == self._recent.maxlen:
            self._by_id.pop(self._recent[0].decision.id, None)
        rec = _Record(d)
        self._recent.append(rec)
        self._by_id[d.id] = rec
        self._counts[d.kind] += 1

    # --- observations ---------------------------------------------------------------------

    def observe_prefill(self, cached: int, new: int, seconds: float) -> None:
        """A real prefill of ``new`` tokens behind ``cached`` took ``seconds``."""
        with self._lock:
            self._flops.update(self.shape.prefill_flops(cached, new) / max(seconds, 1e-9))

    def observe_transfer(self, tier_bytes: Mapping[str, int], seconds: float) -> None:
        """One load request moved ``tier_bytes`` (by tier) in ``seconds``, end to end.

        The time is split between tiers in proportion to their predicted shares; each tier's
        bandwidth is updated from its share less its request latency.
        """
        with self._lock:
            known = {tier_name(t): nb for t, nb in tier_bytes.items() if tier_name(t) in self.tiers and nb > 0}
            pred = {t: self.tiers[t].time(nb) for t, nb in known.items()}
            total = sum(pred.values())
            for t, nb in known.items():
                share = seconds * pred[t] / total
                rate = self.tiers[t]
                rate.bandwidth.update(nb / max(share - rate.latency.value, 0.1 * share, 1e-9))

    def observe_latency(self, tier: str, seconds: float) -> None:
        """A request that moved no bytes (e.g. a lookup round trip) took ``seconds``."""
        with self._lock:
            rate = self.tiers.get(tier_name(tier))
            if rate is not None:
                rate.latency.update(seconds)

    def observe_ttft(self, decision_id: int, seconds: float) -> None:
        """The actual time to first token of the request decided by ``decision_id``."""
        with self._lock:
            rec = self._by_id.get(decision_id)
            if rec is None or rec.actual_ttft_s is not None:
                return
            rec.actual_ttft_s = seconds
            if seconds > 0:
                self._abs_err += abs(rec.decision.predicted_ttft_s - seconds) / seconds
                self._err_n += 1

    # --- stats ----------------------------------------------------------------------------

    def decision(self, decision_id: int) -> Decision | None:
        """A recent decision by id (None once it has left the history)."""
        with self._lock:
            rec = self._by_id.get(decision_id)
        return rec.decision if rec else None

    @property
    def current_flop_rate(self) -> float:
        return self._flops.value

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "flop_rate": self._flops.value,
                "flop_rate_samples": self._flops.samples,
                "tiers": {
                    n: {
                        "bandwidth_bytes_per_s": r.bandwidth.value,
                        "latency_s": r.latency.value,
                        "samples": r.bandwidth.samples,
                    }
                    for n, r in self.tiers.items()
                },
                "decisions": dict(self._counts),
                "mean_abs_rel_error": self._abs_err / self._err_n if self._err_n else None,
                "recent": [
                    {
                        **asdict(r.decision),
                        "kind": r.decision.kind,
                        "load_blocks": r.decision.load_blocks,
                        "predicted_ttft_s": r.decision.predicted_ttft_s,
                        "actual_ttft_s": r.actual_ttft_s,
                    }
                    for r in self._recent
                ],
            }


# --- calibration ----------------------------------------------------------------------------


def calibrate_flop_rate(n: int = 384, repeats: int = 3) -> float:
    """FLOP/s of a real float32 ``n×n`` matmul (torch if installed, else numpy); best of ``repeats``."""
    try:
        import torch

        a, b = torch.randn(n, n), torch.randn(n, n)
        mm: Any = torch.matmul
    except ImportError:  # pragma: no cover - torch is in every test environment
        rng = np.random.default_rng(0)
        a, b = rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32)
        mm = np.matmul
    mm(a, b)  # warm up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / max(best, 1e-9)


def calibrate_memcpy_bandwidth(nbytes: int = 16 << 20, repeats: int = 3) -> float:
    """Bytes/s of a plain in-memory copy: the ceiling of a DRAM-slot load."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / max(best, 1e-9)
