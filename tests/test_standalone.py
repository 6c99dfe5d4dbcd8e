"""A clone stands alone: nothing in the repository reads or points at the folder that sits beside
this project's own checkout (the development machine's shared notes and traces), which a user's
clone does not have."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# What a reference to the folder beside the checkout looks like: a relative path up into it, the
# absolute path on the development machine, a path built from its name, or one of its files.
OUTSIDE = re.compile(
    rb"\.\./shared\b"
    rb"|/work/(?:shared)\b"
    rb"|[\"']shared[\"']\s*/"
    rb"|\bshared/(?:DESIGN|CLUSTER|STYLE)\.md"
    rb"|\bshared/(?:traces|hooks)\b"
)


def repository_files() -> list[Path]:
    """Tracked files plus new files git would add (untracked, not ignored)."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: which files belong to the repository is unknown")
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         check=True, capture_output=True).stdout
    return [ROOT / name for name in out.decode().split("\0") if name and (ROOT / name).is_file()]


def outside_references(root: Path, paths: list[Path]) -> list[str]:
    """``path:line: text`` of every line that points outside the repository."""
    hits = []
    for path in paths:
        for no, line in enumerate(path.read_bytes().splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{path.relative_to(root)}:{no}: {line.decode(errors='replace').strip()[:120]}")
    return hits


def test_the_pattern_finds_each_kind_of_reference(tmp_path: Path) -> None:
    d = "shared"  # spelled apart, so that this file does not match itself
    lines = [f"kvstore replay ../{d}/traces/x.jsonl", f"see /work/{d}/DESIGN.md",
             f'Path(__file__).parents[3] / "{d}" / "traces"', f"as in {d}/DESIGN.md", f"ok: a {d} slab"]
    f = tmp_path / "f.md"
    f.write_text("\n".join(lines) + "\n")
    assert [h.split(": ", 1)[1] for h in outside_references(tmp_path, [f])] == lines[:4]


def test_no_file_references_the_folder_beside_the_checkout() -> None:
    files = repository_files()
    assert ROOT / "data" / "traces" / "conversation_trace.jsonl.gz" in files
    hits = outside_references(ROOT, files)
    assert not hits, "files that point outside the repository:\n" + "\n".join(hits)
