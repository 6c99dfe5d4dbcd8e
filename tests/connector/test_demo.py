"""`kvstore demo` end to end, as a user runs it: a subprocess, an embedded sidecar, two workers."""

from __future__ import annotations

import json
import subprocess
import sys

from kvstore.harness.sidecar import REPO


def test_demo_hands_off_and_matches_a_full_recompute() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvstore", "demo", "--tokens", "400", "--new-tokens", "8", "--json"],
        capture_output=True, text=True, cwd=REPO, timeout=600, check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    lines = out.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    text = "\n".join(lines[:-1])
    assert "greedy outputs match full recompute: yes" in text
    assert "outputs match full recompute: yes" in text
    turn1, turn2 = summary["decode"]["turn1"], summary["decode"]["turn2"]
    assert summary["ok"] and turn1["match"] and turn2["match"]
    assert turn1["loaded_blocks"] == 400 // 16 - (400 % 16 == 0)  # every full block bar the last token's
    assert f"loaded {turn1['loaded_blocks']} blocks" in text
    assert turn2["loaded_tokens"] == (400 + 8 - 1) // 16 * 16  # turn 1's prompt and answer
    assert summary["prefill"]["saved_blocks"] == 400 // 16
    assert summary["sidecar_stats"]["decisions"]["loaded"] >= 2
