"""docs/autocast.md says what the code does: its rules table is the one rules.py generates,
its printed report is what ``ls.autocast_report`` prints, and its examples (run by
tests/test_docs.py) leave what the page claims."""

from __future__ import annotations

import re

import doc_blocks
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import loss_scaling as ls
from loss_scaling.autocast import rules

PAGE = doc_blocks.ROOT / "docs" / "autocast.md"
BEGIN, END = "<!-- autocast-rules:begin -->\n", "<!-- autocast-rules:end -->"


def test_the_rules_table_is_the_generated_one():
    text = PAGE.read_text()
    table = text[text.index(BEGIN) + len(BEGIN):text.index(END)]
    assert table == rules.table_markdown() + "\n", (
        "docs/autocast.md's rules table is not rules.table_markdown(): paste its output "
        f"between the {BEGIN.strip()} and {END} markers")


def test_the_table_names_every_rule_and_every_tabled_primitive():
    table = rules.table_markdown()
    for rule in ls.AutocastRule:
        assert f"| {rule.value} |" in table, rule
    for name in rules.RULES:
        assert f"`{name}`" in table, name


def _fence_lines_normalized(text: str) -> str:
    # a block's source is "autocast.md:FENCE:LINE"; FENCE moves when the page above changes
    return re.sub(r"autocast\.md:\d+:", "autocast.md:N:", text)


def test_the_printed_report_is_what_the_report_block_prints():
    namespace = doc_blocks.namespace(doc_blocks.named("autocast.md", "report"))
    printed = _fence_lines_normalized(str(namespace["report"])).splitlines()
    shown = next(b for b in doc_blocks.blocks("docs/autocast.md")
                 if b.option("name") == "report_output")
    assert shown.info == "text"
    for line in _fence_lines_normalized(shown.code).splitlines():
        assert line.rstrip() in printed, f"docs/autocast.md shows a line not printed: {line!r}"


def test_the_plain_example_trains_in_float16_with_float32_params():
    namespace = doc_blocks.namespace(doc_blocks.named("autocast.md", "plain"))
    params, x, y = namespace["params"], namespace["x"], namespace["y"]
    report = ls.autocast_report(namespace["half_loss"], params, x, y)
    assert report.half_flops_fraction() == 1.0
    assert float(namespace["loss"]) < 0.5  # it learned
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))


def test_the_nnx_example_moves_the_batch_statistics_as_without_autocast():
    namespace = doc_blocks.namespace(doc_blocks.named("autocast.md", "nnx"))
    x = namespace["x"]
    plain, cast = (namespace["MLP"](nnx.Rngs(0)) for _ in range(2))
    plain(x)
    ls.autocast(lambda model: model(x))(cast)
    np.testing.assert_allclose(plain.norm.mean[...], cast.norm.mean[...], rtol=1e-2,
                               atol=1e-3)
    assert float(jnp.abs(cast.norm.mean[...]).sum()) > 0
    counts = [jax.tree.leaves(nnx.state(m, nnx.RngCount)) for m in (plain, cast)]
    assert counts[0] and [int(c) for c in counts[0]] == [int(c) for c in counts[1]]


def test_the_bfloat16_example_needs_no_loss_scale():
    namespace = doc_blocks.namespace(doc_blocks.named("autocast.md", "bfloat16"))
    assert isinstance(ls.get_loss_scale(namespace["opt_state"]), ls.NoOpLossScale)
    report = ls.autocast_report(ls.autocast(namespace["loss_fn"], dtype=jnp.bfloat16),
                                namespace["params"], namespace["x"], namespace["y"])
    assert report.half_flops_fraction() == 1.0 and str(report.dtype) == "bfloat16"


def test_the_page_quotes_the_benchmark_and_its_command():
    text = PAGE.read_text()
    assert "benchmarks/autocast_cost.py" in text
    assert "benchmarks/results/cpu_autocast_cost.txt" in text
    assert (doc_blocks.ROOT / "benchmarks" / "results" / "cpu_autocast_cost.txt").is_file()


def test_the_api_page_names_every_rule():
    text = (doc_blocks.ROOT / "docs" / "api.md").read_text()
    for rule in ls.AutocastRule:
        assert f"`{rule.name}`" in text, rule


def test_the_forward_overflow_section_prints_what_the_page_shows():
    block = doc_blocks.named("autocast.md", "forward_overflow")
    namespace = doc_blocks.namespace(block)
    printed = doc_blocks.printed(block)
    shown = next(b for b in doc_blocks.blocks("docs/autocast.md")
                 if b.option("name") == "forward_overflow_output")
    assert shown.code.strip().splitlines() == printed
    # the report flagged the planted matmul, and only it
    (row,) = namespace["report"].overflows
    assert (row.path, row.rule) == ("LM/block_0/down", ls.AutocastRule.HALF)
