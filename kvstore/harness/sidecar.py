"""`kvstore serve` as a subprocess, the way users run it; used by tests and benchmarks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from kvstore.server.watchdog import EXIT_STUCK
from kvstore.util.tuning import ENV as MALLOC_ENV

REPO = Path(__file__).resolve().parents[2]


class ServeProcess:
    """Starts ``kvstore serve ARGS`` and waits for its ready line (bound addresses as JSON), and
    then (``recovered``, the default) for its recovered line: every block its lower tiers held
    at the start loaded (it serves from the ready line on, a block not loaded yet a miss)."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None,
                 entry: tuple[str, ...] = ("-m", "kvstore", "serve"), recovered: bool = True) -> None:
        """``entry``: what the interpreter runs before ``args`` (a test's ``-c`` wrapper around
        ``kvstore.cli.main``, say)."""
        # stderr (structured logs) goes to a file: a pipe nobody reads would block the server.
        # closed in stop(); read after the process is gone
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115
            "w+", prefix="kvstore-serve-", suffix=".log", delete=False
        )
        self.proc = subprocess.Popen(
            [sys.executable, *entry, *args],
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env={**os.environ, **MALLOC_ENV, **(env or {})},
            cwd=REPO,
        )
        assert self.proc.stdout is not None  # stdout=PIPE
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            err = Path(self.log.name).read_text()
            raise RuntimeError(f"kvstore serve exited {self.proc.wait()}: {err}")
        self.ready: dict[str, str] = json.loads(line)
        self.grpc: str = self.ready["grpc"]
        self.http: str = self.ready["http"]
        self.recovered: dict[str, int] = {}
        if recovered:
            self.wait_recovered()

    def wait_recovered(self) -> dict[str, int]:
        """Wait for the recovered line (``blocks``, ``batches``: what the restart loaded)."""
        assert self.proc.stdout is not None  # stdout=PIPE
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"kvstore serve exited {self.proc.wait()} before recovering: {self.logs()[-3000:]}")
        self.recovered = json.loads(line)
        return self.recovered

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Signal the sidecar and wait for it; its exit status. A sidecar whose shutdown stuck
        (its watchdog's exit status, or still running after ``timeout``: then it is killed) has its
        log's tail printed to stderr, where pytest shows it beside the failure."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            print(f"kvstore serve did not exit {timeout} s after signal {sig}; its log ends:\n{self.logs()[-20000:]}",
                  file=sys.stderr)
            raise
        if code == EXIT_STUCK:
            print(f"kvstore serve's shutdown stuck; its log ends:\n{self.logs()[-20000:]}", file=sys.stderr)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()
        return code

    def logs(self) -> str:
        return Path(self.log.name).read_text()

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
