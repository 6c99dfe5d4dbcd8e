"""Reload-or-recompute outcomes, reported to the sidecar's ``/stats`` (``Report`` RPC).

Records are buffered and sent in one batched call by :meth:`DecisionReporter.flush`, off the
request's critical path; a sidecar that cannot take them loses them (they are statistics).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from connector.cost import Decision
from connector.roles.metadata import LoadResult
from kvstore.tier_table import NAMES

log = logging.getLogger(__name__)

TIER_ORDER = NAMES  # fastest first (kvstore/tier_table.py)
MAX_BATCH = 1024  # the sidecar's limit per Report call


def slowest_tier(tiers: Sequence[str]) -> str:
    if not tiers:
        return ""
    return max(tiers, key=lambda t: TIER_ORDER.index(t) if t in TIER_ORDER else len(TIER_ORDER))


def decision_record(
    namespace: str,
    decision: Decision | None,
    *,
    prompt_blocks: int,
    cached_blocks: int,
    tiers: Sequence[str],
    load: LoadResult | None,
    actual_s: float = 0.0,
) -> dict[str, Any]:
    """One ``kvstore.v1.Decision`` as a dict."""
    loaded = load.loaded if load is not None else 0
    if load is not None and load.failure is not None:
        outcome = f"fallback:{load.failure.value}"
    else:
        outcome = "loaded" if loaded else "recomputed"
    return {
        "namespace": namespace,
        "prompt_blocks": prompt_blocks,
        "cached_blocks": cached_blocks,
        "loaded_blocks": loaded,
        "tier": slowest_tier(list(tiers)[:loaded]),
        "predicted_load_s": decision.predicted_load_s if decision else 0.0,
        "predicted_recompute_s": decision.recompute_ttft_s if decision else 0.0,
        "actual_s": actual_s or (load.seconds if load is not None else 0.0),
        "outcome": outcome,
    }


def bypass_record(namespace: str, reason: str, prompt_blocks: int) -> dict[str, Any]:
    """One ``kvstore.v1.Decision`` for a request served without the cache: outcome
    ``bypass:<reason>`` (``reason``: one of :data:`kvstore.stats.counters.BYPASS_REASONS`)."""
    return {"namespace": namespace, "prompt_blocks": prompt_blocks, "cached_blocks": 0, "loaded_blocks": 0,
            "tier": "", "predicted_load_s": 0.0, "predicted_recompute_s": 0.0, "actual_s": 0.0,
            "outcome": f"bypass:{reason}"}


class DecisionReporter:
    def __init__(self, client: Any) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._pending: list[dict[str, Any]] = []
        self.dropped = 0

    def add(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._pending.append(record)
            if len(self._pending) > 4 * MAX_BATCH:  # never grow without bound
                self.dropped += len(self._pending) - 4 * MAX_BATCH
                del self._pending[: len(self._pending) - 4 * MAX_BATCH]

    def flush(self) -> int:
        """Send what is buffered; returns the number of records sent."""
        with self._lock:
            batch, self._pending = self._pending, []
        report = getattr(self._client, "report", None)
        if not batch or report is None:
            return 0
        sent = 0
        for i in range(0, len(batch), MAX_BATCH):
            try:
                report(batch[i : i + MAX_BATCH])
                sent += len(batch[i : i + MAX_BATCH])
            except Exception as exc:  # noqa: BLE001 - statistics only
                self.dropped += len(batch) - sent
                log.info("report: %d decision records dropped (%s)", len(batch) - sent, exc)
                break
        return sent
