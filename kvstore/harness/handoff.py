"""A prefill's ``kv_transfer_params`` handed to the decode request through files, one per request
(what a P/D proxy passes from the prefill's output to the decode request)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_handoff(directory: str | Path, i: int, params: dict[str, Any] | None) -> None:
    """Request ``i``'s ``kv_transfer_params`` for the other side of a handoff (see :func:`read_handoff`)."""
    path = Path(directory, f"{i}.json")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(params))
    tmp.replace(path)  # whole or not at all


def read_handoff(directory: str | Path, i: int) -> dict[str, Any] | None:
    """What :func:`write_handoff` wrote for request ``i`` (None: nothing, or no file)."""
    path = Path(directory, f"{i}.json")
    params: dict[str, Any] | None = json.loads(path.read_text()) if path.exists() else None
    return params
