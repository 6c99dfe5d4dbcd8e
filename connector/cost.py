"""Reload-or-recompute: how many cached leading blocks to load so that TTFT is smallest.

Prefill of ``S`` new tokens behind ``C`` tokens already in the engine's cache does::

    matmul(S)       = 2·P·S                                    (weight matmuls)
    attention(C, S) = 2·L·Hq·d·[(C+S)(C+S+1) − C(C+1)]         (causal scores and values)

(P parameters, L layers, Hq query heads, d head dim) and is predicted to take::

    prefill(C, S) = overhead + matmul(S) / matmul_rate + attention(C, S) / attention_rate

The per-forward ``overhead`` matters: a forward over a few tokens is mostly fixed cost (kernel
launches, Python, cache bookkeeping), and attention FLOPs run at a different rate from weight
matmuls. Loading blocks from tier ``t`` costs ``latency_t + bytes_t / bandwidth_t`` (one request
per tier touched). For every candidate ``k`` (blocks the engine already holds .. blocks
available, leaving at least one token to compute, since the engine needs the last token's
logits) the model predicts ``TTFT(k) = load(k) + prefill(C=k·B, S=N−k·B)`` and picks the
smallest; ties go to loading more.

Both are fitted, not assumed: every observed prefill ``(C, S, seconds)`` and transfer
``(bytes, seconds)`` is kept in a bounded window **per size bucket** (powers of two), and the
coefficients are a robust (Huber-weighted), non-negative least-squares fit of relative error over
all buckets. A burst of short prefills therefore only replaces older short prefills: it refines
the overhead term and cannot drag the long-prompt rates down (a per-sample FLOP-rate average
would). With samples from too few sizes to tell the terms apart, the fit falls back to scaling
the prior (one size) or to overhead + scaled prior (two sizes); a tier seen at one size fits the
term that dominates its samples under the prior (bandwidth for large loads, latency for small
ones and zero-byte round trips) and keeps the other.

:func:`calibrate_prefill` feeds a few real forwards of different lengths at start-up;
:meth:`CostModel.observe_prefill` / :meth:`CostModel.observe_transfer` keep the fits current
from real traffic. :meth:`CostModel.snapshot` is the ``/stats`` view. A tier the model has no rate
for is treated as unreachable: no block at or past it is loaded.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvstore.tier_table import LOAD_COSTS

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

    def matmul_flops(self, new: int) -> float:
        return float(2 * self.params * new)

    def attention_flops(self, cached: int, new: int) -> float:
        c, s = cached, new
        return float(2 * self.layers * self.q_heads * self.head_dim * ((c + s) * (c + s + 1) - c * (c + 1)))

    def prefill_flops(self, cached: int, new: int) -> float:
        return self.matmul_flops(new) + self.attention_flops(cached, new)


# --- robust non-negative least squares over bucketed samples -------------------------------------


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min ||a·x − b|| with x >= 0, by trying every support (a has at most a few columns)."""
    p = a.shape[1]
    best, best_err = np.zeros(p), float(b @ b)
    for r in range(1, p + 1):
        for cols in itertools.combinations(range(p), r):
            sub = a[:, cols]
            x, *_ = np.linalg.lstsq(sub, b, rcond=None)
            if np.all(x >= 0):
                err = float(np.sum((sub @ x - b) ** 2))
                if err < best_err:
                    best, best_err = np.zeros(p), err
                    best[list(cols)] = x
    return best


def robust_fit(x: np.ndarray, t: np.ndarray, iterations: int = 4, huber: float = 1.5) -> np.ndarray:
    """Non-negative ``θ`` minimising the Huber loss of relative residuals ``(t − x·θ) / t``.

    Relative error, because short and long samples matter alike to a decision; Huber weights
    (iteratively reweighted), so one sample slowed down by a noisy neighbour does not move it.
    """
    scale = np.maximum(np.abs(x).max(axis=0), 1e-300)  # columns to ~1: conditioning
    a = x / scale / t[:, None]
    b = np.ones(len(t))
    w = np.ones(len(t))
    theta = np.zeros(x.shape[1])
    for _ in range(iterations):
        sw = np.sqrt(w)
        theta = _nnls(a * sw[:, None], b * sw)
        r = np.abs(b - a @ theta)
        s = 1.4826 * float(np.median(r))
        if s <= 1e-12:
            break
        w = np.minimum(1.0, huber * s / np.maximum(r, 1e-300))
    fitted: np.ndarray = theta / scale
    return fitted


class Samples:
    """Recent ``(features, seconds)`` samples, at most ``per_bucket`` per size bucket and at most
    ``max_buckets`` buckets (the least recently fed bucket goes first)."""

    def __init__(self, per_bucket: int = 8, max_buckets: int = 64) -> None:
        self.per_bucket, self.max_buckets = per_bucket, max_buckets
        self._buckets: OrderedDict[Hashable, deque[tuple[tuple[float, ...], float]]] = OrderedDict()
        self.count = 0  # samples ever added

    def add(self, bucket: Hashable, features: tuple[float, ...], seconds: float) -> None:
        q = self._buckets.get(bucket)
        if q is None:
            q = self._buckets[bucket] = deque(maxlen=self.per_bucket)
            while len(self._buckets) > self.max_buckets:
                self._buckets.popitem(last=False)
        self._buckets.move_to_end(bucket)
        q.append((features, seconds))
        self.count += 1

    @property
    def buckets(self) -> int:
        return len(self._buckets)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        rows = [s for q in self._buckets.values() for s in q]
        return np.array([f for f, _ in rows], dtype=float), np.array([t for _, t in rows], dtype=float)


def _bucket(n: float) -> int:
    return int(n).bit_length()


def _valid(seconds: float) -> bool:
    return seconds > 0 and bool(np.isfinite(seconds))


# --- prefill --------------------------------------------------------------------------------------


@dataclass(slots=True)
class PrefillFit:
    """``seconds = overhead + matmul_flops / matmul_rate + attention_flops / attention_rate``."""

    overhead_s: float
    matmul_rate: float  # FLOP/s
    attention_rate: float  # FLOP/s
    mode: str = "prior"  # which fit produced it: prior, scale, overhead+scale, full
    _prior: tuple[float, float, float] = (0.0, 0.0, 0.0)
    _samples: Samples = field(default_factory=Samples)

    def __post_init__(self) -> None:
        self._prior = self.coefficients()

    def coefficients(self) -> tuple[float, float, float]:
        return self.overhead_s, 1.0 / self.matmul_rate, 1.0 / self.attention_rate

    def _set(self, a: float, b: float, c: float, mode: str) -> None:
        self.overhead_s = max(a, 0.0)
        self.matmul_rate = 1.0 / max(b, 1e-18)
        self.attention_rate = 1.0 / max(c, 1e-18)
        self.mode = mode

    @property
    def samples(self) -> int:
        return self._samples.count

    def time(self, matmul: float, attention: float) -> float:
        return self.overhead_s + matmul / self.matmul_rate + attention / self.attention_rate

    def observe(self, shape: ModelShape, cached: int, new: int, seconds: float) -> None:
        if new <= 0 or not _valid(seconds):
            return
        self._samples.add((_bucket(new), _bucket(cached + new)),
                          (1.0, shape.matmul_flops(new), shape.attention_flops(cached, new)), seconds)
        self.refit()

    def refit(self) -> None:
        x, t = self._samples.arrays()
        if len(t) == 0:
            return
        a0, b0, c0 = self._prior
        flops0 = x[:, 1] * b0 + x[:, 2] * c0  # the prior's FLOP time of each sample
        if self._samples.buckets >= 3 and np.linalg.matrix_rank(x / np.abs(x).max(axis=0)) == 3:
            a, b, c = map(float, robust_fit(x, t))
            if b > 0 and c > 0:  # a zero rate term would make long prompts free: not credible
                self._set(a, b, c, "full")
                return
        if self._samples.buckets >= 2 and np.ptp(flops0) > 0:
            a, s = map(float, robust_fit(np.column_stack([np.ones(len(t)), flops0]), t))
            if s > 0:
                self._set(a, s * b0, s * c0, "overhead+scale")
                return
        s = float(np.median(t / (a0 + flops0)))
        self._set(s * a0, s * b0, s * c0, "scale")


# --- tiers ----------------------------------------------------------------------------------------


@dataclass(slots=True)
class Estimate:
    value: float
    samples: int = 0  # observations it was fitted from


@dataclass(slots=True)
class TierRate:
    """``seconds = latency + bytes / bandwidth`` of one load request, engine memory <- tier."""

    bandwidth: Estimate  # bytes / s
    latency: Estimate  # s per request
    _prior: tuple[float, float] | None = None
    _samples: Samples = field(default_factory=Samples)

    @classmethod
    def of(cls, bandwidth: float, latency: float) -> TierRate:
        return cls(Estimate(bandwidth), Estimate(latency))

    def time(self, nbytes: int) -> float:
        return nbytes / self.bandwidth.value + self.latency.value

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes < 0 or not _valid(seconds):
            return
        if self._prior is None:  # the values as set before the first observation are the prior
            self._prior = (self.bandwidth.value, self.latency.value)
        self._samples.add(_bucket(nbytes), (1.0, float(nbytes)), seconds)
        if nbytes:
            self.bandwidth.samples += 1
        else:
            self.latency.samples += 1
        self.refit()

    def refit(self) -> None:
        assert self._prior is not None
        bw0, lat0 = self._prior
        x, t = self._samples.arrays()
        sized = x[:, 1] > 0
        if self._samples.buckets >= 2 and sized.any():
            lat, inv_bw = robust_fit(x, t)
            if inv_bw > 1e-13:  # under 10 TB/s: anything faster is a fit of noise
                self.latency.value, self.bandwidth.value = float(lat), float(1.0 / inv_bw)
                return
        if not sized.any():  # round trips only: latency
            self.latency.value, self.bandwidth.value = float(np.median(t)), bw0
            return
        # one size (or sizes too close to tell the terms apart): fit the term that dominates
        # under the prior, keep the other
        xs, ts = x[sized, 1], t[sized]
        if float(np.median(xs)) / bw0 >= lat0:
            self.latency.value = lat0
            self.bandwidth.value = float(np.median(xs / np.maximum(ts - lat0, 0.1 * ts)))
        else:
            self.bandwidth.value = bw0
            self.latency.value = float(np.median(np.maximum(ts - xs / bw0, 0.1 * ts)))


# Priors, replaced by measurements as soon as transfers are observed.
# (Each tier's load_cost in kvstore/tier_table.py, and the peer data path's.)
DEFAULT_TIERS = LOAD_COSTS


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
    flop_rate: float  # prior FLOP/s (matmul and attention alike) until prefills are observed
    tiers: dict[str, TierRate] = field(default_factory=dict)
    history: int = 64
    overhead_s: float = 0.0  # prior per-forward overhead

    def __post_init__(self) -> None:
        if not self.tiers:
            self.tiers = {n: TierRate.of(bw, lat) for n, (bw, lat) in DEFAULT_TIERS.items()}
        self.prefill = PrefillFit(self.overhead_s, self.flop_rate, self.flop_rate)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._recent: deque[_Record] = deque(maxlen=self.history)
        self._by_id: dict[int, _Record] = {}
        self._counts = {"recompute": 0, "partial": 0, "load_all": 0}
        self._abs_err = 0.0
        self._err_n = 0

    # --- predictions ----------------------------------------------------------------------

    def prefill_time(self, cached: int, new: int) -> float:
        if new <= 0:
            return 0.0
        return self.prefill.time(self.shape.matmul_flops(new), self.shape.attention_flops(cached, new))

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
        """A real forward of ``new`` tokens behind ``cached`` took ``seconds``."""
        with self._lock:
            self.prefill.observe(self.shape, cached, new, seconds)

    def observe_transfer(self, tier_bytes: Mapping[str, int], seconds: float) -> None:
        """One load request moved ``tier_bytes`` (by tier) in ``seconds``, end to end.

        A request that touched several tiers is split between them in proportion to their
        predicted times; each share is one sample of its tier.
        """
        with self._lock:
            known = {tier_name(t): nb for t, nb in tier_bytes.items() if tier_name(t) in self.tiers and nb > 0}
            pred = {t: self.tiers[t].time(nb) for t, nb in known.items()}
            total = sum(pred.values())
            for t, nb in known.items():
                self.tiers[t].observe(nb, seconds * pred[t] / total if total > 0 else seconds / len(known))

    def observe_latency(self, tier: str, seconds: float) -> None:
        """A request that moved no bytes (e.g. a lookup round trip) took ``seconds``."""
        with self._lock:
            rate = self.tiers.get(tier_name(tier))
            if rate is not None:
                rate.observe(0, seconds)

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
        """The fitted matmul FLOP rate (attention has its own: ``prefill.attention_rate``)."""
        return self.prefill.matmul_rate

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            p = self.prefill
            return {
                "flop_rate": p.matmul_rate,
                "flop_rate_samples": p.samples,
                "prefill": {
                    "overhead_s": p.overhead_s,
                    "matmul_flop_rate": p.matmul_rate,
                    "attention_flop_rate": p.attention_rate,
                    "samples": p.samples,
                    "fit": p.mode,
                },
                "tiers": {
                    n: {
                        "bandwidth_bytes_per_s": r.bandwidth.value,
                        "latency_s": r.latency.value,
                        "samples": r.bandwidth.samples,
                        "latency_samples": r.latency.samples,
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


def calibrate_prefill(
    cost: CostModel, forward: Callable[[int], float], lengths: Sequence[int] = (16, 128, 512), repeats: int = 2
) -> None:
    """Feed ``cost`` real forwards at start-up: ``forward(n)`` runs a prefill of ``n`` tokens on an
    empty cache and returns its seconds. One warm-up at the shortest length, then ``repeats``
    forwards per length (at least three lengths fit all three terms)."""
    forward(min(lengths))
    for _ in range(repeats):
        for n in lengths:
            cost.observe_prefill(0, n, forward(n))


def calibrate_flop_rate(n: int = 384, repeats: int = 3) -> float:
    """FLOP/s of a real float32 ``n×n`` matmul (torch if installed, else numpy); best of ``repeats``."""
    a: Any  # torch.Tensor, or np.ndarray without torch
    b: Any
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
