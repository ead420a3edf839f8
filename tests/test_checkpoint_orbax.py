"""Orbax: a loss scale's values in Orbax's own round trips (its configuration is static pytree
data and comes from the restore target), and the helpers ``ls.orbax_save_args`` /
``ls.orbax_restore`` (loss_scaling/checkpoint/orbax.py), which save ``ls.state_dict`` as
JSON next to the arrays and check it on restore: a changed configuration is an error unless
adopted, and arrays the JSON does not confirm are refused. nnx states and bfloat16 targets
too.
"""

from __future__ import annotations

import json

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from checkpoint_states import (
    INF,
    N_STEPS,
    ORBAX_STATES,
    PARAMS,
    RESUME_AT,
    SCALER_KINDS,
    assert_bit_identical,
    batches,
    chained,
    dict_state,
    ls_state,
    scalers,
    stepped,
    stepped_chain_state,
)
from flax.training import train_state

import loss_scaling as ls

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
