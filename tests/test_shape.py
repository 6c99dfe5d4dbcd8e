"""The shape of kvstore/ and connector/ (issue #31): no class over 400 lines, no function over 60
lines, no access to another object's private member.

A private member is an attribute whose name starts with one underscore or two (a dunder,
``__name__``, is not private); reading or writing ``x._name`` is an access to another object's
private member unless ``x`` is ``self`` or ``cls`` (or ``super()``: the object's own member, found
up its classes). Nested functions count inside the function that holds them, and methods inside
their class. A class or function is measured from its ``class``/``def`` line to its last line;
the generated ``kvstore/v1/`` is left out. Read with ``ast``, never imported.

One list, each entry with its reason, names what may stay: ``ALLOWED``, names that only look
private: the standard library's public API that happens to start with an underscore
(``os._exit``; namedtuple's ``_make``, ``_replace``, ``_fields``, ``_asdict``, underscored so as
not to clash with field names). No class or function over its limit may stay: it is split.

The list is exact: the test fails on an offender that it does not name, and on an entry that no
longer offends (remove it), so it never becomes a blanket. The failure names each file:line and
the measure.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tests.support.source_tree import PACKAGES, parsed_sources, write_tree

ROOT = Path(__file__).resolve().parents[1]
MAX_CLASS_LINES = 400
MAX_FUNCTION_LINES = 60


# --- reading the code --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Offence:
    path: str  # relative to the root
    line: int
    kind: str  # "class", "function" or "private"
    name: str  # the class's or function's qualified name, or the expression (``slab._free_pages``)
    measure: str  # what is over: "837 lines (at most 400)", "a private member of another object"

    @property
    def key(self) -> tuple[str, str, str]:
        """What the list names: no line number (lines move as the file changes around it)."""
        return self.path, self.kind, self.name

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.kind} {self.name}: {self.measure}"


def _is_private(attr: str) -> bool:
    return attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__"))


def _is_own(value: ast.expr) -> bool:
    """Whether ``value.attr`` reaches the object's own member: ``self.x``, ``cls.x``, ``super().x``."""
    if isinstance(value, ast.Name):
        return value.id in ("self", "cls")
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super"


class _Reader(ast.NodeVisitor):
    def __init__(self, path: str) -> None:
        self.path = path
        self.found: list[Offence] = []
        self._scope: list[str] = []  # the enclosing classes and functions

    def _measure(self, node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef, kind: str, limit: int) -> None:
        name = ".".join([*self._scope, node.name])
        lines = (node.end_lineno or node.lineno) - node.lineno + 1
        if lines > limit:
            self.found.append(Offence(self.path, node.lineno, kind, name, f"{lines} lines (at most {limit})"))
        self._scope.append(node.name)
        self.generic_visit(node)
        self._scope.pop()

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._measure(node, "class", MAX_CLASS_LINES)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._measure(node, "function", MAX_FUNCTION_LINES)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._measure(node, "function", MAX_FUNCTION_LINES)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if _is_private(node.attr) and not _is_own(node.value):
            expr = f"{ast.unparse(node.value)}.{node.attr}"
            self.found.append(Offence(self.path, node.lineno, "private", expr, "a private member of another object"))
        self.generic_visit(node)


def offences(root: Path, packages: Iterable[str] = PACKAGES) -> list[Offence]:
    """Every class, function and private access over the limits in ``packages`` under ``root``."""
    out: list[Offence] = []
    for rel, tree in parsed_sources(root, packages):
        reader = _Reader(rel)
        reader.visit(tree)
        out += reader.found
    return out


# --- the list ------------------------------------------------------------------------------------------

_OS_EXIT = "os._exit is the os module's public API (exit at once, no clean-up); the underscore is its name"
_NAMEDTUPLE = "namedtuple's public API (_make, _replace, _fields, _asdict: underscored not to clash with fields)"

# (path, expression) -> why it is not a private access
ALLOWED: dict[tuple[str, str], str] = {
    ("kvstore/harness/phases.py", "os._exit"): _OS_EXIT,
    ("kvstore/server/watchdog.py", "os._exit"): _OS_EXIT,
    ("kvstore/cluster/directory.py", "Record._make"): _NAMEDTUPLE,
}


def listed(found: Iterable[Offence], allowed: dict[tuple[str, str], str]) -> tuple[list[str], list[str]]:
    """(offences the list does not name, entries of the list that no longer offend), as messages."""
    found = list(found)
    allowed_keys = {(path, "private", expr) for path, expr in allowed}
    unlisted = [str(o) for o in found if o.key not in allowed_keys]
    seen = {o.key for o in found}
    stale = [
        f"{path}: {kind} {name} is in ALLOWED but no longer found: remove it"
        for path, kind, name in sorted(allowed_keys - seen)
    ]
    return unlisted, stale


# --- the tree's own checks -------------------------------------------------------------------------------


def test_every_reason_is_given() -> None:
    assert all(ALLOWED.values())


def test_no_class_function_or_private_access_over_the_limits() -> None:
    unlisted, _ = listed(offences(ROOT), ALLOWED)
    assert not unlisted, (
        f"kvstore/ and connector/ hold classes over {MAX_CLASS_LINES} lines, functions over {MAX_FUNCTION_LINES} "
        "lines or accesses to another object's private member (split them, or give the member a public name; "
        "a name that only looks private goes in ALLOWED with its reason):\n" + "\n".join(unlisted)
    )


def test_every_listed_offence_still_offends() -> None:
    _, stale = listed(offences(ROOT), ALLOWED)
    assert not stale, "tests/test_shape.py lists what no longer offends:\n" + "\n".join(stale)


# --- the checks themselves catch what they are for -----------------------------------------------------


def _statements(n: int, indent: int) -> list[str]:
    return [f"{' ' * indent}x{i} = {i}" for i in range(n)]


def test_the_checker_reports_what_is_over_and_where(tmp_path: Path) -> None:
    big = [
        "class Big:",  # lines 1-401: 401 lines
        "    def long(self):",  # lines 2-62: 61 lines
        *_statements(60, 8),
        *_statements(336, 4),
        "",
        "    def short(self):",
        "        return 1",
        "",
        "",
        "def fits():",  # lines 404-463: 60 lines, not over
        *_statements(59, 4),
        "",
        "async def outer():",  # lines 465-526: its nested function counts inside it, and on its own
        "    def inner():",  # lines 466-526
        *_statements(60, 8),
    ]
    files = {
        "kvstore/big.py": "\n".join(big) + "\n",
        "kvstore/access.py": textwrap.dedent("""\
            import os


            class A:
                def f(self, other):
                    self._own = cls_ = super()._own
                    other._theirs = os._exit
                    return other.__dict__, other.__mangled, self.__class__, self.peer._x
            """),
        "kvstore/v1/store_pb2.py": "\n".join(["def generated():", *_statements(100, 4)]),
        "connector/ok.py": "class Small:\n    pass\n",
    }
    write_tree(tmp_path, files)

    found = offences(tmp_path)
    assert [str(o) for o in found] == (
        expected := [
            "kvstore/access.py:7: private other._theirs: a private member of another object",
            "kvstore/access.py:7: private os._exit: a private member of another object",
            "kvstore/access.py:8: private other.__mangled: a private member of another object",
            "kvstore/access.py:8: private self.peer._x: a private member of another object",
            "kvstore/big.py:1: class Big: 401 lines (at most 400)",
            "kvstore/big.py:2: function Big.long: 61 lines (at most 60)",
            "kvstore/big.py:465: function outer: 62 lines (at most 60)",
            "kvstore/big.py:466: function outer.inner: 61 lines (at most 60)",
        ]
    )

    allowed = {("kvstore/access.py", "os._exit"): "public", ("kvstore/gone.py", "os._exit"): "public"}
    unlisted, stale = listed(found, allowed)
    assert unlisted == [o for o in expected if "os._exit" not in o]
    assert stale == ["kvstore/gone.py: private os._exit is in ALLOWED but no longer found: remove it"]
