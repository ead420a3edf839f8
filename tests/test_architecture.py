"""docs/architecture.md, read and enforced: the package is what the page says it is.

The page's two tables drive every test here, so a module added, moved or removed is a row
to change there, never a constant to change here:

* "Modules": one row per module of ``loss_scaling/`` (no module missing, no stale row),
  and the test files that test it (each exists and refers to the module);
* "Who may import whom": the layers, what each may import at import time and which layer
  may import the optional frameworks; one test per rule and layer, so a failure names both.

Besides: every module path the page names exists, and a name it places in a module
(`` `decide` (`wrapper/step.py`) ``) is defined there; no import cycle; a pure-optax
program never imports an optional framework (``_registry.py``'s hooks import an
integration only when its framework already is).
"""

from __future__ import annotations

import ast
import functools
import pathlib
import re
import shutil
import subprocess
import sys
from typing import NamedTuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "loss_scaling"
TESTS = ROOT / "tests"
PAGE = ROOT / "docs" / "architecture.md"
OPTIONAL_FRAMEWORKS = ("flax.nnx", "equinox", "orbax")


# ----------------------------------------------------------------------- the package


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_path(name: str) -> str:
    """``loss_scaling.core.tree`` -> ``core/tree.py`` (as the page writes it)."""
    rel = PACKAGE.parent / name.replace(".", "/")
    return ((rel / "__init__.py") if rel.is_dir() else rel.with_suffix(".py")).relative_to(
        PACKAGE).as_posix()


FILES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
MODULES = {name: ast.parse(p.read_text(), str(p)) for name, p in FILES.items()}
BY_PATH = {module_path(name): name for name in MODULES}


def is_package(name: str) -> bool:
    return FILES[name].name == "__init__.py"


def import_time_imports(name: str, tree: ast.Module) -> set[str]:
    """Modules imported when ``name`` is imported: top-level statements only (an import
    inside a function runs on first use), ``if TYPE_CHECKING`` blocks aside. For
    ``from a import b`` both ``a`` and ``a.b`` (a module of the package only if it is one)."""
    found: set[str] = set()
    package = name if is_package(name) else name.rpartition(".")[0]
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue  # annotations only: never imported at run time
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.ClassDef):  # a class body runs at import time
            found |= import_time_imports(name, ast.Module(body=node.body, type_ignores=[]))
            continue
        for sub in ast.walk(node):
            if isinstance(sub, ast.Import):
                found.update(a.name for a in sub.names)
            elif isinstance(sub, ast.ImportFrom):
                base = sub.module or ""
                if sub.level:
                    up = package.split(".")[: len(package.split(".")) - sub.level + 1]
                    base = ".".join(up + ([base] if base else []))
                if base.split(".")[0] == "loss_scaling":
                    # `from package import module` needs the module, not the package's names.
                    submodules = {f"{base}.{a.name}" for a in sub.names} & set(MODULES)
                    found.update(submodules or {base})
                else:  # `from flax import nnx` imports flax.nnx
                    found.add(base)
                    found.update(f"{base}.{a.name}" for a in sub.names)
    return found


IMPORTS = {name: import_time_imports(name, tree) for name, tree in MODULES.items()}
INTERNAL = {name: {m for m in imports if m in MODULES and m != name}
            for name, imports in IMPORTS.items()}


def frameworks_of(imported: set[str]) -> set[str]:
    return {f for f in OPTIONAL_FRAMEWORKS for m in imported if m == f or m.startswith(f + ".")}


def defined_names(name: str, private: bool = False) -> set[str]:
    """The names ``name`` defines at top level (with ``private``, those starting with _)."""
    found: set[str] = set()
    for node in MODULES[name].body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, ast.Assign):
            found.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found.add(node.target.id)
    return found if private else {n for n in found if not n.startswith("_")}


# -------------------------------------------------------------------------- the page


def page_section(title: str) -> str:
    text = PAGE.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def page_table(title: str) -> list[dict[str, str]]:
    """The first markdown table of the page's section ``title``, as one dict per row."""
    lines = [line.strip() for line in page_section(title).splitlines()
             if line.strip().startswith("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    header, rows = cells[0], cells[2:]
    assert set(cells[1]) <= {"---", ":---", "---:", ":---:"}, f"{title}: not a table"
    bad = [" | ".join(r) for r in rows if len(r) != len(header)]
    assert not bad, f"{title}: rows without the {len(header)} columns {header}: {bad}"
    return [dict(zip(header, row, strict=True)) for row in rows]


def ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def words(cell: str) -> list[str]:
    return [w.strip() for w in cell.split(",") if w.strip()]


MODULE_ROWS = page_table("Modules")


class Layer(NamedTuple):
    name: str
    patterns: tuple[str, ...]  # module paths under loss_scaling/, or folders ending in /
    may_import: tuple[str, ...]  # other layers
    frameworks: tuple[str, ...]  # optional frameworks it may import at import time


LAYERS = {row["layer"]: Layer(row["layer"], tuple(ticked(row["modules"])),
                              tuple(words(row["may import"])), tuple(ticked(row["frameworks"])))
          for row in page_table("Who may import whom")}


def layer_of(name: str) -> str | None:
    """The layer of the most specific pattern that names the module (None: no layer)."""
    path = module_path(name)
    matches = [(len(p), layer.name) for layer in LAYERS.values() for p in layer.patterns
               if path == p or (p.endswith("/") and path.startswith(p))]
    return max(matches)[1] if matches else None


def members(layer: str) -> list[str]:
    return sorted(n for n in MODULES if layer_of(n) == layer)


# ------------------------------------------------------------------- the module table


def test_the_page_parses():
    assert len(MODULE_ROWS) > 20 and len(LAYERS) > 5  # the tables were read
    assert {"module", "owns", "tests"} <= set(MODULE_ROWS[0])
    assert all(len(ticked(row["module"])) == 1 for row in MODULE_ROWS), "one module per row"


def test_the_module_table_names_every_module_once_and_no_other():
    named = [ticked(row["module"])[0] for row in MODULE_ROWS]
    duplicates = sorted({p for p in named if named.count(p) > 1})
    assert not duplicates, f"rows named twice: {duplicates}"
    assert sorted(set(BY_PATH) - set(named)) == [], "modules without a row"
    assert sorted(set(named) - set(BY_PATH)) == [], "rows without a module (stale)"


def test_every_module_owns_something():
    assert [ticked(r["module"])[0] for r in MODULE_ROWS if not r["owns"]] == []


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
def parsed(path: pathlib.Path) -> tuple[str, ast.Module]:
    return path.read_text(), ast.parse(path.read_text())


@functools.cache
def own_strings(name: str) -> str:
    return " ".join(" ".join(string_constants(MODULES[name])).split())


def refers_to(test_file: pathlib.Path, name: str) -> bool:
    """Whether a test file imports the module ``name``, names its path, uses a name the
    module defines through a ``loss_scaling`` import, quotes a message it writes (a string
    of three words or more that appears in the module's own strings) or is named after it."""
    text, tree = parsed(test_file)
    path = module_path(name)
    stem = pathlib.Path(path).stem if not is_package(name) else pathlib.Path(path).parent.name
    if test_file.stem in (f"test_{stem}", f"test_{stem.strip('_')}"):
        return True
    if re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", text) or path in text:
        return True
    imported: set[str] = set()
    aliases: set[str] = set()
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "loss_scaling":
                    imported.add(a.name)
                    aliases.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("loss_scaling"):
            imported.add(node.module or "")
            for a in node.names:
                imported.add(f"{node.module}.{a.name}")
                used.add(a.name)
                aliases.add(a.asname or a.name)
    if name in imported:
        return True
    used |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
             and isinstance(n.value, ast.Name) and n.value.id in aliases}
    if used & defined_names(name):
        return True
    return quotes(tree, name)


def quotes(tree: ast.AST, name: str) -> bool:
    """Whether a string of ``tree`` (a message, or a ``match=`` pattern with its regex
    escapes taken out) holds three words in a row, 15 characters or more, of the module's
    own strings."""
    own = own_strings(name)
    for literal in string_constants(tree):
        tokens = re.sub(r"\\(.)", r"\1", literal).split()
        for i in range(len(tokens) - 2):
            for j in range(i + 3, len(tokens) + 1):
                run = " ".join(tokens[i:j])
                if run not in own:
                    break
                if len(run) >= 15:
                    return True
    return False


@pytest.mark.parametrize("row", MODULE_ROWS, ids=lambda r: ticked(r["module"])[0])
def test_each_named_test_file_refers_to_its_module(row):
    path = ticked(row["module"])[0]
    if path not in BY_PATH:
        pytest.fail(f"{path}: no such module (stale row)")
    silent = [f for f in named_tests(row)
              if (TESTS / f).is_file() and not refers_to(TESTS / f, BY_PATH[path])]
    assert not silent, (f"{path}: these test files neither import it, name its path, use a "
                        f"name it defines nor quote a message it writes: {silent}")


def test_the_reference_finder_is_not_fooled():
    # A test file about one module does not count for an unrelated one.
    assert refers_to(TESTS / "test_tree.py", "loss_scaling.core.tree")
    assert not refers_to(TESTS / "test_tree.py", "loss_scaling.debug.readiness")


# ------------------------------------------------------------- who may import whom


def test_every_module_is_in_exactly_one_layer_and_the_layers_are_known():
    assert [n for n in MODULES if layer_of(n) is None] == [], "modules in no layer"
    unknown = {m for layer in LAYERS.values() for m in layer.may_import if m not in LAYERS}
    assert not unknown, f"'may import' names layers the table does not have: {unknown}"
    for layer in LAYERS.values():
        for pattern in layer.patterns:
            exists = (PACKAGE / pattern).is_dir() if pattern.endswith("/") else (
                pattern in BY_PATH)
            assert exists, f"layer {layer.name}: {pattern} is no module or folder"


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_a_layer_imports_only_its_own_layer_and_those_it_may(layer):
    allowed = {layer, *LAYERS[layer].may_import}
    assert members(layer), f"layer {layer} has no module"
    offenders = [f"{module_path(n)} imports {module_path(m)} (layer {layer_of(m)})"
                 for n in members(layer) for m in sorted(INTERNAL[n])
                 if layer_of(m) not in allowed]
    assert not offenders, f"layer {layer} may import {sorted(allowed)}: {offenders}"


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_only_a_layer_with_frameworks_imports_an_optional_framework(layer):
    allowed = set(LAYERS[layer].frameworks)
    offenders = [f"{module_path(n)} imports {f}" for n in members(layer)
                 for f in sorted(frameworks_of(IMPORTS[n]) - allowed)]
    assert not offenders, offenders


def reached(name: str) -> set[str]:
    """The package's modules that importing ``name`` imports (transitively)."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        for dep in INTERNAL[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


@pytest.mark.parametrize("layer", sorted(n for n, layer in LAYERS.items() if not layer.frameworks
                                         and n != "aliases"))
def test_a_layer_without_frameworks_reaches_none_through_its_imports(layer):
    # (The aliases are the public paths of integrations: loss_scaling.nnx imports flax.nnx.)
    offenders = [f"{module_path(n)} -> {module_path(m)} imports {sorted(frameworks_of(IMPORTS[m]))}"
                 for n in members(layer) for m in sorted(reached(n))
                 if frameworks_of(IMPORTS[m])]
    assert not offenders, offenders


def test_the_core_imports_no_integration_and_no_optional_framework():
    # The page's layers, read from the other side: what the core layers reach.
    def frameworks(name: str) -> tuple[str, ...]:
        layer = LAYERS.get(layer_of(name) or "")
        return layer.frameworks if layer else ()

    core = [n for n in MODULES if not frameworks(n)
            and layer_of(n) not in ("root", "aliases", "demo", "debug")]
    # (the integrations' map, `integrations/__init__.py`: the core never imports them)
    assert "loss_scaling.core.numerics" in core  # the rule reads the real tree
    offenders = [f"{n} imports {m}" for n in core for m in INTERNAL[n]
                 if frameworks(m) or layer_of(m) in ("aliases", "debug")]
    offenders += [f"{n} imports {f}" for n in core for f in frameworks_of(IMPORTS[n])]
    assert not offenders, offenders


@pytest.mark.parametrize("name", members("aliases") if "aliases" in LAYERS else [])
def test_an_alias_is_a_thin_re_export(name):
    """The aliases (`nnx.py`, `equinox.py`, `orbax.py`: the public paths of integrations):
    a docstring, imports from their layer's ``may import`` and ``__all__``, nothing else."""
    body = [n for n in MODULES[name].body if not (isinstance(n, ast.Expr)
                                                  and isinstance(n.value, ast.Constant))]
    imported = sorted(a.asname or a.name for n in body if isinstance(n, ast.ImportFrom)
                      for a in n.names)
    rest = [n for n in body if not isinstance(n, ast.ImportFrom)]
    assert len(rest) == 1 and ast.unparse(rest[0]).startswith("__all__ ="), (
        f"{module_path(name)} holds more than re-exports: {[ast.unparse(n)[:60] for n in rest]}")
    assert sorted(ast.literal_eval(rest[0].value)) == imported


def test_import_and_a_pure_optax_lookup_import_no_optional_framework():
    """``_registry.py``: the hooks import an integration only when its framework is."""
    code = ("import sys, jax.numpy as jnp, optax, loss_scaling as ls\n"
            "s = ls.with_loss_scaling(optax.sgd(1.0)).init(jnp.zeros(2))\n"
            "ls.get_loss_scale(s); ls.check(s); ls.metrics(s)\n"
            "grads = ls.value_and_grad(lambda p: p.sum())(s, jnp.ones(2))\n"
            "print([m for m in ('flax.nnx', 'equinox', 'orbax.checkpoint') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=PACKAGE.parent)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


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
    assert sum(map(len, INTERNAL.values())) > 50  # the rule reads the real imports
    # The package root imports everything and is imported by nothing but its users.
    graph = {n: {m for m in deps if m != "loss_scaling"} for n, deps in INTERNAL.items()}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


# --------------------------------------------------------- the page's other claims


def test_every_module_path_the_page_names_exists():
    text = PAGE.read_text()
    named = {p for p in re.findall(r"`([\w/]+\.py)`", text)}
    stale = sorted(p for p in named if p not in BY_PATH and not (TESTS / p).is_file()
                   and not (ROOT / p).is_file())
    assert not stale, f"the page names modules that do not exist: {stale}"


def test_a_name_the_page_places_in_a_module_is_defined_there():
    # "`decide` (`wrapper/step.py`)", "`ls.scale` (`core/tree.py`)"
    text = PAGE.read_text()
    pairs = re.findall(r"`([A-Za-z_][\w.]*)` \(`([\w/]+\.py)`", text)
    assert len(pairs) >= 5  # the rule reads the page's step
    wrong = [f"{n} in {p}" for n, p in pairs
             if p in BY_PATH and n.rpartition(".")[2] not in defined_names(BY_PATH[p], True)]
    assert not wrong, f"the page places names in modules that do not define them: {wrong}"


@pytest.mark.skipif(shutil.which("duplicates") is None, reason="the duplicates command is "
                    "not installed here")
def test_duplicates_finds_no_pair_inside_the_package():
    out = subprocess.run(["duplicates", "--repo", str(PACKAGE), "--seconds", "60"],
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith("no duplicates"), out


@pytest.mark.parametrize("package", ["core/__init__.py", "wrapper/__init__.py"])
def test_a_sub_package_map_names_exactly_its_modules(package):
    """The docstring of ``core/__init__.py`` / ``wrapper/__init__.py`` lists its modules in
    parentheses: a module moved or merged changes it (it named a removed one before)."""
    folder = PACKAGE / package.split("/")[0]
    named = set(re.findall(r"\((\w+)\)", ast.get_docstring(ast.parse(
        (PACKAGE / package).read_text())) or ""))
    assert named == {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}


def test_the_state_and_option_tables_list_exactly_the_fields():
    from loss_scaling.wrapper.state import LossScalingState, WrapperOptions

    section = page_section("The state and the options")
    tables = [[line.split("|")[1].strip().strip("`") for line in block.splitlines()[2:]]
              for block in section.split("\n\n") if block.startswith("| ")]
    assert tables == [list(LossScalingState._fields), list(WrapperOptions._fields)]
    # Derived, not stored: a property of the state (the page says so).
    assert "last_step_applied" not in LossScalingState._fields
    assert isinstance(LossScalingState.last_step_applied, property)
