"""benchmarks/policy_runs.py, the run table of docs/policy_runs.md, on a shortened run.

The demo model under the four policies, 150 steps, with two injected gradient spikes and
one NaN loss: replay drops no batch but the NaN one, and the headroom rule skips fewer
steps than the interval rule at an equal or lower underflow fraction. The full table (both
models, 300 steps) is the benchmark's; this checks that its claims hold on a run short
enough for the suite.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import numpy as np
import pytest

BENCHMARK = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "policy_runs.py"


def _load_benchmark():
    spec = importlib.util.spec_from_file_location("policy_runs", BENCHMARK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("policy_runs", module)
    spec.loader.exec_module(module)
    return module


pr = _load_benchmark()
CONFIG = pr.Config(steps=150, spike_steps=(50, 120), nan_steps=(100,))


@pytest.fixture(scope="module")
def rows():
    return {row["policy"]: row for row in pr.table_rows(pr.run_all(["demo"], pr.POLICIES,
                                                                    CONFIG))}


def test_replay_drops_only_the_batch_whose_loss_is_nan(rows):
    for policy in ("interval+replay", "headroom+replay"):
        row = rows[policy]
        assert row["dropped_steps"] == list(CONFIG.nan_steps), row
        assert row["dropped_with_finite_loss"] == 0
        assert row["replays"] >= row["overflowed_steps"] > 0, row


def test_without_replay_every_overflow_and_the_nan_loss_drop_a_batch(rows):
    for policy in ("interval", "headroom"):
        row = rows[policy]
        assert row["batches_dropped"] == row["overflowed_steps"] + len(CONFIG.nan_steps)
        assert row["replays"] == 0


def test_the_headroom_rule_skips_fewer_steps_at_no_more_underflow(rows):
    for suffix in ("", "+replay"):
        interval, headroom = rows["interval" + suffix], rows["headroom" + suffix]
        assert headroom["overflowed_steps"] < interval["overflowed_steps"], (interval, headroom)
        assert headroom["mean_zero_fraction"] <= interval["mean_zero_fraction"]
    assert rows["headroom"]["batches_dropped"] < rows["interval"]["batches_dropped"]
    assert rows["headroom"]["growth_overflows"] == 0


def test_the_table_and_the_json(rows, tmp_path, capsys):
    table = pr.markdown_table(list(rows.values()))
    assert table.count("\n") == 1 + len(rows) and "| demo | headroom+replay |" in table
    out = tmp_path / "runs.json"
    assert pr.main(["--models", "demo", "--policies", "interval", "--steps", "3",
                    "--spike-steps", "1", "--nan-steps", "--json", str(out)]) == 0
    assert "| demo | interval |" in capsys.readouterr().out
    record = json.loads(out.read_text())
    assert record["config"]["steps"] == 3 and len(record["runs"]) == 1
    assert np.isfinite(record["runs"][0]["final_loss"])
