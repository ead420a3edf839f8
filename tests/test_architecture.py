"""docs/architecture.md, read and enforced: the package is what the page says it is.

The page's tables and lists drive every test here, so a module added, moved or removed is
a row to change there, never a constant to change here. The source is read with ``ast``
(nothing of the package is imported, so a drift is reported, never an import error):

* "Modules": one row per module of ``loss_scaling/``; each name ticked in its "owns" cell
  is defined in that module (:func:`defines`); each test file in its "tests" cell
  exercises it (:func:`exercises`: calls a name the module defines, or quotes a message
  it writes);
* "One step, in order": the functions ``guarded_step`` calls, in the order it calls
  them, are the ones the page's sub-list under ``guarded_step`` leads with, in the same
  order; what each item names inside such a function comes in the order the function
  calls it;
* "Who may import whom": every import anywhere in a module (inside functions too,
  ``importlib.import_module`` and ``sys.modules`` lookups included) follows its layer's
  "may import" (at import time) and "on first use" (inside functions) columns; a
  framework (a package other than the standard library and the dependencies the page
  names) is reached only where the layer's "frameworks" column names it, directly or
  through the modules imported at import time;
* the sub-packages' README.md tables: one row per module of the folder, and what each
  row owns is defined there;
* no import cycle, no duplicated block of code (:func:`duplicate_blocks`, the rule of
  the ``duplicates`` command, in Python), and the state and option tables list exactly
  the fields.
"""

from __future__ import annotations

import ast
import functools
import io
import itertools
import json
import keyword
import pathlib
import re
import shutil
import subprocess
import sys
import tokenize
from collections import defaultdict
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "loss_scaling"
TESTS = ROOT / "tests"
PAGE = ROOT / "docs" / "architecture.md"


# ----------------------------------------------------------------------- the package


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_path(name: str) -> str:
    """``loss_scaling.core.tree`` -> ``core/tree.py`` (as the page writes it)."""
    return FILES[name].relative_to(PACKAGE).as_posix()


FILES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
MODULES = {name: ast.parse(p.read_text(), str(p)) for name, p in FILES.items()}
BY_PATH = {module_path(name): name for name in MODULES}


def is_package(name: str) -> bool:
    return FILES[name].name == "__init__.py"


def package_of(name: str) -> str:
    return name if is_package(name) else name.rpartition(".")[0]


def module_of(dotted: str) -> str | None:
    """The package module a dotted name is in (its longest prefix that is a module):
    ``loss_scaling.core.update.backoff_now`` -> ``loss_scaling.core.update``."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in MODULES:
            return ".".join(parts[:i])
    return None


def top_level(tree: ast.Module) -> Iterator[ast.stmt]:
    """The statements that run at import time (into ``if`` / ``try`` blocks, not into
    functions or classes)."""
    for node in tree.body:
        if isinstance(node, ast.If):
            yield from top_level(ast.Module(body=node.body + node.orelse, type_ignores=[]))
        elif isinstance(node, ast.Try):
            yield from top_level(ast.Module(body=node.body + node.orelse + node.finalbody
                                            + [s for h in node.handlers for s in h.body],
                                            type_ignores=[]))
        else:
            yield node


@functools.cache
def defined_names(name: str) -> frozenset[str]:
    """The names ``name`` binds at top level: its functions, classes and assignments, and in
    a package's ``__init__.py`` the names it imports (its public names are re-exports)."""
    found: set[str] = set()
    for node in top_level(MODULES[name]):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, ast.Assign):
            found.update(n.id for t in node.targets for n in ast.walk(t)
                         if isinstance(n, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found.add(node.target.id)
        elif isinstance(node, ast.ImportFrom) and is_package(name):
            found.update(a.asname or a.name for a in node.names)
    return frozenset(found)


def class_members(name: str, cls: str) -> set[str]:
    """What the class ``cls`` of module ``name`` defines in its body (fields, methods,
    properties), or an empty set if the module defines no such class."""
    for node in top_level(MODULES[name]):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            found = set()
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    found.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    found.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    found.update(t.id for t in item.targets if isinstance(t, ast.Name))
            return found
    return set()


def function_def(name: str, function: str) -> ast.FunctionDef:
    """The top-level function ``function`` of module ``name``."""
    for node in MODULES[name].body:
        if isinstance(node, ast.FunctionDef) and node.name == function:
            return node
    raise AssertionError(f"{module_path(name)} defines no function {function!r}")


def defines(name: str, item: str) -> bool:
    """Whether module ``name`` defines ``item``: a top-level name, or ``Class.member``."""
    if "." in item:
        cls, _, member = item.partition(".")
        return cls in defined_names(name) and member in class_members(name, cls)
    return item in defined_names(name)


# ------------------------------------------------- static values (what a dynamic import names)


class Unknown(Exception):
    """A value the source does not tell statically."""


class Items(NamedTuple):
    """A dict literal (or comprehension): its (key, value) pairs, every possibility."""

    pairs: tuple[tuple[Any, Any], ...]


def _bindings(scope: ast.AST, target_name: str) -> Iterator[tuple[ast.AST, ast.AST, int | None]]:
    """Where ``scope`` binds ``target_name``: ``(target, source, index)``, the source an
    assignment's value or a loop (its iterable), the index the name's position in a tuple
    target (or None)."""
    for node in ast.walk(scope):
        pairs: list[tuple[ast.AST, ast.AST]] = []
        if isinstance(node, ast.Assign):
            pairs = [(t, node.value) for t in node.targets]
        elif isinstance(node, (ast.For, ast.comprehension)):
            pairs = [(node.target, node)]
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            pairs = [(node.target, node.value)]
        for target, source in pairs:
            if isinstance(target, ast.Name) and target.id == target_name:
                yield target, source, None
            elif isinstance(target, ast.Tuple):
                for i, elt in enumerate(target.elts):
                    if isinstance(elt, ast.Name) and elt.id == target_name:
                        yield target, source, i


class Resolver:
    """The string values an expression of a module can have, read from the source: literals,
    f-strings, names bound to them (assignments, loops, comprehensions, an enclosing ``if
    name in (...)``), dict literals and their ``items()``. :class:`Unknown` otherwise."""

    def values(self, node: ast.AST, scopes: list[ast.AST], guards: list[ast.expr],
               depth: int = 0) -> list[Any]:
        if depth > 20:
            raise Unknown("too deep")
        v = functools.partial(self.values, scopes=scopes, guards=guards, depth=depth + 1)
        if isinstance(node, ast.Constant):
            return [node.value]
        if isinstance(node, ast.JoinedStr):
            parts = [[p.value] if isinstance(p, ast.Constant) else
                     [str(x) for x in v(p.value)] for p in node.values
                     if isinstance(p, (ast.Constant, ast.FormattedValue))]
            return ["".join(p) for p in itertools.product(*parts)]
        if isinstance(node, (ast.Tuple, ast.List)):
            return list(itertools.product(*(v(e) for e in node.elts)))
        if isinstance(node, ast.Dict):
            pairs: list[tuple[Any, Any]] = []
            for key, value in zip(node.keys, node.values, strict=True):
                if key is None:  # **other
                    for other in v(value):
                        pairs.extend(other.pairs)
                else:
                    pairs.extend(itertools.product(v(key), v(value)))
            return [Items(tuple(pairs))]
        if isinstance(node, ast.DictComp):
            pairs = []
            for binding in self._comprehension(node, scopes, guards, depth):
                inner = [*scopes, _Bound(binding)]
                pairs.extend(itertools.product(self.values(node.key, inner, guards, depth + 1),
                                               self.values(node.value, inner, guards,
                                                           depth + 1)))
            return [Items(tuple(pairs))]
        if isinstance(node, ast.Subscript):  # d[key]: any of d's values
            return [value for d in v(node.value) for _, value in self._items(d)]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("items", "values", "keys") and not node.args:
            found = []
            for d in v(node.func.value):
                pairs_of = self._items(d)
                found.append(Items(pairs_of) if node.func.attr == "items" else
                             tuple(p[1 if node.func.attr == "values" else 0] for p in pairs_of))
            return found
        if isinstance(node, ast.Name):
            return self._name(node.id, scopes, guards, depth)
        raise Unknown(ast.unparse(node))

    @staticmethod
    def _items(value: Any) -> tuple[tuple[Any, Any], ...]:
        if not isinstance(value, Items):
            raise Unknown(f"not a dict: {value!r}")
        return value.pairs

    def elements(self, node: ast.AST, scopes: list[ast.AST], guards: list[ast.expr],
                 depth: int) -> list[Any]:
        """What iterating ``node`` gives (any of its possible values' elements)."""
        found = []
        for value in self.values(node, scopes, guards, depth + 1):
            if isinstance(value, Items):
                found.extend(value.pairs)
            elif isinstance(value, (tuple, list, frozenset, set)):
                found.extend(value)
            else:
                raise Unknown(f"iterating {value!r}")
        return found

    def _comprehension(self, node: ast.AST, scopes: list[ast.AST], guards: list[ast.expr],
                       depth: int) -> list[dict[str, Any]]:
        bindings: list[dict[str, Any]] = [{}]
        for gen in node.generators:
            new = []
            for bound in bindings:
                for element in self.elements(gen.iter, [*scopes, _Bound(bound)], guards, depth):
                    new.append({**bound, **_unpack(gen.target, element)})
            bindings = new
        return bindings

    def _name(self, name: str, scopes: list[ast.AST], guards: list[ast.expr],
              depth: int) -> list[Any]:
        for test in reversed(guards):  # `if name in ("a", "b"):` around the use
            if (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name)
                    and test.left.id == name and len(test.ops) == 1
                    and isinstance(test.ops[0], ast.In)):
                return self.elements(test.comparators[0], scopes, [], depth)
        for scope in reversed(scopes):
            if isinstance(scope, _Bound):
                if name in scope.names:
                    return [scope.names[name]]
                continue
            found = list(_bindings(scope, name))
            if found:
                values: list[Any] = []
                for _, source, index in found:
                    if isinstance(source, (ast.For, ast.comprehension)):
                        elements = self.elements(source.iter, scopes, guards, depth)
                    else:
                        elements = self.values(source, scopes, guards, depth + 1)
                    values.extend(e if index is None else _at(e, index) for e in elements)
                return values
            if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and \
                    name in {a.arg for a in ast.walk(scope.args) if isinstance(a, ast.arg)}:
                raise Unknown(f"the argument {name!r}")
        raise Unknown(f"the name {name!r}")


class _Bound(ast.AST):
    """A comprehension's loop variables with one of their values, as a scope."""

    def __init__(self, names: dict[str, Any]):
        super().__init__()
        self.names = names


def _unpack(target: ast.AST, value: Any) -> dict[str, Any]:
    if isinstance(target, ast.Name):
        return {target.id: value}
    if isinstance(target, ast.Tuple) and isinstance(value, tuple) \
            and len(value) == len(target.elts):
        return {k: w for t, x in zip(target.elts, value, strict=True)
                for k, w in _unpack(t, x).items()}
    raise Unknown(f"unpacking {value!r}")


def _at(value: Any, index: int) -> Any:
    if isinstance(value, tuple) and index < len(value):
        return value[index]
    raise Unknown(f"element {index} of {value!r}")


# -------------------------------------------------------- what a module reaches, and when


class Reach(NamedTuple):
    """One module (or ``module.name``) a module imports or looks up."""

    target: str  # dotted, e.g. "loss_scaling.core.update", "flax.nnx", "jax.numpy"
    line: int
    first_use: bool  # inside a function: when it is called, not when the module is imported
    how: str  # "import", "importlib" or "sys.modules"


def _is_sys_modules(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "modules"
            and isinstance(node.value, ast.Name) and node.value.id == "sys")


def _lookup_of(node: ast.AST) -> ast.expr | None:
    """The key of ``sys.modules[key]`` / ``sys.modules.get(key, ...)``, else None."""
    if isinstance(node, ast.Subscript) and _is_sys_modules(node.value) \
            and isinstance(node.ctx, ast.Load):
        return node.slice
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get" and _is_sys_modules(node.func.value) and node.args):
        return node.args[0]
    return None


def _dynamic_import_of(node: ast.AST) -> ast.expr | None:
    """The argument of ``importlib.import_module(x)`` / ``import_module(x)`` /
    ``__import__(x)``, else None."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    func = node.func
    named = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return node.args[0] if named in ("import_module", "__import__") else None


class _Reaches(ast.NodeVisitor):
    def __init__(self, name: str, tree: ast.Module, path: str, package: str):
        self.name, self.tree, self.path, self.package = name, tree, path, package
        self.resolver = Resolver()
        self.found: list[Reach] = []
        self.unknown: list[str] = []
        self.scopes: list[ast.AST] = [self.tree]
        self.guards: list[ast.expr] = []
        self.depth = 0
        self.where_only: set[int] = set()
        self.visit(self.tree)

    def add(self, target: str, node: ast.AST, how: str) -> None:
        self.found.append(Reach(target, node.lineno, self.depth > 0, how))

    def resolved(self, expr: ast.expr, node: ast.AST, how: str) -> None:
        try:
            values = self.resolver.values(expr, self.scopes, self.guards)
        except Unknown as cannot:
            self.unknown.append(f"{self.path}:{node.lineno} "
                                f"{ast.unparse(node)} ({cannot})")
            return
        for value in values:
            if not isinstance(value, str):
                self.unknown.append(f"{self.path}:{node.lineno}: "
                                    f"{value!r} is no module name")
            else:
                self.add(value, node, how)

    def visit_If(self, node: ast.If) -> None:
        if "TYPE_CHECKING" in ast.unparse(node.test):  # annotations only: never run
            for stmt in node.orelse:
                self.visit(stmt)
            return
        self.visit(node.test)
        self.guards.append(node.test)
        for stmt in node.body:
            self.visit(stmt)
        self.guards.pop()
        for stmt in node.orelse:
            self.visit(stmt)

    def _function(self, node: ast.AST) -> None:
        for decorator in getattr(node, "decorator_list", []):
            self.visit(decorator)  # run when the function is defined
        self.visit(node.args)
        self.scopes.append(node)
        self.depth += 1
        body = node.body
        for stmt in body if isinstance(body, list) else [body]:
            self.visit(stmt)
        self.depth -= 1
        self.scopes.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.add(alias.name, node, "import")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            up = self.package.split(".")
            up = up[: len(up) - node.level + 1]
            base = ".".join(up + ([base] if base else []))
        for alias in node.names:  # `from a import b`: the module a.b, or the name b of a
            self.add(f"{base}.{alias.name}", node, "import")

    def visit_Call(self, node: ast.Call) -> None:
        if (isinstance(node.func, ast.Name) and node.func.id == "getattr" and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant) and node.args[1].value == "__file__"):
            self.where_only.add(id(node.args[0]))  # where a module lives, not its code
        argument = _dynamic_import_of(node)
        if argument is not None:
            self.resolved(argument, node, "importlib")
        key = _lookup_of(node)
        if key is not None and id(node) not in self.where_only:
            self.resolved(key, node, "sys.modules")
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        key = _lookup_of(node)
        if key is not None and id(node) not in self.where_only:
            self.resolved(key, node, "sys.modules")
        self.generic_visit(node)


@functools.cache
def reaches_of(name: str) -> tuple[tuple[Reach, ...], tuple[str, ...]]:
    """Everything module ``name`` imports or looks up, and what the test cannot resolve."""
    walk = _Reaches(name, MODULES[name], module_path(name), package_of(name))
    return tuple(walk.found), tuple(walk.unknown)


def internal(name: str, first_use: bool | None = None) -> set[str]:
    """The package modules ``name`` reaches (only at import time with ``first_use=False``,
    only inside functions with ``True``)."""
    return {m for r in reaches_of(name)[0] if first_use in (None, r.first_use)
            and r.target.split(".")[0] == "loss_scaling"
            and (m := module_of(r.target)) is not None and m != name}


STDLIB = frozenset(sys.stdlib_module_names) | {"__future__"}


def external(name: str, first_use: bool | None = None) -> set[str]:
    """The dotted names outside the package and the standard library that ``name`` reaches."""
    return {r.target for r in reaches_of(name)[0] if first_use in (None, r.first_use)
            and r.target.split(".")[0] not in STDLIB | {"loss_scaling"}}


def covered(dotted: str, prefixes: set[str] | tuple[str, ...]) -> bool:
    """Whether ``dotted`` is one of ``prefixes`` or inside one (``flax.nnx.Module`` is
    inside ``flax.nnx``; ``flax`` is inside none of them)."""
    return any(dotted == p or dotted.startswith(p + ".") for p in prefixes)


# -------------------------------------------------------------------------- the page


def page_section(title: str) -> str:
    text = PAGE.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def markdown_table(text: str, where: str) -> list[dict[str, str]]:
    """The first markdown table of ``text``, as one dict per row."""
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith("|")]
    assert lines, f"{where}: no table"
    block = list(itertools.takewhile(lambda line: line.startswith("|"), [
        line.strip() for line in text[text.index(lines[0]):].splitlines()]))
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in block]
    header, rows = cells[0], cells[2:]
    assert set(cells[1]) <= {"---", ":---", "---:", ":---:"}, f"{where}: not a table"
    bad = [" | ".join(r) for r in rows if len(r) != len(header)]
    assert not bad, f"{where}: rows without the {len(header)} columns {header}: {bad}"
    return [dict(zip(header, row, strict=True)) for row in rows]


def page_table(title: str) -> list[dict[str, str]]:
    return markdown_table(page_section(title), f"docs/architecture.md, {title}")


def ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def words(cell: str) -> list[str]:
    return [w.strip() for w in cell.split(",") if w.strip()]


MODULE_ROWS = page_table("Modules")


class Layer(NamedTuple):
    name: str
    patterns: tuple[str, ...]  # module paths under loss_scaling/, or folders ending in /
    may_import: tuple[str, ...]  # other layers, at import time
    on_first_use: tuple[str, ...]  # other layers, inside functions only
    frameworks: tuple[str, ...]  # the frameworks it may reach


LAYERS = {row["layer"]: Layer(row["layer"], tuple(ticked(row["modules"])),
                              tuple(words(row["may import"])), tuple(words(row["on first use"])),
                              tuple(ticked(row["frameworks"])))
          for row in page_table("Who may import whom")}


def dependencies() -> tuple[str, ...]:
    """The packages every module may import, as the page names them (the paragraph that
    begins "Besides the standard library")."""
    section = page_section("Who may import whom")
    paragraph = section[section.index("Besides the standard library"):].split("\n\n")[0]
    return tuple(ticked(paragraph))


def layer_of(name: str) -> str | None:
    """The layer of the most specific pattern that names the module (None: no layer)."""
    path = module_path(name)
    matches = [(len(p), layer.name) for layer in LAYERS.values() for p in layer.patterns
               if path == p or (p.endswith("/") and path.startswith(p))]
    return max(matches)[1] if matches else None


def members(layer: str) -> list[str]:
    return sorted(n for n in MODULES if layer_of(n) == layer)


def frameworks(name: str, first_use: bool | None = None) -> set[str]:
    """The frameworks ``name`` reaches itself: what it imports or looks up outside the
    package, the standard library and the page's dependencies."""
    return {t for t in external(name, first_use) if not covered(t, dependencies())}


# ------------------------------------------------------------------- the module table


def test_the_page_parses():
    assert len(MODULE_ROWS) > 20 and len(LAYERS) > 5  # the tables were read
    assert {"module", "owns", "tests"} <= set(MODULE_ROWS[0])
    assert all(len(ticked(row["module"])) == 1 for row in MODULE_ROWS), "one module per row"
    assert set(dependencies()) >= {"jax", "numpy"}, dependencies()


def test_the_module_table_names_every_module_once_and_no_other():
    named = [ticked(row["module"])[0] for row in MODULE_ROWS]
    duplicates = sorted({p for p in named if named.count(p) > 1})
    assert not duplicates, f"rows named twice: {duplicates}"
    assert sorted(set(BY_PATH) - set(named)) == [], "modules without a row"
    assert sorted(set(named) - set(BY_PATH)) == [], "rows without a module (stale)"


def test_every_module_owns_something():
    assert [ticked(r["module"])[0] for r in MODULE_ROWS if not r["owns"]] == []


def owned_names(cell: str) -> list[str]:
    """The names an "owns" cell ticks: every ticked item but module paths (``x.py``,
    ``folder/``), which another test checks exist."""
    return [item for item in ticked(cell) if not re.fullmatch(r"[\w/.]+(\.py|/)", item)]


def undefined_owned(path: str, cell: str) -> list[str]:
    """The names ``cell`` ticks that the module at ``path`` does not define (a public path
    of the package, ``loss_scaling.nnx``, names itself: it is that module)."""
    name = BY_PATH[path]
    return [item for item in owned_names(cell)
            if item != name and not defines(name, item)]


# The rules below check every row, layer or README in one test (not one test each): the
# quick subset runs one parametrization per test function, and a drift must show there.


def report(failures: dict[str, Any], what: str) -> None:
    """Fails with one line per row, layer or file that breaks the rule ``what``."""
    assert not failures, f"{what}:\n" + "\n".join(f"  {k}: {v}" for k, v in failures.items())


def test_each_name_an_owns_cell_ticks_is_defined_in_that_module():
    """A ticked name in the "owns" column is the module's own: a top-level name, a
    ``Class.member``, or a package's re-export. Other things are written without ticks."""
    rows = {ticked(row["module"])[0]: row["owns"] for row in MODULE_ROWS}
    report({path: missing for path, cell in rows.items() if path in BY_PATH
            and (missing := undefined_owned(path, cell))},
           "names an 'owns' cell ticks that its module does not define (move the words to "
           "the module that defines them, or untick what is not a name of this module)")


def test_the_owns_rule_reads_the_real_modules():
    assert undefined_owned("core/update.py", "`backoff_now`, `update`") == []
    assert undefined_owned("core/update.py", "`finite_leaves`") == ["finite_leaves"]
    assert undefined_owned("core/numerics.py", "`Reciprocal.lifted`") == []
    assert undefined_owned("core/numerics.py", "`Reciprocal.nothing`") == ["Reciprocal.nothing"]


# ---------------------------------------------------------------- modules -> tests


def named_tests(row: dict[str, str]) -> list[str]:
    return ticked(row["tests"])


def test_every_module_has_a_test_file_and_every_named_test_file_exists():
    missing = [ticked(r["module"])[0] for r in MODULE_ROWS if not named_tests(r)]
    assert not missing, f"modules with no test file: {missing}"
    absent = sorted({f for r in MODULE_ROWS for f in named_tests(r) if not (TESTS / f).is_file()})
    assert not absent, f"named test files that do not exist under tests/: {absent}"


def string_constants(tree: ast.AST) -> list[str]:
    """The strings of ``tree``'s code: docstrings (and other bare strings) aside."""
    bare = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str) and id(n) not in bare]


@functools.cache
def parsed(path: pathlib.Path) -> ast.Module:
    return ast.parse(path.read_text())


@functools.cache
def messages(name: str) -> tuple[str, ...]:
    """The texts module ``name`` writes: its code's strings (not docstrings), whitespace
    folded, split at ``{placeholders}`` (what a message has between them)."""
    return tuple(" ".join(part.split()) for text in string_constants(MODULES[name])
                 for part in re.split(r"\{[^{}]*\}", text) if part.strip())


QUOTE_WORDS, QUOTE_CHARS = 4, 20


def quoted_message(tree: ast.AST, name: str) -> str | None:
    """A run of at least QUOTE_WORDS words and QUOTE_CHARS characters of a string of
    ``tree`` (a literal, or a ``match=`` pattern, split at its wildcards, its escapes
    taken out) that
    one of the module's messages holds and no other module's does; the run, or None."""
    own = messages(name)
    for literal in string_constants(tree):
        # A pattern's wildcards separate words; its escapes are the characters themselves.
        tokens = re.sub(r"\\(.)", r"\1", re.sub(r"(?<!\\)\.[*+?]", " ", literal)).split()
        for i in range(len(tokens)):
            for j in range(len(tokens), i + QUOTE_WORDS - 1, -1):
                run = " ".join(tokens[i:j])
                if len(run) >= QUOTE_CHARS and any(run in text for text in own) and not any(
                        run in text for other in MODULES if other != name
                        for text in messages(other)):
                    return run
    return None


def reexported(name: str, item: str, seen: frozenset[str] = frozenset()) -> list[str]:
    """The modules a use of ``name.item`` goes through: ``name``, and where it imports
    ``item`` from or (a package's ``_LAZY`` table) loads it from on first use, down to
    the module that defines it."""
    if name in seen:
        return [name]
    chain = [name]
    for node in top_level(MODULES[name]):
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == item
                                                    for a in node.names):
            source = next(a.name for a in node.names if (a.asname or a.name) == item)
            module = module_of(f"{node.module}.{source}") if node.module else None
            if module is not None and module != name:
                target = f"{node.module}.{source}"
                if target in MODULES:  # `from package import module`
                    return [*chain, target]
                return chain + reexported(module, source, seen | {name})
    if is_package(name):
        for lazy in lazily_loaded(name):
            if lazy[0] == item:
                module = module_of(lazy[1])
                if module is not None:
                    return chain + reexported(module, lazy[2], seen | {name})
    return chain


@functools.cache
def lazily_loaded(name: str) -> tuple[tuple[str, str, str], ...]:
    """A package's names loaded on first use: ``(name, module, attribute)`` from a
    top-level dict of ``name: (module, attribute)`` that it passes to ``import_module``
    (the package root's ``_LAZY``)."""
    found = []
    resolver = Resolver()
    for node in top_level(MODULES[name]):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            try:
                (items,) = resolver.values(node.value, [MODULES[name]], [])
            except Unknown:
                continue
            for key, value in items.pairs:
                if (isinstance(key, str) and isinstance(value, tuple) and len(value) == 2
                        and all(isinstance(v, str) for v in value) and module_of(value[0])):
                    found.append((key, value[0], value[1]))
    return tuple(found)


class Use(NamedTuple):
    modules: tuple[str, ...]  # the modules the use goes through, the defining one last
    item: str | None  # the name used, or None for the module itself


def resolve_use(node: ast.expr, imported: dict[str, Use]) -> Use | None:
    """What a name or an attribute chain of a test file stands for in the package."""
    if isinstance(node, ast.Name):
        return imported.get(node.id)
    if isinstance(node, ast.Attribute):
        base = resolve_use(node.value, imported)
        if base is None or base.item is not None:
            return None
        module = base.modules[-1]
        if f"{module}.{node.attr}" in MODULES:  # ls.nnx: a module (the root's __getattr__)
            return Use((*base.modules, f"{module}.{node.attr}"), None)
        return Use(tuple(dict.fromkeys(base.modules[:-1] + tuple(
            reexported(module, node.attr)))), node.attr)
    return None


def imports_of_test(tree: ast.Module) -> dict[str, Use]:
    """The test file's local names for the package's modules and names."""
    imported: dict[str, Use] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "loss_scaling" and a.name in MODULES:
                    if a.asname:
                        imported[a.asname] = Use((a.name,), None)
                    else:
                        imported["loss_scaling"] = Use(("loss_scaling",), None)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == \
                "loss_scaling" and node.module in MODULES:
            for a in node.names:
                local = a.asname or a.name
                if f"{node.module}.{a.name}" in MODULES:
                    imported[local] = Use((node.module, f"{node.module}.{a.name}"), None)
                else:
                    imported[local] = Use(tuple(reexported(node.module, a.name)), a.name)
    return imported


NOT_A_CALL = {"isinstance", "issubclass", "type", "hasattr", "getattr", "id"}


def programs_of(test_file: pathlib.Path) -> list[ast.Module]:
    """The test file, and the programs it runs in a subprocess (its strings that parse as
    Python and import the package)."""
    found = [parsed(test_file)]
    for text in string_constants(parsed(test_file)):
        if "import loss_scaling" in text or "from loss_scaling" in text:
            try:
                found.append(ast.parse(text))
            except SyntaxError:
                pass
    return found


@functools.cache
def called_modules(test_file: pathlib.Path) -> frozenset[str]:
    """The package modules whose names the test file calls (:func:`calls_in` of it and of
    the programs it runs, :func:`programs_of`)."""
    return frozenset(calls_in(programs_of(test_file)))


def calls_in(programs: list[ast.Module]) -> set[str]:
    """The package modules whose names these programs call: a name (or a member of it,
    ``ls.DynamicLossScale.something``) as the function of a call, or handed to a call as
    an argument (``jax.jit(ls.update)``, ``functools.partial(f, ...)``,
    ``pytest.raises(ls.LossScaleError)``); never inside ``isinstance`` and the like. A
    use through a re-export counts for every module on the way (the package root, a
    sub-package, an alias)."""
    found: set[str] = set()
    for tree in programs:
        imported = imports_of_test(tree)

        def use(node: ast.expr, imported: dict[str, Use] = imported,
                argument: bool = False) -> None:
            while True:
                resolved = resolve_use(node, imported)
                if resolved is not None and resolved.item is not None:
                    if not argument or _definition(resolved.modules[-1], resolved.item):
                        found.update(resolved.modules)  # (an argument: a function or class)
                    return
                if not isinstance(node, ast.Attribute):
                    return
                node = node.value  # a member of a name: ls.DynamicLossScale.from_x(...)

        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            use(node.func)
            if getattr(node.func, "id", None) not in NOT_A_CALL:
                for argument in [*node.args, *(k.value for k in node.keywords)]:
                    if isinstance(argument, (ast.Name, ast.Attribute)):
                        use(argument, argument=True)
    return found


def structure_only(name: str) -> bool:
    """A module of nothing but a docstring, imports and ``__all__`` (a sub-package's map,
    a public alias): this file holds it to the page."""
    return all(_is_docstring(n) or isinstance(n, (ast.Import, ast.ImportFrom))
               or (isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "__all__")
               for n in MODULES[name].body)


def users_in_folder(name: str) -> set[str] | None:
    """For a module that only its own folder imports (an internal part of a sub-package):
    those importing modules; else None."""
    folder = FILES[name].parent
    users = {n for n in MODULES if name in internal(n) and not structure_only(n)}
    if folder == PACKAGE or not users or any(FILES[n].parent != folder for n in users):
        return None
    return users


def exercises(test_file: pathlib.Path, name: str) -> bool:
    """Whether a test file exercises module ``name``, strictly:

    * it calls a name the module defines, imported from it or through the package
      (:func:`called_modules`; a program it runs in a subprocess counts);
    * or it quotes a message that the module writes and no other module does
      (:func:`quoted_message`);
    * or the module is internal to its folder (:func:`users_in_folder`) and the file
      calls a name of a module of that folder that imports it (``autocast/rewrite.py``
      through ``ls.autocast``);
    * or the module is structure only (:func:`structure_only`) and the file is this one,
      which checks it.

    Naming the module, importing it, or using a name without calling it (``isinstance``,
    a constant, ``monkeypatch.setattr``) does not count.
    """
    if structure_only(name) and test_file.name == pathlib.Path(__file__).name:
        return True
    called = called_modules(test_file)
    if name in called or quoted_message(parsed(test_file), name) is not None:
        return True
    users = users_in_folder(name)
    return users is not None and bool(users & called)


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
        and isinstance(node.value.value, str)


def test_each_named_test_file_exercises_its_module():
    idle = {path: files for row in MODULE_ROWS
            if (path := ticked(row["module"])[0]) in BY_PATH
            and (files := [f for f in named_tests(row) if (TESTS / f).is_file()
                           and not exercises(TESTS / f, BY_PATH[path])])}
    report(idle, "test files named in the tests column that neither call a name of the "
                 "module nor quote a message only it writes")


def test_the_exercise_rule_is_not_fooled():
    # A file about one module does not count for an unrelated one.
    assert exercises(TESTS / "test_tree.py", "loss_scaling.core.tree")
    assert not exercises(TESTS / "test_tree.py", "loss_scaling.debug.readiness")
    # Naming, importing, holding or type-testing a name is not calling it.
    mention = ast.parse("import loss_scaling as ls\nfrom loss_scaling.core import update\n"
                        "f = ls.update\nisinstance(s, ls.DynamicLossScale)\n"
                        "print('loss_scaling.core.update', ls.FORMAT_VERSION)\n")
    assert calls_in([mention]) == set()
    # A call through the package counts for every module on the way, a lazy name included.
    called = ast.parse("import loss_scaling as ls\njax.jit(ls.update)(s, True)\n"
                       "ls.find_overflow(f, x)\n")
    assert calls_in([called]) == {"loss_scaling", "loss_scaling.core.update",
                                  "loss_scaling.debug", "loss_scaling.debug.overflow"}
    # A message counts only where no other module writes the same words.
    assert quoted_message(ast.parse("x = 'a dtype without a zero'"), "loss_scaling.wrapper.state")
    assert not quoted_message(ast.parse("x = 'the loss scale'"), "loss_scaling.wrapper.state")


# ------------------------------------------------------------- who may import whom


def test_every_module_is_in_exactly_one_layer_and_the_layers_are_known():
    assert [n for n in MODULES if layer_of(n) is None] == [], "modules in no layer"
    unknown = {m for layer in LAYERS.values() for m in (*layer.may_import, *layer.on_first_use)
               if m not in LAYERS}
    assert not unknown, f"'may import' / 'on first use' name unknown layers: {unknown}"
    for layer in LAYERS.values():
        for pattern in layer.patterns:
            exists = (PACKAGE / pattern).is_dir() if pattern.endswith("/") else (
                pattern in BY_PATH)
            assert exists, f"layer {layer.name}: {pattern} is no module or folder"


def test_every_import_and_lookup_is_one_the_test_can_read():
    """A dynamic import or a ``sys.modules`` lookup whose name the source does not tell
    (an argument, a computed string) would pass every layer rule unseen: write it so that
    the name is a literal, or a value of a literal tuple or dict in the module."""
    unknown = [u for name in MODULES for u in reaches_of(name)[1]]
    assert not unknown, unknown


def per_layer(offenders_of: Any) -> dict[str, list[str]]:
    """``{layer: offenders}`` for the layers with any."""
    return {layer: found for layer in sorted(LAYERS) if (found := offenders_of(layer))}


def test_at_import_time_a_layer_imports_only_its_own_layer_and_those_it_may():
    assert not [layer for layer in LAYERS if not members(layer)], "layers without a module"

    def offenders(layer: str) -> list[str]:
        allowed = {layer, *LAYERS[layer].may_import}
        return [f"{module_path(n)} imports {module_path(m)} (layer {layer_of(m)})"
                for n in members(layer) for m in sorted(internal(n, first_use=False))
                if layer_of(m) not in allowed]

    report(per_layer(offenders), "imports at import time outside 'may import'")


def test_on_first_use_a_layer_reaches_only_the_layers_it_names():
    """Imports inside functions, ``importlib.import_module`` and ``sys.modules`` lookups:
    the "may import" layers and the "on first use" ones."""
    def offenders(layer: str) -> list[str]:
        allowed = {layer, *LAYERS[layer].may_import, *LAYERS[layer].on_first_use}
        return [f"{module_path(n)}:{r.line} reaches {module_path(m)} (layer {layer_of(m)}, "
                f"{r.how})" for n in members(layer) for r in reaches_of(n)[0]
                if r.first_use and r.target.split(".")[0] == "loss_scaling"
                and (m := module_of(r.target)) not in (None, n) and layer_of(m) not in allowed]

    report(per_layer(offenders), "reaches inside functions outside 'may import' and 'on "
                                 "first use'")


def test_a_layer_reaches_only_the_frameworks_it_names():
    """Anything outside the package, the standard library and the page's dependencies is a
    framework (``flax.struct`` too), reached by an import anywhere in a module or a
    ``sys.modules`` lookup."""
    def offenders(layer: str) -> list[str]:
        return [f"{module_path(n)}:{r.line} reaches {r.target} ({r.how})"
                for n in members(layer) for r in reaches_of(n)[0]
                if r.target in frameworks(n) and not covered(r.target, LAYERS[layer].frameworks)]

    report(per_layer(offenders), "frameworks a layer reaches but its 'frameworks' column "
                                 "does not name")


def imported_at_import_time(name: str) -> set[str]:
    """The package's modules that importing ``name`` imports (transitively)."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        for dep in internal(todo.pop(), first_use=False) - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


def test_importing_a_layer_imports_only_the_frameworks_it_names():
    """Through the modules it imports at import time: the root imports flax linen (through
    ``integrations/linen.py``), never flax.nnx, Equinox or Orbax."""
    def offenders(layer: str) -> list[str]:
        return sorted({f"{module_path(n)} -> {module_path(m)} imports {f}"
                       for n in members(layer) for m in imported_at_import_time(n)
                       for f in frameworks(m, first_use=False)
                       if not covered(f, LAYERS[layer].frameworks)})

    report(per_layer(offenders), "frameworks that importing a layer imports, which its "
                                 "'frameworks' column does not name")


def test_the_framework_rule_reads_the_page_not_a_list():
    """The frameworks are whatever lies outside the page's dependencies: a new one needs no
    change here, and a part of flax the page does not name is not allowed by another."""
    named = {f for layer in LAYERS.values() for f in layer.frameworks}
    assert "equinox" in named and not covered("flax.struct", named)
    assert frameworks("loss_scaling.core.numerics") == set()  # jax and numpy: dependencies
    assert frameworks("loss_scaling.integrations.equinox") == {"equinox"}


def test_the_registry_lists_the_integrations_layer():
    """``_registry.INTEGRATIONS`` (framework -> the integration that registers its hooks):
    each integration is a module of the integrations layer, and each framework one that
    layer names."""
    resolver = Resolver()
    table = next(node.value for node in top_level(MODULES["loss_scaling._registry"])
                 if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "INTEGRATIONS")
    (items,) = resolver.values(table, [MODULES["loss_scaling._registry"]], [])
    assert items.pairs, "the registry lists no integration"
    for framework, module in items.pairs:
        assert module in MODULES and layer_of(module) == "integrations", module
        assert covered(framework, LAYERS["integrations"].frameworks), framework


def test_an_alias_is_a_thin_re_export():
    """The aliases (`nnx.py`, `equinox.py`, `orbax.py`: the public paths of integrations):
    a docstring, imports from their layer's ``may import`` and ``__all__``, nothing else."""
    assert members("aliases")
    for name in members("aliases"):
        body = [n for n in MODULES[name].body if not _is_docstring(n)]
        imported = sorted(a.asname or a.name for n in body if isinstance(n, ast.ImportFrom)
                          for a in n.names)
        rest = [n for n in body if not isinstance(n, ast.ImportFrom)]
        assert len(rest) == 1 and ast.unparse(rest[0]).startswith("__all__ ="), (
            f"{module_path(name)} holds more than re-exports: "
            f"{[ast.unparse(n)[:60] for n in rest]}")
        assert sorted(ast.literal_eval(rest[0].value)) == imported, module_path(name)


def test_a_pure_optax_program_imports_no_integration_until_its_framework_is_imported():
    """``_registry.hooks()`` imports an integration only once the program has imported its
    framework: ``import loss_scaling`` and a pure-optax step import none of them (nor
    Orbax), and the only hooks answered are linen's own ``is_model`` (the root imports
    ``integrations/linen.py``, which registers it); after ``import equinox`` the next
    lookup brings the Equinox integration's hooks too."""
    program = """
import json, sys
import jax.numpy as jnp, optax
import loss_scaling as ls
from loss_scaling import _registry
s = ls.with_loss_scaling(optax.sgd(1.0)).init(jnp.zeros(2))
ls.get_loss_scale(s); ls.check(s); ls.metrics(s)
ls.value_and_grad(lambda p: p.sum())(s, jnp.ones(2))
seen = lambda: [m for m in ("flax.nnx", "equinox", "orbax.checkpoint",
                            "loss_scaling.integrations.nnx",
                            "loss_scaling.integrations.equinox") if m in sys.modules]
filled = lambda: [sorted(k for k, v in h._asdict().items() if v is not None)
                  for h in _registry.hooks()]
before, hooks_before = seen(), filled()
import equinox
hooks_after = filled()
print(json.dumps([before, hooks_before, seen(), hooks_after]))
"""
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                         check=True, cwd=PACKAGE.parent)
    linen = ["is_model"]
    equinox = ["is_model", "modules", "value_and_grad"]
    assert json.loads(out.stdout) == [[], [linen], ["equinox", "loss_scaling.integrations.equinox"],
                                      [linen, equinox]], out.stdout + out.stderr


def test_the_import_reader_sees_every_kind_of_import():
    """A function-level import, ``importlib.import_module`` of a literal, of a guarded
    f-string and of a dict's values, ``sys.modules`` lookups (not a membership test, not a
    read of where a module lives), and a name it cannot tell."""
    source = '''
import sys, importlib
TABLE = {"a": "pkg.one", **{k: "pkg.two" for k in ("b", "c")}}
def f(name):
    import pkg.three
    importlib.import_module("pkg.four")
    if name in ("x", "y"):
        importlib.import_module(f"pkg.{name}")
    for key, module in TABLE.items():
        importlib.import_module(module)
    sys.modules.get("pkg.five"), sys.modules["pkg.six"], "pkg.seven" in sys.modules
    getattr(sys.modules.get("pkg.eight"), "__file__", None)
    importlib.import_module(name)
'''
    walk = _Reaches("loss_scaling._probe", ast.parse(source), "_probe.py", "loss_scaling")
    found, unknown = walk.found, walk.unknown
    assert sorted({(r.target, r.first_use) for r in found if r.target.startswith("pkg")}) == [
        ("pkg.five", True), ("pkg.four", True), ("pkg.one", True), ("pkg.six", True),
        ("pkg.three", True), ("pkg.two", True), ("pkg.x", True), ("pkg.y", True)]
    assert len(unknown) == 1 and "the argument 'name'" in unknown[0], unknown


# -------------------------------------------------------------------- no cycle


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` (depth-first), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                raise _Cycle(stack[stack.index(dep):] + [dep])
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    try:
        for node in sorted(graph):
            if node not in state:
                visit(node)
    except _Cycle as cycle:
        return cycle.args[0]
    return None


class _Cycle(Exception):
    pass


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_import_graph_has_no_cycle():
    graph = {n: internal(n, first_use=False) - {"loss_scaling"} for n in MODULES}
    assert sum(map(len, graph.values())) > 50  # the rule reads the real imports
    # The package root imports everything and is imported by nothing but its users.
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def annotation_imports(tree: ast.Module, name: str) -> set[str]:
    """The package modules that module ``name`` (parsed: ``tree``) imports under
    ``if TYPE_CHECKING:``, for its annotations only (the reaches above skip them, as Python
    does at run time)."""
    found = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in ast.walk(node):
                if isinstance(stmt, ast.ImportFrom) and stmt.module:
                    found |= {stmt.module, *(f"{stmt.module}.{a.name}" for a in stmt.names)}
                elif isinstance(stmt, ast.Import):
                    found |= {a.name for a in stmt.names}
    return {m for target in found if target.startswith("loss_scaling.")
            and (m := module_of(target)) is not None and m != name}


def test_no_cycle_either_with_the_imports_for_annotations():
    # A cycle closed only by TYPE_CHECKING imports runs, but a reader (and a type checker)
    # still sees two modules that each need the other: type by shape (a Protocol) instead.
    graph = {n: (internal(n, first_use=False) | annotation_imports(MODULES[n], n))
             - {"loss_scaling"} for n in MODULES}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle through annotations: " + " -> ".join(cycle or [])
    # the rule reads such an import
    sample = ast.parse("if TYPE_CHECKING:\n"
                       "    from loss_scaling.core.fields import DynamicConfig\n")
    assert annotation_imports(sample, "loss_scaling.core.validation") == {
        "loss_scaling.core.fields"}


# ------------------------------------------------------------ one step, in order


def step_list() -> str:
    section = page_section("One step, in order")
    return section[re.search(r"^1\. ", section, re.M).start():]


class Item(NamedTuple):
    lead: list[str]  # the ticked names before the item's first colon
    rest: list[str]  # the ticked names after it


def guarded_step_items() -> list[Item]:
    """The sub-list under the item of the step list that names ``guarded_step``."""
    lines = step_list().splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"\d+\. ", line)
                 and "`guarded_step`" in line)
    indent = None
    items: list[str] = []
    for line in lines[start + 1:]:
        match = re.match(r"(\s+)\d+\. (.*)", line)
        if match and (indent is None or len(match.group(1)) == indent):
            indent = len(match.group(1))
            items.append(match.group(2))
        elif re.match(r"\d+\. ", line):
            break  # the next item of the outer list
        elif items:
            items[-1] += " " + line.strip()
    found = []
    for text in items:
        head, _, rest = text.partition(":")
        found.append(Item([n.removeprefix("ls.") for n in ticked(head) if not n.endswith(".py")],
                          [n.removeprefix("ls.") for n in ticked(rest)
                           if not n.endswith(".py")]))
    return found


def package_references(module: str, function: ast.AST) -> list[tuple[str, str]]:
    """The package's functions a function of ``module`` refers to, ``(module, name)``, in the
    order of their first reference in its source (calls, and functions handed to calls)."""
    tree = MODULES[module]
    local: dict[str, tuple[str, str]] = {}
    for node in top_level(tree):
        if isinstance(node, ast.FunctionDef):
            local[node.name] = (module, node.name)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("loss_scaling"):
            for a in node.names:
                target = f"{node.module}.{a.name}"
                local[a.asname or a.name] = (target, "") if target in MODULES else (
                    node.module, a.name)
    found: list[tuple[str, str]] = []
    body = function.body  # not its annotations
    nodes = sorted((n for stmt in body for n in ast.walk(stmt)
                    if isinstance(n, (ast.Name, ast.Attribute))),
                   key=lambda n: (n.lineno, n.col_offset))
    for node in nodes:
        ref: tuple[str, str] | None = None
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            owner = local.get(node.value.id)
            if owner is not None and owner[1] == "":
                ref = (owner[0], node.attr)
        elif isinstance(node, ast.Name) and node.id in local and local[node.id][1]:
            ref = local[node.id]
        if ref is not None and not isinstance(_definition(*ref), ast.FunctionDef):
            ref = None  # a class, a constant: not a step
        if ref is not None and ref not in found:
            found.append(ref)
    return found


def _definition(module: str, name: str) -> ast.AST | None:
    for node in top_level(MODULES[module]):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return node
    return None


GUARDED_STEP = ("loss_scaling.wrapper.transform", "guarded_step")


def test_the_step_list_leads_with_what_guarded_step_calls_in_that_order():
    """The sub-list under ``guarded_step``: the names before each item's colon, read in
    order, are the package functions ``guarded_step`` refers to, in the order it does
    (replay included): a call added, removed or moved is a change of the page."""
    calls = [name for _, name in package_references(
        GUARDED_STEP[0], function_def(*GUARDED_STEP))]
    leads = [name.rpartition(".")[2] for item in guarded_step_items() for name in item.lead]
    assert len(leads) >= 4, leads  # the rule reads the page's step
    assert leads == calls, (f"the step list's sub-list leads with {leads}, but guarded_step "
                            f"refers to {calls}, in this order")


def test_inside_each_step_the_page_names_what_a_function_calls_in_its_order():
    """Within an item, the names after the colon that its lead function (or one of the
    functions it leads with) refers to come in the order that function refers to them."""
    for item in guarded_step_items():
        for lead in item.lead:
            module = next((m for m, n in package_references(
                GUARDED_STEP[0], function_def(*GUARDED_STEP)) if n == lead.rpartition(".")[2]),
                None)
            assert module is not None, f"{lead}: guarded_step refers to no such function"
            inner = [n for _, n in package_references(module, _definition(
                module, lead.rpartition(".")[2]))]
            named = [n.rpartition(".")[2] for n in item.rest if n.rpartition(".")[2] in inner]
            assert named == [n for n in inner if n in named], (
                f"{lead}: the page names {named}, but it refers to them in the order "
                f"{[n for n in inner if n in named]}")


def test_the_functions_of_the_step_have_docstrings():
    """What the step list names in ``guarded_step``'s sub-list is read from its docstring
    first (UNDOCUMENTED: those that have none today; remove a name once it has one)."""
    undocumented = set()
    for item in guarded_step_items():
        for lead in item.lead:
            module = next(m for m, n in package_references(
                GUARDED_STEP[0], function_def(*GUARDED_STEP)) if n == lead.rpartition(".")[2])
            node = _definition(module, lead.rpartition(".")[2])
            if ast.get_docstring(node) is None:
                undocumented.add(lead.rpartition(".")[2])
    assert undocumented == UNDOCUMENTED, (
        "functions of the step without a docstring; UNDOCUMENTED lists those known (remove "
        "a name when it gets one)")


UNDOCUMENTED: set[str] = set()


# --------------------------------------------------------- the page's other claims


def test_every_module_path_the_page_names_exists():
    text = PAGE.read_text()
    named = {p for p in re.findall(r"`([\w/]+\.py)`", text)}
    stale = sorted(p for p in named if p not in BY_PATH and not (TESTS / p).is_file()
                   and not (ROOT / p).is_file())
    assert not stale, f"the page names modules that do not exist: {stale}"


def test_a_name_the_page_places_in_a_module_is_defined_there():
    # "`decide` (`wrapper/transform.py`)", "`ls.scale` (`core/tree.py`)"
    text = PAGE.read_text()
    pairs = re.findall(r"`([A-Za-z_][\w.]*)` \(`([\w/]+\.py)`", text)
    pairs += [(n, p) for p, n in re.findall(r"`([\w/]+\.py)`'s `([A-Za-z_][\w.]*)`", text)]
    assert len(pairs) >= 5  # the rule reads the page's step
    wrong = [f"{n} in {p}" for n, p in pairs
             if p in BY_PATH and not defines(BY_PATH[p], n.removeprefix("ls.").rpartition(".")[2])
             and not defines(BY_PATH[p], n.removeprefix("ls."))]
    assert not wrong, f"the page places names in modules that do not define them: {wrong}"


def test_a_sub_package_map_names_its_modules_or_its_readme():
    """A sub-package's ``__init__.py`` docstring is its map: it lists its modules in
    parentheses (``core/``, ``wrapper/``) or points to its README.md, whose table lists
    them (checked below). A module moved or merged changes it."""
    wrong = {}
    for package in sorted(p for p in BY_PATH if p.endswith("/__init__.py")):
        folder = PACKAGE / package.rpartition("/")[0]
        doc = ast.get_docstring(MODULES[BY_PATH[package]]) or ""
        modules = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
        if "README.md" in doc:
            if not (folder / "README.md").is_file():
                wrong[package] = "points to a README.md that does not exist"
        elif (named := set(re.findall(r"\((\w+)\)", doc))) != modules:
            wrong[package] = f"names {sorted(named)}, the folder holds {sorted(modules)}"
    report(wrong, "sub-package maps that name other modules than their folder's")


def test_the_state_and_option_tables_list_exactly_the_fields():
    section = page_section("The state and the options")
    tables = [[line.split("|")[1].strip().strip("`") for line in block.splitlines()[2:]]
              for block in section.split("\n\n") if block.startswith("| ")]
    state = "loss_scaling.wrapper.state"

    def fields(cls: str) -> list[str]:
        node = _definition(state, cls)
        return [s.target.id for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]

    assert tables == [fields("LossScalingState"), fields("WrapperOptions")]
    # Derived, not stored: a property of the state (the page says so).
    node = _definition(state, "LossScalingState")
    properties = {f.name for f in node.body if isinstance(f, ast.FunctionDef)
                  and any(ast.unparse(d) == "property" for d in f.decorator_list)}
    assert "last_step_applied" in properties


# ------------------------------------------------------------ the sub-packages' READMEs


READMES = sorted(PACKAGE.glob("*/README.md"))


def test_every_sub_package_has_a_readme():
    assert {p.parent.name for p in READMES} == {
        p.parent.name for p in PACKAGE.glob("*/__init__.py")} - {"core", "wrapper"}


def readme_table(readme: pathlib.Path) -> list[dict[str, str]]:
    """A sub-package README's table of its modules: the one whose first column is
    "module"."""
    text = readme.read_text()
    header = re.search(r"^\| module \|.*$", text, re.M)
    assert header, f"{readme.relative_to(ROOT)}: no table of its modules (| module | owns |)"
    return markdown_table(text[header.start():], str(readme.relative_to(ROOT)))


def test_a_readme_table_names_every_module_of_its_folder_once():
    wrong = {}
    for readme in READMES:
        named = sorted(ticked(row["module"])[0] for row in readme_table(readme))
        modules = sorted(p.name for p in readme.parent.glob("*.py") if p.name != "__init__.py")
        if named != modules:
            wrong[str(readme.relative_to(ROOT))] = f"names {named}, the folder holds {modules}"
    report(wrong, "README tables that do not name their folder's modules once each")


def test_what_a_readme_row_owns_is_defined_there():
    wrong = {}
    for readme in READMES:
        for row in readme_table(readme):
            path = f"{readme.parent.name}/{ticked(row['module'])[0]}"
            if path in BY_PATH and (missing := undefined_owned(path, row["owns"])):
                wrong[f"{readme.relative_to(ROOT)}, {path}"] = missing
    report(wrong, "names a README row ticks that its module does not define")


# ------------------------------------------------------------------- no duplicates


class Line(NamedTuple):
    number: int
    text: str  # the line, white space folded
    shape: str  # names, strings and numbers replaced (a thin line: its text)


THIN = {"N", "S", "0", ",", "(", ")", "[", "]", "{", "}", ":", "."}


def code_lines(source: str) -> list[Line]:
    """The lines of a Python file that count, as the ``duplicates`` command reads them:
    not blank, not only a comment or punctuation, not an import, not a one-line docstring.
    A line's shape has its names, strings and numbers replaced (comments kept); a thin
    line (nothing but those and ``,:.()[]{}``: a list item, a field, a message's next
    line) is compared only to the letter, as is text inside a multi-line string."""
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    per_line: dict[int, list[tokenize.TokenInfo]] = defaultdict(list)
    inside_string: set[int] = set()
    docstrings: set[int] = set()
    for i, tok in enumerate(tokens):
        if tok.type in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                        tokenize.ENDMARKER):
            continue
        if tok.type == tokenize.STRING:
            inside_string.update(range(tok.start[0] + 1, tok.end[0] + 1))
            before = tokens[i - 1].type if i else tokenize.NEWLINE
            if before in (tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT) \
                    and tokens[i + 1].type in (tokenize.NEWLINE, tokenize.COMMENT):
                docstrings.add(tok.start[0])
        per_line[tok.start[0]].append(tok)
    found = []
    for number, raw in enumerate(source.splitlines(), 1):
        text = " ".join(raw.split())
        toks = per_line.get(number, [])
        code = [t for t in toks if t.type != tokenize.COMMENT]
        if number in inside_string and not toks:
            if re.search(r"[^\W_]", text):
                found.append(Line(number, text, text))
            continue
        if not code or all(t.type == tokenize.OP for t in code):
            continue
        if code[0].string in ("import", "from") and any(t.string == "import" for t in code):
            continue
        if len(code) == 1 and number in docstrings and code[0].start[0] == code[0].end[0]:
            continue
        shape = [("N" if not keyword.iskeyword(t.string) else t.string)
                 if t.type == tokenize.NAME else
                 {tokenize.STRING: "S", tokenize.NUMBER: "0"}.get(t.type, t.string)
                 for t in toks if t.type != tokenize.COMMENT]
        comment = [t.string for t in toks if t.type == tokenize.COMMENT]
        thin = set(shape) <= THIN
        found.append(Line(number, text, text if thin else " ".join(shape + comment)))
    return found


class Pair(NamedTuple):
    first: tuple[str, int, int]  # file, first line, last line
    second: tuple[str, int, int]
    alike: bool  # the same shape, not the same letters


def duplicate_blocks(files: dict[str, str], min_lines: int = 6,
                     most_places: int = 8) -> list[Pair]:
    """Pairs of places that share ``min_lines`` consecutive lines that count
    (:func:`code_lines`), to the letter or in shape; a run found in more than
    ``most_places`` places is too common to list (what the ``duplicates`` command
    reports, checked against it where it is installed)."""
    lines = {f: code_lines(text) for f, text in files.items()}
    found: dict[tuple[str, str], Pair] = {}
    for alike in (False, True):
        windows: dict[tuple[str, ...], list[tuple[str, int]]] = defaultdict(list)
        for f, seq in lines.items():
            for i in range(len(seq) - min_lines + 1):
                windows[tuple(line.shape if alike else line.text
                              for line in seq[i:i + min_lines])].append((f, i))
        for places in windows.values():
            if not 2 <= len(places) <= most_places:
                continue
            for (fa, ia), (fb, ib) in itertools.combinations(places, 2):
                if fa == fb and abs(ia - ib) < min_lines:
                    continue  # a run that overlaps itself
                key = tuple(sorted((fa, fb)))
                if key not in found or (found[key].alike and not alike):
                    found[key] = Pair((fa, lines[fa][ia].number,
                                       lines[fa][ia + min_lines - 1].number),
                                      (fb, lines[fb][ib].number,
                                       lines[fb][ib + min_lines - 1].number), alike)
    return sorted(found.values())


def package_sources() -> dict[str, str]:
    return {module_path(n): FILES[n].read_text() for n in MODULES}


def test_no_block_of_code_stands_twice_in_the_package():
    """Six lines that count, the same or of the same shape, in two places of
    ``loss_scaling/``: one function should serve both (the ``duplicates`` command's rule,
    so that CI checks what a developer's ``duplicates --repo loss_scaling`` shows)."""
    pairs = duplicate_blocks(package_sources())
    assert not pairs, "\n".join(
        f"{a[0]}:{a[1]}-{a[2]} ~ {b[0]}:{b[1]}-{b[2]}{' (alike)' if alike else ''}"
        for a, b, alike in pairs)


def test_the_duplicate_finder_finds_a_copied_block_and_no_list():
    body = ("def {f}({a}):\n    '''Doc {f}.'''\n    {b} = {a} + 1  # one\n    c = {b} * 2\n"
            "    d = c - 3\n    e = d / 4\n    return e ** 5\n")
    copied = {"a.py": body.format(f="f", a="x", b="y"), "b.py": body.format(f="g", a="p", b="q")}
    (pair,) = duplicate_blocks(copied)
    assert pair.alike and pair.first == ("a.py", 1, 7), pair
    assert duplicate_blocks({"a.py": body.format(f="f", a="x", b="y"),
                             "b.py": body.format(f="f", a="x", b="y")})[0].alike is False
    names = "__all__ = [\n" + "".join(f'    "{n}",\n' for n in "abcdefgh") + "]\n"
    assert duplicate_blocks({"a.py": names, "b.py": names.replace('"', "'x")}) == []
    # Imports, comments, blank lines and lone brackets do not count.
    skipped = "import os\n# a comment\n\nfrom os import path\n" * 6
    assert duplicate_blocks({"a.py": skipped, "b.py": skipped}) == []
    # A run in more than eight places is too common to list.
    assert duplicate_blocks({f"{i}.py": body.format(f="f", a="x", b="y")
                             for i in range(9)}) == []


@pytest.mark.skipif(shutil.which("duplicates") is None, reason="the duplicates command is "
                    "not installed here (the finder above runs everywhere)")
@pytest.mark.parametrize("folder", ["loss_scaling", "tests", "benchmarks"])
def test_the_duplicate_finder_agrees_with_the_duplicates_command(folder):
    """Where the command is installed: the same pairs of files, at six lines, in the package
    (none) and in two folders that have some."""
    out = subprocess.run(["duplicates", "--repo", str(ROOT / folder), "--most", "200",
                          "--seconds", "60"], capture_output=True, text=True, check=True).stdout
    assert "incomplete" not in out, out
    theirs = {tuple(sorted(m)) for m in re.findall(r"^D\d+ (\S+?):\d+-\d+ ~ (\S+?):\d+-\d+",
                                                     out, re.M)}
    sources = {p.relative_to(ROOT / folder).as_posix(): p.read_text()
               for p in sorted((ROOT / folder).rglob("*.py")) if "__pycache__" not in p.parts}
    ours = {tuple(sorted((p.first[0], p.second[0]))) for p in duplicate_blocks(sources)}
    assert ours == theirs, (sorted(ours - theirs), sorted(theirs - ours))
