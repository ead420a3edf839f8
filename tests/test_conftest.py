"""tests/conftest.py: the names its marker lists give exist, and the compilation cache it
shares between the processes of a run is shared.

Every name the lists mark by must exist: a test renamed or moved to another file must not
silently leave the slow subset's list, the numerics list (and with it the AVX2 pass of
.ci/run) or the order of the longest units. The lists name files, folders, classes, test
functions and fixtures; each is looked up in the source (``ast``), nothing is collected."""

from __future__ import annotations

import ast
import functools
import json
import os
import pathlib
import subprocess
import sys

import conftest
import jax
import jax.numpy as jnp
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

PATH_LISTS = {"SLOW_MODULES": conftest.SLOW_MODULES,
              "NUMERICS_MODULES": conftest.NUMERICS_MODULES}
NODE_LISTS = {"SLOW_TESTS": conftest.SLOW_TESTS, "NUMERICS_TESTS": conftest.NUMERICS_TESTS}


@functools.cache
def defined(path: str) -> frozenset[str]:
    """The test functions and classes of a test file: ``name`` and ``Class::name``."""
    names = set()
    for node in ast.parse((ROOT / path).read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
            names.update(f"{node.name}::{item.name}" for item in node.body
                         if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)))
    return frozenset(names)


def is_fixture(node: ast.AST) -> bool:
    """A function decorated with ``pytest.fixture`` (called or not)."""
    return isinstance(node, ast.FunctionDef) and any(
        ast.unparse(d.func if isinstance(d, ast.Call) else d) == "pytest.fixture"
        for d in node.decorator_list)


def missing_nodes(nodes: tuple[str, ...]) -> list[str]:
    out = []
    for node in nodes:
        path, _, name = node.partition("::")
        if not (ROOT / path).is_file() or name not in defined(path):
            out.append(node)
    return out


@pytest.mark.parametrize("name", list(PATH_LISTS))
def test_every_listed_file_or_folder_exists(name):
    paths = PATH_LISTS[name]
    assert [p for p in paths if not (ROOT / p).exists()] == []
    assert len(set(paths)) == len(paths), f"{name} lists a path twice"
    # a folder ends in "/", a file in ".py": `startswith` matches nothing else
    assert all(p.endswith(("/", ".py")) for p in paths), paths


@pytest.mark.parametrize("name", list(NODE_LISTS))
def test_every_listed_test_exists(name):
    nodes = NODE_LISTS[name]
    missing = missing_nodes(nodes)
    assert missing == [], f"{name} names tests that do not exist: {missing}"
    assert len(set(nodes)) == len(nodes), f"{name} lists a test twice"


def test_every_unit_of_the_longest_first_order_exists():
    units = conftest.LONGEST_FIRST
    assert [u for u in units if not (ROOT / u.partition("::")[0]).exists()] == []
    assert missing_nodes(tuple(u for u in units if "::" in u)) == []
    assert len(set(units)) == len(units)


def test_every_listed_fixture_exists():
    fixtures = {node.name for path in ROOT.glob("tests/**/*.py")
                for node in ast.walk(ast.parse(path.read_text())) if is_fixture(node)}
    assert set(conftest.SLOW_FIXTURES) - fixtures == set()


def test_a_renamed_test_is_reported(tmp_path, monkeypatch):
    """The check itself: a node whose function is gone, or whose file is, is missing."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        "def test_kept():\n    pass\n\nclass TestY:\n    def test_z(self):\n        pass\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    defined.cache_clear()
    try:
        assert missing_nodes(("tests/test_x.py::test_kept", "tests/test_x.py::TestY",
                              "tests/test_x.py::TestY::test_z")) == []
        assert missing_nodes(("tests/test_x.py::test_renamed", "tests/test_gone.py::test_kept",
                              "tests/test_x.py::TestY::test_gone")) == [
            "tests/test_x.py::test_renamed", "tests/test_gone.py::test_kept",
            "tests/test_x.py::TestY::test_gone"]
    finally:
        defined.cache_clear()


# ---------------------------------------------------------------- the compilation cache

# Two programs no other test compiles (by name and shape): the test compiles the first, the
# process it starts both, counting jax's persistent-cache events at each.
PROGRAMS = """
def compiled_by_the_test(x):
    return (x * 7.25 + 3.5).sum()

def compiled_by_the_subprocess_only(x):
    return (x * 2.75 - 1.5).sum()
"""
COUNT_HITS = PROGRAMS + """
import json, jax, jax.numpy as jnp
from jax._src import monitoring
events = []
monitoring.register_event_listener(lambda event, **_: events.append(event))
x = jnp.ones(37)
counted = []
for program in (compiled_by_the_test, compiled_by_the_subprocess_only):
    del events[:]
    jax.jit(program)(x)
    counted.append(sum(event.endswith("/cache_hits") for event in events))
print(json.dumps(counted))
"""


@pytest.mark.skipif(os.environ.get("LS_TEST_COMPILATION_CACHE") == "0", reason="turned off")
def test_a_process_the_tests_start_reads_what_they_compiled_and_writes_nothing():
    folder = pathlib.Path(os.environ[conftest.CACHE_FOLDER])
    assert jax.config.jax_compilation_cache_dir == str(folder)
    namespace: dict = {}
    exec(PROGRAMS, namespace)
    jax.jit(namespace["compiled_by_the_test"])(jnp.ones(37))  # written to the folder
    out = subprocess.run([sys.executable, "-c", COUNT_HITS], capture_output=True, text=True,
                         check=True)
    first, second = json.loads(out.stdout.splitlines()[-1])
    assert first >= 1 and second == 0, out.stdout + out.stderr  # a hit, then a miss...
    names = [p.name for p in folder.iterdir()]
    assert any(n.startswith("jit_compiled_by_the_test-") for n in names)
    assert not any(n.startswith("jit_compiled_by_the_subprocess_only-") for n in names)
    assert not [n for n in names if n.startswith(".")]  # ...not written; none half-written
