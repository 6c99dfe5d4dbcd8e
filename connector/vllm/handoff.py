"""The prefill -> decode handoff on the scheduler side: what a finished request announces in its
``kv_transfer_params`` and how long a request that arrives with such an announcement waits for
the blocks.

vLLM emits a finished request's output in the step it finishes, while its saves may still be in
flight, so a prefill's "done" can reach a proxy before its blocks are stored. A finished request
therefore announces ``{"kvstore": {"blocks": N, "root": ..., "block_size": ..., ...}}`` (the
prompt's full blocks this instance stores, and the shape of its KV). A proxy passes them on to the
decode request (``SamplingParams.extra_args["kv_transfer_params"]``, as vLLM's P/D proxies do); the
decode instance's scheduler then answers "not yet" while fewer of those blocks are found, for at
most ``handoff_wait_ms``, asking the sidecar again every :data:`HANDOFF_POLL_S`, and afterwards
loads what is there and recomputes the rest. A prefill whose KV is shaped otherwise (block size,
tensor or pipeline parallel size) is refused with an error naming the field (``handoff_refused``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from connector.roles.stats import ConnectorStats
from kvstore.keys import Namespace

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

HANDOFF_KEY = "kvstore"  # this connector's entry in kv_transfer_params
HANDOFF_POLL_S = 0.005  # a decode request waiting for its prefill's blocks asks the sidecar this often


@dataclass(slots=True)
class _Wait:
    """A request waiting for the blocks its kv_transfer_params announce (a prefill elsewhere)."""

    since: float
    deadline: float
    next_poll: float = 0.0


class Handoffs:
    """The requests waiting for announced blocks, and what a finished request announces."""

    def __init__(self, stats: ConnectorStats, shape: dict[str, int], wait_ms: int) -> None:
        self.stats = stats  # the scheduler core's counters: the handoff's are counted with them
        self.shape = shape  # this instance's block size and parallel sizes
        self.wait_ms = wait_ms
        self._waits: dict[str, _Wait] = {}  # requests waiting for announced blocks
        self._handed: set[str] = set()  # requests whose announced blocks were waited for (once each)

    def polling(self, req_id: str, now: float) -> bool:
        """Whether the request waits and is not due to ask the sidecar again yet."""
        wait = self._waits.get(req_id)
        return wait is not None and now < wait.next_poll

    def waits(self, request: Request, ns: Namespace, found: int, now: float) -> bool:
        """Whether the request goes on waiting, having found ``found`` leading blocks: True while
        fewer than announced are there and its wait lasts."""
        req_id = request.request_id
        announced = self._announced(request, ns) if req_id not in self._handed else 0
        wait = self._waits.get(req_id)
        if announced and found < announced:
            if wait is None:
                wait = self._waits[req_id] = _Wait(now, now + self.wait_ms / 1000)
                self.stats.add(handoff_waits=1)
            if now < wait.deadline:
                wait.next_poll = now + HANDOFF_POLL_S
                self.stats.add(handoff_polls=1)
                return True  # its lease goes with the next lookup (or request_finished)
            self.stats.add(handoff_timeouts=1)
            log.info("request %s: %d of the %d announced blocks found after %.0f ms; recomputing the rest",
                     req_id, found, announced, (now - wait.since) * 1e3)
        if announced:
            self._handed.add(req_id)  # asked again later (preempted, say): what is there, no wait
        if wait is not None:
            del self._waits[req_id]
            self.stats.add(handoff_waited_ms=round((now - wait.since) * 1e3))
        return False

    def _announced(self, request: Request, ns: Namespace) -> int:
        """Loadable blocks the request's kv_transfer_params say a prefill stored for it (0: none,
        or another namespace's): what its lookup waits for."""
        params = getattr(request, "kv_transfer_params", None)
        ours = params.get(HANDOFF_KEY) if isinstance(params, dict) else None
        if not isinstance(ours, dict) or self.wait_ms <= 0:
            return 0
        blocks = ours.get("blocks")
        if not isinstance(blocks, int) or blocks <= 0:
            return 0
        if self._refused(request, ours):
            return 0
        if ours.get("root") != ns.root.hex():
            self.stats.add(handoff_other_namespace=1)  # another model or layout: nothing to wait for
            return 0
        return min(blocks, (request.num_tokens - 1) // self.shape["block_size"])  # the last token is computed

    def _refused(self, request: Request, ours: dict[str, Any]) -> bool:
        """A prefill whose KV is shaped otherwise (another block size, tensor or pipeline parallel
        size): its blocks can never be loaded here. Refused with an error naming the field
        (logged and counted); the request is computed here in full."""
        for name, mine in self.shape.items():
            theirs = ours.get(name)
            if theirs is not None and theirs != mine:
                self.stats.add(handoff_refused=1)
                log.error("request %s: kv_transfer_params.%s.%s: the prefill instance ran with %s, this instance "
                          "with %s; its blocks cannot be loaded here (refused; computing the prompt here)",
                          request.request_id, HANDOFF_KEY, name, theirs, mine)
                self._handed.add(request.request_id)  # said once per request
                return True
        return False

    def announce(self, ns: Namespace, blocks: int) -> dict[str, Any] | None:
        """The ``kv_transfer_params`` of a finished request that stores ``blocks`` prompt blocks."""
        return {HANDOFF_KEY: {"blocks": blocks, "root": ns.root.hex(), **self.shape}} if blocks > 0 else None

    def forget(self, req_id: str) -> None:
        self._waits.pop(req_id, None)
        self._handed.discard(req_id)
