"""docs/checkpoints.md: the recipe (Orbax arrays and ``ls.state_dict`` JSON, checked on
restore) and every block of the guide run, and a resume in a fresh process is
bit-identical.

Run as a script (``python tests/test_checkpoint_recipe.py DIR``), this file is the fresh
process of the resume test: it rebuilds every run from scratch, restores the checkpoints the
test wrote under DIR, finishes the runs and dumps their final states for the test to compare
with the uninterrupted runs.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
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
from checkpoint_states import (
    INF,
    JSON_BLOCK,
    N_STEPS,
    OVERFLOW_STEPS,
    PARAMS,
    RECIPE,
    RESUME_AT,
    VARIANTS,
    assert_bit_identical,
    batches,
    chained,
    host_copy,
    recipe,
    stepped_chain_state,
)
from flax.training import train_state

import loss_scaling as ls

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


# ------------------------------------------------ resume in a fresh process: bit-identical


def make_scaler():
    return ls.DynamicLossScale(init_scale=2.0**12, growth_interval=3, hysteresis=2)


def init_params():
    rng = np.random.default_rng(0)
    return {
        "w1": jnp.asarray(rng.normal(size=(4, 8)), jnp.float32),
        "b1": jnp.zeros(8, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(8, 1)) * 0.3, jnp.float32),
    }


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
