"""Resume on 8 devices, bit-identical: a pmap-replicated and a NamedSharding-sharded run.

The runs are in ``restore_devices_worker.py`` (a subprocess: 8 virtual CPU devices); the
assertions are here. Each layout is run uninterrupted and resumed from an Orbax
checkpoint (``ls.orbax_save_args`` / ``ls.orbax_restore`` into a target rebuilt from
scratch); the resumed run must end bit-identical to the uninterrupted one, every leaf
placed as before. ``ls.restore_loss_scale`` must keep each layout too.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

WORKER = Path(__file__).with_name("restore_devices_worker.py")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("restore_devices") / "results.pkl"
    # This checkout's loss_scaling first, whatever the environment has installed.
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    proc = subprocess.run([sys.executable, str(WORKER), str(out)], capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path})
    assert proc.returncode == 0 and out.exists(), proc.stderr[-6000:]
    return pickle.loads(out.read_bytes())


def assert_bit_identical(a, b):
    assert list(a) == list(b)                      # the same leaves, by key path
    for path in a:
        x, y = a[path], b[path]
        assert (x.dtype, x.shape) == (y.dtype, y.shape), path
        assert x.tobytes() == y.tobytes(), path


def run(results, name):
    assert results["devices"] == 8
    result = results[name]
    assert "error" not in result, result.get("error")
    return result


LOSS_SCALE = "['opt'].scaler.loss_scale"


@pytest.mark.parametrize("name", ["pmap", "sharded"])
def test_resume_on_8_devices_is_bit_identical(results, name):
    r = run(results, name)
    m = r["metrics"]
    # The intended run: steps skipped for an inf on one device, a scale that moved.
    assert int(np.asarray(m["['skipped_steps']"]).reshape(-1)[0]) >= 4
    assert r["uninterrupted"][LOSS_SCALE].reshape(-1)[0] != 2.0**12
    assert_bit_identical(r["restored"], r["at_checkpoint"])
    assert_bit_identical(r["resumed"], r["uninterrupted"])
    assert r["restored_like_fresh"] and r["resumed_like_uninterrupted"]
    if name == "pmap":      # every leaf keeps its leading device axis, over 8 devices
        assert all(x.shape[:1] == (8,) for x in r["restored"].values())
    else:
        assert r["restored"][LOSS_SCALE].shape == ()
    assert "8" in r["restored_placements"][LOSS_SCALE]          # a mesh of 8 devices


@pytest.mark.parametrize("name", ["pmap", "sharded"])
def test_restore_loss_scale_keeps_each_layout(results, name):
    r = run(results, name)
    assert r["direct_like_fresh"]
    assert r["direct_placements"] == r["fresh_scaler_placements"]
    loss_scale = r["direct"][".loss_scale"]
    assert loss_scale.shape == ((8,) if name == "pmap" else ())
    assert (loss_scale == 64.0).all()
