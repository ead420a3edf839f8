"""Checkpoints and resume: Orbax and flax.serialization round trips, config changes, resume.

Orbax stores the loss scale's *values* (leaves); its configuration (``growth_interval`` etc.)
is static pytree data and comes from the restore target. The recipe of docs/checkpoints.md
(run and imported here) therefore saves ``ls.state_dict`` as JSON next to the arrays and
checks it on restore with ``ls.restore_loss_scale``: a changed configuration is an error
unless adopted explicitly.

Run as a script (``python tests/test_checkpoint.py DIR``), this file is the fresh process of
the resume test: it rebuilds every run from scratch, restores the checkpoints the test wrote
under DIR, finishes the runs and dumps their final states for the test to compare with the
uninterrupted runs.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import re
import subprocess
import sys

import doc_blocks
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax.training import train_state

import loss_scaling as ls

INF = float("inf")
# The recipe of docs/checkpoints.md (its `<!-- block: name=recipe -->` block): imported, it
# defines save / restore / make_state, which the tests below use; run as a program, it saves
# and resumes a state (test_docs_recipe_runs).
RECIPE = doc_blocks.named("checkpoints.md", "recipe")
JSON_BLOCK = doc_blocks.named("checkpoints.md", "json")


def recipe() -> dict:
    """The docs' save / restore functions (the block imported, its demo part not run)."""
    return doc_blocks.execute(RECIPE, module_name="checkpointing")


# --------------------------------------------------------------------------- helpers


def as_bytes(x) -> np.ndarray:
    return np.asarray(x).reshape(-1).view(np.uint8)


def assert_bit_identical(a, b, same_treedef=True):
    """Same leaves bit for bit (dtype, shape, bytes); same treedef (configs included).

    A Python scalar leaf (a TrainState's initial ``step``) counts as the array JAX makes of it.
    """
    if same_treedef:
        assert jax.tree.structure(a) == jax.tree.structure(b)
    la, lb = jax.tree.leaves_with_path(a), jax.tree.leaves_with_path(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb, strict=True):
        x, y = (np.asarray(jnp.asarray(v) if isinstance(v, (int, float)) else v) for v in (x, y))
        assert (x.dtype, x.shape) == (y.dtype, y.shape), jax.tree_util.keystr(path)
        assert np.array_equal(as_bytes(x), as_bytes(y)), jax.tree_util.keystr(path)


def host_copy(tree):
    """A numpy copy, safe from donation."""
    return jax.tree.map(np.array, tree)


def scalers():
    """Each kind with non-default values in every leaf."""
    dynamic = ls.DynamicLossScale(init_scale=1000.0, growth_interval=5, hysteresis=3,
                                  min_scale=2.0, growth_factor=3.0, backoff_factor=0.25)
    for finite in (True, True, False, True, True, True, True, True, False):
        dynamic = ls.update(dynamic, finite)
    assert int(dynamic.growth_tracker) == 0 and int(dynamic.nonfinite_tracker) == 1
    dynamic = ls.update(ls.update(dynamic, True), True)  # growth_tracker 2, streak reset
    return {"noop": ls.NoOpLossScale(), "static": ls.StaticLossScale(96.0), "dynamic": dynamic}


SCALER_KINDS = pytest.mark.parametrize("kind", ["noop", "static", "dynamic"])
PARAMS = {"w": jnp.arange(6.0).reshape(3, 2), "b": jnp.array([0.5, -0.0])}


def chained(scaler):
    """The wrapper around an optax.chain of adamw and a schedule with its own state (the
    wrapper outermost: a schedule chained after it would count skipped steps, and is
    refused by ls.check / ls.metrics)."""
    return ls.with_loss_scaling(optax.chain(
        optax.adamw(1e-2),
        optax.scale_by_schedule(lambda count: 1.0 / (1.0 + 0.1 * count)),
    ), scaler)


def stepped_chain_state(scaler, poison=(1.0, INF, 1.0)):
    tx = chained(scaler)
    params, opt_state = PARAMS, tx.init(PARAMS)
    for p in poison:
        grads = jax.tree.map(lambda x, p=p: (x + 1.0) * p, params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return tx, params, opt_state


# ----------------------------------------------------------------- Orbax round trips


@SCALER_KINDS
def test_standard_checkpointer_round_trip_of_each_scaler(kind, tmp_path):
    s = scalers()[kind]
    targets = {
        "shape_dtype": jax.tree.map(ocp.utils.to_shape_dtype_struct, s),
        "eval_shape": jax.eval_shape(lambda: s),
    }
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "s", s)
        ckptr.wait_until_finished()
        for target in targets.values():
            restored = ckptr.restore(tmp_path / "s", target)
            assert type(restored) is type(s)
            assert_bit_identical(restored, s)  # the treedef holds the config


@SCALER_KINDS
@pytest.mark.parametrize("target_from", ["shape_dtype", "eval_shape"])
@pytest.mark.parametrize("checkpointer", ["standard", "manager"])
def test_orbax_round_trip_of_a_wrapped_state_in_a_chain(kind, target_from, checkpointer,
                                                       tmp_path):
    tx, params, opt_state = stepped_chain_state(scalers()[kind])
    state = {"params": params, "opt_state": opt_state}
    if target_from == "shape_dtype":
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    else:  # what a fresh process has: the optimizer rebuilt, nothing computed
        target = jax.eval_shape(lambda p: {"params": p, "opt_state": tx.init(p)}, PARAMS)
    if checkpointer == "standard":
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(tmp_path / "s", state)
            ckptr.wait_until_finished()
            restored = ckptr.restore(tmp_path / "s", target)
    else:
        with ocp.CheckpointManager(tmp_path / "m") as mngr:
            mngr.save(7, args=ocp.args.StandardSave(state))
            mngr.wait_until_finished()
            restored = mngr.restore(7, args=ocp.args.StandardRestore(target))
    assert_bit_identical(restored, state)
    assert int(ls.metrics(restored["opt_state"])["skipped_steps"]) == 1


@pytest.mark.parametrize("state_cls", [ls.TrainState, train_state.TrainState],
                         ids=["ls", "flax"])
def test_orbax_and_flax_round_trips_of_a_train_state(state_cls, tmp_path):
    def make_state():
        tx = ls.with_loss_scaling(optax.adamw(1e-2), ls.DynamicLossScale(
            init_scale=512.0, growth_interval=3, hysteresis=2))
        return state_cls.create(apply_fn=None, params=PARAMS, tx=tx)

    state = make_state()
    for p in (1.0, INF, 1.0, 1.0):
        state = state.apply_gradients(grads=jax.tree.map(lambda x, p=p: (x - 1.0) * p,
                                                         state.params))
    assert int(ls.get_loss_scale(state).nonfinite_tracker) == 0
    assert int(ls.get_loss_scale(state).growth_tracker) == 2
    assert int(ls.metrics(state)["skipped_steps"]) == 1
    fresh = jax.eval_shape(make_state)

    with ocp.CheckpointManager(tmp_path / "m") as mngr:
        mngr.save(4, args=ocp.args.StandardSave(state))
        mngr.wait_until_finished()
        restored = mngr.restore(4, args=ocp.args.StandardRestore(fresh))
    assert type(restored) is state_cls
    assert_bit_identical(restored, state, same_treedef=False)  # tx: a new object
    assert ls.get_loss_scale(restored).config == ls.get_loss_scale(state).config

    from_bytes = flax.serialization.from_bytes(make_state(), flax.serialization.to_bytes(state))
    assert_bit_identical(from_bytes, state, same_treedef=False)


# ------------------------------------------------------------ the docs' recipe


def test_docs_recipe_runs(tmp_path, capsys):
    ns = doc_blocks.execute(RECIPE, cwd=tmp_path)  # as a program: save, then resume
    state, resumed, adopted = ns["state"], ns["resumed"], ns["adopted"]
    assert float(ls.get_loss_scale(state).loss_scale) == 16384.0
    assert_bit_identical(resumed, state, same_treedef=False)
    assert ls.get_loss_scale(resumed).config == ls.get_loss_scale(state).config
    assert_bit_identical(adopted, state, same_treedef=False)  # values kept...
    assert ls.get_loss_scale(adopted).growth_interval == 500  # ...under the new config
    assert capsys.readouterr().out == "16384.0 500\n"
    with ocp.CheckpointManager(tmp_path / "checkpoints") as mngr:  # the commented-out line
        with pytest.raises(ValueError, match="growth_interval: saved 1000, target 500"):
            ns["restore"](mngr, ns["new_config"])


def test_docs_json_snippet_runs():
    ns = doc_blocks.namespace(JSON_BLOCK)
    assert json.loads(ns["text"])["values"] == {
        "loss_scale": 1024.0, "growth_tracker": 1, "nonfinite_tracker": 0}
    assert_bit_identical(ns["s"], ls.update(ls.DynamicLossScale(
        init_scale=1024.0, growth_interval=100), True))


def test_plain_orbax_restore_takes_the_targets_config_which_the_recipe_refuses(tmp_path):
    # Why the recipe saves the JSON: Orbax alone adopts the target's configuration silently.
    _, params, opt_state = stepped_chain_state(ls.DynamicLossScale(
        init_scale=256.0, growth_interval=3, hysteresis=2), poison=(1.0, 1.0, INF))
    state = {"params": params, "opt_state": opt_state}
    new_tx = chained(ls.DynamicLossScale(init_scale=256.0, growth_interval=100, hysteresis=2))
    target = jax.eval_shape(lambda p: {"params": p, "opt_state": new_tx.init(p)}, params)
    with ocp.CheckpointManager(tmp_path / "m") as mngr:
        mngr.save(3, args=ocp.args.StandardSave(state))
        mngr.wait_until_finished()
        silently = mngr.restore(3, args=ocp.args.StandardRestore(target))
    assert ls.get_loss_scale(silently["opt_state"]).growth_interval == 100

    save, restore = recipe()["save"], recipe()["restore"]
    with ocp.CheckpointManager(tmp_path / "recipe") as mngr:
        save(mngr, 3, state)
        mngr.wait_until_finished()
        with pytest.raises(ValueError) as info:
            restore(mngr, target)
        message = str(info.value)
        assert "growth_interval: saved 3, target 100" in message
        assert "adopt_config=True" in message
        adopted = restore(mngr, target, adopt_config=True)
    saved_scaler = ls.get_loss_scale(state)
    scaler = ls.get_loss_scale(adopted)
    assert scaler.config == ls.get_loss_scale(target).config
    assert_bit_identical(adopted, state, same_treedef=False)  # scale and counters kept
    assert (float(scaler.loss_scale), int(scaler.nonfinite_tracker)) == (256.0, 1)
    # The new config rules from here: the next overflow backs off (hysteresis 2), then
    # growth waits for 100 clean steps, not 3.
    for finite in [False] + [True] * 99:
        scaler, saved_scaler = ls.update(scaler, finite), ls.update(saved_scaler, finite)
    assert float(saved_scaler.loss_scale) > 128.0
    assert (float(scaler.loss_scale), int(scaler.growth_tracker)) == (128.0, 99)
    assert float(ls.update(scaler, True).loss_scale) == 256.0


@pytest.mark.parametrize("change", [
    dict(growth_interval=50), dict(hysteresis=1), dict(min_scale=1.0), dict(growth_factor=4.0),
])
def test_any_config_change_is_refused_by_default_and_adopted_on_request(change, tmp_path):
    base = dict(init_scale=256.0, growth_interval=3, hysteresis=2)
    tx = ls.with_loss_scaling(optax.sgd(0.1), ls.DynamicLossScale(**base))
    state = {"opt_state": tx.init(PARAMS)}
    state["opt_state"] = tx.update(PARAMS, state["opt_state"], PARAMS)[1]  # tracker 1
    new_tx = ls.with_loss_scaling(optax.sgd(0.1), ls.DynamicLossScale(**{**base, **change}))
    target = jax.eval_shape(lambda: {"opt_state": new_tx.init(PARAMS)})
    ns = recipe()
    with ocp.CheckpointManager(tmp_path / "m") as mngr:
        ns["save"](mngr, 1, state)
        mngr.wait_until_finished()
        name = next(iter(change))
        with pytest.raises(ValueError, match=f"{name}: saved"):
            ns["restore"](mngr, target)
        adopted = ns["restore"](mngr, target, adopt_config=True)
    s = ls.get_loss_scale(adopted)
    assert getattr(s, name) == change[name]
    assert (float(s.loss_scale), int(s.growth_tracker), int(s.nonfinite_tracker)) == (256.0, 1, 0)


def test_saved_scale_is_restored_not_reset(tmp_path):
    # PyTorch users lose the scale on resume (256 -> 65536: the next steps overflow).
    def make_state():
        return ls.TrainState.create(apply_fn=None, params=PARAMS,
                                    tx=ls.with_loss_scaling(optax.adam(1e-3)))  # defaults

    state = make_state()
    bad = jax.tree.map(lambda x: x * INF, PARAMS)
    for _ in range(7):  # 2**15 -> 2**8
        state = state.apply_gradients(grads=bad)
    assert float(ls.get_loss_scale(state).loss_scale) == 256.0
    assert float(ls.get_loss_scale(make_state()).loss_scale) == 32768.0
    ns = recipe()
    with ocp.CheckpointManager(tmp_path / "m") as mngr:
        ns["save"](mngr, 7, state)
        mngr.wait_until_finished()
        restored = ns["restore"](mngr, jax.eval_shape(make_state))
    assert float(ls.get_loss_scale(restored).loss_scale) == 256.0
    assert int(ls.metrics(restored)["consecutive_skips"]) == 7
    assert int(restored.step) == 7


def test_restore_loss_scale_refuses_another_kind_and_ambiguity():
    wrapped = ls.with_loss_scaling(optax.sgd(0.1), ls.StaticLossScale(8.0)).init(PARAMS)
    saved = ls.state_dict(ls.DynamicLossScale())
    for adopt in (False, True):
        with pytest.raises(ValueError, match="kind: saved 'dynamic', target 'static'"):
            ls.restore_loss_scale(wrapped, saved, adopt_config=adopt)
    two = {"g": ls.with_loss_scaling(optax.sgd(0.1)).init(PARAMS),
           "d": ls.with_loss_scaling(optax.sgd(0.1)).init(PARAMS)}
    with pytest.raises(ValueError, match="Found 2 loss scales"):
        ls.restore_loss_scale(two, saved)
    restored = ls.restore_loss_scale(two, ls.state_dict(ls.DynamicLossScale(init_scale=4.0)),
                                     path="['d']")
    assert float(ls.get_loss_scale(restored, path="['d']").loss_scale) == 4.0
    assert_bit_identical(restored["g"], two["g"])
    inner = ls.with_loss_scaling(optax.sgd(0.1))
    nested = ls.with_loss_scaling(optax.chain(inner, optax.scale(1.0))).init(PARAMS)
    with pytest.raises(ValueError, match="nested inside another"):
        ls.restore_loss_scale(nested, saved, path=".inner_state[0]")


# ------------------------------------------------ resume in a fresh process: bit-identical

N_STEPS, RESUME_AT = 30, 16
OVERFLOW_STEPS = frozenset({2, 3, 4, 9, 15, 16, 22, 23, 24})
VARIANTS = ("plain", "fused", "ls_train_state", "flax_train_state")


def make_scaler():
    return ls.DynamicLossScale(init_scale=2.0**12, growth_interval=3, hysteresis=2)


def init_params():
    rng = np.random.default_rng(0)
    return {
        "w1": jnp.asarray(rng.normal(size=(4, 8)), jnp.float32),
        "b1": jnp.zeros(8, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(8, 1)) * 0.3, jnp.float32),
    }


def batches():
    """(x, y, poison) for every step; poison is inf on the steps that overflow."""
    rng = np.random.default_rng(1)
    xs = rng.normal(size=(N_STEPS, 16, 4)).astype(np.float32)
    ys = rng.normal(size=(N_STEPS, 16, 1)).astype(np.float32)
    poison = np.array([INF if t in OVERFLOW_STEPS else 1.0 for t in range(N_STEPS)],
                      np.float32)
    return [(jnp.asarray(xs[t]), jnp.asarray(ys[t]), jnp.asarray(poison[t]))
            for t in range(N_STEPS)]


def loss_fn(params, x, y, poison):
    h = jax.nn.relu(x.astype(jnp.float16) @ params["w1"].astype(jnp.float16)
                    + params["b1"].astype(jnp.float16))
    pred = (h @ params["w2"].astype(jnp.float16)).astype(jnp.float32)  # float16 compute
    return jnp.mean((pred - y) ** 2) * poison


def make_run(variant):
    """(a fresh initial state, its jitted step) for one variant, built from scratch."""
    if variant == "plain":  # tx.update + optax.apply_updates, the wrapper inside a chain
        tx = chained(make_scaler())

        @jax.jit
        def step(state, x, y, poison):
            params, opt_state = state["params"], state["opt_state"]
            _, grads = ls.value_and_grad(loss_fn)(opt_state, params, x, y, poison)
            updates, opt_state = tx.update(grads, opt_state, params)
            return {"params": optax.apply_updates(params, updates), "opt_state": opt_state}

        return {"params": init_params(), "opt_state": tx.init(init_params())}, step
    if variant == "fused":  # ls.apply_gradients, donated buffers
        tx = ls.with_loss_scaling(optax.adamw(1e-2), make_scaler())

        @functools.partial(jax.jit, donate_argnums=0)
        def step(state, x, y, poison):
            params, opt_state = state["params"], state["opt_state"]
            _, grads = ls.value_and_grad(loss_fn)(opt_state, params, x, y, poison)
            params, opt_state = ls.apply_gradients(tx, grads, opt_state, params)
            return {"params": params, "opt_state": opt_state}

        return {"params": init_params(), "opt_state": tx.init(init_params())}, step
    if variant == "ls_train_state":  # fused, through ls.TrainState
        cls, tx = ls.TrainState, ls.with_loss_scaling(optax.adamw(1e-2), make_scaler())
    else:  # flax's TrainState: tx.update + apply_updates
        cls, tx = train_state.TrainState, chained(make_scaler())

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, x, y, poison):
        _, grads = ls.value_and_grad(loss_fn)(state, state.params, x, y, poison)
        return state.apply_gradients(grads=grads)

    return cls.create(apply_fn=None, params=init_params(), tx=tx), step


def dump(state, path: pathlib.Path) -> None:
    """Every leaf (by key path) and the loss scale's state dict, to compare across processes."""
    leaves = jax.tree.leaves_with_path(state)
    np.savez(path.with_suffix(".npz"), *[np.asarray(x) for _, x in leaves])
    path.with_suffix(".json").write_text(json.dumps({
        "paths": [jax.tree_util.keystr(p) for p, _ in leaves],
        "loss_scale": ls.state_dict(ls.get_loss_scale(state)),
    }))


def assert_matches_dump(state, path: pathlib.Path) -> None:
    meta = json.loads(path.with_suffix(".json").read_text())
    leaves = jax.tree.leaves_with_path(state)
    assert meta["paths"] == [jax.tree_util.keystr(p) for p, _ in leaves]
    assert meta["loss_scale"] == ls.state_dict(ls.get_loss_scale(state))  # config too
    with np.load(path.with_suffix(".npz")) as arrays:
        dumped = [arrays[f"arr_{i}"] for i in range(len(leaves))]
    assert_bit_identical([x for _, x in leaves], dumped)


def resume_in_this_process(directory: pathlib.Path) -> None:
    """The fresh process: rebuild, restore at RESUME_AT, finish the run, dump."""
    save_restore = recipe()
    data = batches()
    for variant in VARIANTS:
        fresh, step = make_run(variant)
        with ocp.CheckpointManager(directory / variant) as mngr:
            state = save_restore["restore"](mngr, jax.eval_shape(lambda fresh=fresh: fresh))
        dump(state, directory / f"{variant}_restored")
        for t in range(RESUME_AT, N_STEPS):
            state = step(state, *data[t])
        dump(state, directory / f"{variant}_final")


def test_resume_in_a_fresh_process_is_bit_identical(tmp_path):
    save = recipe()["save"]
    data = batches()
    at_checkpoint, final = {}, {}
    for variant in VARIANTS:
        state, step = make_run(variant)
        with ocp.CheckpointManager(tmp_path / variant) as mngr:
            for t in range(N_STEPS):
                if t == RESUME_AT:
                    save(mngr, t, state)  # async: training goes on (and donates) meanwhile
                    at_checkpoint[variant] = host_copy(state)
                state = step(state, *data[t])
            mngr.wait_until_finished()
        final[variant] = host_copy(state)

        # The run is the one intended: a pending hysteresis at the checkpoint (the step
        # after it backs off only if nonfinite_tracker survives), growths and backoffs.
        scaler = ls.get_loss_scale(at_checkpoint[variant])
        assert (int(scaler.nonfinite_tracker), int(scaler.growth_tracker)) == (1, 0)
        assert int(ls.metrics(final[variant])["skipped_steps"]) == len(OVERFLOW_STEPS)
        assert ls.get_loss_scale(final[variant]).loss_scale != make_scaler().loss_scale

    for a, b in [("plain", "flax_train_state"), ("fused", "ls_train_state")]:
        assert_bit_identical(final[a]["params"], final[b].params)  # the same computation

    result = subprocess.run(
        [sys.executable, __file__, str(tmp_path)], capture_output=True, text=True,
        timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr[-5000:]
    for variant in VARIANTS:
        assert_matches_dump(at_checkpoint[variant], tmp_path / f"{variant}_restored")
        assert_matches_dump(final[variant], tmp_path / f"{variant}_final")


if __name__ == "__main__":
    resume_in_this_process(pathlib.Path(sys.argv[1]))


# ------------------------------------------------ restore on every route and layout (13)


def test_restore_loss_scale_keeps_a_pmap_replicated_layout():
    # flax.jax_utils.replicate gives every leaf a leading device axis; restoring a saved
    # scalar used to fail in device_put ("incompatible with its sharding annotation").
    from flax import jax_utils

    tx = ls.with_loss_scaling(optax.sgd(0.1), ls.DynamicLossScale(init_scale=256.0,
                                                                  growth_interval=4))
    replicated = jax_utils.replicate(tx.init(PARAMS))
    saved = ls.update(ls.update(ls.DynamicLossScale(init_scale=64.0, growth_interval=4),
                                True), True)
    n = jax.local_device_count()
    for adopt in (False, True):
        out = ls.restore_loss_scale(replicated, ls.state_dict(saved), adopt_config=adopt)
        old, new = ls.get_loss_scale(replicated), ls.get_loss_scale(out)
        for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(new), strict=True):
            assert (b.shape, b.dtype, b.sharding) == (a.shape, a.dtype, a.sharding) == (
                b.shape, b.dtype, b.sharding)
        assert new.loss_scale.tolist() == [64.0] * n
        assert new.growth_tracker.tolist() == [2] * n


def test_restore_loss_scale_refuses_a_different_static_factor_unless_adopted():
    def make(factor):
        return ls.TrainState.create(apply_fn=None, params=PARAMS, tx=ls.with_loss_scaling(
            optax.sgd(0.1), ls.StaticLossScale(factor)))

    saved = ls.state_dict(ls.StaticLossScale(128.0))
    with pytest.raises(ValueError, match=r"a StaticLossScale's factor\): saved 128.0, target "
                                         r"1024.0"):
        ls.restore_loss_scale(make(1024.0), saved)
    adopted = ls.restore_loss_scale(make(1024.0), saved, adopt_config=True)
    assert float(ls.get_loss_scale(adopted).loss_scale) == 1024.0   # the configured factor
    kept = ls.restore_loss_scale(make(128.0), saved)
    assert float(ls.get_loss_scale(kept).loss_scale) == 128.0


def linen_state():
    tx = ls.with_loss_scaling(optax.adamw(1e-2), ls.DynamicLossScale(
        init_scale=512.0, growth_interval=3, hysteresis=2))
    return train_state.TrainState.create(apply_fn=None, params=PARAMS, tx=tx)


def ls_state():
    tx = ls.with_loss_scaling(optax.adamw(1e-2), ls.DynamicLossScale(
        init_scale=512.0, growth_interval=3, hysteresis=2))
    return ls.TrainState.create(apply_fn=None, params=PARAMS, tx=tx)


def dict_state():
    tx = chained(ls.DynamicLossScale(init_scale=512.0, growth_interval=3, hysteresis=2))
    return {"params": PARAMS, "opt_state": tx.init(PARAMS)}


def stepped(state):
    grads = [jax.tree.map(lambda x, p=p: (x - 1.0) * p, PARAMS) for p in (1.0, INF, 1.0)]
    if isinstance(state, dict):
        tx = chained(ls.DynamicLossScale(init_scale=512.0, growth_interval=3, hysteresis=2))
        for g in grads:
            updates, opt_state = tx.update(g, state["opt_state"], state["params"])
            state = {"params": optax.apply_updates(state["params"], updates),
                     "opt_state": opt_state}
        return state
    for g in grads:
        state = state.apply_gradients(grads=g)
    return state


ORBAX_STATES = pytest.mark.parametrize("make", [linen_state, ls_state, dict_state],
                                       ids=["linen", "ls", "dict"])


@ORBAX_STATES
def test_orbax_helpers_round_trip_bit_identically(make, tmp_path):
    state = stepped(make())
    assert int(ls.metrics(state if not isinstance(state, dict) else state["opt_state"])[
        "skipped_steps"]) == 1
    with ocp.CheckpointManager(tmp_path / "m") as mngr:
        mngr.save(3, args=ls.orbax_save_args(state))   # async
        mngr.wait_until_finished()
        saved_json = json.loads((tmp_path / "m" / "3" / "loss_scale" / "metadata").read_text())
        restored = ls.orbax_restore(mngr, jax.eval_shape(make))
    assert saved_json == ls.state_dict(ls.get_loss_scale(state))
    assert type(restored) is type(state)
    assert_bit_identical(restored, state, same_treedef=False)
    assert ls.get_loss_scale(restored).config == ls.get_loss_scale(state).config


@ORBAX_STATES
def test_orbax_helpers_refuse_a_changed_config_and_adopt_it_on_request(make, tmp_path):
    state = stepped(make())
    new_scaler = ls.DynamicLossScale(init_scale=512.0, growth_interval=50, hysteresis=2)
    if isinstance(state, dict):
        tx = chained(new_scaler)
        target = jax.eval_shape(lambda: {"params": PARAMS, "opt_state": tx.init(PARAMS)})
    else:
        target = jax.eval_shape(lambda: type(state).create(
            apply_fn=None, params=PARAMS, tx=ls.with_loss_scaling(optax.adamw(1e-2),
                                                                   new_scaler)))
    with ocp.CheckpointManager(tmp_path / "m") as mngr:
        mngr.save(3, args=ls.orbax_save_args(state))
        mngr.wait_until_finished()
        with pytest.raises(ValueError, match="growth_interval: saved 3, target 50"):
            ls.orbax_restore(mngr, target)
        adopted = ls.orbax_restore(mngr, target, adopt_config=True)
    assert ls.get_loss_scale(adopted).growth_interval == 50
    assert_bit_identical(adopted, state, same_treedef=False)


def test_orbax_helpers_refuse_a_stored_scale_the_json_does_not_confirm(tmp_path):
    # Plain Orbax restores any stored scale unchecked, -32768 included.
    state = stepped(ls_state())
    bad = state.replace(opt_state=state.opt_state._replace(
        scaler=jax.tree.map(lambda x: x, state.opt_state.scaler)))
    poisoned = jax.tree.unflatten(jax.tree.structure(bad.opt_state.scaler), [
        jnp.float32(-32768.0), *jax.tree.leaves(bad.opt_state.scaler)[1:]])
    bad = bad.replace(opt_state=bad.opt_state._replace(scaler=poisoned))
    with ocp.CheckpointManager(tmp_path / "plain") as mngr:
        mngr.save(1, args=ocp.args.StandardSave(bad))
        mngr.wait_until_finished()
        silently = mngr.restore(1, args=ocp.args.StandardRestore(jax.eval_shape(ls_state)))
    assert float(ls.get_loss_scale(silently).loss_scale) == -32768.0   # Orbax alone
    # ...which cannot hurt: the step's own guard applies no update and records the failure.
    after = jax.jit(lambda s: s.apply_gradients(grads=jax.tree.map(jnp.ones_like, s.params)))(
        silently)
    assert_bit_identical(after.params, silently.params)
    assert int(ls.metrics(after)["failure"]) == int(ls.Failure.INVALID_SCALE)
    with pytest.raises(ls.LossScaleError, match="-32768"):
        ls.check(after)
    # With the helpers the JSON is written from the same state: an invalid scale is
    # refused at save time...
    with pytest.raises(ValueError, match="loss_scale"):
        ls.orbax_save_args(bad)
    # ...and arrays that disagree with the JSON (a checkpoint corrupted after saving, or
    # items mixed up) at restore time.
    with ocp.CheckpointManager(tmp_path / "mixed") as mngr:
        mngr.save(1, args=ocp.args.Composite(
            state=ocp.args.StandardSave(bad),
            loss_scale=ocp.args.JsonSave(ls.state_dict(ls.get_loss_scale(state)))))
        mngr.wait_until_finished()
        with pytest.raises(ValueError, match=r"corrupted: its arrays say loss_scale -32768.0, "
                                             r"its loss-scale JSON says 512.0"):
            ls.orbax_restore(mngr, jax.eval_shape(ls_state))


def test_orbax_helpers_refuse_a_different_static_factor_with_a_concrete_target(tmp_path):
    def make(factor):
        return ls.TrainState.create(apply_fn=None, params=PARAMS, tx=ls.with_loss_scaling(
            optax.sgd(0.1), ls.StaticLossScale(factor)))

    with ocp.CheckpointManager(tmp_path / "m") as mngr:
        mngr.save(0, args=ls.orbax_save_args(make(128.0)))
        mngr.wait_until_finished()
        with pytest.raises(ValueError, match="saved 128.0, target 1024.0"):
            ls.orbax_restore(mngr, make(1024.0))
        adopted = ls.orbax_restore(mngr, make(1024.0), adopt_config=True)
        assert float(ls.get_loss_scale(adopted).loss_scale) == 1024.0
        restored = ls.orbax_restore(mngr, jax.eval_shape(lambda: make(1024.0)))
        assert float(ls.get_loss_scale(restored).loss_scale) == 128.0  # abstract: no factor


def test_orbax_helpers_with_extra_items_and_errors(tmp_path):
    state = stepped(dict_state())
    with ocp.CheckpointManager(tmp_path / "m") as mngr:
        with pytest.raises(ValueError, match="no checkpoint"):
            ls.orbax_restore(mngr, jax.eval_shape(dict_state))
        mngr.save(0, args=ls.orbax_save_args(state, extra=ocp.args.JsonSave({"epoch": 3})))
        mngr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
        mngr.wait_until_finished()
        assert mngr.restore(0, args=ocp.args.Composite(extra=ocp.args.JsonRestore()))[
            "extra"] == {"epoch": 3}
        restored = ls.orbax_restore(mngr, jax.eval_shape(dict_state), step=0)
        assert_bit_identical(restored, state, same_treedef=False)
        with pytest.raises(ValueError, match=r"loss-scale item 'loss_scale' of step 1"):
            ls.orbax_restore(mngr, jax.eval_shape(dict_state))       # the latest: step 1


def test_import_loss_scaling_does_not_import_orbax():
    code = "import sys, loss_scaling; assert 'orbax' not in sys.modules, 'orbax imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120,
                   env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_orbax_save_args_saves_one_replica_and_refuses_replicas_that_disagree():
    from loss_scaling.checkpoint.orbax import one_replica

    s = ls.update(ls.DynamicLossScale(init_scale=8.0), True)
    stacked = jax.tree.map(lambda x: jnp.stack([x, x, x]), s)
    assert ls.state_dict(one_replica(stacked)) == ls.state_dict(s)
    drifted = jax.tree.unflatten(jax.tree.structure(stacked), [
        jnp.array([8.0, 8.0, 4.0]), *jax.tree.leaves(stacked)[1:]])
    with pytest.raises(ValueError, match=r"replicas of the loss scale disagree: loss_scale is "
                                         r"\[8.0, 8.0, 4.0\]"):
        one_replica(drifted)
    nan = jax.tree.map(lambda x: jnp.stack([x, x]), ls.StaticLossScale(2.0))
    nan = jax.tree.unflatten(jax.tree.structure(nan), [jnp.array([np.nan, np.nan])])
    with pytest.raises(ValueError, match="loss_scale"):    # agreeing NaNs: invalid, not drift
        ls.state_dict(one_replica(nan))


# --------------------------------------------------------------------------------- nnx


def nnx_run(steps, model=None, optimizer=None, start=0):
    """A float16 nnx MLP with BatchNorm, trained with ls.nnx.Optimizer; overflows injected."""
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(4, 8, rngs=rngs, param_dtype=jnp.float32)
            self.bn = nnx.BatchNorm(8, rngs=rngs)
            self.l2 = nnx.Linear(8, 1, rngs=rngs)

        def __call__(self, x):
            h = jax.nn.relu(self.bn(self.l1(x.astype(jnp.float16)).astype(jnp.float32)))
            return self.l2(h)

    if model is None:
        model = MLP(nnx.Rngs(0))
        tx = ls.with_loss_scaling(optax.adam(1e-2), ls.DynamicLossScale(
            init_scale=2.0**12, growth_interval=3, hysteresis=2))
        optimizer = ls.nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(optimizer, model, x, y, poison):
        def loss_fn(model, x, y, poison):
            return jnp.mean((model(x) - y) ** 2) * poison

        _, grads = ls.value_and_grad(loss_fn)(optimizer, model, x, y, poison)
        optimizer.update(model, grads)

    data = batches()
    for t in range(start, steps):
        x, y, poison = data[t]
        step(optimizer, model, x, y, poison)
    return model, optimizer


@pytest.mark.parametrize("abstract", [False, True], ids=["fresh", "eval_shape"])
def test_nnx_resume_through_the_orbax_helpers_is_bit_identical(abstract, tmp_path):
    from flax import nnx

    model, optimizer = nnx_run(N_STEPS)                 # uninterrupted
    m1, o1 = nnx_run(RESUME_AT)
    assert int(ls.metrics(o1)["skipped_steps"]) >= 3
    with ocp.CheckpointManager(tmp_path / "m") as mngr:
        mngr.save(RESUME_AT, args=ls.orbax_save_args(
            {"model": nnx.state(m1), "optimizer": nnx.state(o1)}))
        mngr.wait_until_finished()
        m2, o2 = nnx_run(0)                              # a fresh run, rebuilt
        target = {"model": nnx.state(m2), "optimizer": nnx.state(o2)}
        if abstract:
            target = jax.eval_shape(lambda: target)
        restored = ls.orbax_restore(mngr, target)
    nnx.update(m2, restored["model"])
    nnx.update(o2, restored["optimizer"])
    assert ls.state_dict(ls.get_loss_scale(o2)) == ls.state_dict(ls.get_loss_scale(o1))
    nnx_run(N_STEPS, m2, o2, start=RESUME_AT)
    assert_bit_identical(jax.tree.leaves(nnx.state(m2)), jax.tree.leaves(nnx.state(model)))
    assert_bit_identical(jax.tree.leaves(nnx.state(o2)), jax.tree.leaves(nnx.state(optimizer)))


def test_nnx_helpers_refuse_a_changed_config(tmp_path):
    from flax import nnx

    m1, o1 = nnx_run(RESUME_AT)
    with ocp.CheckpointManager(tmp_path / "m") as mngr:
        mngr.save(0, args=ls.orbax_save_args(nnx.state(o1)))
        mngr.wait_until_finished()
        other = ls.nnx.Optimizer(m1, ls.with_loss_scaling(optax.adam(1e-2), ls.DynamicLossScale(
            init_scale=2.0**12, growth_interval=7, hysteresis=2)), wrt=nnx.Param)
        with pytest.raises(ValueError, match="growth_interval: saved 3, target 7"):
            ls.orbax_restore(mngr, nnx.state(other))
        adopted = ls.orbax_restore(mngr, nnx.state(other), adopt_config=True)
    nnx.update(other, adopted)
    s = ls.get_loss_scale(other)
    assert s.growth_interval == 7
    assert float(s.loss_scale) == float(ls.get_loss_scale(o1).loss_scale)


# ------------------------------------------------- docs/checkpoints.md: every block runs

GUIDE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "checkpoints.md"


def guide_blocks():
    import re

    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.DOTALL)


def run_block(code, cwd, monkeypatch, name="__main__"):
    monkeypatch.chdir(cwd)
    namespace = {"__name__": name}
    exec(compile(code, str(GUIDE), "exec"), namespace)
    return namespace


def test_the_guide_has_the_recipe_and_says_which_routes_check():
    text = GUIDE.read_text()
    assert "<!-- block: name=recipe -->\n```python\n" in text
    assert "<!-- block: name=json -->\n```python\n" in text
    assert "## Which routes check what" in text
    for route in ("ls.orbax_restore", "ls.restore_loss_scale", "ls.from_state_dict",
                  "flax.serialization.from_bytes", "ls.from_bytes", "ocp.args.StandardRestore"):
        assert f"`{route}" in text.split("## Which routes check what")[1]


def test_the_guides_blocks_run(tmp_path, monkeypatch, capsys):
    (recipe_block, change_growth, _start_scaling, sharded, nnx_block, earlier_versions,
     flax_block, json_block) = guide_blocks()
    ns = run_block(recipe_block, tmp_path, monkeypatch)
    assert capsys.readouterr().out == "16384.0 500\n"
    assert_bit_identical(ns["resumed"], ns["state"], same_treedef=False)
    assert_bit_identical(ns["adopted"], ns["state"], same_treedef=False)
    with ocp.CheckpointManager(tmp_path / "checkpoints") as mngr:   # the commented-out line
        with pytest.raises(ValueError, match="growth_interval: saved 1000, target 500"):
            ns["restore"](mngr, ns["new_config"])
    imported = run_block(recipe_block, tmp_path, monkeypatch, name="checkpointing")
    assert {"save", "restore", "make_state"} <= set(imported) and "state" not in imported

    # Another growth rule: refused by orbax_restore(adopt_config=True) by name, then
    # moved over with restore_loss_scale (issue 33, item 9).
    ns = run_block(change_growth, tmp_path, monkeypatch)
    assert capsys.readouterr().out == "headroom 1024.0\n"
    assert ns["scaler"].growth == "headroom" and ns["scaler"].grad_max_history.shape == (16,)
    assert_bit_identical(ns["new"].params, ns["restored"].params)

    ns = run_block(sharded, tmp_path, monkeypatch)
    assert capsys.readouterr().out == "1024.0\n"
    assert_bit_identical(ns["restored"], ns["state"])

    ns = run_block(nnx_block, tmp_path, monkeypatch)
    assert capsys.readouterr().out == "16384.0\n"
    assert int(ls.metrics(ns["optimizer2"])["skipped_steps"]) == 1

    # A checkpoint with 250089d's fields, through Orbax's own API in two steps.
    ns = run_block(earlier_versions, tmp_path, monkeypatch)
    assert capsys.readouterr().out == "LossScalingState True\n"
    assert_bit_identical(ns["restored"], ns["state"])

    run_block(flax_block, tmp_path, monkeypatch)
    assert "loss-scale state at './opt_state/scaler'" in capsys.readouterr().out

    ns = run_block(json_block, tmp_path, monkeypatch)
    assert json.loads(ns["text"])["values"]["growth_tracker"] == 1


# ------------------------------------------- a restored failure stays a failure (issue 22)

FAILED_CONFIG = {"growth_interval": 10, "hysteresis": 1}
FAILED_PARAMS = {"w": jnp.arange(3.0)}
RESTORE_ROUTES = ["from_state_dict", "restore_loss_scale", "restore_loss_scale_adopt",
                  "restore_with_config", "ls_from_bytes_scaler", "flax_from_bytes_state",
                  "ls_from_bytes_state", "orbax", "orbax_adopt"]


def failed_tx(scaler=None):
    return ls.with_loss_scaling(optax.sgd(0.1), scaler or ls.DynamicLossScale(**FAILED_CONFIG))


def fresh_failed_target(**config):
    tx = failed_tx(ls.DynamicLossScale(**{**FAILED_CONFIG, **config}))
    return {"params": FAILED_PARAMS, "opt_state": tx.init(FAILED_PARAMS)}


def restored_failed_state(route, tmp_path):
    """A freshly built {"params", "opt_state"} into which a failed scaler was restored."""
    failed = jax.jit(ls.update)(ls.DynamicLossScale(init_scale=2.0**-126, **FAILED_CONFIG),
                                False)
    assert int(failed.failure) == ls.Failure.BACKOFF_UNDERFLOW
    saved = json.loads(json.dumps(ls.state_dict(failed)))
    assert saved["values"]["failure"] == ls.Failure.BACKOFF_UNDERFLOW
    fresh = fresh_failed_target()
    # Only the scaler's register says failed: the wrapper state around it is new.
    only_scaler = {**fresh, "opt_state": ls.restore_loss_scale(fresh["opt_state"], saved)}
    if route == "from_state_dict":
        opt_state = failed_tx(ls.from_state_dict(saved)).init(FAILED_PARAMS)
    elif route == "restore_loss_scale":
        opt_state = only_scaler["opt_state"]
    elif route == "restore_loss_scale_adopt":
        opt_state = ls.restore_loss_scale(fresh_failed_target(growth_interval=20)["opt_state"],
                                          saved, adopt_config=True)
    elif route == "restore_with_config":
        adopted = ls.restore_with_config(saved, ls.DynamicLossScale(growth_interval=20))
        opt_state = failed_tx(adopted).init(FAILED_PARAMS)
    elif route == "ls_from_bytes_scaler":
        scaler = ls.from_bytes(ls.DynamicLossScale(**FAILED_CONFIG),
                               flax.serialization.to_bytes(failed))
        opt_state = failed_tx(scaler).init(FAILED_PARAMS)
    elif route in ("flax_from_bytes_state", "ls_from_bytes_state"):
        restore = (flax.serialization.from_bytes if route.startswith("flax")
                   else ls.from_bytes)
        return restore(fresh_failed_target(), flax.serialization.to_bytes(only_scaler))
    else:
        adopt = route == "orbax_adopt"
        with ocp.CheckpointManager(tmp_path / "m") as mngr:
            mngr.save(0, args=ls.orbax_save_args(only_scaler))
            mngr.wait_until_finished()
            config = {"growth_interval": 20} if adopt else {}
            return ls.orbax_restore(
                mngr, jax.eval_shape(lambda: fresh_failed_target(**config)), adopt_config=adopt)
    return {"params": FAILED_PARAMS, "opt_state": opt_state}


@pytest.mark.parametrize("route", RESTORE_ROUTES)
def test_a_restored_failed_scaler_fails_check_and_the_next_step_on_every_route(route,
                                                                               tmp_path):
    # "A new configuration does not heal a run": the scaler's own failure register is
    # restored on every route, and ls.check and the step both read it.
    state = restored_failed_state(route, tmp_path)
    with pytest.raises(ls.LossScaleError, match="loss scale backoff failed"):
        ls.check(state["opt_state"])
    tx = failed_tx()
    step = jax.jit(lambda g, s, p: tx.update(g, s, p))
    updates, opt_state = step({"w": jnp.ones(3)}, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    assert_bit_identical(params, FAILED_PARAMS)
    assert int(ls.metrics(opt_state)["failure"]) == ls.Failure.BACKOFF_UNDERFLOW
    with pytest.raises(ls.LossScaleError, match="loss scale backoff failed"):
        ls.check(opt_state)


def bf16_state():
    tx = ls.with_loss_scaling(optax.adam(1e-2), ls.DynamicLossScale(
        init_scale=1000.0, growth_interval=3, hysteresis=2))   # 1000: not a bfloat16
    return ls.TrainState.create(apply_fn=None, params=PARAMS, tx=tx)


def to_bf16(x, floats_only):
    x = x if isinstance(x, jax.ShapeDtypeStruct) else jnp.asarray(x)  # step 0 is an int
    if floats_only and not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)
    return x.astype(jnp.bfloat16)


@pytest.mark.parametrize("target_from", ["eval_shape", "concrete"])
@pytest.mark.parametrize("floats_only", [True, False], ids=["floats", "every_leaf"])
def test_orbax_helpers_restore_the_scaler_in_its_own_dtypes_from_a_bfloat16_target(
        target_from, floats_only, tmp_path):
    # Restoring every (float) leaf in bfloat16 is a common Orbax idiom: the loss scale and
    # its counters still come back as float32 / int32, bit-identical to the saved ones.
    state = stepped(bf16_state())
    target = jax.eval_shape(bf16_state) if target_from == "eval_shape" else bf16_state()
    target = jax.tree.map(lambda x: to_bf16(x, floats_only), target)
    with ocp.CheckpointManager(tmp_path / "m") as mngr:
        mngr.save(3, args=ls.orbax_save_args(state))
        mngr.wait_until_finished()
        restored = ls.orbax_restore(mngr, target)
    assert_bit_identical(ls.get_loss_scale(restored), ls.get_loss_scale(state))
    assert restored.params["w"].dtype == jnp.bfloat16   # the rest as the target asks


# ------------------------------------ starting loss scaling from an fp32 run's checkpoint

START_BLOCK = doc_blocks.named("checkpoints.md", "start_scaling")


def test_a_checkpoint_saved_before_loss_scaling_is_named_and_the_recipe_starts_from_it(
        tmp_path, monkeypatch):
    params = {"w": jnp.arange(3.0)}
    old_tx = optax.adam(0.1)
    old = {"params": params, "opt_state": old_tx.init(params)}
    _, old["opt_state"] = old_tx.update({"w": jnp.ones(3)}, old["opt_state"], params)
    tx = optax.chain(ls.with_loss_scaling(optax.adam(0.1)))  # anything after it is refused

    def new_state():
        return {"params": params, "opt_state": tx.init(params)}

    with ocp.CheckpointManager(tmp_path / "m") as mngr:
        mngr.save(0, args=ocp.args.StandardSave(old))
        mngr.wait_until_finished()
        with pytest.raises(ValueError, match=r"loss-scale item 'loss_scale' of step 0 is "
                                             r"missing .*written before loss scaling was "
                                             r"added.*_replace\(inner_state="):
            ls.orbax_restore(mngr, jax.eval_shape(new_state))
    with pytest.raises(ValueError, match=r"no loss-scale state at '\./opt_state/0', where the "
                                         r"target has a with_loss_scaling state.*before loss"):
        ls.from_bytes(new_state(), flax.serialization.to_bytes(old))
    # The documented recipe, inside a chain: the inner adam continues where it stopped.
    restored = ls.from_bytes(old, flax.serialization.to_bytes(old))
    opt_state = tx.init(params)
    opt_state = (opt_state[0]._replace(inner_state=restored["opt_state"]), *opt_state[1:])
    grads = {"w": jnp.full(3, 2.0)}
    scale = ls.get_loss_scale(opt_state).loss_scale
    updates, _ = tx.update(jax.tree.map(lambda g: g * scale, grads), opt_state, params)
    expected, _ = old_tx.update(grads, old["opt_state"], params)
    assert_bit_identical(updates, expected)
    # ...and the page's Orbax block runs as written.
    monkeypatch.chdir(tmp_path)
    namespace = doc_blocks.execute(START_BLOCK)
    assert float(ls.get_loss_scale(namespace["opt_state"]).loss_scale) == 2.0**15


def test_the_documented_list_of_configuration_checked_options_is_the_codes():
    import dataclasses
    import inspect
    import re

    from loss_scaling.checkpoint import state_dict as json_format
    from loss_scaling.core import fields

    page = (pathlib.Path(__file__).parent.parent / "docs" / "checkpoints.md").read_text()
    table = page.split("<!-- config-checked -->")[1].split("<!-- /config-checked -->")[0]
    rows = [line.split("|")[1:4] for line in table.strip().splitlines()[2:]]
    checked = {name for option, compared, _ in rows if compared.strip().startswith("yes")
               for name in re.findall(r"`(\w+)", option)}
    unchecked = {name for option, compared, _ in rows if compared.strip() == "no"
                 for name in re.findall(r"`(\w+)", option)}
    config = {f.name for f in dataclasses.fields(fields.DynamicConfig)}
    assert config == set(json_format.config_keys("dynamic", "headroom"))  # the one list
    assert checked == config | {"StaticLossScale"}
    wrapper_options = {name for name, p in inspect.signature(
        ls.with_loss_scaling).parameters.items() if p.kind is p.KEYWORD_ONLY}
    assert unchecked == {"init_scale", "with_loss_scaling"} | wrapper_options
    assert set(inspect.signature(ls.DynamicLossScale).parameters) == config | {"init_scale"}
    # What the table says is unchecked really is: a restore accepts a change of it.
    saved = ls.state_dict(ls.DynamicLossScale(init_scale=8.0))
    target = ls.with_loss_scaling(optax.sgd(0.1), ls.DynamicLossScale(init_scale=1.0),
                                  max_consecutive_skips=3).init(jnp.ones(2))
    assert float(ls.get_loss_scale(ls.restore_loss_scale(target, saved)).loss_scale) == 8.0


def test_every_recipe_restores_flax_bytes_through_the_validating_route():
    # Plain flax.serialization.from_bytes raises flax's own errors (TypeError: unhashable
    # type: 'dict', KeyError, ...) on corrupted bytes: the recipes use ls.from_bytes.
    offenders = [block.id for block in doc_blocks.python_blocks()
                 if re.search(r"(?<!ls\.)\bserialization\.from_bytes\b", block.code)]
    assert offenders == []
