"""The layering of kvstore/ and connector/ holds: every import follows the table of
docs/architecture.md, no module-level import cycle exists, and the module tables of the README and
of docs/architecture.md name files that exist.

The table in docs/architecture.md ("What each package may import") is the one statement of the
rules; this test reads it. Imports are read with ``ast``, never executed. Imports under
``if TYPE_CHECKING:`` are left out of both checks (they never run); imports inside functions count
for the layering (they run when called) but not for cycles (they run after every module has
loaded). A module named as a string to ``importlib.import_module`` or in a lazy registry
(``("kvstore.policy.lru", "LRUPolicy")``) counts for the layering as a function-level import does.
"""

from __future__ import annotations

import ast
import re
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvstore", "connector")
DOC = ROOT / "docs" / "architecture.md"
README = ROOT / "README.md"
TABLE_HEADER = "| package | layer | holds | may import (besides itself) |"


# --- reading the code --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Import:
    importer: str  # module name
    target: str  # module name, one of the tree's
    path: str  # importer's file, relative to the root
    line: int
    module_level: bool  # runs when the importer is imported (not inside a function)
    how: str  # "import" or "by name" (importlib / a registry)


def modules(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` under the given packages."""
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _is_call_to(node: ast.AST, name: str) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    return (isinstance(f, ast.Name) and f.id == name) or (isinstance(f, ast.Attribute) and f.attr == name)


class _Reader(ast.NodeVisitor):
    """Every import of one module: (name as written, names imported, line, module-level?, how)."""

    def __init__(self, type_checking: bool = False) -> None:
        self.found: list[tuple[str, tuple[str, ...], int, bool, str]] = []
        self._type_checking = type_checking  # read the ``if TYPE_CHECKING:`` branches too
        self._depth = 0  # functions we are inside
        self._skip: set[int] = set()  # ids of string constants that are docstrings or logger names

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test) and not self._type_checking:
            for child in node.orelse:  # the else branch runs
                self.visit(child)
            return
        self.generic_visit(node)

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.found.append((alias.name, (), node.lineno, self._depth == 0, "import"))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        names = tuple(a.name for a in node.names)
        self.found.append(("." * node.level + (node.module or ""), names, node.lineno, self._depth == 0, "import"))

    def visit_Call(self, node: ast.Call) -> None:
        if _is_call_to(node, "getLogger"):  # a logger's name is not an import
            self._skip.update(id(a) for a in node.args)
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and id(node) not in self._skip:
            self.found.append((node.value, (), node.lineno, False, "by name"))

    def read(self, tree: ast.Module) -> None:
        for holder in [tree, *ast.walk(tree)]:  # docstrings are not references
            body = getattr(holder, "body", None)
            first = body[0] if isinstance(body, list) and body else None
            text = first.value if isinstance(first, ast.Expr) else None
            if isinstance(text, ast.Constant) and isinstance(text.value, str):
                self._skip.add(id(text))
        self.visit(tree)


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The tree's module that ``name`` loads: itself, else its longest known prefix."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return None


def imports(root: Path, known: dict[str, Path], type_checking: bool = False) -> list[Import]:
    """Every import from one module of the tree to another (itself excluded); with
    ``type_checking``, those under ``if TYPE_CHECKING:`` too."""
    out = []
    for module, path in known.items():
        reader = _Reader(type_checking)
        reader.read(ast.parse(path.read_text(), str(path)))
        is_package = path.name == "__init__.py"
        rel = str(path.relative_to(root))
        for written, names, line, module_level, how in reader.found:
            if how == "by name":
                if "." not in written or written not in known:  # a dotted module name, nothing else
                    continue
                targets = [written]
            else:
                base = written.lstrip(".")
                level = len(written) - len(base)
                if level:  # relative: from the importer's package, up level - 1
                    pkg = module.split(".") if is_package else module.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (level - 1)]
                    base = ".".join([*pkg, base] if base else pkg)
                targets = [f"{base}.{n}" if f"{base}.{n}" in known else base for n in names] or [base]
            for t in dict.fromkeys(targets):
                target = _resolve(t, known)
                if target is not None and target != module:
                    out.append(Import(module, target, rel, line, module_level, how))
    return out


# --- the rules: the table of docs/architecture.md --------------------------------------------------


@dataclass(frozen=True, slots=True)
class Rules:
    layer: dict[str, str]  # unit (a module or a package) -> its layer's name
    allowed: dict[str, frozenset[str]]  # unit -> the units it may import

    def unit_of(self, module: str) -> str | None:
        """The row a module falls under: its own, else its nearest package's; a row of the layer
        "root" covers only its package's own ``__init__``."""
        parts = module.split(".")
        while parts:
            unit = ".".join(parts)
            if unit in self.allowed and (unit == module or self.layer[unit] != "root"):
                return unit
            parts.pop()
        return None


_ROW_UNITS = re.compile(r"`([\w.]+)`")


def parse_rules(text: str) -> Rules:
    """The table under TABLE_HEADER. Its last cell lists, comma-separated: `unit`s, layer names (every
    unit of that layer), "anything" (every unit) or "nothing"."""
    lines = text.splitlines()
    try:
        start = lines.index(TABLE_HEADER)
    except ValueError:
        raise AssertionError(f"{DOC.relative_to(ROOT)}: no table with the header {TABLE_HEADER!r}") from None
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 4, f"{DOC.name}: a row of the import table has {len(cells)} cells, not 4: {line!r}"
        units = _ROW_UNITS.findall(cells[0])
        assert units, f"{DOC.name}: a row of the import table names no `unit`: {line!r}"
        rows.append((units, cells[1], cells[3], line))
    layer = {u: lay for units, lay, _, _ in rows for u in units}
    allowed: dict[str, frozenset[str]] = {}
    for units, _, cell, line in rows:
        got: set[str] = set()
        for item in (i.strip() for i in cell.split(",")):
            if item == "anything":
                got |= set(layer)
            elif item in layer.values():
                got |= {u for u, lay in layer.items() if lay == item}
            elif (m := re.fullmatch(r"`([\w.]+)`", item)) and m[1] in layer:
                got.add(m[1])
            elif item != "nothing":
                raise AssertionError(
                    f"{DOC.name}: {item!r} in {line!r} is not a `unit` of the table, a layer, 'anything' or 'nothing'"
                )
        for u in units:
            allowed[u] = frozenset(got - {u})
    return Rules(layer, allowed)


def layer_violations(found: Iterable[Import], rules: Rules) -> list[str]:
    out = []
    for imp in found:
        src, dst = rules.unit_of(imp.importer), rules.unit_of(imp.target)
        if src is None or dst is None or src == dst or dst in rules.allowed[src]:
            continue
        where = " (inside a function)" if imp.how == "import" and not imp.module_level else ""
        verb = "names" if imp.how == "by name" else "imports"
        may = ", ".join(sorted(rules.allowed[src])) or "nothing"
        out.append(f"{imp.path}:{imp.line}: {imp.importer} {verb} {imp.target}{where}: "
                   f"{src} may not import {dst} (it may import: {may})")
    return sorted(out)


def unplaced(known: Iterable[str], rules: Rules) -> list[str]:
    return [m for m in known if rules.unit_of(m) is None]


# --- cycles --------------------------------------------------------------------------------------------


def cycles(found: Iterable[Import]) -> list[list[Import]]:
    """One cycle per strongly connected component of the module-level import graph, as the
    imports that close it."""
    edges: dict[str, dict[str, Import]] = {}
    for imp in found:
        if imp.module_level and imp.how == "import":
            edges.setdefault(imp.importer, {}).setdefault(imp.target, imp)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(v: str) -> None:  # Tarjan; the graph is a few hundred edges
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            components.append(comp)

    for v in sorted(edges):
        if v not in index:
            connect(v)
    out = []
    for comp in components:
        if len(comp) < 2:
            continue
        start = min(comp)
        paths: dict[str, list[Import]] = {start: []}  # breadth-first back to start, inside comp
        queue = [start]
        cycle: list[Import] | None = None
        while queue and cycle is None:
            v = queue.pop(0)
            for w, imp in sorted(edges.get(v, {}).items()):
                if w == start:
                    cycle = [*paths[v], imp]
                    break
                if w in comp and w not in paths:
                    paths[w] = [*paths[v], imp]
                    queue.append(w)
        assert cycle is not None
        out.append(cycle)
    return out


def describe(cycle: list[Import]) -> str:
    steps = "\n".join(f"    {imp.path}:{imp.line}: {imp.importer} imports {imp.target}" for imp in cycle)
    return f"  {' -> '.join([cycle[0].importer, *(i.target for i in cycle)])}\n{steps}"


def two_way(found: Iterable[Import]) -> list[str]:
    """Every pair of modules that import each other, however: at module level, inside a function or
    under ``if TYPE_CHECKING:`` (a type-only import is still a dependency a reader must follow both
    ways). A module only named (a lazy registry's ``("connector.transfer.cuda", ...)``) is not
    imported by the name."""
    edges: dict[tuple[str, str], Import] = {}
    for imp in found:
        if imp.how == "import":
            edges.setdefault((imp.importer, imp.target), imp)
    out = []
    for (a, b), imp in sorted(edges.items()):
        back = edges.get((b, a))
        if back is not None and a < b:
            out.append(f"  {a} <-> {b}\n    {imp.path}:{imp.line}: {a} imports {b}\n"
                       f"    {back.path}:{back.line}: {b} imports {a}")
    return out


# --- the product stands apart from its benchmarks and tests ----------------------------------------------

OUTSIDE = ("benchmarks", "tests")  # not the product: the suites and the test suite
SUITE_LAUNCHER = "kvstore.commands.bench"  # `kvstore bench SUITE` loads the suite's module by name when asked
_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")


def outside_references(root: Path, known: dict[str, Path]) -> list[str]:
    """Every import of ``benchmarks`` or ``tests`` (or a module under them) by the given modules,
    at module level or inside a function, and every such module named as a string (to
    ``importlib``, in ``python -m ...``), except the suite launcher's table of suites."""
    out = []
    for module, path in known.items():
        reader = _Reader()
        reader.read(ast.parse(path.read_text(), str(path)))
        rel = str(path.relative_to(root))
        for written, _, line, _, how in reader.found:
            if written.split(".")[0] not in OUTSIDE:
                continue
            if how == "by name" and (not _DOTTED.fullmatch(written) or module == SUITE_LAUNCHER):
                continue
            out.append(f"{rel}:{line}: {module} {'names' if how == 'by name' else 'imports'} {written}")
    return sorted(out)


# --- the tree's own checks -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tree() -> tuple[dict[str, Path], list[Import]]:
    known = modules(ROOT)
    return known, imports(ROOT, known)


@pytest.fixture(scope="module")
def rules() -> Rules:
    return parse_rules(DOC.read_text())


def test_every_row_of_the_table_names_a_module_or_package(rules: Rules) -> None:
    known = modules(ROOT)
    missing = sorted(u for u in rules.allowed if u not in known)
    assert not missing, f"docs/architecture.md's import table names what the tree does not hold: {missing}"


def test_every_module_falls_under_a_row(tree: tuple[dict[str, Path], list[Import]], rules: Rules) -> None:
    known, _ = tree
    lost = unplaced(known, rules)
    assert not lost, (
        "modules no row of docs/architecture.md's import table covers (add a row for their package): "
        + ", ".join(lost)
    )


def test_imports_follow_the_table(tree: tuple[dict[str, Path], list[Import]], rules: Rules) -> None:
    _, found = tree
    broken = layer_violations(found, rules)
    assert not broken, "imports against docs/architecture.md's table:\n" + "\n".join(broken)


def test_the_engine_side_reaches_the_sidecar_through_the_client_only(rules: Rules) -> None:
    """The connectors build no message and speak no wire format: calls, pipelined ones included,
    are the client's (``kvstore.client``); the table must not let them import either."""
    reached = sorted({"kvstore.v1", "kvstore.wire"} & rules.allowed["connector"])
    assert not reached, f"docs/architecture.md lets connector/ import {reached}: it talks through kvstore.client"


def test_no_import_cycle(tree: tuple[dict[str, Path], list[Import]]) -> None:
    _, found = tree
    loops = cycles(found)
    assert not loops, "module-level import cycles (TYPE_CHECKING-only imports aside):\n" + "\n".join(
        map(describe, loops))


def test_no_two_modules_import_each_other() -> None:
    """Item 9 of issue #40: no circle of two, type-only and function-local imports included, in the
    product or its benchmarks."""
    packages = (*PACKAGES, "benchmarks")
    known = modules(ROOT, packages)
    pairs = two_way(imports(ROOT, known, type_checking=True))
    assert not pairs, "modules that import each other (TYPE_CHECKING and function-local imports included):\n" + (
        "\n".join(pairs))


def test_the_product_imports_nothing_from_benchmarks_or_tests(tree: tuple[dict[str, Path], list[Import]]) -> None:
    known, _ = tree
    found = outside_references(ROOT, known)
    assert not found, ("kvstore/ and connector/ reach into benchmarks/ or tests/ (what both need belongs in the "
                       "product, e.g. kvstore/harness/):\n" + "\n".join(found))


# --- the checks themselves catch what they are for -----------------------------------------------------


RULES_DOC = f"""
{TABLE_HEADER}
|---|---|---|---|
| `kvstore` | root | the version | nothing |
| `kvstore.errors` | foundation | errors | nothing |
| `kvstore.store` | state | the store | foundation |
| `kvstore.server` | service | the server | foundation, `kvstore.store` |
| `connector` | engine side | the engine side | `kvstore.errors` |
| `kvstore.cli` | top | the CLI | anything |
"""


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_the_checks_report_what_breaks_and_where(tmp_path: Path) -> None:
    _write(tmp_path, {
        "kvstore/__init__.py": '"""The package."""\n',
        "kvstore/errors.py": "",
        "kvstore/cli.py": "import connector.hf\nfrom kvstore.server import api\n",
        "kvstore/store/__init__.py": "",
        "kvstore/store/index.py": """\
            from typing import TYPE_CHECKING

            from kvstore.errors import *

            if TYPE_CHECKING:
                from kvstore.server.api import Api  # never runs: neither rule sees it
            else:
                import kvstore.store.block_store  # runs
            """,
        "kvstore/store/block_store.py": """\
            \"\"\"Not an import: kvstore.server.api\"\"\"
            import logging

            from . import index

            log = logging.getLogger("kvstore.server.api")


            def start():
                from ..server import api  # a layering break, but no cycle (runs once all are loaded)
            """,
        "kvstore/server/__init__.py": "",
        "kvstore/server/api.py": """\
            from kvstore.store.block_store import start
            REGISTRY = {"x": ("connector.hf", "Hf")}
            """,
        "kvstore/stray.py": "",
        "connector/__init__.py": "",
        "connector/hf.py": "import numpy\nfrom kvstore import errors, store\n",
    })
    rules = parse_rules(RULES_DOC)
    known = modules(tmp_path)
    found = imports(tmp_path, known)

    assert unplaced(known, rules) == ["kvstore.stray"]
    assert layer_violations(found, rules) == [
        "connector/hf.py:2: connector.hf imports kvstore.store: connector may not import kvstore.store "
        "(it may import: kvstore.errors)",
        "kvstore/server/api.py:2: kvstore.server.api names connector.hf: kvstore.server may not import connector "
        "(it may import: kvstore.errors, kvstore.store)",
        "kvstore/store/block_store.py:10: kvstore.store.block_store imports kvstore.server.api (inside a function): "
        "kvstore.store may not import kvstore.server (it may import: kvstore.errors)",
    ]
    assert [describe(c) for c in cycles(found)] == [
        "  kvstore.store.block_store -> kvstore.store.index -> kvstore.store.block_store\n"
        "    kvstore/store/block_store.py:4: kvstore.store.block_store imports kvstore.store.index\n"
        "    kvstore/store/index.py:8: kvstore.store.index imports kvstore.store.block_store"
    ]
    assert two_way(imports(tmp_path, known, type_checking=True)) == [  # a function-local import counts here
        "  kvstore.server.api <-> kvstore.store.block_store\n"
        "    kvstore/server/api.py:1: kvstore.server.api imports kvstore.store.block_store\n"
        "    kvstore/store/block_store.py:10: kvstore.store.block_store imports kvstore.server.api",
        "  kvstore.store.block_store <-> kvstore.store.index\n"
        "    kvstore/store/block_store.py:4: kvstore.store.block_store imports kvstore.store.index\n"
        "    kvstore/store/index.py:8: kvstore.store.index imports kvstore.store.block_store",
    ]


def test_the_outside_check_finds_imports_and_names_but_not_the_suite_launcher(tmp_path: Path) -> None:
    _write(tmp_path, {
        "kvstore/__init__.py": "",
        "kvstore/commands/__init__.py": "",
        "kvstore/commands/bench.py": 'SUITES = {"vllm": "benchmarks.vllm"}\n',
        "kvstore/commands/demo.py": """\
            \"\"\"Runs what benchmarks.vllm runs (a docstring, not an import).\"\"\"
            import subprocess


            def run():
                from benchmarks.vllm import CrossHost
                subprocess.run(["python", "-m", "tests.support.x"], check=True)
                return "benchmarks are slow"
            """,
        "connector/__init__.py": "import benchmarks\nfrom tests.conftest import small_config\n",
    })
    assert outside_references(tmp_path, modules(tmp_path)) == [
        "connector/__init__.py:1: connector imports benchmarks",
        "connector/__init__.py:2: connector imports tests.conftest",
        "kvstore/commands/demo.py:6: kvstore.commands.demo imports benchmarks.vllm",
        "kvstore/commands/demo.py:7: kvstore.commands.demo names tests.support.x",
    ]


def test_a_malformed_table_is_an_error_naming_the_row() -> None:
    with pytest.raises(AssertionError, match=r"'the store' in .*`kvstore\.server`.* is not a `unit`"):
        parse_rules(RULES_DOC.replace("foundation, `kvstore.store`", "the store"))


# --- the module tables name what exists -------------------------------------------------------------


_PATH = re.compile(r"`((?:kvstore|connector|proto|docs|tests|scripts|benchmarks|deploy)/[\w./-]*)`")


def _section(text: str, heading: str) -> str:
    """The text under ``heading`` up to the next heading of the same or a higher level."""
    level = heading.split(" ")[0]
    lines = text.splitlines()
    start = lines.index(heading)
    end = next((i for i in range(start + 1, len(lines))
                if lines[i].startswith("#") and len(lines[i].split(" ")[0]) <= len(level)), len(lines))
    return "\n".join(lines[start:end])


def missing_paths(text: str, root: Path) -> list[str]:
    return sorted({p for p in _PATH.findall(text) if not (root / p.rstrip("/")).exists()})


def test_the_module_tables_name_files_that_exist() -> None:
    readme = _section(README.read_text(), "## Architecture")
    assert "](docs/architecture.md)" in readme, "README's architecture section does not link docs/architecture.md"
    for name, text in (("README.md, section Architecture", readme), ("docs/architecture.md", DOC.read_text())):
        missing = missing_paths(text, ROOT)
        assert not missing, f"{name} names paths that do not exist: {missing}"


def test_readme_links_stay_inside_the_repository() -> None:
    """Every link of the README is a file of the repository (or the sidecar's own local address)."""
    outside = []
    for no, line in enumerate(README.read_text().splitlines(), 1):
        for target in re.findall(r"\]\(([^)\s]+)\)|<(\w+://[^>]+)>", line):
            link = target[0] or target[1]
            if re.match(r"\w+://(127\.0\.0\.1|localhost)[:/]", link):
                continue
            if "://" in link or not (ROOT / link.split("#")[0]).exists():
                outside.append(f"README.md:{no}: {link}")
    assert not outside, "README links outside the repository (or to files it does not hold):\n" + "\n".join(outside)
