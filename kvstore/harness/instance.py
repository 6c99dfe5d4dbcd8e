"""One vLLM instance in a process of its own, seen from the parent: start it from a JSON spec, let
it take its turns, read its results (the child's side is :mod:`kvstore.harness.phases`).

Every instance runs with :data:`VLLM_ENV`: the in-process engine
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``, so no instance gets
more cores than another and no vLLM state leaks between instances or into the parent.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstore.harness.sidecar import REPO
from kvstore.util.tuning import ENV as MALLOC_ENV

VLLM_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
    **MALLOC_ENV,
}


def repo_pythonpath() -> str:
    """``PYTHONPATH`` for a child process that imports this tree (before what the parent's has)."""
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)


def kvstore_config(url: str, role: str = "kv_both", **extra: Any) -> dict[str, Any]:
    """``kv_transfer_config`` for the kvstore connector."""
    return {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "connector.vllm", "kv_role": role,
            "kv_connector_extra_config": {"url": url, **extra}}


def run_instance(
    spec: dict[str, Any], *, env: dict[str, str] | None = None, timeout: float = 600, prefix: Sequence[str] = (),
) -> dict[str, Any]:
    """Run one vLLM instance in a fresh process (see :func:`kvstore.harness.phases.main`); returns
    its results."""
    with Instance(spec, env=env, prefix=prefix) as inst:
        return inst.result(timeout)


class Instance:
    """One vLLM instance in its own process. With ``paced``, each request or batch round of its
    ``paced`` phases waits for :meth:`turn` (one byte each way on a pair of pipes): ``R`` = ready
    for the next, ``G`` = go, ``D`` = all its phases are done (the next ``G`` lets it shut down:
    :meth:`result`). ``prefix``: the command line starts with it, e.g. ``["nsenter", "-t", PID,
    "-m", "-n"]`` to run the instance on a test host, in its sidecar's namespaces
    (:meth:`kvstore.harness.cross_host.CrossHost.nsenter`)."""

    def __init__(
        self, spec: dict[str, Any], *, env: dict[str, str] | None = None, paced: bool = False,
        prefix: Sequence[str] = (),
    ) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="kvstore-vllm-")
        path = Path(self._dir.name) / "spec.json"
        self.out = Path(self._dir.name) / "out.json"
        self.log = Path(self._dir.name) / "log.txt"
        fds: tuple[int, ...] = ()
        self._go: int | None = None
        if paced:
            go_r, self._go = os.pipe()
            self._ready, ready_w = os.pipe()
            spec = {**spec, "pace": {"in": go_r, "out": ready_w}}
            fds = (go_r, ready_w)
        path.write_text(json.dumps({**spec, "out": str(self.out)}))
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [*prefix, sys.executable, "-m", "kvstore.harness.phases", str(path)], cwd=REPO, pass_fds=fds,
                env={**os.environ, **VLLM_ENV, "PYTHONPATH": repo_pythonpath(), **(env or {})}, stdout=log,
                stderr=subprocess.STDOUT,
            )
        for fd in fds:
            os.close(fd)  # the child's ends

    def signal(self, timeout: float) -> bytes:
        """The instance's next byte (``R`` or ``D``); b"" if it exited or fell silent."""
        ready, _, _ = select.select([self._ready], [], [], timeout)
        return os.read(self._ready, 1) if ready else b""

    def go(self) -> None:
        """Let it run its next request (or batch round), without waiting: :meth:`signal` says
        when it is done."""
        assert self._go is not None, "not a paced instance"
        os.write(self._go, b"G")

    def turn(self, timeout: float) -> bytes:
        """Let it run one request or batch round; returns what it says afterwards."""
        self.go()
        return self.signal(timeout)

    def result(self, timeout: float) -> dict[str, Any]:
        if self._go is not None:
            with contextlib.suppress(OSError):  # a paced instance waits for leave to shut down
                os.write(self._go, b"G")
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        log = self.log.read_text(errors="replace")
        if code != 0 or not self.out.exists():
            raise RuntimeError(f"vLLM instance exited {code}:\n{log[-6000:]}")
        return {**json.loads(self.out.read_text()), "log": log}

    def __enter__(self) -> Instance:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self._go is not None:
            os.close(self._go)
            os.close(self._ready)
        self._dir.cleanup()
