"""One place writes a block's checksum (issue #31): ``Block.seal`` in ``kvstore/store/books/index.py``.

A block's checksum is recorded once (set while it is None) and never changes; every copy that
comes back across a tier boundary, from a peer or out of a DRAM slot is judged against it. That
rule holds only while one method writes the field, so this test reads ``kvstore/`` and
``connector/`` with ``ast`` (never importing them) for every write of an attribute named
``checksum``: an assignment's target (``x.checksum = ...``, ``x.checksum += ...``, a tuple's or
a chained assignment's element, a ``for``'s or ``with``'s target), a ``del x.checksum``, and
``setattr(x, "checksum", ...)``. The writes it finds must be exactly those of ``OWNERS``: the
owner, and the client's own protobuf message (``CommitBlock.checksum``, the checksum a writer
sends, which is no block's record).
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass
from pathlib import Path

from kvstore.keys import BlockKey, Namespace
from kvstore.store.books.index import Index, State
from tests.support.source_tree import PACKAGES, parsed_sources, write_tree

ROOT = Path(__file__).resolve().parents[1]
FIELD = "checksum"

# (path, the enclosing function's qualified name) -> why it may write an attribute named checksum
OWNERS: dict[tuple[str, str], str] = {
    ("kvstore/store/books/index.py", "Block.seal"): "the owner: a block's checksum is recorded once",
    ("kvstore/store/books/index.py", "Block.__init__"): "a new block's None: unsealed (Index.add makes it)",
    ("kvstore/client/calls.py", "AllocationState._commit_request"): "the client's CommitBlock message: no block's",
}


@dataclass(frozen=True, slots=True)
class Write:
    path: str
    line: int
    scope: str  # the enclosing classes and functions, dotted ("" at module level)

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.scope or '<module>'} writes .{FIELD}"


class _Reader(ast.NodeVisitor):
    def __init__(self, path: str) -> None:
        self.path = path
        self.found: list[Write] = []
        self._scope: list[str] = []

    def _nested(self, node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._scope.append(node.name)
        self.generic_visit(node)
        self._scope.pop()

    visit_ClassDef = visit_FunctionDef = visit_AsyncFunctionDef = _nested

    def _write(self, node: ast.AST) -> None:
        self.found.append(Write(self.path, getattr(node, "lineno", 0), ".".join(self._scope)))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr == FIELD and isinstance(node.ctx, (ast.Store, ast.Del)):
            self._write(node)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        if (
            isinstance(f, ast.Name)
            and f.id == "setattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value == FIELD
        ):
            self._write(node)
        self.generic_visit(node)


def writes(root: Path, packages: tuple[str, ...] = PACKAGES) -> list[Write]:
    """Every write of an attribute named ``checksum`` in ``packages`` under ``root``."""
    out: list[Write] = []
    for rel, tree in parsed_sources(root, packages):
        reader = _Reader(rel)
        reader.visit(tree)
        out += reader.found
    return out


def unowned(found: list[Write], owners: dict[tuple[str, str], str]) -> list[str]:
    return [str(w) for w in found if (w.path, w.scope) not in owners]


# --- the tree's own check ------------------------------------------------------------------------------


def test_one_place_writes_a_blocks_checksum() -> None:
    found = writes(ROOT)
    extra = unowned(found, OWNERS)
    assert not extra, (
        "a block's checksum is written only by Block.seal (kvstore/store/books/index.py), which records it once; "
        "call b.seal(checksum) instead:\n" + "\n".join(extra)
    )
    # exactly one site each: the owner's rule is its one assignment, and no listed owner is stale
    assert sorted((w.path, w.scope) for w in found) == sorted(OWNERS)


def test_seal_records_a_checksum_once() -> None:
    index = Index()
    namespace = Namespace(model="tiny-llama", kv_layout="raw", dtype="float16", block_size=16)
    ns = index.namespace(namespace.root, namespace.label, namespace)
    b = index.add(ns, BlockKey(bytes(32)), b"", 4096, State.COMMITTED)
    assert b.checksum is None
    assert b.seal(7) and b.checksum == 7  # unsealed: takes the first
    assert b.seal(7) and b.checksum == 7  # the same again: agrees
    assert not b.seal(8) and b.checksum == 7  # another: disagrees, the first is kept


# --- the check catches what it is for ------------------------------------------------------------------


def test_the_check_finds_every_kind_of_write(tmp_path: Path) -> None:
    files = {
        "kvstore/store/books/index.py": textwrap.dedent("""\
            class Block:
                checksum: int | None = None

                def seal(self, checksum):
                    if self.checksum is None:
                        self.checksum = checksum
                    return self.checksum == checksum
            """),
        "kvstore/tiers/sneaky.py": textwrap.dedent("""\
            def f(b, c, blocks):
                b.checksum = c
                b.size, b.checksum = 1, c
                b.checksum += 1
                x = b.checksum = c
                for b.checksum in blocks:
                    pass
                del b.checksum
                setattr(b, "checksum", c)
                return b.checksum, getattr(b, "checksum"), x


            class C:
                def g(self, b):
                    b.checksum: int = 0
            """),
        "kvstore/v1/store_pb2.py": "def generated(m):\n    m.checksum = 1\n",
        "connector/ok.py": "def read(b):\n    return b.checksum\n",
    }
    write_tree(tmp_path, files)

    found = writes(tmp_path)
    assert [str(w) for w in found] == [
        "kvstore/store/books/index.py:6: Block.seal writes .checksum",
        "kvstore/tiers/sneaky.py:2: f writes .checksum",
        "kvstore/tiers/sneaky.py:3: f writes .checksum",
        "kvstore/tiers/sneaky.py:4: f writes .checksum",
        "kvstore/tiers/sneaky.py:5: f writes .checksum",
        "kvstore/tiers/sneaky.py:6: f writes .checksum",
        "kvstore/tiers/sneaky.py:8: f writes .checksum",
        "kvstore/tiers/sneaky.py:9: f writes .checksum",
        "kvstore/tiers/sneaky.py:15: C.g writes .checksum",
    ]
    owners = {("kvstore/store/books/index.py", "Block.seal"): "the owner"}
    assert unowned(found, owners) == [str(w) for w in found[1:]]
    assert unowned(found[:1], owners) == []
