"""The package type-checks and lints clean: part of the one test command CI runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_tool(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_mypy_is_clean_on_the_package():
    result = run_tool("mypy", "loss_scaling")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_is_clean():
    result = run_tool("ruff", "check", "loss_scaling", "tests", "benchmarks")
    assert result.returncode == 0, result.stdout + result.stderr
