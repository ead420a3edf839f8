"""Resumes on 8 devices for tests/test_checkpoint_devices.py (a subprocess: the 8 virtual CPU
devices need XLA_FLAGS set before jax is imported).

Two layouts, each run uninterrupted and run again with an Orbax checkpoint at RESUME_AT
(``ls.orbax_save_args`` / ``ls.orbax_restore``, a fresh CheckpointManager and a target
built from scratch), then finished:

* ``pmap``: the state replicated with ``flax.jax_utils.replicate`` (a leading device
  axis), ``axis_name="data"``, an inf in one device's batch on some steps;
* ``sharded``: ``jax.jit`` with a ``NamedSharding`` mesh of 8 devices, the state
  replicated (``P()``), the batch sharded over "data".

Also ``ls.restore_loss_scale`` directly on each layout. Writes one pickle of numpy
arrays, shardings as strings, and any exception's traceback.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib  # noqa: E402
import pickle  # noqa: E402
import traceback  # noqa: E402

import flax.jax_utils  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import loss_scaling as ls  # noqa: E402

N_DEVICES, N_STEPS, RESUME_AT = 8, 14, 7
BAD_STEPS = {2: 3, 6: 5, 7: 1, 11: 0}   # step -> the device whose batch holds an inf


def make_tx(axis_name=None):
    scaler = ls.DynamicLossScale(init_scale=2.0**12, growth_interval=2, hysteresis=2)
    return ls.with_loss_scaling(optax.adam(1e-2), scaler, axis_name=axis_name)


def init_params():
    rng = np.random.default_rng(0)
    return {"w": jnp.asarray(rng.normal(size=(4, 2)), jnp.float32),
            "b": jnp.zeros(2, jnp.float32)}


def batch(t):
    rng = np.random.default_rng(100 + t)
    x = rng.normal(size=(N_DEVICES, 4, 4)).astype(np.float32)
    if t in BAD_STEPS:
        x[BAD_STEPS[t], 0, 0] = np.inf
    return x


def loss_fn(params, x):
    h = x.astype(jnp.float16) @ params["w"].astype(jnp.float16) + params["b"].astype(
        jnp.float16)
    return jnp.mean(h.astype(jnp.float32) ** 2)


def host(tree):
    """Every leaf by key path, as numpy (picklable without loss_scaling's classes)."""
    return {jax.tree_util.keystr(path): np.asarray(x)
            for path, x in jax.tree.leaves_with_path(tree)}


def same_placement(a, b) -> bool:
    """Every leaf of ``a`` placed as the matching leaf of ``b`` (equivalent shardings)."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        x.shape == y.shape and x.sharding.is_equivalent_to(y.sharding, x.ndim)
        for x, y in zip(la, lb, strict=True))


def placements(tree):
    return {jax.tree_util.keystr(path): str(getattr(x, "sharding", None))
            for path, x in jax.tree.leaves_with_path(tree)}


# ------------------------------------------------------------------------------- pmap

def pmap_run():
    tx = make_tx("data")

    def local(state, x):
        grads = jax.grad(lambda p: ls.scale(ls.get_loss_scale(state["opt"]), loss_fn(p, x)))(
            state["params"])
        grads = jax.lax.pmean(grads, "data")
        params, opt = ls.apply_gradients(tx, grads, state["opt"], state["params"])
        return {"params": params, "opt": opt}

    step = jax.pmap(local, axis_name="data")

    def fresh():
        return flax.jax_utils.replicate({"params": init_params(), "opt": tx.init(init_params())})

    return fresh, step, lambda t: batch(t)


# ---------------------------------------------------------------------------- sharded

def sharded_run():
    mesh = jax.make_mesh((N_DEVICES,), ("data",))
    replicated = NamedSharding(mesh, P())
    tx = make_tx()

    @jax.jit
    def step(state, x):
        grads = jax.grad(lambda p: ls.scale(ls.get_loss_scale(state["opt"]), loss_fn(p, x)))(
            state["params"])
        params, opt = ls.apply_gradients(tx, grads, state["opt"], state["params"])
        return {"params": params, "opt": opt}

    def fresh():
        return jax.device_put({"params": init_params(), "opt": tx.init(init_params())},
                              replicated)

    return fresh, step, lambda t: jax.device_put(batch(t), NamedSharding(mesh, P("data")))


def scenario(make, directory: pathlib.Path):
    fresh, step, feed = make()
    state = fresh()
    for t in range(N_STEPS):
        state = step(state, feed(t))
    uninterrupted = state

    state = fresh()
    with ocp.CheckpointManager(directory) as mngr:
        for t in range(RESUME_AT):
            state = step(state, feed(t))
        at_checkpoint = host(state)
        mngr.save(RESUME_AT, args=ls.orbax_save_args(state))
        mngr.wait_until_finished()
    del state

    fresh_again, step, feed = make()          # everything rebuilt, as in a new process
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, fresh_again())
    with ocp.CheckpointManager(directory) as mngr:
        state = ls.orbax_restore(mngr, target)
    restored = host(state)
    restored_placements = placements(state)
    restored_like_fresh = same_placement(state, fresh_again())
    for t in range(RESUME_AT, N_STEPS):
        state = step(state, feed(t))

    # restore_loss_scale directly on a fresh state of this layout.
    saved = ls.state_dict(ls.DynamicLossScale(init_scale=64.0, growth_interval=2,
                                              hysteresis=2))
    direct = ls.restore_loss_scale(fresh_again(), saved)
    return {
        "restored_like_fresh": restored_like_fresh,
        "resumed_like_uninterrupted": same_placement(state, uninterrupted),
        "direct_like_fresh": same_placement(direct, fresh_again()),
        "uninterrupted": host(uninterrupted), "resumed": host(state),
        "at_checkpoint": at_checkpoint, "restored": restored,
        "placements": placements(fresh_again()), "restored_placements": restored_placements,
        "resumed_placements": placements(state),
        "direct": host(ls.get_loss_scale(direct["opt"])),
        "direct_placements": placements(ls.get_loss_scale(direct["opt"])),
        "fresh_scaler_placements": placements(ls.get_loss_scale(fresh_again()["opt"])),
        "metrics": host(ls.metrics(uninterrupted["opt"])),
    }


def main(out: pathlib.Path) -> None:
    results = {"devices": jax.device_count()}
    for name, make in (("pmap", pmap_run), ("sharded", sharded_run)):
        try:
            results[name] = scenario(make, out.parent / f"ckpt_{name}")
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    out.write_bytes(pickle.dumps(results))


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
