"""A clone stands alone: nothing in the repository reads or points at a folder that sits beside
this checkout (on the development machine, its shared notes and traces), which a user's clone
does not have. The folders beside are found when the test runs, so no name or path of the
development machine is written here."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def outside_pattern(root: Path) -> re.Pattern[bytes] | None:
    """What a reference to a folder beside ``root`` looks like: a relative path up into it, its
    absolute path, a path built from ``parents[...]`` and its name, or one of its own entries."""
    beside = [p for p in root.parent.iterdir() if p.is_dir() and p != root]
    if not beside:
        return None
    kinds = []
    for folder in beside:
        name = re.escape(os.fsencode(folder.name))
        kinds += [rb"\.\./" + name + rb"\b", re.escape(os.fsencode(folder)) + rb"\b",
                  rb"parents\[\d+\]\s*/\s*[\"']" + name + rb"[\"']"]
        entries = [re.escape(os.fsencode(e.name)) for e in folder.iterdir() if not e.name.startswith(".")]
        if entries:
            kinds.append(rb"\b" + name + rb"/(?:" + b"|".join(entries) + rb")\b")
    return re.compile(b"|".join(kinds))


def repository_files(root: Path) -> list[Path]:
    """Tracked files plus new files git would add (untracked, not ignored); without git, every file
    outside ``.git`` and caches."""
    if (root / ".git").exists():
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                             check=True, capture_output=True).stdout
        return [root / name for name in out.decode().split("\0") if name and (root / name).is_file()]
    skip = {".git", "__pycache__", ".mypy_cache", ".ruff_cache"}
    return [p for p in root.rglob("*") if p.is_file() and not skip & set(p.relative_to(root).parts)]


def outside_references(root: Path, paths: list[Path]) -> list[str]:
    """``path:line: text`` of every line that points outside the repository."""
    pattern = outside_pattern(root)
    if pattern is None:
        return []
    hits = []
    for path in paths:
        for no, line in enumerate(path.read_bytes().splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{path.relative_to(root)}:{no}: {line.decode(errors='replace').strip()[:120]}")
    return hits


def test_the_pattern_finds_each_kind_of_reference(tmp_path: Path) -> None:
    repo, notes = tmp_path / "repo", tmp_path / "notes"
    (notes / "traces").mkdir(parents=True)
    (notes / "DESIGN.md").write_text("")
    repo.mkdir()
    lines = ["kvstore replay ../notes/traces/x.jsonl", f"see {notes}/DESIGN.md",
             'Path(__file__).parents[3] / "notes" / "traces"', "as in notes/DESIGN.md", "ok: some notes here"]
    f = repo / "f.md"
    f.write_text("\n".join(lines) + "\n")
    assert [h.split(": ", 1)[1] for h in outside_references(repo, repository_files(repo))] == lines[:4]


def test_no_file_references_a_folder_beside_the_checkout() -> None:
    files = repository_files(ROOT)
    assert ROOT / "data" / "traces" / "conversation_trace.jsonl.gz" in files
    hits = outside_references(ROOT, files)
    assert not hits, "files that point outside the repository:\n" + "\n".join(hits)
