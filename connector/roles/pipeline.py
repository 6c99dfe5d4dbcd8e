"""The connectors' pipeline to the sidecar (:meth:`kvstore.client.SyncClient.pipeline`: calls sent
now and answered later, on one connection to its Unix socket), opened on first use.

The scheduler side sends a request's ``Acquire`` on the engine's thread when the engine adds the
request, and reads the answer when the engine asks how many tokens it can load (a background
thread would first have to wait for the engine's thread to let go of the GIL, up to the
interpreter's 5 ms switch interval, before it could send anything). The worker side sends a
step's ``Release`` and hit ``Lookup`` calls all at once from its background thread, then reads
their answers: one round trip for all of them. Where the sidecar's socket cannot be opened (another
host or container) :class:`PipelineSlot` gives None and callers use their blocking client.
"""

from __future__ import annotations

import threading
from typing import Any

from kvstore.client import Pipeline
from kvstore.errors import KVStoreError


class PipelineSlot:
    """The :class:`~kvstore.client.Pipeline` of ``client`` (a :class:`kvstore.client.SyncClient`),
    opened on first use: None while the sidecar cannot be reached (asked again next time), and for
    good when its socket cannot be opened from here or the client stays on gRPC."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._pipe: Pipeline | None = None
        self._want = callable(getattr(client, "pipeline", None))
        self._lock = threading.Lock()

    def get(self) -> Pipeline | None:
        if self._pipe is not None or not self._want:
            return self._pipe
        with self._lock:
            if self._pipe is None and self._want:
                try:
                    pipe = self._client.pipeline()
                except KVStoreError:
                    return None  # down: ask again at the next use
                self._want = False
                self._pipe = pipe
        return self._pipe

    def close(self) -> None:
        with self._lock:
            pipe, self._pipe, self._want = self._pipe, None, False
        if pipe is not None:
            pipe.close()
