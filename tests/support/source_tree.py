"""The project's own Python source as the structural tests read it: every module of ``kvstore/``
and ``connector/`` but protoc's output, parsed with ``ast`` (never imported); and the small trees
their self-tests write to show that a check can fail."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

PACKAGES = ("kvstore", "connector")
GENERATED = ("kvstore/v1",)  # protoc's output (scripts/gen_proto.py)


def parsed_sources(root: Path, packages: Iterable[str] = PACKAGES) -> Iterator[tuple[str, ast.Module]]:
    """Each module of ``packages`` under ``root`` but the generated ones, as (path relative to
    ``root``, its syntax tree), in path order."""
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if "__pycache__" in path.parts or any(rel.startswith(g + "/") for g in GENERATED):
                continue
            yield rel, ast.parse(path.read_text(), rel)


def write_tree(root: Path, files: Mapping[str, str]) -> None:
    """Write ``files`` (path relative to ``root`` -> text) under ``root``, making their folders."""
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
