"""What ``import loss_scaling`` imports: no optional framework and not the debugging tools,
each brought in only by the first use of the name that needs it.

A test process has imported everything already, so the checks read a fresh interpreter:
one program, started once for the whole file, that imports the package and then uses the
lazy names one at a time, writing down after each step which of the watched modules are
imported. Each test reads the steps it is about.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# The watched modules, and the program's steps in the order it runs them.
WATCHED = ("orbax", "flax.nnx", "equinox", "loss_scaling.debug")
PROGRAM = f"""
import json, sys
imported = lambda: [m for m in {WATCHED!r} if m in sys.modules]
steps = {{}}
import loss_scaling as ls
steps["import loss_scaling"] = imported()
ls.find_overflow
steps["ls.find_overflow"] = imported()
ls.nnx.Optimizer
steps["ls.nnx.Optimizer"] = imported()
print(json.dumps(steps))
"""


@pytest.fixture(scope="module")
def imported() -> dict[str, list[str]]:
    """The watched modules imported after each step of :data:`PROGRAM`."""
    out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_loss_scaling_does_not_import_orbax(imported):
    assert "orbax" not in imported["import loss_scaling"]


def test_import_loss_scaling_imports_neither_nnx_nor_equinox(imported):
    for step in ("import loss_scaling", "ls.find_overflow"):
        assert "flax.nnx" not in imported[step] and "equinox" not in imported[step], step
    assert "flax.nnx" in imported["ls.nnx.Optimizer"]


def test_import_loss_scaling_does_not_import_the_debugging_tools(imported):
    assert "loss_scaling.debug" not in imported["import loss_scaling"]
    assert "loss_scaling.debug" in imported["ls.find_overflow"]
    assert "equinox" not in imported["ls.find_overflow"]
    assert "flax.nnx" not in imported["ls.find_overflow"]
