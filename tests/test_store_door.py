"""The cluster's only door into a store is ``kvstore.store.door.StoreDoor`` (issue #40, item 4).

The cluster (``kvstore/cluster/``) is handed the store's exchange typed as ``StoreDoor``, so mypy
refuses any call past it; this test holds the rest of the rule, reading the cluster's modules with
``ast`` (never importing them): they never name ``BlockStore`` (in code: an annotation, an import,
a ``TYPE_CHECKING`` import, a call), import of the store's package only the names of ``ALLOWED``
(the door, the records the door hands out, the counters, a few constants), and never read an
attribute named after one of the store's rooms (``.index``, ``.slab``, ``.space``, ...), so a
module that holds a store some other way cannot reach through it either.

The lists are exact: the test fails on an import they do not name, and on an entry no module
imports any more (remove it), so they never become a blanket. Each failure names file:line.
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass
from pathlib import Path

from tests.support.source_tree import parsed_sources, write_tree

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = "kvstore/cluster/"

# (store module, name) -> why the cluster may import it
ALLOWED: dict[tuple[str, str], str] = {
    ("kvstore.store.door", "StoreDoor"): "the door itself",
    ("kvstore.store.exchange", "Reservation"): "what the door's reserve hands out (a fetch's slots, settled)",
    ("kvstore.store.books.index", "Block"): "the records the door's lookups and the change feed hand out",
    ("kvstore.store.books.index", "NsEntry"): "a namespace's entry, as the door's lookups take and give it",
    ("kvstore.store.books.index", "ChangeFeed"): "what the door's subscribe hands out",
    ("kvstore.store.books.index", "DRAM"): "a placement bit (a constant)",
    ("kvstore.store.books.index", "top_label"): "a label for the logs (a pure function)",
    ("kvstore.store.remote", "PeerBlock"): "the Remote Protocol's record of a block a peer holds",
    ("kvstore.store.remote", "MAX_HOLDERS"): "the Remote Protocol's bound (a constant)",
    ("kvstore.store.books.retention", "MAX_RETAIN_MS"): "a retention hint's bound (a constant)",
    ("kvstore.store.books.retention", "PRIORITIES"): "a retention hint's priorities (a constant)",
}
FORBIDDEN_NAME = "BlockStore"
# attributes named after the store's rooms: the door hands out calls, never these
ROOMS = frozenset(
    {"index", "slab", "space", "exchange", "sealing", "retention", "tiering", "movers", "placement", "checks"}
)


@dataclass(frozen=True, slots=True)
class Reach:
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def reaches(root: Path) -> tuple[list[Reach], set[tuple[str, str]]]:
    """What the cluster's modules under ``root`` do past the door, and the ``ALLOWED`` entries
    they use."""
    bad: list[Reach] = []
    used: set[tuple[str, str]] = set()
    for rel, tree in parsed_sources(root, ("kvstore",)):
        if not rel.startswith(CLUSTER):
            continue
        for node in ast.walk(tree):
            line = getattr(node, "lineno", 0)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvstore.store"):
                for alias in node.names:
                    entry = (node.module or "", alias.name)
                    if entry in ALLOWED:
                        used.add(entry)
                    else:
                        bad.append(Reach(rel, line, f"imports {alias.name} from {node.module}"))
            elif isinstance(node, ast.Import):
                bad += [
                    Reach(rel, line, f"imports {a.name}") for a in node.names if a.name.startswith("kvstore.store")
                ]
            elif isinstance(node, ast.Name) and node.id == FORBIDDEN_NAME:
                bad.append(Reach(rel, line, f"names {FORBIDDEN_NAME}"))
            elif isinstance(node, ast.Attribute) and (node.attr == FORBIDDEN_NAME or node.attr in ROOMS):
                bad.append(Reach(rel, line, f"reads .{node.attr}"))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _annotation_names(node.value):
                bad.append(Reach(rel, line, f"names {FORBIDDEN_NAME} in a string annotation"))
    return sorted(bad, key=lambda r: (r.path, r.line, r.what)), used


def _annotation_names(text: str) -> bool:
    """Whether ``text`` is an expression (a quoted annotation) that names BlockStore."""
    try:
        expr = ast.parse(text, mode="eval")
    except SyntaxError:
        return False
    return any(isinstance(n, ast.Name) and n.id == FORBIDDEN_NAME for n in ast.walk(expr))


# --- the tree's own check ------------------------------------------------------------------------------


def test_the_cluster_uses_the_store_only_through_its_door() -> None:
    bad, used = reaches(ROOT)
    assert not bad, (
        "kvstore/cluster/ works on the store only through kvstore.store.door.StoreDoor (add a call "
        "there and to kvstore/store/exchange.py, or an entry to ALLOWED with its reason):\n"
        + "\n".join(map(str, bad))
    )
    assert sorted(set(ALLOWED) - used) == [], "ALLOWED names imports no cluster module makes: remove them"


# --- the check catches what it is for ------------------------------------------------------------------


def test_the_check_finds_every_reach_past_the_door(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        {
            "kvstore/cluster/sneaky.py": textwrap.dedent("""\
                from __future__ import annotations
                from typing import TYPE_CHECKING
                import kvstore.store.books.dram_space
                from kvstore.store.door import StoreDoor
                from kvstore.store.books.index import Block, Index
                if TYPE_CHECKING:
                    from kvstore.store.block_store import BlockStore

                def f(store: BlockStore, door: StoreDoor, b: Block) -> None:
                    store.index.get(b.ns, b.key)
                    door.slab.holds(b.size)

                def g(x: "BlockStore | None") -> None:
                    "BlockStore in a docstring is prose, not a reach."
            """),
            "kvstore/store/exchange.py": "from kvstore.store.books.index import Index\n",  # (not the cluster's)
        },
    )
    bad, used = reaches(tmp_path)
    assert [str(r) for r in bad] == [
        "kvstore/cluster/sneaky.py:3: imports kvstore.store.books.dram_space",
        "kvstore/cluster/sneaky.py:5: imports Index from kvstore.store.books.index",
        "kvstore/cluster/sneaky.py:7: imports BlockStore from kvstore.store.block_store",
        "kvstore/cluster/sneaky.py:9: names BlockStore",
        "kvstore/cluster/sneaky.py:10: reads .index",
        "kvstore/cluster/sneaky.py:11: reads .slab",
        "kvstore/cluster/sneaky.py:13: names BlockStore in a string annotation",
    ]
    assert used == {("kvstore.store.door", "StoreDoor"), ("kvstore.store.books.index", "Block")}
