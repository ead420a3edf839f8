"""The package's structure rules (docs/architecture.md), read from the source with ast.

No import cycle inside loss_scaling/; the core never imports an integration or an
optional framework at import time; no module over 400 lines; no function body over 50.
"""

from __future__ import annotations

import ast
import pathlib
import shutil
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "loss_scaling"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 50
# Modules that are not the core: the integrations (each imports its framework), their
# thin public aliases, the package root, the debugging tools and the demo.
# loss_scaling.checkpoint.orbax is the Orbax integration (imported on first use).
NOT_CORE = ("loss_scaling", "loss_scaling.nnx", "loss_scaling.equinox", "loss_scaling.orbax",
            "loss_scaling.checkpoint.orbax", "loss_scaling.demo")
NOT_CORE_PACKAGES = ("loss_scaling.integrations.", "loss_scaling.debug.")
OPTIONAL_FRAMEWORKS = ("flax.nnx", "equinox", "orbax")


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, ast.Module]:
    return {module_name(p): ast.parse(p.read_text(), str(p)) for p in PACKAGE.rglob("*.py")}


def import_time_imports(name: str, tree: ast.Module) -> set[str]:
    """Modules imported when ``name`` is imported: top-level statements only (an import
    inside a function runs on first use), ``if TYPE_CHECKING`` blocks aside."""
    found: set[str] = set()
    package = name if tree is MODULES.get(name) and is_package(name) else name.rpartition(".")[0]
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue  # annotations only: never imported at run time
        for sub in ast.walk(node) if not isinstance(node, (ast.FunctionDef, ast.ClassDef,
                                                           ast.AsyncFunctionDef)) else []:
            if isinstance(sub, ast.Import):
                found.update(a.name for a in sub.names)
            elif isinstance(sub, ast.ImportFrom):
                base = sub.module or ""
                if sub.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - sub.level + 1]
                                    + ([base] if base else []))
                submodules = {f"{base}.{a.name}" for a in sub.names} & set(MODULES)
                # `from package import module` needs the module, not the package's names.
                found.update(submodules or {base})
        if isinstance(node, ast.ClassDef):  # a class body runs at import time
            found |= import_time_imports(name, ast.Module(body=node.body, type_ignores=[]))
    return found


def is_package(name: str) -> bool:
    return (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()


MODULES = modules()


def internal_graph() -> dict[str, set[str]]:
    return {name: {m for m in import_time_imports(name, tree) if m in MODULES and m != name}
            for name, tree in MODULES.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` (depth-first), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if dep == "loss_scaling":
                continue
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
    graph = internal_graph()
    assert sum(map(len, graph.values())) > 50  # the rule reads the real imports
    # The package root imports everything and is imported by nothing but its users.
    graph = {n: {m for m in deps if n != "loss_scaling"} for n, deps in graph.items()}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def core_modules() -> list[str]:
    return [n for n in MODULES if n not in NOT_CORE and not n.startswith(NOT_CORE_PACKAGES)
            and n not in ("loss_scaling.integrations", "loss_scaling.debug")]


def test_the_core_imports_no_integration_and_no_optional_framework():
    assert "loss_scaling.core.numerics" in core_modules()  # the rule reads the real tree
    offenders = []
    for name in core_modules():
        for imported in import_time_imports(name, MODULES[name]):
            if imported.startswith(("loss_scaling.integrations", "loss_scaling.debug")) or \
                    imported in ("loss_scaling.nnx", "loss_scaling.equinox", "loss_scaling.orbax") \
                    or any(imported == f or imported.startswith(f + ".")
                           for f in OPTIONAL_FRAMEWORKS):
                offenders.append(f"{name} imports {imported}")
    assert not offenders, offenders


def test_import_and_a_pure_optax_lookup_import_no_optional_framework():
    code = ("import sys, jax.numpy as jnp, optax, loss_scaling as ls\n"
            "s = ls.with_loss_scaling(optax.sgd(1.0)).init(jnp.zeros(2))\n"
            "ls.get_loss_scale(s); ls.check(s); ls.metrics(s)\n"
            "grads = ls.value_and_grad(lambda p: p.sum())(s, jnp.ones(2))\n"
            "print([m for m in ('flax.nnx', 'equinox', 'orbax.checkpoint') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=PACKAGE.parent)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_no_module_is_over_400_lines():
    long = {name: len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")
            if (name := module_name(path))}
    assert {n: c for n, c in long.items() if c > MAX_MODULE_LINES} == {}


def function_lengths() -> dict[str, int]:
    lengths = {}
    for name, tree in MODULES.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body
                if (body and isinstance(body[0], ast.Expr)
                        and isinstance(body[0].value, ast.Constant)
                        and isinstance(body[0].value.value, str)):
                    body = body[1:]  # the docstring does not count
                if body:
                    lengths[f"{name}.{node.name}:{node.lineno}"] = (
                        body[-1].end_lineno - body[0].lineno + 1)
    return lengths


def test_no_function_body_is_over_50_lines():
    lengths = function_lengths()
    assert len(lengths) > 100  # the rule reads the real tree
    assert {f: n for f, n in lengths.items() if n > MAX_FUNCTION_LINES} == {}


@pytest.mark.skipif(shutil.which("duplicates") is None, reason="the duplicates command is "
                    "not installed here")
def test_duplicates_finds_no_pair_inside_the_package():
    out = subprocess.run(["duplicates", "--repo", str(PACKAGE), "--seconds", "60"],
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith("no duplicates"), out
