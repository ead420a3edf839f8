"""Every device makes the same skip decision: sharded jit, shard_map and pmap on 8 devices.

The 8 virtual CPU devices need ``XLA_FLAGS`` set before jax is imported, so the scenarios
run in one subprocess (``distributed_worker.py``) that hands back plain values and numpy
arrays; the assertions are here. Each distributed run reads *every device's own copy* of
what should be replicated, so a replica that drifted cannot hide behind the type system.

Paths (see the worker for each one's setup):

* ``jit``: sharded jit, data parallel, params and state replicated, no ``axis_name``.
* ``jit_tp``: sharded jit on a 2x4 ("data", "model") mesh, hidden layer, moments sharded,
  a NaN in one model shard of a gradient.
* ``shard_map``: data parallel, vma-checked, a NaN in one device's gradient contribution
  (its local loss).
* ``shard_map_tp``: 2x4 mesh, vma-checked, tensor parallel, a NaN in one device's shard;
  ``axis_name=("data", "model")``.
* ``shard_map_unchecked``: ``check_vma=False``, a NaN in one device's gradients *after*
  the pmean: only the wrapper's reduction keeps the replicas together.
* ``pmap``: data parallel, a NaN in one device's gradients after the pmean.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from distributed_worker import (
    BAD_DEVICE,
    BATCH_INF_STEPS,
    BATCH_NAN_STEPS,
    FAIL_CLOSED_RUNS,
    GRAD_NAN_STEPS,
    N_DEVICES,
    N_STEPS,
    RUNS,
    XLA_FLAGS,
)

WORKER = Path(__file__).with_name("distributed_worker.py")
SKIPPED = sorted({*BATCH_INF_STEPS, *BATCH_NAN_STEPS, *GRAD_NAN_STEPS})
# init_scale 1024, growth every 2nd clean step, halved on each skipped step (2, 5, 6, 9).
EXPECTED_SCALES = [1024, 2048, 1024, 1024, 2048, 1024, 512, 512, 1024, 512, 512, 1024]
RUN_IDS = ["/".join(r) for r in RUNS]
METRICS = ("loss_scale", "growth_tracker", "skipped_steps", "consecutive_skips",
           "last_step_applied")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("distributed") / "results.pkl"
    # The worker imports this checkout's loss_scaling (not another one an editable install
    # points at).
    path = os.pathsep.join([str(WORKER.parents[2]), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {XLA_FLAGS}".strip(),
           "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, str(WORKER), "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"the worker failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n"
                    f"{proc.stderr[-12000:]}")
    return pickle.loads(out.read_bytes())


def scenario(results: dict[str, Any], name: str) -> Any:
    result = results[name]
    assert result["error"] is None, f"scenario {name} raised:\n{result['error']}"
    assert result["warnings"] == [], result["warnings"]
    return result["value"]


def run_result(results: dict[str, Any], name: str, run_id: str) -> dict[str, Any]:
    run = scenario(results, name)[run_id]
    assert "exception" not in run, f"{run_id} raised:\n{run['exception']}"
    return run


def bits(tree: Any) -> list[bytes]:
    return [np.ascontiguousarray(x).tobytes() for x in _leaves(tree)]


def _leaves(tree: Any) -> list[np.ndarray]:
    if isinstance(tree, dict):
        return [leaf for key in sorted(tree) for leaf in _leaves(tree[key])]
    if isinstance(tree, list):
        return [leaf for item in tree for leaf in _leaves(item)]
    return [np.asarray(tree)]


# ------------------------------------------------------------------------- all_finite


def test_all_finite_under_jit_with_shardings_is_global_without_axis_name(results):
    value = scenario(results, "all_finite")
    for kind in ("explicit", "auto"):
        assert value[f"jit_{kind}/clean"].tolist() == [True] * N_DEVICES
        # An inf / a NaN in device 5's shard: every device's copy of the answer is False.
        assert value[f"jit_{kind}/inf"].tolist() == [False] * N_DEVICES
        assert value[f"jit_{kind}/nan"].tolist() == [False] * N_DEVICES


@pytest.mark.parametrize("path", ["shard_map", "pmap"])
def test_all_finite_with_axis_name_and_reduces_over_devices(results, path):
    value = scenario(results, "all_finite")
    assert value[f"{path}_data/clean"].tolist() == [True] * N_DEVICES
    assert value[f"{path}_data/inf"].tolist() == [False] * N_DEVICES
    assert value[f"{path}_data/nan"].tolist() == [False] * N_DEVICES
    # Without axis_name each device only knows its own shard.
    local = [i != BAD_DEVICE for i in range(N_DEVICES)]
    assert value[f"{path}_None/inf"].tolist() == local
    assert value[f"{path}_None/nan"].tolist() == local


def test_all_finite_over_a_tuple_of_axes(results):
    value = scenario(results, "all_finite")
    # inf on device (data=0, model=2) of a 2x4 mesh.
    assert value["shard_map_2d_both"].tolist() == [[False] * 4] * 2
    assert value["shard_map_2d_list"].tolist() == [[False] * 4] * 2
    # Over "data" alone only the inf's model column hears of it.
    assert value["shard_map_2d_data"].tolist() == [[True, True, False, True]] * 2


@pytest.mark.parametrize("size", [3, 100_000])
@pytest.mark.parametrize("path", ["shard_map", "pmap"])
def test_grads_max_over_devices_reads_a_nan_as_inf_on_every_device(results, path, size):
    """Issue 42, item 1: one device's NaN made every device report 3.0 (a max over
    replicas drops NaN); the step reads it as inf (``numerics.agree``), so does
    ``ls.grads_max``."""
    value = scenario(results, "grads_max")
    assert value[f"{path}/{size}/clean"].tolist() == [3.0] * N_DEVICES
    assert value[f"{path}/{size}/inf"].tolist() == [np.inf] * N_DEVICES
    assert value[f"{path}/{size}/nan"].tolist() == [np.inf] * N_DEVICES


def test_one_scalar_collective(results):
    assert scenario(results, "all_finite")["collectives"] == ["pmin"]
    for combination, names in scenario(results, "step_collectives").items():
        # The wrapper's whole step (no user pmean): one scalar pmin on a healthy step (the
        # CPU screen, `finite_leaves` in `wrapper/screen.py`); the exact per-leaf test and
        # its pmin run under a conditional, only when the screen fails.
        assert [n for n in names if not n.startswith("cond/")] == ["pmin"], combination
        assert set(names) <= {"pmin", "cond/pmin"}, combination


# ----------------------------------------------------- multi-step runs on every path


def reference(results: dict[str, Any]) -> dict[str, Any]:
    return run_result(results, "multi_step", "reference")


def test_reference_run_is_as_scripted(results):
    ref = reference(results)
    assert [float(s["metrics"]["loss_scale"][0]) for s in ref["steps"]] == EXPECTED_SCALES
    finite = [bool(s["metrics"]["last_step_applied"][0]) for s in ref["steps"]]
    assert finite == [i not in SKIPPED for i in range(N_STEPS)]
    assert ref["traces"] == 1


@pytest.mark.parametrize("run_id", RUN_IDS)
def test_every_device_skips_together(results, run_id):
    run = run_result(results, "multi_step", run_id)
    assert run["error"] is None
    assert len(run["steps"]) == N_STEPS
    for i, step in enumerate(run["steps"]):
        # Params and the whole optimizer state: one byte pattern per shard on all devices.
        assert step["distinct"] == 1, f"replicas differ after step {i}"
        for name in METRICS:
            copies = step["metrics"][name]
            assert len(copies) == N_DEVICES
            assert (copies == copies[0]).all(), (i, name, copies)
            # ls.metrics inside the step agrees with ls.metrics on the returned state.
            np.testing.assert_array_equal(step["inside"][name], copies, err_msg=name)
        assert bool(step["metrics"]["last_step_applied"][0]) == (i not in SKIPPED), i
        if i in SKIPPED:  # bit-identical to before the skipped step
            previous = run["steps"][i - 1]
            assert bits(step["params"]) == bits(previous["params"]), i
            assert bits(step["inner"]) == bits(previous["inner"]), i


@pytest.mark.parametrize("run_id", RUN_IDS)
def test_matches_the_single_device_run(results, run_id):
    run = run_result(results, "multi_step", run_id)
    ref = reference(results)
    for i, (step, expected) in enumerate(zip(run["steps"], ref["steps"], strict=True)):
        for name in METRICS:  # exactly: the scale, its trackers and the counters
            np.testing.assert_array_equal(step["metrics"][name],
                                          np.repeat(expected["metrics"][name], N_DEVICES),
                                          err_msg=f"{name} after step {i}")
        # The global norm of the unscaled gradients (data-parallel: replicated; tensor
        # parallel: the shards' squares summed), to float tolerance; inf/NaN where skipped.
        np.testing.assert_allclose(step["metrics"]["grad_norm"],
                                   np.repeat(expected["metrics"]["grad_norm"], N_DEVICES),
                                   rtol=1e-5, err_msg=f"grad_norm after step {i}")
        for key in expected["params"]:  # to float tolerance: the sums are reordered
            np.testing.assert_allclose(step["params"][key], expected["params"][key],
                                       rtol=1e-5, atol=1e-6, err_msg=f"{key} after step {i}")
        for got, want in zip(step["inner"], expected["inner"], strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("run_id", RUN_IDS)
def test_compiles_once_and_donates(results, run_id):
    run = run_result(results, "multi_step", run_id)
    assert run["traces"] == 1
    assert run["cache_size"] in (1, None)  # pmap has no cache to ask
    # Every donated buffer is consumed, except the inputs `grad_norm` (float32) and
    # `last_step_replays` (int32), which the step only writes (jit prunes unused arguments,
    # so their buffers stay alive).
    assert all(kept in ([], ["float32"], ["float32", "int32"]) for kept in run["kept"]), run["kept"]
    # tx.init hands out fresh buffers: it still works after donated steps.
    assert run["reinit_scale"] == 1024.0


@pytest.mark.parametrize("path", ["jit", "shard_map", "shard_map_unchecked"])
def test_replicated_state_stays_replicated(results, path):
    run = run_result(results, "multi_step", f"{path}/fused/cond")
    assert set(run["placement"].values()) <= {"P()", "P(None,)", "P(None, None)"}


@pytest.mark.parametrize("path", ["jit_tp", "shard_map_tp"])
def test_sharded_state_keeps_its_partition_specs(results, path):
    placement = run_result(results, "multi_step", f"{path}/fused/cond")["placement"]
    sharded = {"['w1']": "P(None, 'model')", "['b1']": "P('model',)",
               "['w2']": "P('model', None)", "['b2']": "P(None,)"}
    for key, spec in placement.items():
        if key.startswith("[0]"):  # params
            assert spec == sharded[key[3:]], key
        elif ".mu[" in key or ".nu[" in key:  # moments follow their params
            assert spec == sharded[key[key.rindex("["):]], key
        elif key.endswith(".nonfinite_grads"):  # the per-leaf flags: a replicated vector
            assert spec in ("P()", "P(None,)"), key
        elif key.endswith("nonfinite_grads"):  # the per-leaf flags: a replicated vector
            assert spec == "P(None,)", key
        else:  # the scaler, adam's count, the wrapper's counters: replicated scalars
            assert spec == "P()", key


# ------------------------------------------------------------------------- controls


@pytest.mark.parametrize("control", ["pmap/no_axis", "shard_map_unchecked/no_axis"])
def test_without_the_reduction_replicas_drift_apart(results, control):
    """The tests above would see a drift: without axis_name device 5 skips alone."""
    run = scenario(results, "controls")[control]
    first_bad = GRAD_NAN_STEPS[0]
    assert all(s["distinct"] == 1 for s in run["steps"][:first_bad])
    bad = run["steps"][first_bad]
    assert bad["distinct"] > 1
    finite = bad["metrics"]["last_step_applied"]
    assert finite.tolist() == [i != BAD_DEVICE for i in range(N_DEVICES)]
    assert len(set(bad["metrics"]["loss_scale"].tolist())) == 2


def test_shard_map_vma_refuses_a_missing_axis(results):
    """With axis_name="data" only, the scaler would vary over "model": a trace-time error."""
    message = scenario(results, "controls")["shard_map_tp/data_only"]
    assert message is not None
    assert "out_specs" in message and "scaler" in message and "model" in message


# ---------------------------------------------------------------------- fail closed


@pytest.mark.parametrize("run_id", ["/".join(r) for r in FAIL_CLOSED_RUNS])
def test_fail_closed_is_recorded_on_every_path_and_loses_nothing(results, run_id):
    run = run_result(results, "fail_closed", run_id)
    # 2**-124 -> 2**-125 -> 2**-126 (the smallest normal) -> the third backoff fails: no
    # raise inside the donated step; every device records it and skips from then on.
    assert run["error"] is None, "the default step must not raise inside jit"
    assert len(run["steps"]) == 6
    scales = [float(s["metrics"]["loss_scale"][0]) for s in run["steps"]]
    assert scales == [2.0**-125] + [2.0**-126] * 5      # frozen at the last valid value
    for i, step in enumerate(run["steps"]):
        assert step["distinct"] == 1, i                  # every replica agrees, bit for bit
        assert step["metrics"]["failed"].tolist() == [i >= 2] * N_DEVICES, i
        assert bits(step["params"]) == bits(run["steps"][0]["params"]), i
    assert run["steps"][-1]["metrics"]["skipped_steps"].tolist() == [6] * N_DEVICES
    assert run["check"] is not None and run["check"].startswith("loss scale backoff failed")
    assert run["checkpoint"]["values"]["failure"] == 1


@pytest.mark.parametrize("path", ["jit_tp", "shard_map_tp", "pmap"])
def test_on_failure_raise_raises_at_once_on_every_path(results, path):
    run = run_result(results, "fail_closed", f"{path}/on_failure_raise")
    assert run["error"] is not None and "loss scale backoff failed" in run["error"]
    assert run["failed_at"] == 2
    assert all(s["distinct"] == 1 for s in run["steps"])


def test_min_scale_clamps_instead(results):
    run = run_result(results, "fail_closed", "min_scale")
    assert run["error"] is None
    scales = [float(s["metrics"]["loss_scale"][0]) for s in run["steps"]]
    assert scales == [2.0**-125] + [2.0**-126] * 5
    assert run["steps"][-1]["metrics"]["skipped_steps"].tolist() == [6] * N_DEVICES


# ------------------------------------------------------------- docs/distributed.md


def test_docs_blocks_run_on_every_path(results):
    value = scenario(results, "readme")
    assert value["count"] == 3  # sharded jit, shard_map, pmap
    for i in range(value["count"]):
        snippet = value[i]
        assert snippet["params_distinct"] == 1 and snippet["opt_state_distinct"] == 1, i
        metrics = snippet["metrics"]
        assert metrics["skipped_steps"].tolist() == [1] * N_DEVICES, i
        assert metrics["loss_scale"].tolist() == [2.0**14] * N_DEVICES, i
        assert snippet["cache_size"] in (1, None), i


# ----------------------------------------------------------------------------- replay


@pytest.mark.parametrize("path", ["jit", "shard_map", "pmap"])
def test_replay_takes_the_same_decision_on_every_device(results, path):
    """One device's rows overflow: every replica replays twice, applies the batch, and
    equals the single-device step at the backed-off scale; without replay all skip."""
    value = scenario(results, "replay")
    replayed, skipped = value[f"{path}/4"], value[f"{path}/0"]
    final_scale = 512.0 if path != "pmap" else 64.0
    assert replayed["distinct"] == 1 and skipped["distinct"] == 1
    assert replayed["metrics"]["replays"].tolist() == [2] * N_DEVICES
    assert replayed["metrics"]["skipped_steps"].tolist() == [0] * N_DEVICES
    assert replayed["metrics"]["loss_scale"].tolist() == [final_scale] * N_DEVICES
    assert bits(replayed["params"]) == bits(value["reference"])
    assert skipped["metrics"]["skipped_steps"].tolist() == [1] * N_DEVICES
    assert skipped["metrics"]["replays"].tolist() == [0] * N_DEVICES


# --------------------------------------------------------------- growth="headroom"


@pytest.mark.parametrize("path", ["pmap", "shard_map/True", "shard_map/False", "jit"])
def test_headroom_growth_takes_the_max_over_every_device(results, path):
    """Device i's gradients peak at (i + 1) / 64: every device records the global max,
    1/8, and grows to the same scale, 2**14 (2**14 * 16 / 8 <= 65504 < 2**15 * 16 / 8),
    where its own max (1/64) would have let device 0 grow to 2**17."""
    run = scenario(results, "headroom")[path]
    assert run["loss_scale"].tolist() == [2.0**14] * N_DEVICES
    assert [h.tolist() for h in run["history"]] == [[0.125]] * N_DEVICES


# -------------------------------------------------------------------------- autocast


@pytest.mark.parametrize("path", ["reference", "pmap", "shard_map", "jit", "shard_map_tp"])
def test_autocast_gives_the_float32_programs_loss_and_gradients_on_every_path(results, path):
    value = scenario(results, "autocast")
    loss, grads = value[f"{path}/autocast"]
    ref_loss, ref_grads = value[f"{path}/float32"]
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-3)
    for name in ref_grads:
        assert grads[name].dtype == np.float32
        np.testing.assert_allclose(grads[name], ref_grads[name], rtol=2e-2, atol=2e-3)
    # and every path computes what one device computes for the whole batch (shard_map's
    # replicated params: the gradient summed over the 8 data shards, 2 on the 2x4 mesh)
    one_loss, one_grads = value["reference/float32"]
    np.testing.assert_allclose(loss, one_loss, rtol=1e-3)
    shards = {"shard_map": N_DEVICES, "shard_map_tp": 2}.get(path, 1)
    np.testing.assert_allclose(grads["w1"], shards * one_grads["w1"], rtol=2e-2, atol=2e-3)


def test_autocast_inside_shard_map_runs_the_matmuls_in_half(results):
    value = scenario(results, "autocast")
    assert value["shard_map_dots/autocast"] == [("float16", "float16")]
    assert value["shard_map_dots/float32"] == [("float32", "float32")]
