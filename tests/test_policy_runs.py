"""benchmarks/policy_runs.py, the run table of docs/policy_runs.md, on a shortened run.

The demo model under the four policies, 150 steps with ``growth_interval=10`` (so that the
interval rule reaches float16's limit and overflows by growing within the run), two
injected overflow spikes and one NaN loss: replay drops no batch but the NaN one, and the
headroom rule skips fewer steps than the interval rule at the same underflow fraction; from
``init_scale=1`` (a scale that has to climb) at a far lower one. The full tables (both
models, 300 steps) are the benchmark's; this checks that their claims hold on a run short
enough for the suite.
"""

from __future__ import annotations

import dataclasses
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
CONFIG = pr.Config(steps=150, growth_interval=10, spike_steps=(60, 110), nan_steps=(90,))
# At the scales the demo runs at (2**15 and up) its gradients have a handful of exact zeros
# at most, whatever the rule: "the same underflow" is equal to within 1e-5 of the entries
# (under 0.1 of the demo's 7,587 per step).
SAME_UNDERFLOW = 1e-5


def _rows(config, policies=pr.POLICIES):
    return {row["policy"]: row
            for row in pr.table_rows(pr.run_all(["demo"], policies, config))}


@pytest.fixture(scope="module")
def rows():
    return _rows(CONFIG)


def test_replay_drops_only_the_batch_whose_loss_is_nan(rows):
    for policy in ("interval+replay", "headroom+replay"):
        row = rows[policy]
        assert row["dropped_steps"] == list(CONFIG.nan_steps), row
        assert row["dropped_with_finite_loss"] == 0
        assert row["replays"] >= row["overflowed_steps"], row
    # The interval rule overflows (on the spikes and by growing) and replays; the headroom
    # rule, a margin of 2**4 below the limit, absorbs spikes of 2**3 and needs no replay.
    assert rows["interval+replay"]["replays"] > 0


def test_without_replay_every_overflow_and_the_nan_loss_drop_a_batch(rows):
    for policy in ("interval", "headroom"):
        row = rows[policy]
        assert row["batches_dropped"] == row["overflowed_steps"] + len(CONFIG.nan_steps)
        assert row["replays"] == 0


def test_the_headroom_rule_skips_fewer_steps_at_the_same_underflow(rows):
    for suffix in ("", "+replay"):
        interval, headroom = rows["interval" + suffix], rows["headroom" + suffix]
        assert headroom["overflowed_steps"] < interval["overflowed_steps"], (interval, headroom)
        assert headroom["mean_zero_fraction"] <= (interval["mean_zero_fraction"]
                                                  + SAME_UNDERFLOW)
    assert rows["headroom"]["batches_dropped"] < rows["interval"]["batches_dropped"]
    assert rows["headroom"]["growth_overflows"] == 0 < rows["interval"]["growth_overflows"]


def test_from_scale_1_the_headroom_rule_underflows_far_less(rows):
    """The same compiled steps (only the initial scale differs): the interval rule climbs
    one power of two per 10 steps, the headroom rule jumps once its window is full."""
    climb = _rows(dataclasses.replace(CONFIG, init_scale=1.0), pr.POLICIES[:2])
    interval, headroom = climb["interval"], climb["headroom"]
    assert headroom["mean_zero_fraction"] < interval["mean_zero_fraction"] / 2, climb
    assert headroom["final_loss"] < interval["final_loss"]


def test_the_table_and_the_json(rows, tmp_path, capsys):
    table = pr.markdown_table(list(rows.values()))
    assert table.count("\n") == 1 + len(rows) and "| demo | headroom+replay |" in table
    out = tmp_path / "runs.json"
    # CONFIG's flags: the step compiled for the fixture serves main too
    assert pr.main(["--models", "demo", "--policies", "interval", "--steps", "150",
                    "--growth-interval", "10", "--spike-steps", "60", "110",
                    "--nan-steps", "90", "--json", str(out)]) == 0
    assert "| demo | interval |" in capsys.readouterr().out
    record = json.loads(out.read_text())
    assert record["config"] == json.loads(json.dumps(dataclasses.asdict(CONFIG)))
    assert record["runs"] == [rows["interval"] | {"seconds": record["runs"][0]["seconds"]}]
    assert np.isfinite(record["runs"][0]["final_loss"])
