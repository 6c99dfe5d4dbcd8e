"""Every field of a block has one owner (issue #40): one room writes it, through the methods named here.

``Block`` (``kvstore/store/books/index.py``) is the record of one block: its state, where it lies, its
slot, its pins, its retention. Each transition of it is a method of the room that owns the field
(the index pins and publishes, the DRAM space binds a slot, a placement space places, the
retention retains), and every other room calls those methods, never writes the field: so the
question "who may change ``b.leases``?" has one answer, and a compact index can later change how
blocks are stored behind these methods alone.

This test reads ``kvstore/`` and ``connector/`` with ``ast`` (never importing them) for every
write of an attribute named after a field of ``Block`` (the fields are read from the class
itself): an assignment's target (plain, augmented, annotated, a tuple's or a chained
assignment's element, a ``for``'s or ``with``'s target), a ``del``, and ``setattr(x, "field",
...)`` / ``object.__setattr__(x, "field", ...)``. ``self.field`` inside a class other than
``Block`` is that class's own member, not a block's. The writes found must be exactly those of
``OWNERS`` (each field's one room, and the methods there that write it) and ``NOT_BLOCKS``
(another object's attribute of the same name).
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvstore.keys import BlockKey, Namespace
from kvstore.store.books.index import Block, Index, State
from tests.support.source_tree import PACKAGES, parsed_sources, write_tree

ROOT = Path(__file__).resolve().parents[1]
INDEX = "kvstore/store/books/index.py"

# field -> (its owner's module, the methods there that write it). A field set only when the block
# is made (Index.add) lists none.
OWNERS: dict[str, tuple[str, frozenset[str]]] = {
    "ns": (INDEX, frozenset()),
    "key": (INDEX, frozenset()),
    "parent": (INDEX, frozenset()),
    "size": (INDEX, frozenset()),
    "depth": (INDEX, frozenset()),
    "state": (INDEX, frozenset({"Index.publish"})),
    "replica": (INDEX, frozenset({"Index.publish"})),
    "checksum": (INDEX, frozenset({"Block.seal"})),
    "leases": (INDEX, frozenset({"Index.take_lease", "Index.release_lease", "Index.pinned"})),
    "moving": (INDEX, frozenset({"Index.start_moving", "Index.stop_moving"})),
    "tiers": ("kvstore/store/books/placement.py",
              frozenset({"Space.place", "Space.place_many", "Space.unplace", "placed_nowhere"})),
    "slot": ("kvstore/store/books/dram_space.py", frozenset({"DramSpace.bind", "DramSpace.free"})),
    "retain_until": (
        "kvstore/store/books/retention.py",
        frozenset({"Retention.retain", "Retention.end", "Retention.adopt", "Retention.inherit", "Retention.recount"}),
    ),
    "retain_priority": (
        "kvstore/store/books/retention.py",
        frozenset({"Retention.retain", "Retention.end", "Retention.inherit", "Retention.recount"}),
    ),
}

# (path, the enclosing function's qualified name, attribute) -> why it is no block's field
NOT_BLOCKS: dict[tuple[str, str, str], str] = {
    ("kvstore/client/calls.py", "AllocationState._commit_request", "checksum"): "the client's CommitBlock message",
}


@dataclass(frozen=True, slots=True)
class Write:
    path: str
    line: int
    scope: str  # the enclosing classes and functions, dotted ("" at module level)
    field: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.scope or '<module>'} writes .{self.field}"


def block_fields(root: Path) -> set[str]:
    """The fields ``Block`` declares, read from its source: its annotated class attributes (its
    own slots) and its writable properties (the rare fields it keeps aside, issue 41)."""
    tree = ast.parse((root / INDEX).read_text(), INDEX)
    block = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Block")
    slots = {n.target.id for n in block.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    return slots | {
        n.name
        for n in block.body
        if isinstance(n, ast.FunctionDef)
        and any(isinstance(d, ast.Attribute) and d.attr == "setter" for d in n.decorator_list)
    }


def storage(w: Write) -> bool:
    """A write inside ``Block``'s constructor (called by ``Index.add`` alone) or its own setter of
    the field: where it is stored, not who sets it."""
    return w.path == INDEX and w.scope in ("Block.__init__", f"Block.{w.field}")


class _Reader(ast.NodeVisitor):
    def __init__(self, path: str, fields: set[str]) -> None:
        self.path = path
        self.fields = fields
        self.found: list[Write] = []
        self._scope: list[str] = []
        self._classes: list[str] = []

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._scope.append(node.name)
        self._classes.append(node.name)
        self.generic_visit(node)
        self._classes.pop()
        self._scope.pop()

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._scope.append(node.name)
        self.generic_visit(node)
        self._scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def _write(self, node: ast.AST, field: str) -> None:
        self.found.append(Write(self.path, getattr(node, "lineno", 0), ".".join(self._scope), field))

    def _own(self, value: ast.expr) -> bool:
        """``self.x`` / ``cls.x`` in a class other than Block: that class's own member."""
        in_other = bool(self._classes) and self._classes[-1] != "Block"
        return in_other and isinstance(value, ast.Name) and value.id in ("self", "cls")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in self.fields and isinstance(node.ctx, (ast.Store, ast.Del)) and not self._own(node.value):
            self._write(node, node.attr)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        named = (isinstance(f, ast.Name) and f.id == "setattr") or (
            isinstance(f, ast.Attribute) and f.attr == "__setattr__"
        )
        if named and len(node.args) >= 2:
            name = node.args[1]
            if isinstance(name, ast.Constant) and name.value in self.fields:
                self._write(node, str(name.value))
        self.generic_visit(node)


def writes(root: Path, packages: tuple[str, ...] = PACKAGES) -> list[Write]:
    """Every write of an attribute named after a field of ``Block`` in ``packages`` under ``root``."""
    fields = block_fields(root)
    out: list[Write] = []
    for rel, tree in parsed_sources(root, packages):
        reader = _Reader(rel, fields)
        reader.visit(tree)
        out += reader.found
    return out


def unowned(
    found: list[Write], owners: dict[str, tuple[str, frozenset[str]]], not_blocks: dict[tuple[str, str, str], str]
) -> list[str]:
    """The writes that are neither their field's owner's nor another object's."""
    out = []
    for w in found:
        if storage(w):
            continue
        path, scopes = owners[w.field]
        if (w.path, w.scope, w.field) not in not_blocks and not (w.path == path and w.scope in scopes):
            out.append(f"{w} (its owner: {path}, {', '.join(sorted(scopes)) or 'nothing after Index.add'})")
    return out


# --- the tree's own check ------------------------------------------------------------------------------


def test_every_field_of_a_block_has_an_owner() -> None:
    assert set(OWNERS) == block_fields(ROOT), "a new field of Block needs its owner here (and the old ones theirs)"


def test_only_its_owner_writes_a_field_of_a_block() -> None:
    found = writes(ROOT)
    extra = unowned(found, OWNERS, NOT_BLOCKS)
    assert not extra, "a field of a block is written only by its owner; call the owner's method instead:\n" + "\n".join(
        extra
    )
    # no listed owner or exception is stale
    listed = {(path, scope, field) for field, (path, scopes) in OWNERS.items() for scope in scopes}
    assert {(w.path, w.scope, w.field) for w in found if not storage(w)} == listed | set(NOT_BLOCKS)


# --- the owners' methods ------------------------------------------------------------------------------


def _block(index: Index, n: int = 0) -> Block:
    namespace = Namespace(model="tiny-llama", kv_layout="raw", dtype="float16", block_size=16)
    ns = index.namespace(namespace.root, namespace.label, namespace)
    return index.add(ns, BlockKey(bytes([n]) * 32), b"", 4096, State.COMMITTED)


def test_a_pin_around_an_await_is_taken_back_however_the_body_ends() -> None:
    index = Index()
    a, b = _block(index, 1), _block(index, 2)
    lease = index.take_lease([a], deadline=1.0)
    with index.pinned([a, b]):
        assert (a.leases, b.leases) == (2, 1) and a.pinned and b.pinned
    assert (a.leases, b.leases) == (1, 0) and not b.pinned
    with pytest.raises(RuntimeError), index.pinned([b]):
        assert b.pinned
        raise RuntimeError("the fetch failed")
    assert b.leases == 0 and not b.pinned
    index.release_lease(lease.id)
    assert a.leases == 0


def test_a_mover_pins_what_it_reads_until_it_ends() -> None:
    index = Index()
    a = _block(index)
    index.start_moving([a])
    index.start_moving([a])
    assert a.moving == 2 and a.pinned
    index.stop_moving([a])
    index.stop_moving([a])
    assert a.moving == 0 and not a.pinned


def test_a_replica_is_published_as_one() -> None:
    index = Index()
    namespace = Namespace(model="tiny-llama", kv_layout="raw", dtype="float16", block_size=16)
    ns = index.namespace(namespace.root, namespace.label, namespace)
    own = index.add(ns, BlockKey(bytes([1]) * 32), b"", 4096, State.ALLOCATED)
    fetched = index.add(ns, BlockKey(bytes([2]) * 32), b"", 4096, State.ALLOCATED)
    index.publish(own)
    index.publish(fetched, replica=True)
    assert (own.state, own.replica) == (State.COMMITTED, False)
    assert (fetched.state, fetched.replica) == (State.COMMITTED, True)


# --- the check catches what it is for ------------------------------------------------------------------


def test_the_check_finds_every_kind_of_write(tmp_path: Path) -> None:
    files = {
        INDEX: textwrap.dedent("""\
            class Block:
                leases: int = 0
                slot: object = None

                def seal(self):
                    self.leases = 0


            class Index:
                def __init__(self):
                    self.leases = {}

                def take(self, b):
                    b.leases += 1
            """),
        "kvstore/tiers/sneaky.py": textwrap.dedent("""\
            def f(b, s, slots):
                b.slot = s
                b.size, b.leases = 1, 2
                x = b.slot = s
                for b.slot in slots:
                    pass
                del b.leases
                setattr(b, "slot", s)
                object.__setattr__(b, "leases", 3)
                return x, b.slot, getattr(b, "slot")


            class Own:
                def __init__(self, b):
                    self.slot = None
                    self.b = b

                def g(self):
                    self.b.leases: int = 0
            """),
        "connector/ok.py": "def read(b):\n    return b.leases + (b.slot is None)\n",
    }
    write_tree(tmp_path, files)

    assert block_fields(tmp_path) == {"leases", "slot"}
    found = writes(tmp_path)
    assert [str(w) for w in found] == [
        "kvstore/store/books/index.py:6: Block.seal writes .leases",
        "kvstore/store/books/index.py:14: Index.take writes .leases",
        "kvstore/tiers/sneaky.py:2: f writes .slot",
        "kvstore/tiers/sneaky.py:3: f writes .leases",
        "kvstore/tiers/sneaky.py:4: f writes .slot",
        "kvstore/tiers/sneaky.py:5: f writes .slot",
        "kvstore/tiers/sneaky.py:7: f writes .leases",
        "kvstore/tiers/sneaky.py:8: f writes .slot",
        "kvstore/tiers/sneaky.py:9: f writes .leases",
        "kvstore/tiers/sneaky.py:19: Own.g writes .leases",
    ]
    owners = {"leases": (INDEX, frozenset({"Block.seal", "Index.take"})), "slot": (INDEX, frozenset())}
    assert [line.split(" (")[0] for line in unowned(found, owners, {})] == [str(w) for w in found[2:]]
    not_blocks = {("kvstore/tiers/sneaky.py", "Own.g", "leases"): "another object's"}
    assert len(unowned(found, owners, not_blocks)) == len(found) - 3


def test_a_field_kept_behind_a_property_has_its_owner_too(tmp_path: Path) -> None:
    """A rare field that ``Block`` keeps aside (issue 41) is a writable property: it is a field all
    the same, every write of it outside its setter is checked, and its setter's own store is not
    a write by anyone."""
    files = {
        INDEX: textwrap.dedent("""\
            class Block:
                size: int

                @property
                def moving(self):
                    return self._x.moving

                @moving.setter
                def moving(self, value):
                    x = self._x
                    x.moving = value

                @property
                def top_tier(self):
                    return 0
            """),
        "kvstore/tiers/sneaky.py": "def f(b):\n    b.moving += 1\n",
    }
    write_tree(tmp_path, files)

    assert block_fields(tmp_path) == {"size", "moving"}  # (a read-only property is no field)
    found = writes(tmp_path)
    assert [str(w) for w in found] == [
        "kvstore/store/books/index.py:11: Block.moving writes .moving",
        "kvstore/tiers/sneaky.py:2: f writes .moving",
    ]
    owners = {"size": (INDEX, frozenset()), "moving": (INDEX, frozenset({"Index.start_moving"}))}
    assert [line.split(" (")[0] for line in unowned(found, owners, {})] == [str(found[1])]
