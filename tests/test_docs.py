"""The README and the docs site: every code block runs, and the site builds with -W.

The code-block convention (README.md and every docs/*.md page; parsing in doc_blocks.py):

* A fenced block whose info string is exactly ``python`` is a complete program: it runs here
  on its own, in a fresh namespace (``__name__ == "__main__"``) and a scratch working
  directory, with warnings as errors (pytest's ``filterwarnings = error``). Keep such blocks
  small: a few steps of a tiny model.
* Other blocks are shown, never run: ```` ```bash ```` (commands), ```` ```text ```` (output),
  and ```` ```{code-block} python ```` (another library's code, on docs/migrating.md).
* An HTML comment on the line right above a fence gives options, comma separated; GitHub and
  Sphinx hide it:

  - ``<!-- block: name=NAME -->``: other tests find the block with ``doc_blocks.named(page,
    NAME)`` and assert on the namespace it leaves (one run per session, shared with the runner);
  - ``<!-- block: devices=8 -->``: the block needs 8 devices; the blocks so marked run in one
    subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``;
  - ``<!-- block: tested-by=PATH -->``: the block needs something a single process cannot give
    (several processes with ``jax.distributed``); the test file PATH runs it and must name the
    page;
  - ``<!-- block: wide=REASON -->``: a ```` ```text ```` block of verbatim program output
    whose lines may be wider than the others' limit.

* Every line of every block is at most 88 characters: the rendered site cuts longer ones off
  (wrap code; put a long trailing comment on the line above).

The site build is ``sphinx-build -W --keep-going -b html docs OUT``: a broken page, a missing
link target, a docstring that does not parse or a page outside the toctree fails it.
"""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
from pathlib import Path

import doc_blocks
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import loss_scaling as ls

ROOT = doc_blocks.ROOT
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ALL_BLOCKS = doc_blocks.python_blocks()
LOCAL_BLOCKS = [b for b in ALL_BLOCKS if not b.option("devices") and not b.option("tested-by")]
DEVICE_BLOCKS = [b for b in ALL_BLOCKS if b.option("devices")]
TESTED_ELSEWHERE = [b for b in ALL_BLOCKS if b.option("tested-by")]
README = (ROOT / "README.md").read_text()


# ------------------------------------------------------------------------ the code blocks


@pytest.mark.parametrize("block", LOCAL_BLOCKS, ids=lambda b: b.id)
def test_python_block_runs(block):
    namespace = doc_blocks.namespace(block)
    assert namespace["__name__"] == "__main__"


@pytest.fixture(scope="module")
def device_results():
    by_devices: dict[int, list[doc_blocks.Block]] = {}
    for block in DEVICE_BLOCKS:
        by_devices.setdefault(int(block.option("devices")), []).append(block)
    results = {}
    for devices, selected in by_devices.items():
        results.update(doc_blocks.run_in_subprocess(selected, devices))
    return results


@pytest.mark.parametrize("block", DEVICE_BLOCKS, ids=lambda b: b.id)
def test_python_block_runs_on_virtual_devices(block, device_results):
    assert device_results[block.id] is None, f"{block.id} raised:\n{device_results[block.id]}"


def test_python_blocks_tested_elsewhere_name_their_page():
    for block in TESTED_ELSEWHERE:  # none may be run by nobody
        test_file = ROOT / block.option("tested-by")
        assert test_file.is_file(), f"{block.id}: tested-by={test_file} does not exist"
        assert Path(block.page).name in test_file.read_text(), (
            f"{test_file} must run the blocks of {block.page} (it does not name the page)")


def test_every_python_fence_is_a_block_that_runs():
    # An indented fence (inside a list item) would be missed by the runner: forbid it.
    for page in doc_blocks.pages():
        fences = [line for line in (ROOT / page).read_text().splitlines()
                  if line.strip() == "```python"]
        assert len(fences) == len(doc_blocks.python_blocks(page)), (
            f"{page}: a ```python fence that does not start at the left margin")


CODE_WIDTH = 88  # characters: what the rendered site shows without cutting a line off


def test_every_code_block_line_fits_the_rendered_width():
    too_long = []
    for page in doc_blocks.pages():
        for block in doc_blocks.blocks(page):
            if block.option("wide"):
                assert block.info == "text", f"{block.id}: only text output may be wide"
                continue
            too_long += [f"{block.id} (+{number}): {len(line)} characters: {line[:40]}..."
                         for number, line in enumerate(block.code.splitlines(), 1)
                         if len(line) > CODE_WIDTH]
    assert not too_long, "wrap these code lines to at most 88 characters:\n" + "\n".join(
        too_long)


def test_the_pages_have_blocks_and_names_are_unique():
    # (docs/distributed.md's 8-device blocks: tests/distributed/ runs them, on every path)
    assert len(LOCAL_BLOCKS) >= 20 and len(TESTED_ELSEWHERE) >= 3
    for page in doc_blocks.pages():
        names = [b.option("name") for b in doc_blocks.python_blocks(page) if b.option("name")]
        assert len(names) == len(set(names)), f"{page}: duplicate block names {names}"


def test_markers_are_checked():
    with pytest.raises(ValueError, match="bad block marker option 'colour=red'"):
        doc_blocks._parse_marker("<!-- block: colour=red -->", "x.md:1")
    assert doc_blocks._parse_marker("<!-- block: name=a, devices=8 -->", "x.md:1") == (
        ("name", "a"), ("devices", "8"))
    assert doc_blocks._parse_marker("<!-- section: why -->", "x.md:1") == ()


# ------------------------------------------------------------------------------ README


def test_readme_is_a_front_page():
    lines = README.splitlines()
    # a front page: the install, why, the quick starts (hand-cast nnx and linen with what
    # they print and why a step is skipped, autocast)
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move detail into docs/"
    # The two set-up commands come first, and the second is exactly what CI runs (CI then
    # reruns the numerics tests under AVX2: the line after it).
    first = doc_blocks.blocks("README.md")[0]
    assert first.info == "bash" and first.line < 15
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1].startswith("XLA_FLAGS=--xla_cpu_max_isa=AVX2 ") and "-m numerics" in ci[-1]
    commands = re.sub(r" \\\n\s*", " ", first.code)  # lines continued with a backslash
    assert ci[-2] in commands
    assert ('python3 -m venv .venv && .venv/bin/pip install -q -e ".[demo]" && '
            ".venv/bin/python -m loss_scaling.demo") in commands
    for needed in ('-m "not slow"', "docs/demo.png", "ls.check(", "ls.TrainState",
                   "ls.nnx.Optimizer", "pip install", "pip wheel", "sphinx"):
        assert needed in README, needed


def test_readme_quickstart_nnx_trains_and_skips_exactly():
    ns = doc_blocks.namespace(doc_blocks.named("README.md", "quickstart_nnx"))
    model, optimizer, train_step, x, y = (ns[k] for k in ("model", "optimizer", "train_step",
                                                            "x", "y"))
    assert isinstance(optimizer, ls.nnx.Optimizer)  # the fused path
    assert int(ns["metrics"]["skipped_steps"]) <= 2 and float(ns["loss"]) < 1.0
    _assert_a_nan_batch_is_skipped(
        lambda x: train_step(model, optimizer, x, y)[1], x,
        lambda: (nnx.state(model, nnx.Param), optimizer.opt_state.inner_state), optimizer)


def test_readme_quickstart_linen_trains_and_skips_exactly():
    ns = doc_blocks.namespace(doc_blocks.named("README.md", "quickstart_linen"))
    holder = {"state": ns["state"]}

    def step(x):
        holder["state"], _, metrics = ns["train_step"](holder["state"], x, ns["y"])
        return metrics

    assert isinstance(ns["state"], ls.TrainState) and int(ns["state"].step) == 20
    _assert_a_nan_batch_is_skipped(
        step, ns["x"],
        lambda: (holder["state"].params, holder["state"].opt_state.inner_state), holder)


_PRINTED = re.compile(r"step (\d+): loss ([\d.]+), scale ([\d.]+), skipped (\d+)")


def _printed(block):
    """The lines a block prints, run afresh: ``(step, loss, scale, skipped)`` each."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        doc_blocks.execute(block)
    return [_parsed(m) for m in _PRINTED.finditer(out.getvalue())]


def _parsed(match):
    step, loss, scale, skipped = match.groups()
    return int(step), float(loss), float(scale), int(skipped)


def _assert_prints_what_the_page_shows(shown, printed):
    """The same steps, scales and skips; the losses within the CPU-to-CPU spread."""
    assert len(shown) == len(printed) >= 2, (shown, printed)
    for (step, loss, scale, skipped), (s, lo, sc, sk) in zip(shown, printed, strict=True):
        assert (step, scale, skipped) == (s, sc, sk)
        assert abs(loss - lo) <= 0.01 * loss, (loss, lo)


def test_getting_started_loop_prints_what_the_page_shows():
    (output,) = [b for b in doc_blocks.blocks("docs/getting_started.md")
                 if b.option("name") == "loop_output"]
    shown = [_parsed(m) for m in _PRINTED.finditer(output.code)]
    printed = _printed(doc_blocks.named("docs/getting_started.md", "loop"))
    _assert_prints_what_the_page_shows(shown, printed)
    assert printed[0][2] == 2.0**13 and printed[0][3] == 2  # the two skips the page explains


def test_readme_nnx_quickstart_prints_what_the_readme_shows():
    text = re.sub(r"\s+", " ", README)
    shown = [_parsed(m) for m in _PRINTED.finditer(text[text.index("It prints `step 9"):])][:2]
    printed = _printed(doc_blocks.named("README.md", "quickstart_nnx"))
    _assert_prints_what_the_page_shows(shown, printed)
    assert printed[0][2] == 2.0**14 and printed[0][3] == 1  # the one skip it explains


def test_readme_quickstart_autocast_computes_in_float16_and_skips_exactly():
    ns = doc_blocks.namespace(doc_blocks.named("README.md", "quickstart_autocast"))
    model, optimizer, train_step, x, y = (ns[k] for k in ("model", "optimizer", "train_step",
                                                            "x", "y"))
    assert isinstance(optimizer, ls.nnx.Optimizer)  # the fused path
    assert ls.autocast_report(lambda m: m(x), model).half_flops_fraction() == 1.0
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert float(ns["loss"]) < 1.0

    def step(x):
        train_step(model, optimizer, x, y)
        return ls.metrics(optimizer)

    _assert_a_nan_batch_is_skipped(
        step, x, lambda: (nnx.state(model, nnx.Param), optimizer.opt_state.inner_state),
        optimizer)


def _assert_a_nan_batch_is_skipped(step, x, snapshot, state_holder):
    scale = float(step(x)["loss_scale"])  # a clean step first
    before = bits(snapshot())
    metrics = step(x.at[0, 0].set(jnp.nan))  # a NaN batch: skipped, scale halved
    assert not bool(metrics["last_step_applied"])
    assert float(metrics["loss_scale"]) == scale / 2
    assert before == bits(snapshot())  # params and optimizer state bit-identical
    assert not bool(metrics["failed"])  # one skip is not a failure: ls.check passes
    state = state_holder["state"] if isinstance(state_holder, dict) else state_holder
    assert ls.check(state) is None


def bits(tree):
    return [np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(tree)]


def test_readme_links_resolve():
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [t for t in targets if "://" not in t]
    assert local, "the README links into the docs"
    for target in local:
        assert (ROOT / target).exists(), f"README.md links to a missing {target}"


# -------------------------------------------------------------------------- the site


def test_api_page_covers_every_public_name():
    text = (ROOT / "docs" / "api.md").read_text()
    documented = set(re.findall(r"^\.\. auto(?:function|class|exception|data):: (\w+)",
                                text, re.M))
    summarized = set(re.findall(r"^   (\w+)$", text, re.M))
    assert documented == set(ls.__all__)
    assert summarized == set(ls.__all__)


def test_every_page_is_in_the_toctree():
    toctrees = [b.code for b in doc_blocks.blocks("docs/index.md") if b.info == "{toctree}"]
    entries = {line.strip() for code in toctrees for line in code.splitlines()
               if line.strip() and not line.startswith(":")}
    included = "".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    for page in (ROOT / "docs").glob("*.md"):
        if page.stem.startswith("_"):  # a part of a page: some page must include it
            assert f"```{{include}} {page.name}" in included, f"docs/{page.name} is unused"
        elif page.stem != "index":
            assert page.stem in entries, f"docs/{page.name} is not in index.md's toctree"
    for notebook in (ROOT / "notebooks").glob("*.ipynb"):
        assert f"notebooks/{notebook.stem}" in entries, notebook.name


def test_site_builds_with_warnings_as_errors(tmp_path):
    out = tmp_path / "html"
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         "-d", str(tmp_path / "doctrees"), "docs", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"sphinx-build failed:\n{proc.stdout[-4000:]}\n" \
                                 f"{proc.stderr[-8000:]}"
    for page in (ROOT / "docs").glob("[!_]*.md"):
        assert (out / f"{page.stem}.html").is_file(), page.name
    for notebook in (ROOT / "notebooks").glob("*.ipynb"):
        html = (out / "notebooks" / f"{notebook.stem}.html").read_text()
        assert "<img" in html, f"{notebook.name}: rendered without its committed outputs"
    api = (out / "api.html").read_text()
    assert "PEP 604" not in api and "Any of the three loss-scale states (a type alias)" in api
    for name in ls.__all__:
        assert f'id="loss_scaling.{name}"' in api, name
    for name in ("nnx.Optimizer", "nnx.value_and_grad", "equinox.apply_gradients"):
        assert f'id="loss_scaling.{name}"' in api, name  # the integrations, imported lazily
    # Nothing written into the source tree by a build (no generated stubs, no caches).
    untracked = subprocess.run(["git", "status", "--porcelain", "--", "docs"], cwd=ROOT,
                               capture_output=True, text=True, check=False).stdout
    assert "_autosummary" not in untracked and "jupyter_execute" not in untracked


# What the pages promise about installing, the demo's output and the nnx Orbax recipe.

def test_no_page_installs_from_a_placeholder_or_made_up_url():
    """the install lines name a checkout or a wheel built from one."""
    for page in PAGES:
        text = page.read_text()
        assert "OWNER" not in text, page.name
        assert "git+https://" not in text, page.name
    for page in ("README.md", "docs/getting_started.md"):
        install = doc_blocks.blocks(page)[0 if page.startswith("docs") else 1].code
        assert "pip install /path/to/loss_scaling" in install, page
        assert "pip wheel --no-deps -w dist /path/to/loss_scaling" in install, page
        assert "pip install dist/loss_scaling-0.1.0-py3-none-any.whl" in install, page
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(),
                        re.MULTILINE)
    assert version and version.group(1) == "0.1.0"   # the wheel's name in the docs


def test_the_demo_output_is_not_claimed_verbatim_across_cpus():
    """the printed table is one run's; the page gives the range across CPUs."""
    text = (ROOT / "docs" / "getting_started.md").read_text()
    output = next(b for b in doc_blocks.blocks("docs/getting_started.md")
                  if b.info == "text" and "fp16+ls" in b.code)
    assert "verbatim" not in output.option("wide")
    assert "differ from CPU to CPU" in text and "--xla_cpu_max_isa=AVX2" in text


def test_one_nnx_orbax_recipe_on_both_pages():
    """docs/nnx.md and docs/checkpoints.md save and restore an nnx model the
    same way, with the helpers; the hand-written route is explained, not a second
    recipe."""
    for page in ("nnx.md", "checkpoints.md"):
        code = doc_blocks.named(page, "nnx_orbax").code
        assert "ls.orbax_save_args(" in code and "ls.orbax_restore(" in code, page
        assert '{"model": nnx.state(model), "optimizer": nnx.state(optimizer)}' in code
        assert "JsonSave" not in code and "restore_loss_scale" not in code, page
    assert "recommended recipe" in (ROOT / "docs" / "checkpoints.md").read_text()
