"""A sidecar tunes the process's collector while it runs and undoes it when it stops (#31 item 6).

Frozen objects are never collected, not even at interpreter exit: with the freeze of
``Sidecar.start`` never undone, a cycle of triton's nanobind objects (imported by transformers)
outlived the interpreter and nanobind printed ~30 lines of "leaked" warnings after the suite's
summary at every run."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
from pathlib import Path

from kvstore.server.sidecar import Sidecar
from kvstore.util.tuning import GC_THRESHOLDS
from tests.conftest import small_config

ROOT = Path(__file__).resolve().parents[2]


async def test_two_sidecars_tune_the_collector_until_the_last_one_stops(tmp_path: Path) -> None:
    before = gc.get_threshold()
    a = await Sidecar(small_config(tmp_path / "a")).start()
    try:
        assert gc.get_threshold() == GC_THRESHOLDS and gc.get_freeze_count() > 0
        b = await Sidecar(small_config(tmp_path / "b")).start()
        await a.stop()
        assert gc.get_threshold() == GC_THRESHOLDS and gc.get_freeze_count() > 0  # b still runs
        await b.stop()
    finally:
        await a.stop()
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_a_process_that_ran_a_sidecar_beside_triton_exits_without_nanobind_warnings(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import asyncio
        from pathlib import Path
        from transformers import AutoModelForCausalLM  # loads triton (torch._dynamo)
        from kvstore.server.sidecar import Sidecar
        from tests.conftest import small_config

        async def main():
            async with Sidecar(small_config(Path({str(tmp_path)!r}))):
                pass

        asyncio.run(main())
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "nanobind: leaked" not in out.stderr, out.stderr[-3000:]
