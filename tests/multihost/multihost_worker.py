"""One process of a multi-process run on ``jax.distributed`` (CPU), or its single-process twin.

``test_multihost.py`` starts N copies of this script at once, process ``i`` with
``--num-processes N --process-id i``, each with ``--devices K`` virtual CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=K``, set here before jax is imported).
They meet at a coordinator on ``127.0.0.1:PORT`` (``jax.distributed.initialize``, gloo CPU
collectives), build meshes over all N*K devices, feed their own rows of each global batch
with ``jax.make_array_from_process_local_data``, and each write what they saw (one pickled
dict of plain values and bytes) to ``OUT/process_<i>.pkl``. With ``--num-processes 1`` there
is no coordinator: the same scenarios on one process with ``--devices`` devices, the
reference the multi-process runs must reproduce.

Run it by hand to debug a scenario (two processes of two devices each)::

    for i in 0 1; do
      PYTHONPATH=. python tests/multihost/multihost_worker.py --num-processes 2 \\
        --process-id $i --port 23456 --devices 2 --out /tmp/mh train &
    done; wait

What is recorded never goes through a collective: every process reads the bytes of its
*own* device buffers (``addressable_shards``), so the test sees a process (or a device)
whose copy of a replicated value drifted, even where the type system says "replicated".

Importing this module (pytest's doctest collection does) runs nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pickle
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--port", type=int, default=None, help="the coordinator's port")
    parser.add_argument("--devices", type=int, required=True, help="CPU devices per process")
    parser.add_argument("--out", type=Path, required=True, help="a folder for the results")
    parser.add_argument("--checkpoint", type=Path, default=None, help="the Orbax folder")
    parser.add_argument("scenarios", nargs="+")
    return parser.parse_args(argv)


if __name__ == "__main__":  # before jax is imported
    ARGS = parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " "
                               f"--xla_force_host_platform_device_count={ARGS.devices}").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import loss_scaling as ls  # noqa: E402

TESTS = Path(__file__).resolve().parents[1]
INIT_TIMEOUT_S = 60  # jax.distributed.initialize gives up after this (the test kills sooner)

# ------------------------------------------------------------------------ the schedule
#
# The README's model (tanh MLP 4 -> 8 -> 2, no biases, adam(1e-3)) on a global batch of
# 24 rows: divisible by every data-axis size used here (2, 3, 4, 6, 8). The last row lives
# on the last device, which belongs to the last process: the overflows go there.

N_STEPS = 8
GLOBAL_BATCH = 24
D_IN, D_HIDDEN, D_OUT = 4, 8, 2
BAD_ROW = GLOBAL_BATCH - 1
BATCH_INF_STEPS = (2,)  # an inf in the last process's rows of y
GRAD_NAN_STEPS = (5,)  # a NaN in the last device's gradients (each path says where)
FAIL_STEPS = 5
SAVE_AT = 4  # the checkpoint holds the state after steps 0..3 (step 2 skipped)


def scaler(**overrides: Any) -> ls.DynamicLossScale:
    """Growth every 2 clean steps, so that the scale both grows and backs off in 8 steps."""
    return ls.DynamicLossScale(**({"init_scale": 2.0**10, "growth_interval": 2} | overrides))


def batch(step: int, *, always_overflow: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The *global* batch of ``step``: every process computes it, and feeds its own rows."""
    rng = np.random.default_rng(100 + step)
    x = rng.normal(size=(GLOBAL_BATCH, D_IN)).astype(np.float32)
    y = rng.normal(size=(GLOBAL_BATCH, D_OUT)).astype(np.float32)
    if step in BATCH_INF_STEPS or always_overflow:
        y[BAD_ROW, 0] = np.inf
    return x, y


def bad_devices(step: int) -> np.ndarray:
    """One flag per device of the global mesh: the last device's gradients get a NaN."""
    bad = np.zeros(jax.device_count(), bool)
    if step in GRAD_NAN_STEPS:
        bad[-1] = True
    return bad


def init_params() -> dict[str, jax.Array]:
    """As the README creates them (under ``jax.set_mesh``: global, replicated arrays)."""
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w1": jax.random.normal(k1, (D_IN, D_HIDDEN)),
            "w2": jax.random.normal(k2, (D_HIDDEN, D_OUT))}


def poison(tree: Any, bad: jax.Array) -> Any:
    return jax.tree.map(lambda g: jnp.where(bad, jnp.nan, g), tree)


def replicated(x: Any) -> P:
    return P(*[None] * jnp.ndim(x))


# ------------------------------------------------------------------------- feeding


def local_rows(sharding: NamedSharding, shape: tuple[int, ...]) -> tuple[int, int]:
    """The rows of a global array of ``shape`` that this process's devices hold."""
    starts, stops = set(), set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        rows = index[0] if index else slice(None)
        starts.add(rows.start or 0)
        stops.add(shape[0] if rows.stop is None else rows.stop)
    start, stop = min(starts), max(stops)
    assert sum(b - a for a, b in zip(sorted(starts), sorted(stops), strict=True)) <= stop - start
    return start, stop


FED: dict[str, set[tuple[int, int]]] = {}  # the rows this process fed, per input


def feed(sharding: NamedSharding, value: np.ndarray, name: str) -> jax.Array:
    """This process's rows of ``value``, assembled into one global array."""
    start, stop = local_rows(sharding, value.shape)
    FED.setdefault(name, set()).add((start, stop))
    return jax.make_array_from_process_local_data(sharding, value[start:stop], value.shape)


# --------------------------------------------------------------------- reading buffers


def host(x: Any) -> np.ndarray:
    """A host copy (a view would keep a donated buffer alive)."""
    return np.array(x, copy=True)


def index_key(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple((s.start or 0, dim if s.stop is None else s.stop)
                 for s, dim in zip(index, shape, strict=True))


def snapshot(tree: Any, stacked: bool = False) -> dict[str, dict[str, Any]]:
    """Every leaf: dtype, global shape and, per shard index, the bytes of each local copy.

    ``stacked``: a ``pmap`` output, whose leading axis holds one copy per device (all
    copies are then filed under one index).
    """
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        shards: dict[Any, list[bytes]] = {}
        if isinstance(leaf, jax.Array):
            for shard in leaf.addressable_shards:
                data = host(shard.data)
                if stacked:
                    key: Any = index_key((slice(None),) * (data.ndim - 1), data.shape[1:])
                    data = data[0]
                else:
                    key = index_key(shard.index, leaf.shape)
                shards.setdefault(key, []).append(data.tobytes())
            shape = leaf.shape[1:] if stacked else leaf.shape
        else:
            data = np.asarray(leaf)
            shards[index_key((slice(None),) * data.ndim, data.shape)] = [data.tobytes()]
            shape = data.shape
        out[jax.tree_util.keystr(path)] = {"dtype": str(np.dtype(leaf.dtype)),
                                           "shape": tuple(shape), "shards": shards}
    return out


def per_device(x: jax.Array, stacked: bool = False) -> list[Any]:
    """This process's devices' copies of a replicated scalar, as Python values."""
    return [host(s.data).reshape(-1)[0].item() for s in x.addressable_shards] if stacked \
        else [host(s.data).reshape(()).item() for s in x.addressable_shards]


def metrics_record(opt_state: Any, stacked: bool = False) -> dict[str, list[Any]]:
    return {k: per_device(v, stacked) for k, v in ls.metrics(opt_state).items()}


def step_record(params: Any, opt_state: Any, stacked: bool = False) -> dict[str, Any]:
    return {"state": snapshot({"params": params, "opt_state": opt_state}, stacked),
            "metrics": metrics_record(opt_state, stacked)}


# -------------------------------------------------------------- the paths, as in README
#
# Each builds (tx, step, place, inputs): `place` puts the initial state where the step
# wants it, `inputs(step_index)` makes the step's global (x, y, bad) from this process's
# rows, and step(params, opt_state, x, y, bad) -> (params, opt_state, loss).


def path_jit(n_devices: int, **tx_kwargs: Any) -> dict[str, Any]:
    """The README's sharded ``jit``: a ("data", "model") mesh, hidden units split over
    "model", no ``axis_name``. A NaN step poisons the (global) gradients everywhere when
    the last device's flag is set: XLA reads that flag from the last process."""
    mesh = jax.make_mesh((n_devices // 2, 2), ("data", "model"))
    param_specs = {"w1": P(None, "model"), "w2": P("model", None)}
    tx = ls.with_loss_scaling(optax.adam(1e-3), tx_kwargs.pop("scale", scaler()), **tx_kwargs)

    def loss_fn(params, x, y):
        h = jnp.tanh(x @ params["w1"])
        pred = jnp.matmul(h, params["w2"], out_sharding=P("data", None))  # sums over "model"
        return jnp.mean((pred - y) ** 2)

    @jax.jit(donate_argnums=(0, 1))
    def train_step(params, opt_state, x, y, bad):
        loss, grads = ls.value_and_grad(loss_fn)(opt_state, params, x, y)
        grads = poison(grads, jnp.any(bad))
        params, opt_state = ls.apply_gradients(tx, grads, opt_state, params)
        return params, opt_state, loss

    def place(params, opt_state):
        opt_specs = optax.tree_map_params(tx, lambda _, spec: spec, opt_state, param_specs,
                                          transform_non_params=replicated)
        return jax.device_put((params, opt_state), (param_specs, opt_specs))

    def inputs(x, y, bad):
        rows = NamedSharding(mesh, P("data"))
        return (feed(rows, x, "x"), feed(rows, y, "y"),
                feed(NamedSharding(mesh, P(("data", "model"))), bad, "bad"))

    return {"mesh": mesh, "tx": tx, "step": train_step, "place": place, "inputs": inputs}


def path_shard_map(n_devices: int, **tx_kwargs: Any) -> dict[str, Any]:
    """The README's ``shard_map`` (vma-checked): the mean loss over devices is
    differentiated; a NaN step multiplies the last device's local loss by NaN."""
    mesh = jax.make_mesh((n_devices,), ("data",))
    tx = ls.with_loss_scaling(optax.adam(1e-3), tx_kwargs.pop("scale", scaler()),
                              axis_name="data", **tx_kwargs)

    def loss_fn(params, x, y, bad):  # the mean over all devices' rows
        local = jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)
        return lax.pmean(local * jnp.where(bad, jnp.nan, 1.0), "data")

    @jax.jit(donate_argnums=(0, 1))
    @jax.shard_map(mesh=mesh, in_specs=(P(), P(), P("data"), P("data"), P("data")),
                   out_specs=P())
    def train_step(params, opt_state, x, y, bad):
        loss, grads = ls.value_and_grad(loss_fn)(opt_state, params, x, y, bad[0])
        params, opt_state = ls.apply_gradients(tx, grads, opt_state, params)  # one pmin
        return params, opt_state, loss

    def place(params, opt_state):
        return params, opt_state  # created under set_mesh: replicated already

    def inputs(x, y, bad):
        rows = NamedSharding(mesh, P("data"))
        return feed(rows, x, "x"), feed(rows, y, "y"), feed(rows, bad, "bad")

    return {"mesh": mesh, "tx": tx, "step": train_step, "place": place, "inputs": inputs}


def path_shard_map_unchecked(n_devices: int, axis_name: Any = "data",
                             **tx_kwargs: Any) -> dict[str, Any]:
    """``shard_map`` with ``check_vma=False``, the plain optax path (``tx.update`` and
    ``optax.apply_updates``), and the NaN put into the last device's gradients *after*
    their mean over devices: only the wrapper's ``pmin`` can tell the other processes."""
    mesh = jax.make_mesh((n_devices,), ("data",))
    tx = ls.with_loss_scaling(optax.adam(1e-3), tx_kwargs.pop("scale", scaler()),
                              axis_name=axis_name, **tx_kwargs)

    def loss_fn(params, x, y):
        return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)

    @jax.jit(donate_argnums=(0, 1))
    @jax.shard_map(mesh=mesh, in_specs=(P(), P(), P("data"), P("data"), P("data")),
                   out_specs=P(), check_vma=False)
    def train_step(params, opt_state, x, y, bad):
        loss, grads = ls.value_and_grad(loss_fn)(opt_state, params, x, y)
        # The mean over devices in a fixed order (gather, then sum along the gathered
        # axis): the same bits on one process or many, whatever order the runtime's
        # all-reduce adds in, so this path can be compared with the reference exactly.
        grads = poison(jax.tree.map(lambda g: jnp.mean(lax.all_gather(g, "data"), axis=0),
                                    grads), bad[0])
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, lax.pmean(loss, "data")

    def place(params, opt_state):
        return params, opt_state

    def inputs(x, y, bad):
        rows = NamedSharding(mesh, P("data"))
        return feed(rows, x, "x"), feed(rows, y, "y"), feed(rows, bad, "bad")

    return {"mesh": mesh, "tx": tx, "step": train_step, "place": place, "inputs": inputs}


def path_pmap(n_devices: int, **tx_kwargs: Any) -> dict[str, Any]:
    """The README's ``pmap`` step: one copy of the state per device (the leading axis), a
    ``pmean`` of the gradients, and the NaN put into the last device's gradients after
    it: only the wrapper's ``pmin`` over "batch" can tell the other processes."""
    import flax.jax_utils

    tx = ls.with_loss_scaling(optax.adam(1e-3), tx_kwargs.pop("scale", scaler()),
                              axis_name="batch", **tx_kwargs)

    def loss_fn(params, x, y):
        return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)

    def train_step(params, opt_state, x, y, bad):
        loss, grads = ls.value_and_grad(loss_fn)(opt_state, params, x, y)
        grads = poison(lax.pmean(grads, "batch"), bad)
        params, opt_state = ls.apply_gradients(tx, grads, opt_state, params)
        return params, opt_state, lax.pmean(loss, "batch")

    def place(params, opt_state):
        # One copy per local device, with the step's axis name (else the second step
        # traces again).
        return flax.jax_utils.replicate((params, opt_state), axis_name="batch")

    def inputs(x, y, bad):
        k, process = jax.local_device_count(), jax.process_index()
        start = process * GLOBAL_BATCH // jax.process_count()
        stop = (process + 1) * GLOBAL_BATCH // jax.process_count()
        FED.setdefault("x", set()).add((start, stop))
        split = lambda a: a[start:stop].reshape(k, -1, *a.shape[1:])  # noqa: E731
        return split(x), split(y), bad[process * k:(process + 1) * k]

    return {"mesh": None, "tx": tx, "place": place, "inputs": inputs, "stacked": True,
            "step": jax.pmap(train_step, axis_name="batch", donate_argnums=(0, 1))}


PATHS: dict[str, Callable[..., dict[str, Any]]] = {
    "jit": path_jit,
    "shard_map": path_shard_map,
    "shard_map_unchecked": path_shard_map_unchecked,
    "pmap": path_pmap,
}


# (path, scaler configuration, other options) -> an earlier run's build.
BUILT: dict[tuple[str, str, str], dict[str, Any]] = {}


def run(path: str, *, steps: int = N_STEPS, always_overflow: bool = False,
        **kwargs: Any) -> dict[str, Any]:
    """Trains ``steps`` steps on one path; returns what this process saw after each."""
    built = PATHS[path](jax.device_count(), **kwargs)
    # A run whose step is the same program as an earlier run's (the same path, options and
    # scaler configuration: only the initial scale, a value in the state, differs) reuses
    # that run's compiled step; its own tx still makes the initial state.
    key = (path, repr(kwargs.get("scale", scaler()).config),
           repr(sorted((k, v) for k, v in kwargs.items() if k != "scale")))
    built = {**BUILT.setdefault(key, built), "tx": built["tx"]}
    FED.clear()
    out: dict[str, Any] = {"steps": []}
    stacked = built.get("stacked", False)
    mesh = built["mesh"]
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        params = init_params()
        opt_state = built["tx"].init(params)
        params, opt_state = built["place"](params, opt_state)
        out["initial"] = step_record(params, opt_state, stacked)
        for i in range(steps):
            x, y = batch(i, always_overflow=always_overflow)
            params, opt_state, loss = built["step"](params, opt_state,
                                                    *built["inputs"](x, y, bad_devices(i)))
            out["steps"].append(step_record(params, opt_state, stacked))
    out["fed_rows"] = {name: sorted(rows) for name, rows in FED.items()}
    out["cache_size"] = getattr(built["step"], "_cache_size", lambda: None)()
    out["params"], out["opt_state"] = params, opt_state  # for the caller; dropped when saved
    return out


def public(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if k not in ("params", "opt_state")}


# ------------------------------------------------------------------------- scenarios


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Every path, with the overflows of the schedule, and the control without a pmin."""
    out = {path: public(run(path)) for path in PATHS}
    out["control"] = public(run("shard_map_unchecked", axis_name=None,
                                steps=GRAD_NAN_STEPS[0] + 1))
    return out


def fail_closed(args: argparse.Namespace) -> dict[str, Any]:
    """Always overflowing from 2**-124: the third backoff leaves float32's normal range."""
    out = {}
    for path in ("jit", "shard_map", "pmap"):
        result = run(path, steps=FAIL_STEPS, always_overflow=True,
                     scale=scaler(init_scale=2.0**-124))
        try:
            ls.check(result["opt_state"])
            result["check"] = None
        except ls.LossScaleError as error:
            result["check"] = f"{type(error).__name__}: {error}"
        out[path] = public(result)
    return out


def checkpoint_mesh() -> Mesh:
    """For the checkpoint: hidden units split over the *processes* ("model" spans them),
    so that every process holds (and writes) shards no other process has."""
    n, k = jax.process_count(), jax.local_device_count()
    if n == 1:
        return jax.make_mesh((jax.device_count() // 2, 2), ("data", "model"))
    devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
    return Mesh(devices.reshape(n, k).T, ("data", "model"),
                axis_types=(AxisType.Explicit, AxisType.Explicit))  # as jax.make_mesh


def checkpoint_run(mesh: Mesh) -> dict[str, Any]:
    """The README's jit step on ``mesh``, and a ``make_state`` as the README's recipe wants."""
    param_specs = {"w1": P(None, "model"), "w2": P("model", None)}
    tx = ls.with_loss_scaling(optax.adam(1e-3), scaler())

    def loss_fn(params, x, y):
        h = jnp.tanh(x @ params["w1"])
        pred = jnp.matmul(h, params["w2"], out_sharding=P("data", None))
        return jnp.mean((pred - y) ** 2)

    @jax.jit(donate_argnums=0)
    def train_step(state, x, y):
        params, opt_state = state["params"], state["opt_state"]
        loss, grads = ls.value_and_grad(loss_fn)(opt_state, params, x, y)
        params, opt_state = ls.apply_gradients(tx, grads, opt_state, params)
        return {"params": params, "opt_state": opt_state}

    def make_state():
        params = init_params()
        opt_state = tx.init(params)
        opt_specs = optax.tree_map_params(tx, lambda _, spec: spec, opt_state, param_specs,
                                          transform_non_params=replicated)
        return jax.device_put({"params": params, "opt_state": opt_state},
                              {"params": param_specs, "opt_state": opt_specs})

    def step(state, i):
        x, y = batch(i)
        rows = NamedSharding(mesh, P("data"))
        return train_step(state, feed(rows, x, "x"), feed(rows, y, "y"))

    return {"make_state": make_state, "step": step}


def recipe() -> dict[str, Any]:
    """The Orbax recipe (``save`` / ``restore``) of docs/checkpoints.md, as
    ``tests/test_checkpoint_recipe.py`` runs it (the docs block imported, its demo part not run)."""
    sys.path.insert(0, str(TESTS))
    from checkpoint_states import recipe as docs_recipe

    return docs_recipe()


def save(args: argparse.Namespace) -> dict[str, Any]:
    """Train SAVE_AT steps, save with the README's recipe, then train on to N_STEPS."""
    import orbax.checkpoint as ocp

    mesh = checkpoint_mesh()
    out: dict[str, Any] = {"steps": []}
    with jax.set_mesh(mesh):
        run_ = checkpoint_run(mesh)
        state = run_["make_state"]()
        for i in range(SAVE_AT):
            state = run_["step"](state, i)
        out["saved"] = snapshot(state)
        out["saved_metrics"] = metrics_record(state["opt_state"])
        with ocp.CheckpointManager(args.checkpoint) as mngr:
            recipe()["save"](mngr, SAVE_AT, state)
            for i in range(SAVE_AT, N_STEPS):  # training goes on while Orbax writes
                state = run_["step"](state, i)
                out["steps"].append(step_record(state["params"], state["opt_state"]))
            mngr.wait_until_finished()
    return out


def resume(args: argparse.Namespace) -> dict[str, Any]:
    """A fresh run (any process and device count): restore with the README's recipe into
    the freshly built state's shapes and shardings, then train on to N_STEPS."""
    import orbax.checkpoint as ocp

    mesh = checkpoint_mesh()
    out: dict[str, Any] = {"steps": []}
    with jax.set_mesh(mesh):
        run_ = checkpoint_run(mesh)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, run_["make_state"]())
        with ocp.CheckpointManager(args.checkpoint) as mngr:
            out["latest_step"] = mngr.latest_step()
            state = recipe()["restore"](mngr, abstract)
        out["restored"] = snapshot(state)
        out["restored_metrics"] = metrics_record(state["opt_state"])
        out["shardings"] = {jax.tree_util.keystr(k): str(v.sharding.spec)
                            for k, v in jax.tree_util.tree_leaves_with_path(state)}
        for i in range(SAVE_AT, N_STEPS):
            state = run_["step"](state, i)
            out["steps"].append(step_record(state["params"], state["opt_state"]))
    return out


SCENARIOS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "train": train,
    "fail_closed": fail_closed,
    "save": save,
    "resume": resume,
}


def main(args: argparse.Namespace) -> int:
    if args.num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{args.port}", num_processes=args.num_processes,
            process_id=args.process_id, initialization_timeout=INIT_TIMEOUT_S,
            # Listen on localhost only (the default is every interface, "[::]:PORT").
            coordinator_bind_address=f"127.0.0.1:{args.port}")
    expected = (args.num_processes, args.num_processes * args.devices, args.devices)
    got = (jax.process_count(), jax.device_count(), jax.local_device_count())
    if got != expected:
        print(f"process {args.process_id}: expected (processes, devices, local devices) "
              f"{expected}, got {got}: XLA_FLAGS must be set before jax is imported",
              file=sys.stderr)
        return 2
    results: dict[str, Any] = {"meta": {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "devices": [(d.id, d.process_index) for d in jax.devices()],
        "local_devices": [d.id for d in jax.local_devices()],
        "collectives": jax.config.jax_cpu_collectives_implementation,
    }}
    for name in args.scenarios:
        started = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                result = {"value": SCENARIOS[name](args), "error": None}
            except Exception:  # noqa: BLE001 - reported to the test, which fails on it
                result = {"value": None, "error": traceback.format_exc()}
                print(result["error"], file=sys.stderr)
        result["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
        result["seconds"] = time.perf_counter() - started
        results[name] = result
        print(f"process {args.process_id}: {name} "
              f"{'error' if result['error'] else 'done'} in {result['seconds']:.1f}s",
              file=sys.stderr, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    partial = args.out / f"process_{args.process_id}.pkl.partial"
    partial.write_bytes(pickle.dumps(results))
    partial.rename(args.out / f"process_{args.process_id}.pkl")
    if args.num_processes > 1:
        jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
