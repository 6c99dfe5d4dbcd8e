"""Retention hints from the engine's side: how long the sidecar should keep a request's blocks.

An agent framework that ends a turn in a tool call knows the conversation will come back; it says
so per request, as vLLM's ``kv_transfer_params`` ``{"kvstore_retain_s": 60}`` or the HF connector's
``retain_s`` argument. The saves of that request then retain its blocks (the sidecar's soft pin,
kvstore/store/books/retention.py): each save retains every full block of the prompt so far, so the
retention runs from the request's last save, its end.

A hint of 0 (given, not left out) ends the retention of the blocks the request's saves cover:
the next turn, sent once the tool call has returned, says the earlier turn's retention has done
its work (``Retain(keys, 0)``; a turn that ends in a tool call again says its own seconds, which
keep the later end). That is the rule ``kvstore replay --hints until-continued`` measures
(docs/eviction.md, "Retention hints"): a long hint (600 s) ended so gives 1.4-2.5x the prefix hit
rate at 1% of one node, and holds over 8 nodes under prefix routing, where the next turn runs on
the node holding the turn it continues. Like every Retain it acts on the sidecar it reaches, so
under other routing the framework ends the retention on the sidecar that served the earlier turn
(``until-returned``). No hint (None): nothing is said.
"""

from __future__ import annotations

import math
from typing import Any

RETAIN_KEY = "kvstore_retain_s"  # this connector's hint in kv_transfer_params
MAX_RETAIN_S = 86_400.0  # the sidecar's limit (kvstore.store.books.retention.MAX_RETAIN_MS)


def retain_ms(seconds: Any, field: str) -> int | None:
    """``seconds`` as the sidecar's retain_ms (None: no hint; 0: end the retention); ValueError
    naming ``field`` when it is not a number of seconds in [0, 86400]."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds):
        raise ValueError(f"{field}: want a number of seconds, got {seconds!r}")
    if not 0 <= seconds <= MAX_RETAIN_S:
        raise ValueError(f"{field}: {seconds} is outside 0..{MAX_RETAIN_S:g} seconds")
    return round(seconds * 1000)


def retain_ms_of_params(params: Any) -> int | None:
    """The hint in a request's ``kv_transfer_params`` (None: none; 0: end the retention);
    ValueError naming the field."""
    if not isinstance(params, dict) or RETAIN_KEY not in params:
        return None
    return retain_ms(params[RETAIN_KEY], f"kv_transfer_params.{RETAIN_KEY}")
