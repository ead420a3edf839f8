"""Resume on 8 devices, bit-identical: a pmap-replicated and a NamedSharding-sharded run.

The runs are in ``checkpoint_devices_worker.py`` (a subprocess: 8 virtual CPU devices); the
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

WORKER = Path(__file__).with_name("checkpoint_devices_worker.py")
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


# ------------------------------------------------------------- two processes (multi-host)

PROGRAM = '''
import argparse, hashlib, os, pathlib
parser = argparse.ArgumentParser()
parser.add_argument("--process-id", type=int)
parser.add_argument("--coordinator")
# Each --run trains from its checkpoint folder's latest step (or from the start) until
# STEPS, then saves: several runs in one launch share the process and its compiled step.
parser.add_argument("--run", nargs=2, action="append", metavar=("CHECKPOINT", "STEPS"))
args = parser.parse_args()
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax, jax.numpy as jnp, numpy as np, optax, orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P
import loss_scaling as ls
jax.distributed.initialize(args.coordinator, 2, args.process_id)
mesh = jax.make_mesh((jax.device_count(),), ("data",))
tx = ls.with_loss_scaling(optax.adam(1e-2), ls.DynamicLossScale(init_scale=2.0**12,
                                                                growth_interval=2))

def make_state():
    params = {"w": jnp.linspace(-1.0, 1.0, 8).reshape(4, 2)}
    return jax.device_put({"params": params, "opt_state": tx.init(params)},
                          NamedSharding(mesh, P()))

@jax.jit
def step(state, x):
    loss_fn = lambda p: ls.scale(ls.get_loss_scale(state["opt_state"]),
                                 jnp.mean((x @ p["w"]) ** 2))
    grads = jax.grad(loss_fn)(state["params"])
    params, opt_state = ls.apply_gradients(tx, grads, state["opt_state"], state["params"])
    return {"params": params, "opt_state": opt_state}

rows = NamedSharding(mesh, P("data"))
for checkpoint, steps in args.run:
    with ocp.CheckpointManager(pathlib.Path(checkpoint).absolute()) as mngr:
        state, start = make_state(), 0
        if mngr.latest_step() is not None:
            state = ls.orbax_restore(mngr, jax.tree.map(ocp.utils.to_shape_dtype_struct, state))
            start = mngr.latest_step()
            same = [a.sharding.is_equivalent_to(b.sharding, a.ndim)
                    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(make_state()))]
            print("placed", all(same))
        for t in range(start, int(steps)):
            x = np.random.default_rng([t, jax.process_index()]).normal(size=(4, 4))
            if t == 2 and jax.process_index() == 1:
                x[0, 0] = np.inf
            x = jax.make_array_from_process_local_data(rows, x.astype(np.float32))
            state = step(state, x)
        mngr.save(int(steps), args=ls.orbax_save_args(state))
        mngr.wait_until_finished()
    digest = hashlib.sha256(b"".join(np.asarray(x.addressable_data(0)).tobytes()
                                     for x in jax.tree.leaves(state))).hexdigest()
    print("final", digest, float(ls.get_loss_scale(state).loss_scale))
jax.distributed.shutdown()
'''


def test_orbax_helpers_resume_on_two_processes_bit_identically(tmp_path):
    sys.path.insert(0, str(ROOT / "tests" / "multihost"))
    from test_multihost import free_port, run_processes  # the multi-process harness

    program = tmp_path / "program.py"
    program.write_text(PROGRAM)

    def launch(name, runs):
        def argv(i, port):
            return [sys.executable, str(program), "--process-id", str(i), "--coordinator",
                    f"127.0.0.1:{port}", *[a for folder, steps in runs
                                           for a in ("--run", str(folder), str(steps))]]

        run_processes(argv, 2, tmp_path / name, port=free_port(), timeout=300)
        return [(tmp_path / name / f"process_{i}.stdout").read_text().split("\n")
                for i in range(2)]

    # The uninterrupted run and the first half of the interrupted one share a launch; the
    # second half resumes in a fresh one.
    straight = launch("straight_and_first", [(tmp_path / "a", 6), (tmp_path / "b", 3)])
    resumed = launch("resumed", [(tmp_path / "b", 6)])
    for i in range(2):
        finals = [line for line in straight[i] if line.startswith("final")]  # a's, then b's
        assert len(finals) == 2 and finals[0].endswith(" 8192.0")  # grown, backed off, grown
        final = finals[:1]
        assert [line for line in resumed[i] if line.startswith("final")] == final
        assert "placed True" in resumed[i]
    metadata = tmp_path / "b" / "3" / "loss_scale" / "metadata"
    assert "\"loss_scale\": 4096.0" in metadata.read_text()    # 8192 backed off at step 2
