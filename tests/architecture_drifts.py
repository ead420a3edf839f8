"""Checks that the map's test can fail: applies one drift at a time to a scratch copy of
the checkout and runs tests/test_architecture.py there (issue 41).

Usage: python tests/architecture_drifts.py [CHECKOUT]   (default: this checkout)
Each drift must turn the test red; the unmodified copy must be green. Not a test itself
(about 20 runs of the map's test): run it after changing the map or its test, and when a
drift no longer applies to the code, replace it with the nearest one that does.
"""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

SOURCE = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parents[1])
PYTHON = sys.executable


def replace(path: str, old: str, new: str, count: int = 1):
    def apply(root: pathlib.Path) -> None:
        f = root / path
        text = f.read_text()
        assert text.count(old) >= 1, f"{path}: {old!r} not found"
        f.write_text(text.replace(old, new, count))
    return apply


def move_backoff_now(root: pathlib.Path) -> None:
    """`backoff_now` moved out of core/update.py, into wrapper/replay.py (its one user)."""
    update = root / "loss_scaling/core/update.py"
    text = update.read_text()
    match = re.search(r"\ndef backoff_now\(.*?(?=\n\n\ndef )", text, re.S)
    assert match
    update.write_text(text.replace(match.group(0), ""))
    replay = root / "loss_scaling/wrapper/replay.py"
    r = replay.read_text().replace("from loss_scaling.core.update import backoff_now\n",
                                   "from loss_scaling.core.update import _run\n")
    replay.write_text(r + "\n" + match.group(0).lstrip("\n") + "\n")


DRIFTS = {
    # The four of the issue.
    "backoff_now moved out of core/update.py": move_backoff_now,
    "function-level import of loss_scaling.wrapper in core/update.py": replace(
        "loss_scaling/core/update.py",
        '    on_failure = resolve_on_failure(on_failure)\n    require_scaler("state", state)',
        '    on_failure = resolve_on_failure(on_failure)\n'
        '    import loss_scaling.wrapper  # drift\n'
        '    require_scaler("state", state)'),
    "import flax.struct at the top of core/numerics.py": replace(
        "loss_scaling/core/numerics.py", "import jax\n",
        "import flax.struct  # drift\nimport jax\n"),
    "replay removed from guarded_step": replace(
        "loss_scaling/wrapper/transform.py",
        "    if replay.enabled(options, state):  # the batch recomputed while it overflows\n"
        "        decision, scaler, extra_args = replay.replay(options, state, params, extra_args,\n"
        "                                                     decision, decide)\n"
        "        state, grads = state._replace(scaler=scaler), decision.grads\n", ""),
    # More of my own.
    "autocast/README.md's table loses the measure.py row": replace(
        "loss_scaling/autocast/README.md", "| `measure.py` |", "| `measure_gone.py` |"),
    "debug/README.md's row names a function the module does not define": replace(
        "loss_scaling/debug/README.md", "(`largest_finite_scale`)", "(`largest_safe_scale`)"),
    "tests column: wrapper/replay.py tested by test_tree.py": replace(
        "docs/architecture.md", "no_growth_after` | `test_replay.py` |",
        "no_growth_after` | `test_tree.py` |"),
    "tests column: demo.py 'tested' by test_docs.py, which only names loss_scaling.demo":
        replace("docs/architecture.md", "`save_figure`) | `test_demo.py` |",
                "`save_figure`) | `test_docs.py` |"),
    "tests column: core/__init__.py 'tested' by test_skipping.py (the old row: a mention)":
        replace("docs/architecture.md", "| `core/__init__.py` | the core's map (its modules, no "
                "names of its own) | `test_architecture.py` |", "| `core/__init__.py` | the "
                "core's map (its modules, no names of its own) | `test_skipping.py` |"),
    "importlib.import_module('loss_scaling.demo') inside a core function": replace(
        "loss_scaling/core/tree.py", '    require_scaler("state", state)\n    return scale_loss',
        '    require_scaler("state", state)\n    import importlib\n'
        '    importlib.import_module("loss_scaling.demo")  # drift\n    return scale_loss'),
    "sys.modules['equinox'] looked up inside wrapper/state.py": replace(
        "loss_scaling/wrapper/state.py", "def differentiated(params: Any) -> Any:\n",
        "def differentiated(params: Any) -> Any:\n    import sys\n"
        "    sys.modules.get('equinox')  # drift\n"),
    "an import the test cannot resolve: importlib.import_module(name) of an argument": replace(
        "loss_scaling/lookup.py", "def unwrap_frameworks(x: Any) -> Any:\n",
        "def unwrap_frameworks(x: Any, name: str = 'os') -> Any:\n    import importlib\n"
        "    importlib.import_module(name)  # drift\n"),
    "_resolve_skip called after replay in guarded_step": replace(
        "loss_scaling/wrapper/transform.py",
        "    mode = _resolve_skip(options.skip, fused)\n", "", 1),
    "a block of six lines copied into another module": lambda root: (
        root / "loss_scaling/report.py").write_text(
        (root / "loss_scaling/report.py").read_text() + "\n\n" + re.search(
            r"def _as_finite_flag\(.*?(?=\n\n\n)", (root / "loss_scaling/core/update.py")
            .read_text(), re.S).group(0).replace("_as_finite_flag", "_flag_again") + "\n"),
    "decide's docstring-less list: decide documented without updating UNDOCUMENTED": replace(
        "loss_scaling/wrapper/transform.py",
        "           extra_args: dict) -> StepDecision:\n",
        "           extra_args: dict) -> StepDecision:\n    \"\"\"The decision.\"\"\"\n"),
}


def copy_tree() -> pathlib.Path:
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="map-drift-"))
    shutil.copytree(SOURCE, scratch / "repo", ignore=shutil.ignore_patterns(
        ".git", "__pycache__", ".venv", "*.pyc", ".mypy_cache", ".ruff_cache", "_build"))
    return scratch / "repo"


def run(root: pathlib.Path) -> tuple[int, list[str]]:
    out = subprocess.run([PYTHON, "-m", "pytest", "-n", "0", "-q", "-p", "no:randomly",
                          "tests/test_architecture.py"], cwd=root, capture_output=True,
                         text=True)
    failed = [line.split("::", 1)[1].split(" - ")[0] for line in out.stdout.splitlines()
              if line.startswith("FAILED ")]
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-500:]
    return out.returncode, failed or [summary]


# Since the code landed: decide has a docstring now, so that drift is its inverse; and two
# drifts of what the re-sync changed.
del DRIFTS["decide's docstring-less list: decide documented without updating UNDOCUMENTED"]
DRIFTS["a step function's docstring removed (decide), UNDOCUMENTED left empty"] = replace(
    "loss_scaling/wrapper/transform.py",
    '    """The step\'s one read, before anything is applied:', '    """', 1)
def _undoc(root):
    t = root / "loss_scaling/wrapper/transform.py"
    s = t.read_text()
    start = s.index('           extra_args: dict) -> StepDecision:\n    """') + len(
        '           extra_args: dict) -> StepDecision:\n')
    end = s.index('"""', s.index('"""', start) + 3) + 3
    t.write_text(s[:start] + s[end + 1:])
DRIFTS["a step function's docstring removed (decide), UNDOCUMENTED left empty"] = _undoc
DRIFTS["debug/_trace.py imports flax.nnx itself (its frameworks column is empty now)"] = replace(
    "loss_scaling/debug/_trace.py", "import jax\n", "import flax.nnx  # drift\nimport jax\n")
DRIFTS["the root's rename import computed from the table again"] = replace(
    "loss_scaling/__init__.py",
    "            import optax  # so that the import is one a reader (and test_architecture)"
    " sees\n\n"
    "            return getattr(optax, renamed.new.removeprefix(\"optax.\"))\n",
    "            module, attribute = renamed.new.rsplit(\".\", 1)\n"
    "            return getattr(importlib.import_module(module), attribute)\n")
DRIFTS["records_max moved back out of core/headroom.py's row into core/update.py's"] = replace(
    "docs/architecture.md", "`resolve_on_failure`, `scaler_failure_message` |",
    "`resolve_on_failure`, `scaler_failure_message`, `records_max` |")


def main() -> int:
    bad = skipped = 0
    root = copy_tree()
    code, _ = run(root)
    print(f"unmodified copy: {'green' if code == 0 else 'RED'} (exit {code})")
    bad += code != 0
    shutil.rmtree(root.parent)
    for name, drift in DRIFTS.items():
        root = copy_tree()
        try:
            drift(root)
        except AssertionError as cannot:
            print(f"\n{name}: n/a here ({cannot})")
            skipped += 1
            shutil.rmtree(root.parent)
            continue
        if name.startswith("_resolve_skip"):
            t = root / "loss_scaling/wrapper/transform.py"
            text = t.read_text()
            anchor = "    step = functools.partial(_inner_step"
            t.write_text(text.replace(anchor, "    mode = _resolve_skip(options.skip, fused)\n"
                                      + anchor, 1))
        code, failed = run(root)
        verdict = "RED (caught)" if code != 0 else "GREEN: NOT CAUGHT"
        bad += code == 0
        print(f"\n{name}: {verdict}")
        for line in failed:
            print(f"    {line}")
        shutil.rmtree(root.parent)
    caught = len(DRIFTS) - skipped - bad
    print(f"\n{len(DRIFTS)} drifts: {caught} caught, {bad} not caught or a red baseline, "
          f"{skipped} not applicable to this tree")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
