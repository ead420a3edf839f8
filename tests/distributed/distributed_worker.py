"""The distributed scenarios, run on 8 virtual CPU devices in a process of their own.

``test_distributed.py`` runs this file once as a script, with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (which must be set before jax is
imported, hence the separate process), and asserts on what it writes: one pickled dict of
plain values and numpy arrays per scenario. Run it by hand to debug a scenario::

    python tests/distributed/distributed_worker.py --out /tmp/results.pkl [NAME ...]

Importing this module (pytest's doctest collection does) runs nothing.

Every run returns the *per-device copies* of what should be replicated, read from each
device's own buffer (``addressable_shards`` under jit / shard_map, the leading axis under
pmap), so the tests see a replica that drifted even where the type system says
"replicated".
"""

from __future__ import annotations

import argparse
import functools
import os
import pickle
import re
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

N_DEVICES = 8
XLA_FLAGS = f"--xla_force_host_platform_device_count={N_DEVICES}"

if __name__ == "__main__":  # before jax is imported
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + XLA_FLAGS).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import loss_scaling as ls  # noqa: E402

DOCS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "distributed.md"

# ---------------------------------------------------------------------------- the model
#
# A small float32 MLP, written once for every path. Under shard_map the hidden layer can be
# split over a "model" axis (Megatron style: w1 by columns, w2 by rows, one psum).

N_STEPS = 12
GLOBAL_BATCH = 16
SIZES = (4, 8, 2)
# Injected overflows: an inf / a NaN in one device's rows of the batch (row 11 of 16 is on
# device 5), and at GRAD_NAN_STEPS a NaN in one device's gradients (each path says where).
# Growth every 2 clean steps, so the scale both grows and backs off.
BATCH_INF_STEPS = (2,)
BATCH_NAN_STEPS = (9,)
GRAD_NAN_STEPS = (5, 6)
BAD_ROW = 11  # lives on device 5 of 8 (two rows per device)
BAD_DEVICE = 5
TP_BAD_DEVICE = (0, 2)  # (data, model) on the 2x4 mesh
TP_BAD_COLUMN = 5  # a hidden unit held by model shard 2 (two units per shard)


def scaler(**overrides: Any) -> ls.DynamicLossScale:
    kwargs = {"init_scale": 2.0**10, "growth_interval": 2} | overrides
    return ls.DynamicLossScale(**kwargs)


def init_params() -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    d_in, d_hidden, d_out = SIZES
    return {
        "w1": jnp.asarray(rng.normal(size=(d_in, d_hidden)) * 0.5, jnp.float32),
        "b1": jnp.zeros((d_hidden,), jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(d_hidden, d_out)) * 0.5, jnp.float32),
        "b2": jnp.zeros((d_out,), jnp.float32),
    }


def batch(step: int, *, overflow: bool = False) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    x = rng.normal(size=(GLOBAL_BATCH, SIZES[0])).astype(np.float32)
    y = rng.normal(size=(GLOBAL_BATCH, SIZES[2])).astype(np.float32)
    if step in BATCH_INF_STEPS or overflow:
        y[BAD_ROW, 0] = np.inf
    if step in BATCH_NAN_STEPS:
        y[BAD_ROW, 1] = np.nan
    return x, y


def mlp_loss(params: Any, x: jax.Array, y: jax.Array, *, model_axis: str | None = None,
             out_sharding: Any = None) -> jax.Array:
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    out = jnp.matmul(h, params["w2"], out_sharding=out_sharding)
    if model_axis is not None:
        out = lax.psum(out, model_axis)
    return jnp.mean((out + params["b2"] - y) ** 2)


TRACES = [0]  # times a step function was traced, reset per run


def traced() -> None:
    TRACES[0] += 1


def full_rank(spec: P, value: Any) -> P:
    """``spec`` with one entry per dimension of ``value``.

    Under an Explicit mesh (``jax.make_mesh``'s default) a jitted step returns ``P(None,)``
    for a replicated vector; placing the first inputs with ``P()`` instead makes the second
    step compile again.
    """
    return P(*spec, *([None] * (np.ndim(value) - len(spec))))


def place_on(mesh: Any, tree: Any, specs: Any = None) -> Any:
    """``tree`` on ``mesh``, by a PartitionSpec tree (replicated where ``specs`` is None)."""
    if specs is None:
        specs = jax.tree.map(lambda _: P(), tree)
    shardings = jax.tree.map(lambda spec, value: NamedSharding(mesh, full_rank(spec, value)),
                             specs, tree)
    return jax.device_put(tree, shardings)


def poison(tree: Any, bad: jax.Array, where: Any = None) -> Any:
    """NaN in every element (or the ``where`` elements) of every leaf, when ``bad``."""
    return jax.tree.map(
        lambda g: jnp.where(bad if where is None else bad & where, jnp.nan, g), tree)


def optimizer_step(tx: Any, api: str, grads: Any, opt_state: Any, params: Any) -> Any:
    if api == "fused":
        return ls.apply_gradients(tx, grads, opt_state, params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


# ------------------------------------------------------------------- the runs, per path
#
# Each path builds (tx, step, place, feed): step(params, opt_state, *feed(x, y, bad))
# returns (params, opt_state, loss, metrics computed inside the step); `bad` (one flag per
# device) marks where a gradient NaN goes; `place` puts the initial state where the path
# wants it, so that the step compiles once and every donated buffer is consumed.


def path_reference(api: str, skip: str, scale: ls.LossScale, **tx_kwargs: Any) -> Any:
    """One device, the whole global batch: what every distributed run must reproduce."""
    tx = ls.with_loss_scaling(optax.adam(1e-2), scale, skip=skip, **tx_kwargs)

    def step(params, opt_state, x, y, bad):
        traced()
        loss, grads = ls.value_and_grad(mlp_loss)(opt_state, params, x, y)
        grads = poison(grads, jnp.any(bad))
        params, opt_state = optimizer_step(tx, api, grads, opt_state, params)
        return params, opt_state, loss, ls.metrics(opt_state)

    def feed(x, y, bad):
        return jnp.asarray(x), jnp.asarray(y), jnp.asarray(bad)

    return tx, jax.jit(step), (lambda params, opt_state: (params, opt_state)), feed


def path_jit(api: str, skip: str, scale: ls.LossScale, **tx_kwargs: Any) -> Any:
    """Sharded jit, data parallel: batch split over "data", params and state replicated.

    The gradients are global (replicated) arrays here: the NaN goes into all of them.
    """
    mesh = jax.make_mesh((N_DEVICES,), ("data",))
    tx = ls.with_loss_scaling(optax.adam(1e-2), scale, skip=skip, **tx_kwargs)  # no axis_name
    rows = NamedSharding(mesh, P("data"))

    def step(params, opt_state, x, y, bad):
        traced()
        loss, grads = ls.value_and_grad(mlp_loss)(opt_state, params, x, y)
        grads = poison(grads, jnp.any(bad))
        params, opt_state = optimizer_step(tx, api, grads, opt_state, params)
        return params, opt_state, loss, ls.metrics(opt_state)

    def place(params, opt_state):
        return place_on(mesh, (params, opt_state))

    def feed(x, y, bad):
        return jax.device_put((x, y, bad), rows)

    return tx, jax.jit(step, donate_argnums=(0, 1)), place, feed


TP_PARAM_SPECS = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}


def replicated(x: Any) -> P:
    """Replicated, one None per axis: the spec a step's output comes back with."""
    return P(*[None] * jnp.ndim(x))


def tp_specs(tx: Any, opt_state: Any) -> Any:
    """The opt_state's PartitionSpec tree: moments like their params, the rest replicated."""
    return optax.tree_map_params(tx, lambda _, spec: spec, opt_state, TP_PARAM_SPECS,
                                 transform_non_params=replicated)


def path_jit_tp(api: str, skip: str, scale: ls.LossScale, **tx_kwargs: Any) -> Any:
    """Sharded jit on a 2x4 ("data", "model") mesh: hidden layer and moments sharded.

    The NaN goes into one element of w1's gradient, in model shard 2: XLA's global
    finiteness test must find it in that one shard.
    """
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    tx = ls.with_loss_scaling(optax.adam(1e-2), scale, skip=skip, **tx_kwargs)  # no axis_name
    column = np.zeros((SIZES[0], SIZES[1]), bool)
    column[0, TP_BAD_COLUMN] = True  # one element, in model shard 2's slice of w1

    def step(params, opt_state, x, y, bad):
        traced()
        loss, grads = ls.value_and_grad(mlp_loss)(
            opt_state, params, x, y, out_sharding=NamedSharding(mesh, P("data", None)))
        grads = dict(grads, w1=poison(grads["w1"], jnp.any(bad), where=column))
        params, opt_state = optimizer_step(tx, api, grads, opt_state, params)
        return params, opt_state, loss, ls.metrics(opt_state)

    def place(params, opt_state):
        return place_on(mesh, (params, opt_state), (TP_PARAM_SPECS, tp_specs(tx, opt_state)))

    def feed(x, y, bad):
        rows = NamedSharding(mesh, P("data"))
        return jax.device_put(x, rows), jax.device_put(y, rows), jax.device_put(
            bad.reshape(2, 4), NamedSharding(mesh, P("data", "model")))

    return tx, jax.jit(step, donate_argnums=(0, 1)), place, feed


def path_shard_map(api: str, skip: str, scale: ls.LossScale, **tx_kwargs: Any) -> Any:
    """shard_map, data parallel, vma-checked: NaN in one device's gradient contribution.

    Under vma checks the gradient of replicated params comes out already summed over
    "data" (the transpose of their implicit broadcast), so the step differentiates the
    mean loss over devices instead of pmean-ing the gradients (which would give 8x them).
    """
    mesh = jax.make_mesh((N_DEVICES,), ("data",))
    tx = ls.with_loss_scaling(optax.adam(1e-2), scale, axis_name="data", skip=skip,
                              **tx_kwargs)

    def global_loss(params, x, y, bad):
        local = mlp_loss(params, x, y) * jnp.where(bad, jnp.nan, 1.0)  # this device's grads
        return lax.pmean(local, "data")

    def local_step(params, opt_state, x, y, bad):
        traced()
        loss, grads = ls.value_and_grad(global_loss)(opt_state, params, x, y, bad[0])
        params, opt_state = optimizer_step(tx, api, grads, opt_state, params)
        return params, opt_state, loss, ls.metrics(opt_state)

    step = jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P(), P("data"), P("data"),
                                                          P("data")), out_specs=P())

    def place(params, opt_state):
        return place_on(mesh, (params, opt_state))

    def feed(x, y, bad):
        return jax.device_put((x, y, bad), NamedSharding(mesh, P("data")))

    return tx, jax.jit(step, donate_argnums=(0, 1)), place, feed


def path_shard_map_tp(api: str, skip: str, scale: ls.LossScale,
                      axis_name: Any = ("data", "model"), **tx_kwargs: Any) -> Any:
    """shard_map on 2x4, vma-checked, hidden layer split over "model".

    The NaN goes into model shard 2 of the (already data-reduced) gradients: the other
    model shards only hear of it through the wrapper's reduction over "model".
    """
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    tx = ls.with_loss_scaling(optax.adam(1e-2), scale, axis_name=axis_name, skip=skip,
                              **tx_kwargs)
    opt_specs = tp_specs(tx, tx.init(init_params()))

    def global_loss(params, x, y):  # differentiated as a whole, see path_shard_map
        return lax.pmean(mlp_loss(params, x, y, model_axis="model"), "data")

    def local_step(params, opt_state, x, y, bad):
        traced()
        loss, grads = ls.value_and_grad(global_loss)(opt_state, params, x, y)
        sharded = {k: grads[k] for k in ("w1", "b1", "w2")}  # vary over "model"
        grads = dict(grads, **poison(sharded, bad[0]))
        params, opt_state = optimizer_step(tx, api, grads, opt_state, params)
        return params, opt_state, loss, ls.metrics(opt_state)

    step = jax.shard_map(
        local_step, mesh=mesh,
        in_specs=(TP_PARAM_SPECS, opt_specs, P("data"), P("data"), P("model")),
        out_specs=(TP_PARAM_SPECS, opt_specs, P(), P()))

    def place(params, opt_state):
        return place_on(mesh, (params, opt_state), (TP_PARAM_SPECS, opt_specs))

    def feed(x, y, bad):
        rows = NamedSharding(mesh, P("data"))
        return jax.device_put(x, rows), jax.device_put(y, rows), jax.device_put(
            bad.reshape(2, 4).any(axis=0), NamedSharding(mesh, P("model")))

    return tx, jax.jit(step, donate_argnums=(0, 1)), place, feed


def path_shard_map_unchecked(api: str, skip: str, scale: ls.LossScale,
                             axis_name: Any = "data", **tx_kwargs: Any) -> Any:
    """shard_map without vma checks, NaN in one device's gradients *after* the pmean.

    Only the wrapper's reduction over ``axis_name`` can make the other devices skip; the
    outputs claim to be replicated, and the per-device buffers show whether they are.
    """
    mesh = jax.make_mesh((N_DEVICES,), ("data",))
    tx = ls.with_loss_scaling(optax.adam(1e-2), scale, axis_name=axis_name, skip=skip,
                              **tx_kwargs)

    def local_step(params, opt_state, x, y, bad):
        traced()
        loss, grads = ls.value_and_grad(mlp_loss)(opt_state, params, x, y)
        grads = poison(lax.pmean(grads, "data"), bad[0])
        params, opt_state = optimizer_step(tx, api, grads, opt_state, params)
        return params, opt_state, lax.pmean(loss, "data"), ls.metrics(opt_state)

    step = jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P(), P("data"), P("data"),
                                                          P("data")), out_specs=P(),
                         check_vma=False)

    def place(params, opt_state):
        return place_on(mesh, (params, opt_state))

    def feed(x, y, bad):
        return jax.device_put((x, y, bad), NamedSharding(mesh, P("data")))

    return tx, jax.jit(step, donate_argnums=(0, 1)), place, feed


def path_pmap(api: str, skip: str, scale: ls.LossScale, axis_name: Any = "data",
              **tx_kwargs: Any) -> Any:
    """pmap, data parallel: NaN in one device's gradients after the pmean."""
    tx = ls.with_loss_scaling(optax.adam(1e-2), scale, axis_name=axis_name, skip=skip,
                              **tx_kwargs)

    def local_step(params, opt_state, x, y, bad):
        traced()
        loss, grads = ls.value_and_grad(mlp_loss)(opt_state, params, x, y)
        grads = poison(lax.pmean(grads, "data"), bad)
        params, opt_state = optimizer_step(tx, api, grads, opt_state, params)
        return params, opt_state, lax.pmean(loss, "data"), ls.metrics(opt_state)

    step = jax.pmap(local_step, axis_name="data", donate_argnums=(0, 1))

    def place(params, opt_state):
        stacked = jax.tree.map(lambda a: np.broadcast_to(a, (N_DEVICES, *np.shape(a))),
                               (params, opt_state))
        # On the devices in pmap's layout, with the step's axis name: placed otherwise
        # (e.g. flax.jax_utils.replicate's default axis name) the second step retraces.
        return jax.pmap(lambda t: t, axis_name="data")(stacked)

    def feed(x, y, bad):
        split = lambda a: a.reshape(N_DEVICES, -1, *a.shape[1:])  # noqa: E731
        return split(x), split(y), bad

    return tx, step, place, feed


PATHS: dict[str, Callable[..., Any]] = {
    "jit": path_jit,
    "jit_tp": path_jit_tp,
    "shard_map": path_shard_map,
    "shard_map_tp": path_shard_map_tp,
    "shard_map_unchecked": path_shard_map_unchecked,
    "pmap": path_pmap,
}


# ---------------------------------------------------------------- reading every replica


def host(x: Any) -> np.ndarray:
    """A host copy. On CPU ``np.asarray`` of a device array is a view of its buffer, and a
    buffer with a live view cannot be donated (jit copies it instead, silently)."""
    return np.array(x, copy=True)


def copies(x: Any, stacked: bool) -> list[tuple[Any, np.ndarray]]:
    """(shard index, value) of every device's buffer of ``x``.

    ``stacked``: a pmap output, whose leading axis holds one copy per device.
    """
    if stacked:
        return [(None, host(s.data)[0]) for s in x.addressable_shards]
    if isinstance(x, jax.Array):
        return [(str(s.index), host(s.data)) for s in x.addressable_shards]
    return [(None, host(x))]


def distinct_copies(tree: Any, stacked: bool = False) -> int:
    """The most distinct byte patterns among the copies of one shard of one leaf."""
    worst = 1
    for leaf in jax.tree.leaves(tree):
        groups: dict[Any, set[bytes]] = {}
        for index, value in copies(leaf, stacked):
            groups.setdefault(index, set()).add(np.ascontiguousarray(value).tobytes())
        worst = max(worst, *(len(g) for g in groups.values()))
    return worst


def per_replica(x: Any, stacked: bool = False) -> np.ndarray:
    """Every device's copy of a replicated scalar, as a 1-D array."""
    return np.stack([value.reshape(()) for _, value in copies(x, stacked)])


# (path, api, skip, scaler type and configuration, path options) -> an earlier run's build.
BUILT: dict[tuple[Any, ...], tuple[Any, ...]] = {}


def run(path: str, api: str, skip: str, *, scale: ls.LossScale | None = None,
        steps: int = N_STEPS, always_overflow: bool = False, **path_kwargs: Any) -> dict:
    """Trains ``steps`` steps on one path; returns per-step host copies of everything."""
    build = path_reference if path == "reference" else PATHS[path]
    stacked = path == "pmap"
    global_value = (lambda a: host(a)[0]) if stacked else host

    scale = scaler() if scale is None else scale
    tx, step, place, feed = build(api, skip, scale, **path_kwargs)
    # A run whose step is the same program as an earlier run's (the same path, options and
    # scaler configuration: only the initial scale, a value in the state, differs) reuses
    # that run's compiled step; its own tx still makes (and re-makes) the initial state.
    key = (path, api, skip, type(scale), repr(getattr(scale, "config", None)),
           repr(sorted(path_kwargs.items())))
    _, step, place, feed = BUILT.setdefault(key, (tx, step, place, feed))
    TRACES[0] = 0
    params, opt_state = place(init_params(), tx.init(init_params()))
    out: dict[str, Any] = {"steps": [], "kept": [], "error": None}
    for i in range(steps):
        x, y = batch(i, overflow=always_overflow)
        bad = np.zeros(N_DEVICES, bool)
        if i in GRAD_NAN_STEPS:
            bad[np.ravel_multi_index(TP_BAD_DEVICE, (2, 4)) if path.endswith("_tp")
                else BAD_DEVICE] = True
        inputs = jax.tree.leaves((params, opt_state))
        try:
            params, opt_state, loss, inside = step(params, opt_state, *feed(x, y, bad))
            record = {
                "params": jax.tree.map(global_value, params),
                "inner": [global_value(a) for a in jax.tree.leaves(opt_state.inner_state)],
                "metrics": {k: per_replica(v, stacked)
                            for k, v in ls.metrics(opt_state).items()},
                "inside": {k: per_replica(v, stacked) for k, v in inside.items()},
                "distinct": distinct_copies((params, opt_state), stacked),
                "loss": float(global_value(loss).reshape(-1)[0]),
            }
        except jax.errors.JaxRuntimeError as error:
            out["error"] = str(error)
            out["failed_at"] = i
            try:  # the failed callback also sits in the runtime's effect tokens
                jax.effects_barrier()
            except jax.errors.JaxRuntimeError:
                pass
            break
        out["steps"].append(record)
        # Donated buffers are deleted; the dtypes of any that were not.
        out["kept"].append(sorted({str(a.dtype) for a in inputs if not a.is_deleted()}))
    out["traces"] = TRACES[0]
    if out["error"] is None:  # (after an on_failure="raise" the donated state is gone)
        try:  # the host-side report of a failure recorded in the state
            ls.check(opt_state)
            out["check"] = None
        except ls.LossScaleError as error:
            out["check"] = str(error)
        # A failed state stays readable and checkpointable.
        one = jax.tree.map(lambda a: host(a)[0] if stacked else host(a),
                           ls.get_loss_scale(opt_state))
        out["checkpoint"] = ls.state_dict(ls.from_state_dict(ls.state_dict(one)))
    out["cache_size"] = step._cache_size() if hasattr(step, "_cache_size") else None
    out["placement"] = {
        jax.tree_util.keystr(key): str(getattr(leaf.sharding, "spec", None))
        for key, leaf in jax.tree_util.tree_leaves_with_path((params, opt_state))}
    # tx.init hands out fresh buffers: a second init works after donated steps.
    out["reinit_scale"] = float(ls.get_loss_scale(tx.init(init_params())).loss_scale)
    return out


# ------------------------------------------------------------------------- all_finite


def all_finite_scenarios() -> dict:
    """all_finite over one device's inf under every path, with and without axis_name."""
    out: dict[str, Any] = {}
    values = np.arange(N_DEVICES * 3, dtype=np.float32).reshape(N_DEVICES, 3)
    bad = values.copy()
    bad[BAD_DEVICE, 1] = np.inf
    nan = values.copy()
    nan[BAD_DEVICE, 2] = np.nan

    # jit with shardings: no axis_name, the test covers the global array.
    for kind in ("explicit", "auto"):
        types = (AxisType.Explicit if kind == "explicit" else AxisType.Auto,)
        mesh = jax.make_mesh((N_DEVICES,), ("data",), axis_types=types)
        f = jax.jit(lambda t: ls.all_finite(t))
        for name, v in (("clean", values), ("inf", bad), ("nan", nan)):
            arr = jax.device_put(v, NamedSharding(mesh, P("data")))
            out[f"jit_{kind}/{name}"] = per_replica(f({"x": arr, "n": jnp.int32(3)}))

    # shard_map over one axis: every device's own answer (out_specs P("data")).
    mesh = jax.make_mesh((N_DEVICES,), ("data",))
    for axis_name in ("data", None):
        f = jax.jit(jax.shard_map(lambda t, a=axis_name: ls.all_finite(t, axis_name=a)[None],
                                  mesh=mesh, in_specs=P("data"), out_specs=P("data")))
        for name, v in (("clean", values), ("inf", bad), ("nan", nan)):
            arr = jax.device_put(v, NamedSharding(mesh, P("data")))
            out[f"shard_map_{axis_name}/{name}"] = host(f(arr))

    # shard_map over a 2x4 mesh: a tuple of axes, and one axis only (the control).
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    grid = np.ones((2, 4 * 3), np.float32)
    grid[0, 2 * 3 + 1] = np.inf  # device (data=0, model=2)
    for label, axis_name in (("both", ("data", "model")), ("list", ["data", "model"]),
                             ("data", "data")):
        f = jax.jit(jax.shard_map(
            lambda t, a=axis_name: jnp.broadcast_to(ls.all_finite(t, axis_name=a), (1, 1)),
            mesh=mesh, in_specs=P("data", "model"), out_specs=P("data", "model")))
        out[f"shard_map_2d_{label}"] = host(
            f(jax.device_put(grid, NamedSharding(mesh, P("data", "model")))))

    # pmap over one axis (jax 0.10's pmap is built on shard_map and does not nest).
    for axis_name in ("data", None):
        f = jax.pmap(lambda t, a=axis_name: ls.all_finite(t, axis_name=a), axis_name="data")
        for name, v in (("clean", values), ("inf", bad), ("nan", nan)):
            out[f"pmap_{axis_name}/{name}"] = host(f(v))

    # One scalar collective, whatever the number of leaves or axes.
    tree = {"a": jnp.ones(3), "b": jnp.ones((2, 2), jnp.float16), "c": jnp.int32(1)}
    jaxpr = jax.make_jaxpr(jax.shard_map(
        lambda t: ls.all_finite(t, axis_name=("data", "model")), mesh=mesh,
        in_specs=P(), out_specs=P()))(tree)
    out["collectives"] = collectives(jaxpr.jaxpr)
    return out


def collectives(jaxpr: Any, within: str = "") -> list[str]:
    """Names of the collective primitives in a jaxpr, nested jaxprs included; one inside a
    conditional is named ``"cond/<name>"`` (it runs only when its branch is taken)."""
    names = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("pmin", "pmax", "psum", "psum_invariant", "all_gather",
                                  "ppermute", "all_to_all", "reduce_scatter"):
            names.append(within + eqn.primitive.name)
        nested = "cond/" if eqn.primitive.name == "cond" else within
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    names.extend(collectives(inner, nested))
    return names


def step_collectives() -> dict:
    """Collectives in the wrapper's part of a shard_map train step (no user pmean)."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    out = {}
    for api in ("plain", "fused"):
        for skip in ("cond", "select"):
            tx = ls.with_loss_scaling(optax.adam(1e-2), scaler(), axis_name=("data", "model"),
                                      skip=skip)
            params = init_params()
            opt_state = tx.init(params)

            def local(params, opt_state, grads, tx=tx, api=api):
                return optimizer_step(tx, api, grads, opt_state, params)

            jaxpr = jax.make_jaxpr(jax.shard_map(local, mesh=mesh, in_specs=P(),
                                                 out_specs=P()))(params, opt_state, params)
            out[f"{api}/{skip}"] = collectives(jaxpr.jaxpr)
    return out


# -------------------------------------------------------------------------- scenarios


# The distributed runs, each compared with one single-device reference run. The
# unchecked shard_map (whose replicas only the wrapper's pmin keeps together) runs in two
# combinations to keep the suite fast.
RUNS = [(path, api, skip)
        for path in ("jit", "jit_tp", "shard_map", "shard_map_tp", "pmap")
        for api in ("plain", "fused") for skip in ("cond", "select")]
RUNS += [("shard_map_unchecked", "fused", "cond"), ("shard_map_unchecked", "plain", "select")]


def isolated(f: Callable[..., dict], *args: Any, **kwargs: Any) -> dict:
    """``f(...)``, or ``{"exception": traceback}``: one broken run fails only its tests."""
    try:
        return f(*args, **kwargs)
    except Exception:  # noqa: BLE001 - reported to the test, which fails on it
        return {"exception": traceback.format_exc()}


def multi_step() -> dict:
    out = {"reference": run("reference", "fused", "cond")}
    for path, api, skip in RUNS:
        out[f"{path}/{api}/{skip}"] = isolated(run, path, api, skip)
    return out


def controls() -> dict:
    """Without the reduction the replicas drift apart (or vma refuses to compile)."""
    out = {
        "pmap/no_axis": run("pmap", "fused", "cond", axis_name=None, steps=7),
        "shard_map_unchecked/no_axis": run("shard_map_unchecked", "fused", "cond",
                                           axis_name=None, steps=7),
    }
    try:
        run("shard_map_tp", "fused", "cond", axis_name="data", steps=1)
        out["shard_map_tp/data_only"] = None
    except Exception as error:  # noqa: BLE001 - the message is the result
        out["shard_map_tp/data_only"] = f"{type(error).__name__}: {error}"
    return out


FAIL_CLOSED_RUNS = [(path, "fused", "cond")
                    for path in ("jit", "jit_tp", "shard_map", "shard_map_tp", "pmap")]
FAIL_CLOSED_RUNS += [("shard_map", "plain", "select"), ("pmap", "plain", "select")]


def fail_closed() -> dict:
    """An always-overflowing run without min_scale fails closed: recorded in the state, every
    later step skipped, ls.check raising on the host; on_failure="raise" raises at once."""
    out = {}
    for path, api, skip in FAIL_CLOSED_RUNS:
        out[f"{path}/{api}/{skip}"] = isolated(
            run, path, api, skip, scale=scaler(init_scale=2.0**-124), always_overflow=True,
            steps=6)
    for path in ("jit_tp", "shard_map_tp", "pmap"):
        out[f"{path}/on_failure_raise"] = isolated(
            run, path, "fused", "cond", scale=scaler(init_scale=2.0**-124),
            always_overflow=True, steps=5, on_failure="raise")
    out["min_scale"] = isolated(run, "shard_map", "fused", "cond",
                                scale=scaler(init_scale=2.0**-124, min_scale=2.0**-126),
                                always_overflow=True, steps=6)
    return out


def readme_snippets() -> dict:
    """Runs each python block of docs/distributed.md, as it is written."""
    blocks = re.findall(r"^```python\n(.*?)^```", DOCS_PAGE.read_text(), flags=re.DOTALL | re.M)
    out: dict[Any, Any] = {"count": len(blocks)}
    for i, code in enumerate(blocks):
        namespace: dict[str, Any] = {"__name__": f"docs_distributed_{i}"}
        exec(compile(code, f"docs/distributed.md[{i}]", "exec"), namespace)
        stacked = "jax.pmap(" in code
        step = namespace.get("train_step")
        out[i] = {
            "params_distinct": distinct_copies(namespace["params"], stacked),
            "opt_state_distinct": distinct_copies(namespace["opt_state"], stacked),
            "metrics": {k: per_replica(v, stacked)
                        for k, v in ls.metrics(namespace["opt_state"]).items()},
            "cache_size": step._cache_size() if hasattr(step, "_cache_size") else None,
        }
    return out


# ----------------------------------------------------------------------------- replay
#
# The injected overflow of tests/test_replay.py: sum(f16(w) * f16(x)), whose float16
# backward overflows for x = 1000 above a known scale. Only device REPLAY_DEVICE's rows
# hold the 1000; the gradients meet in float32 (psum / pmean), so every replica sees the
# overflow through its reduced gradients and the agreed flags.

REPLAY_DEVICE = 3


def replay_loss(params: Any, x: jax.Array) -> jax.Array:
    product = params["w"].astype(jnp.float16) * x.astype(jnp.float16)
    return jnp.mean(jnp.sum(product, axis=-1).astype(jnp.float32))


def replay_batch() -> np.ndarray:
    x = np.tile(np.array([[1.0, 2.0, 3.0]], np.float32), (N_DEVICES, 1))
    x[REPLAY_DEVICE, 0] = 1000.0
    return x


@jax.custom_vjp
def mean_grads(params: Any) -> Any:
    """The identity, whose backward pass averages the gradients over "data" (pmap)."""
    return params


mean_grads.defvjp(lambda p: (p, None), lambda _, g: (lax.pmean(g, "data"),))


def replay_step(path: str, tx: Any) -> Any:
    """``step(params, opt_state, x) -> (params, opt_state, metrics)`` on one path."""
    def apply(loss_of: Any, params: Any, opt_state: Any) -> Any:
        loss, grads = ls.value_and_grad(loss_of)(opt_state, params)
        params, opt_state = ls.apply_gradients(tx, grads, opt_state, params, loss=loss,
                                               value_fn=loss_of)
        return params, opt_state, ls.metrics(opt_state)

    if path == "jit":
        return jax.jit(lambda p, s, x: apply(lambda q: replay_loss(q, x), p, s))
    if path == "pmap":
        return jax.pmap(lambda p, s, x: apply(lambda q: replay_loss(mean_grads(q), x), p, s),
                        axis_name="data")
    mesh = jax.make_mesh((N_DEVICES,), ("data",))
    local = lambda p, s, x: apply(  # noqa: E731
        lambda q: lax.pmean(replay_loss(q, x), "data"), p, s)
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("data")),
                                 out_specs=(P(), P(), P())))


def replay_scenarios() -> dict:
    """One step with an overflow on one device, max_replays=4, on each path."""
    out: dict[str, Any] = {}
    for path in ("jit", "shard_map", "pmap"):
        for max_replays in (4, 0):
            scale = ls.DynamicLossScale(init_scale=2048.0 if path != "pmap" else 256.0)
            tx = ls.with_loss_scaling(optax.sgd(0.5), scale, max_replays=max_replays,
                                      axis_name=None if path == "jit" else "data")
            params = {"w": jnp.array([0.5, -1.0, 2.0])}
            opt_state, x = tx.init(params), replay_batch()
            if path == "pmap":
                params, opt_state = jax.pmap(lambda t: t, axis_name="data")(jax.tree.map(
                    lambda a: np.stack([np.asarray(a)] * N_DEVICES), (params, opt_state)))
            else:
                x = jax.device_put(x, NamedSharding(
                    jax.make_mesh((N_DEVICES,), ("data",)), P("data")))
            params, opt_state, inside = replay_step(path, tx)(params, opt_state, x)
            stacked = path == "pmap"
            out[f"{path}/{max_replays}"] = {
                "params": np.asarray(params["w"])[0] if stacked else np.asarray(params["w"]),
                "distinct": distinct_copies((params, opt_state), stacked),
                "metrics": {k: per_replica(v, stacked) for k, v in inside.items()},
            }
    # The single-device run at the scale the replays reached: the same step.
    reference = ls.with_loss_scaling(optax.sgd(0.5), ls.DynamicLossScale(init_scale=512.0))
    params = {"w": jnp.array([0.5, -1.0, 2.0])}
    loss_of = lambda q: replay_loss(q, jnp.asarray(replay_batch()))  # noqa: E731
    _, grads = ls.value_and_grad(loss_of)(reference.init(params), params)
    out["reference"] = np.asarray(
        ls.apply_gradients(reference, grads, reference.init(params), params)[0]["w"])
    return out


def grads_max_scenarios() -> dict:
    """ls.grads_max with axis_name under shard_map and pmap, one device's copy each: the
    largest |entry| is 3.0 on device 0; device BAD_DEVICE holds a NaN, an inf or nothing
    bad, in a 3-entry leaf and in a 100,000-entry one (where XLA CPU's own max drops a
    NaN)."""
    out: dict[str, Any] = {}
    mesh = jax.make_mesh((N_DEVICES,), ("data",))
    for size in (3, 100_000):
        for name, bad in (("clean", 1.0), ("nan", np.nan), ("inf", np.inf)):
            values = np.ones((N_DEVICES, size), np.float32)
            values[0, -1] = 3.0
            values[BAD_DEVICE, size // 2] = bad
            f = jax.jit(jax.shard_map(lambda t: ls.grads_max(t, axis_name="data")[None],
                                      mesh=mesh, in_specs=P("data"), out_specs=P("data")))
            arr = jax.device_put(values, NamedSharding(mesh, P("data")))
            out[f"shard_map/{size}/{name}"] = host(f({"w": arr}))
            g = jax.pmap(lambda t: ls.grads_max(t, axis_name="data"), axis_name="data")
            out[f"pmap/{size}/{name}"] = host(g({"w": values}))
    return out


def headroom() -> dict:
    """growth="headroom" with a different gradient max on every device (one step, a
    window of 1): every device's copy of the scale, and the max the rule recorded."""
    scaler = ls.DynamicLossScale(init_scale=1.0, growth="headroom", headroom_window=1)
    tx = ls.with_loss_scaling(optax.sgd(1e-3), scaler, axis_name="data")
    # Device i holds entries of at most (i + 1) / 64: the global max is 1/8 (device 7).
    local = np.full((N_DEVICES, 4096 + 8), 1e-4, np.float32)
    local[np.arange(N_DEVICES), np.arange(N_DEVICES) * 3] = (np.arange(N_DEVICES) + 1) / 64
    params = {"w": jnp.zeros(4096 + 8), "b": jnp.zeros(3)}
    small = np.full((N_DEVICES, 3), 1e-4, np.float32)
    out: dict[str, Any] = {}

    def scaler_of(opt_state: Any, stacked: bool) -> dict:
        s = ls.get_loss_scale(opt_state)
        return {"loss_scale": per_replica(s.loss_scale, stacked),
                "history": [v for _, v in copies(s.grad_max_history, stacked)]}

    def local_step(opt_state, w, b):
        return ls.apply_gradients(tx, {"w": w.reshape(-1), "b": b.reshape(-1)}, opt_state,
                                  params)[1]

    stepped = jax.pmap(local_step, axis_name="data")(
        jax.pmap(lambda _: tx.init(params))(np.zeros(N_DEVICES)), local, small)
    out["pmap"] = scaler_of(stepped, True)
    mesh = jax.make_mesh((N_DEVICES,), ("data",))
    for check_vma in (True, False):
        step = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P("data"),
                                                                      P("data")),
                                     out_specs=P(), check_vma=check_vma))
        opt_state = place_on(mesh, tx.init(params))
        rows = NamedSharding(mesh, P("data"))
        out[f"shard_map/{check_vma}"] = scaler_of(step(
            opt_state, jax.device_put(local, rows), jax.device_put(small, rows)), False)
    # Sharded jit: a global gradient array whose shards have different maxima.
    plain = ls.with_loss_scaling(optax.sgd(1e-3), scaler)
    sharding = NamedSharding(mesh, P("data"))
    grads = {"w": jax.device_put(local.reshape(-1), sharding),
             "b": jax.device_put(small[0], NamedSharding(mesh, P()))}
    big = {"w": jnp.zeros(N_DEVICES * (4096 + 8)), "b": jnp.zeros(3)}
    opt_state = jax.jit(lambda g, s, p: ls.apply_gradients(plain, g, s, p)[1])(
        grads, place_on(mesh, plain.init(big)),
        {"w": jax.device_put(big["w"], sharding), "b": place_on(mesh, big["b"])})
    out["jit"] = scaler_of(opt_state, False)
    return out


def autocast_scenarios() -> dict:
    """``ls.autocast`` inside pmap, shard_map (data and tensor parallel) and sharded jit:
    the loss and gradients of the float32 MLP autocast and as written (the same program on
    the same path: under vma-checked ``shard_map`` a replicated param's gradient comes back
    summed over "data", autocast or not), and the dtypes its matmuls ran in."""
    params, (x, y) = init_params(), batch(0)
    mesh = jax.make_mesh((N_DEVICES,), ("data",))
    out: dict[str, Any] = {}
    split = lambda a: a.reshape(N_DEVICES, -1, *a.shape[1:])  # noqa: E731
    rows = NamedSharding(mesh, P("data"))
    args = (place_on(mesh, params), jax.device_put(x, rows), jax.device_put(y, rows))
    mesh2 = jax.make_mesh((2, 4), ("data", "model"))
    specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}
    rows2 = NamedSharding(mesh2, P("data"))
    args2 = (place_on(mesh2, params, specs), jax.device_put(x, rows2), jax.device_put(y, rows2))
    for kind, cast in (("autocast", ls.autocast), ("float32", lambda f: f)):
        loss = cast(mlp_loss)

        def local(p, x, y, loss=loss):
            value, grads = jax.value_and_grad(loss)(p, x, y)
            return lax.pmean(value, "data"), grads

        def averaged(p, x, y, local=local):  # pmap: per-device gradients, averaged here
            value, grads = local(p, x, y)
            return value, lax.pmean(grads, "data")

        out[f"reference/{kind}"] = jax.value_and_grad(loss)(params, x, y)
        value, grads = jax.pmap(averaged, axis_name="data", in_axes=(None, 0, 0))(
            params, split(x), split(y))
        out[f"pmap/{kind}"] = (value[0], jax.tree.map(lambda g: g[0], grads))
        sharded = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data"),
                                                                     P("data")),
                                        out_specs=P()))
        out[f"shard_map/{kind}"] = sharded(*args)
        out[f"shard_map_dots/{kind}"] = sorted({
            tuple(str(v.aval.dtype) for v in e.invars)
            for e in _equations(jax.make_jaxpr(sharded)(*args).jaxpr)
            if e.primitive.name == "dot_general"})
        out[f"jit/{kind}"] = jax.jit(jax.value_and_grad(loss))(*args)
        # tensor parallel: the hidden layer split over "model" (one psum inside the loss)
        tp_loss = cast(functools.partial(mlp_loss, model_axis="model"))

        def tp_local(p, x, y, tp_loss=tp_loss):
            value, grads = jax.value_and_grad(tp_loss)(p, x, y)
            return lax.pmean(value, "data"), grads

        tp = jax.jit(jax.shard_map(tp_local, mesh=mesh2, in_specs=(specs, P("data"),
                                                                   P("data")),
                                   out_specs=(P(), specs)))
        out[f"shard_map_tp/{kind}"] = tp(*args2)
    return jax.tree.map(lambda a: host(a) if isinstance(a, jax.Array) else a, out)


def _equations(jaxpr: Any) -> Any:
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for item in value if isinstance(value, tuple) else (value,):
                inner = getattr(item, "jaxpr", item)
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


SCENARIOS: dict[str, Callable[[], dict]] = {
    "autocast": autocast_scenarios,
    "replay": replay_scenarios,


    "headroom": headroom,
    "all_finite": all_finite_scenarios,
    "grads_max": grads_max_scenarios,
    "step_collectives": step_collectives,
    "multi_step": multi_step,
    "controls": controls,
    "readme": readme_snippets,
    "fail_closed": fail_closed,  # last: failed callbacks leave noise in the runtime
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("names", nargs="*", default=list(SCENARIOS))
    args = parser.parse_args(argv)
    if jax.device_count() != N_DEVICES:
        print(f"need {N_DEVICES} devices (XLA_FLAGS={XLA_FLAGS!r} before jax is imported), "
              f"got {jax.devices()}", file=sys.stderr)
        return 2
    results: dict[str, Any] = {}
    for name in args.names:
        started = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                result = {"value": SCENARIOS[name](), "error": None}
            except Exception:  # noqa: BLE001 - reported to the test, which fails on it
                result = {"value": None, "error": traceback.format_exc()}
        result["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
        result["seconds"] = time.perf_counter() - started
        results[name] = result
        print(f"{name}: {'error' if result['error'] else 'done'} in {result['seconds']:.1f}s",
              file=sys.stderr)
    args.out.write_bytes(pickle.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
