"""The code blocks of README.md and docs/*.md: found, named and run.

``tests/test_docs.py`` runs every block; other tests look a block up by name
(``named("diagnostics.md", "guard")``) and assert on what it left in its namespace. The
convention (also written at the top of ``tests/test_docs.py``):

* Every fenced block whose info string is exactly ``python`` is a complete program. It runs on
  its own, in a fresh namespace (``__name__ == "__main__"``), in a scratch working directory.
* Nothing else runs: ```` ```bash ````, ```` ```text ```` and MyST directives such as
  ```` ```{code-block} python ```` (the other libraries' code on the migration page) are shown
  only.
* An HTML comment on the line right above the fence gives options, comma separated:
  ``<!-- block: name=guard -->`` (a name other tests use), ``<!-- block: devices=8 -->`` (run
  in a subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``, set before jax is
  imported), ``<!-- block: tested-by=tests/multihost/test_multihost.py -->`` (needs several
  processes: that test file runs it and must name this page), ``<!-- block: wide=REASON -->``
  (a ```` ```text ```` block of verbatim program output allowed lines over 88 characters,
  the width the rendered site shows). GitHub and Sphinx both hide the comment.

Run by hand (this is what the devices=8 subprocess does)::

    python tests/doc_blocks.py --devices 8 docs/distributed.md:42 ...

Importing this module imports nothing heavy (no jax).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import json
import linecache
import os
import re
import subprocess
import sys
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = ("name", "devices", "tested-by", "wide")
_FENCE = re.compile(r"^(`{3,})(.*)$")
_MARKER = re.compile(r"^<!--\s*block:(.*?)-->\s*$")


def pages() -> list[str]:
    """README.md and every docs/*.md page, as paths relative to the repository root."""
    return ["README.md", *sorted(p.relative_to(ROOT).as_posix()
                                 for p in (ROOT / "docs").glob("*.md"))]


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced code block: where it is, what it says, and its marker's options."""

    page: str  # relative to the repository root
    line: int  # 1-based line of the opening fence
    info: str  # the fence's info string ("python", "bash", "{code-block} python", ...)
    code: str
    options: tuple[tuple[str, str], ...] = ()

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    def option(self, key: str, default: str | None = None) -> str | None:
        return dict(self.options).get(key, default)

    @property
    def runs(self) -> bool:
        return self.info == "python"


def _parse_marker(line: str, where: str) -> tuple[tuple[str, str], ...]:
    match = _MARKER.match(line.strip())
    if match is None:
        return ()
    options = []
    for item in filter(None, (part.strip() for part in match.group(1).split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in OPTIONS or not value:
            raise ValueError(f"{where}: bad block marker option {item!r}; use key=value with "
                             f"a key in {OPTIONS}")
        options.append((key, value))
    return tuple(options)


@functools.cache
def blocks(page: str) -> tuple[Block, ...]:
    """Every fenced block of ``page`` that starts at the left margin (nested ones too)."""
    lines = (ROOT / page).read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        fence, info = match.group(1), match.group(2).strip()
        end = next((j for j in range(i + 1, len(lines))
                    if lines[j].startswith(fence) and not lines[j].strip("`")), None)
        if end is None:
            raise ValueError(f"{page}:{i + 1}: the block is never closed")
        options = _parse_marker(lines[i - 1], f"{page}:{i}") if i else ()
        code = "\n".join(lines[i + 1:end]) + "\n"
        out.append(Block(page, i + 1, info, code, options))
        i = end + 1
    return tuple(out)


def python_blocks(page: str | None = None) -> list[Block]:
    """The blocks that run: of one page, or of README.md and every docs page."""
    return [b for p in ([page] if page else pages()) for b in blocks(p) if b.runs]


def named(page: str, name: str) -> Block:
    """The one python block of ``page`` (``"README.md"`` or ``"diagnostics.md"`` under docs/)
    whose marker says ``name=NAME``."""
    path = page if page == "README.md" or page.startswith("docs/") else f"docs/{page}"
    found = [b for b in python_blocks(path) if b.option("name") == name]
    if len(found) != 1:
        raise LookupError(f"{path}: {len(found)} python blocks named {name!r} (need one: "
                          f"put `<!-- block: name={name} -->` right above its fence)")
    return found[0]


@contextlib.contextmanager
def _scratch_cwd():
    previous = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="doc_block_") as scratch:
        os.chdir(scratch)
        try:
            yield Path(scratch)
        finally:
            os.chdir(previous)


def execute(block: Block, module_name: str = "__main__",
            cwd: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Runs ``block`` in a fresh namespace, in ``cwd`` (default: a scratch directory, removed
    afterwards); returns the namespace. ``module_name`` other than ``"__main__"`` runs it as
    an imported module would (an ``if __name__ == "__main__":`` part does not run)."""
    namespace: dict[str, Any] = {"__name__": module_name}
    # Tracebacks then show the block's lines, named PAGE:LINE.
    linecache.cache[block.id] = (len(block.code), None, block.code.splitlines(True), block.id)
    code = compile(block.code, block.id, "exec")
    if cwd is not None:
        previous = os.getcwd()
        os.chdir(cwd)
        try:
            exec(code, namespace)
        finally:
            os.chdir(previous)
    else:
        with _scratch_cwd():
            exec(code, namespace)
    return namespace


class _Tee(io.TextIOBase):
    """Passes what is written on to ``through`` and keeps a copy."""

    def __init__(self, through: Any) -> None:
        self.through, self.kept = through, io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return self.through.write(text)


@functools.cache
def namespace(block: Block) -> dict[str, Any]:
    """``execute(block)``, once per test session: the runner and the tests that assert on a
    block's results share one run (a test that goes on training with it changes it). What the
    block printed is ``printed(block)``, whichever test ran it first."""
    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        result = execute(block)
    _PRINTED[block] = tee.kept.getvalue()
    return result


_PRINTED: dict[Block, str] = {}


def printed(block: Block) -> list[str]:
    """The lines ``namespace(block)`` printed when it ran the block."""
    namespace(block)
    return _PRINTED[block].splitlines()


def run_in_subprocess(selected: list[Block], devices: int, timeout: float = 600) -> dict:
    """Runs each block in one fresh process with ``devices`` virtual CPU devices.

    Returns ``{block.id: None or the traceback}``; a crash of the process is a RuntimeError
    with its output.
    """
    flags = f"{os.environ.get('XLA_FLAGS', '')} " \
            f"--xla_force_host_platform_device_count={devices}".strip()
    env = {**os.environ, "XLA_FLAGS": flags}
    with tempfile.TemporaryDirectory(prefix="doc_blocks_") as scratch:
        out = Path(scratch) / "results.json"
        proc = subprocess.run(
            [sys.executable, __file__, "--devices", str(devices), "--out", str(out),
             *(b.id for b in selected)],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"the block runner process failed (exit {proc.returncode}):\n"
                               f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
        return json.loads(out.read_text())


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("ids", nargs="+", help="PAGE:LINE of each python block to run")
    args = parser.parse_args(argv)
    import jax  # after XLA_FLAGS is set by the caller

    if jax.device_count() != args.devices:
        print(f"need {args.devices} devices, got {jax.devices()}", file=sys.stderr)
        return 2
    by_id = {b.id: b for b in python_blocks()}
    results: dict[str, str | None] = {}
    for block_id in args.ids:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # as pytest's filterwarnings = error
                execute(by_id[block_id])
            results[block_id] = None
        except Exception:  # noqa: BLE001 - reported to the test, which fails on it
            results[block_id] = traceback.format_exc()
    args.out.write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # the checkout's loss_scaling, as under pytest
    sys.exit(_main())
