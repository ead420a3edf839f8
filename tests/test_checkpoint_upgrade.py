"""The mechanism behind checkpoints of earlier versions (loss_scaling/checkpoint/upgrade.py):
the declared changes, what they refuse, and a change of each kind that no version has made
yet (a field added to the wrapper, a scaler leaf added or removed), declared here the way
the next change will be declared. tests/test_checkpoint_fixtures.py restores the real
checkpoints of each version."""

from __future__ import annotations

import pathlib

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import loss_scaling as ls
from loss_scaling.checkpoint import upgrade
from loss_scaling.checkpoint.upgrade import FIELD_CHANGES, FieldAdded, FieldRemoved

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "checkpoints"


def make_state(**scaler):
    tx = ls.with_loss_scaling(optax.sgd(0.5, momentum=0.5),
                              ls.DynamicLossScale(init_scale=8.0, **scaler))
    params = {"w": jnp.array([1.0, 2.0])}
    state = {"params": params, "opt_state": tx.init(params)}
    _, state["opt_state"] = ls.apply_gradients(  # a skip: counters that are not zero
        tx, {"w": jnp.array([jnp.inf, 1.0])}, state["opt_state"], params)
    return state


def saved_dict(state):
    return flax.serialization.msgpack_restore(flax.serialization.to_bytes(state))


def old_bytes(edit):
    """The 250089d fixture's bytes with ``edit`` applied to the decoded run "interval"."""
    data = (FIXTURES / "250089d" / "optimizer_states.msgpack").read_bytes()
    decoded = flax.serialization.msgpack_restore(data)
    edit(decoded["opt_state"]["interval"])
    return flax.serialization.msgpack_serialize(decoded)


def old_target():
    tx = ls.with_loss_scaling(optax.sgd(0.125, momentum=0.5), ls.DynamicLossScale(
        init_scale=2.0**10, growth_factor=4.0, backoff_factor=0.25, growth_interval=4,
        hysteresis=2, min_scale=2.0**-4, max_scale=2.0**20),
        underflow_diagnostics=True)
    params = {"a": jnp.zeros(2), "b": jnp.zeros((1, 1))}
    targets = {run: tx.init(params) for run in ("interval", "headroom", "failed")}
    headroom = ls.with_loss_scaling(optax.sgd(0.125, momentum=0.5), ls.DynamicLossScale(
        init_scale=2.0**8, growth="headroom", headroom_window=3, headroom_margin=4.0,
        growth_interval=5, max_scale=2.0**24))
    targets["headroom"] = headroom.init(params)
    targets["failed"] = ls.with_loss_scaling(optax.sgd(0.125, momentum=0.5)).init(params)
    return {"params": {run: params for run in targets}, "opt_state": targets}


def test_todays_fields_leave_the_target_as_it_is():
    state = make_state()
    for saved in (flax.serialization.to_bytes(state), saved_dict(state)):
        as_saved = ls.target_as_saved(state, saved)
        assert jax.tree.structure(as_saved) == jax.tree.structure(state)
        leaves = zip(jax.tree.leaves(as_saved), jax.tree.leaves(state), strict=True)
        assert all(a is b for a, b in leaves)  # the target's own leaves
        restored = flax.serialization.from_bytes(as_saved, flax.serialization.to_bytes(state))
        upgraded = ls.upgrade_restored(restored, state)
        assert jax.tree.structure(upgraded) == jax.tree.structure(restored)
        leaves = zip(jax.tree.leaves(upgraded), jax.tree.leaves(restored), strict=True)
        assert all(a is b for a, b in leaves)  # the restored leaves, untouched


def test_a_removed_field_is_read_checked_and_dropped():
    restored = ls.from_bytes(old_target(), old_bytes(lambda run: None))
    state = restored["opt_state"]["interval"]
    assert "last_step_finite" not in ls.LossScalingState._fields
    assert isinstance(state, ls.LossScalingState) and bool(state.last_step_applied)


@pytest.mark.parametrize("own_api", [False, True])
def test_a_removed_field_that_disagrees_is_refused_by_name(own_api):
    data = old_bytes(lambda run: run.update(last_step_finite=np.asarray(False)))
    target = old_target()
    with pytest.raises(ValueError) as error:
        if own_api:
            ls.upgrade_restored(flax.serialization.from_bytes(
                ls.target_as_saved(target, data), data), target)
        else:
            ls.from_bytes(target, data)
    message = str(error.value)
    assert "'./opt_state/interval'" in message and "last_step_finite=False" in message
    assert "inconsistent" in message and "consecutive_skips == 0" in message


def failed_run_bytes(scaler_failure):
    """The issue42 fixture's bytes of whole optimizer states, the "failed" run's scaler
    record (kind 2: with the copy of the wrapper's failure) rewritten to hold
    ``scaler_failure`` (its wrapper's register says TOO_MANY_SKIPS)."""
    from loss_scaling.checkpoint import record
    from loss_scaling.core.scalers import dynamic_from_leaves

    data = (FIXTURES / "issue42" / "optimizer_states.msgpack").read_bytes()
    decoded = flax.serialization.msgpack_restore(data)
    run = decoded["opt_state"]["failed"]
    alone = ls.DynamicLossScale(init_scale=2.0**6, backoff_factor=0.5)
    arrays = record.decode(alone, run["scaler"])
    assert int(arrays["failure"]) == int(run["failure"]) == ls.Failure.TOO_MANY_SKIPS
    arrays["failure"] = np.asarray(scaler_failure, np.int32)
    run["scaler"] = record.encode(dynamic_from_leaves(alone.config, [
        arrays[name] for name in alone.leaf_names]))
    return flax.serialization.msgpack_serialize(decoded)


def fixture_target():
    """The target of the fixtures' optimizer_states (the "failed" run's own scaler)."""
    params = {"a": jnp.zeros(2), "b": jnp.zeros((1, 1))}
    targets = old_target()["opt_state"]
    targets["failed"] = ls.with_loss_scaling(
        optax.sgd(0.125, momentum=0.5), ls.DynamicLossScale(init_scale=2.0**6),
        max_consecutive_skips=2).init(params)
    return {"params": {run: params for run in targets}, "opt_state": targets}


@pytest.mark.parametrize("own_api", [False, True])
def test_a_scalers_failure_copy_is_checked_against_its_wrappers_register(own_api):
    # Issue 41: the state's failure is the one register; a saved scaler's copy of it is
    # read, held to it and dropped. Bytes whose copy disagrees are refused by name.
    target = fixture_target()

    def restore(data):
        if own_api:
            return ls.upgrade_restored(flax.serialization.from_bytes(
                ls.target_as_saved(target, data), data), target)
        return ls.from_bytes(target, data)

    restored = restore(failed_run_bytes(ls.Failure.TOO_MANY_SKIPS))["opt_state"]["failed"]
    assert restored.scaler.leaf_names == ("loss_scale", "growth_tracker", "nonfinite_tracker")
    assert int(restored.failure) == ls.Failure.TOO_MANY_SKIPS
    assert int(ls.get_loss_scale(restored).failure) == ls.Failure.TOO_MANY_SKIPS
    with pytest.raises(ValueError) as error:
        restore(failed_run_bytes(ls.Failure.NONE))
    message = str(error.value)
    assert "'./opt_state/failed/scaler'" in message and "failure=0" in message, message
    assert "inconsistent" in message and "the one register" in message


def test_plain_flax_names_the_route_for_a_record_with_the_failure_copy():
    data = (FIXTURES / "issue42" / "optimizer_states.msgpack").read_bytes()
    with pytest.raises(ValueError, match=r"a checkpoint of an earlier version: restore it "
                                         r"with `loss_scaling.from_bytes`"):
        flax.serialization.from_bytes(fixture_target(), data)
    fields = {"interval": ("loss_scale", "growth_tracker", "nonfinite_tracker"),
              "headroom": ("loss_scale", "growth_tracker", "nonfinite_tracker",
                           "grad_max_history", "headroom_tracker", "ceiling")}
    restored = ls.from_bytes(fixture_target(), data)["opt_state"]
    for run, names in fields.items():
        assert restored[run].scaler.leaf_names == names


def test_a_field_no_version_wrote_is_refused_as_a_newer_versions():
    data = old_bytes(lambda run: run.update(brand_new=np.asarray(1)))
    with pytest.raises(ValueError, match=r"state \(LossScalingState\) at './opt_state/"
                                         r"interval' holds 'brand_new', which neither this "
                                         r"version of loss_scaling nor an earlier one wrote"):
        ls.from_bytes(old_target(), data)


def test_a_missing_field_no_version_lacked_is_refused():
    data = old_bytes(lambda run: run.pop("replays"))
    with pytest.raises(ValueError, match=r"at './opt_state/interval' lacks replays, which "
                                         r"every version of loss_scaling wrote"):
        ls.from_bytes(old_target(), data)


def test_plain_flax_still_refuses_an_old_checkpoint_and_the_pair_restores_it():
    data = (FIXTURES / "250089d" / "optimizer_states.msgpack").read_bytes()
    target = old_target()
    with pytest.raises(ValueError, match="field names of the state dict"):
        flax.serialization.from_bytes(target, data)  # flax's own error: docs say why
    restored = ls.upgrade_restored(
        flax.serialization.from_bytes(ls.target_as_saved(target, data), data), target)
    assert jax.tree.structure(restored) == jax.tree.structure(target)


ADDED_REPLAYS = FieldAdded(
    "LossScalingState", "last_step_replays", like="replays", value=7, dtype="int32",
    since="this test", why="a stand-in for the next field added")


@pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit], ids=["eager", "jit"])
def test_an_added_field_gets_its_declared_value_in_the_layout_of_its_like(maybe_jit):
    # A pmap-style state: every leaf with a leading axis of 2 replicas.
    state = jax.tree.map(lambda x: jnp.stack([x, x]), make_state())
    saved = saved_dict(state)
    del saved["opt_state"]["last_step_replays"]
    as_saved = ls.target_as_saved(state, saved, changes=(ADDED_REPLAYS,))
    assert "last_step_replays" not in as_saved["opt_state"]._fields
    restored = flax.serialization.from_state_dict(as_saved, saved)
    upgraded = maybe_jit(lambda r: upgrade.upgrade_restored(
        r, state, changes=(ADDED_REPLAYS,)))(restored)
    new = upgraded["opt_state"]
    assert isinstance(new, ls.LossScalingState)
    assert new.last_step_replays.dtype == jnp.int32
    assert new.last_step_replays.tolist() == [7, 7]
    for name in ls.LossScalingState._fields:  # every other field as restored
        if name != "last_step_replays":
            jax.tree.map(np.testing.assert_array_equal, getattr(new, name),
                         getattr(state["opt_state"], name))


def test_a_removed_field_needs_concrete_values_inside_jit():
    data = (FIXTURES / "250089d" / "optimizer_states.msgpack").read_bytes()
    target = old_target()
    restored = flax.serialization.from_bytes(ls.target_as_saved(target, data), data)
    with pytest.raises(ValueError, match="needs concrete arrays, got a tracer: call it "
                                         "outside jit"):
        jax.jit(lambda r: ls.upgrade_restored(r, target))(restored)


def test_orbax_metadata_without_a_handler_is_named():
    with pytest.raises(ValueError, match=r"Build the manager with it, e.g. "
                                         r"`ocp.CheckpointManager\(directory, item_handlers"):
        ls.target_as_saved(make_state(), None)


SCALER_ADDED = FieldAdded("DynamicLossScale", "nonfinite_tracker", like="growth_tracker",
                          value=0, dtype="int32", since="this test", why="a stand-in")
SCALER_REMOVED = FieldRemoved(
    "DynamicLossScale", "growth_mirror", like="growth_tracker", dtype="int32",
    derived=lambda fields: fields["growth_tracker"], since="this test",
    why="a copy of `growth_tracker`")


def test_a_scaler_leaf_added_and_one_removed_through_orbax(tmp_path):
    state = make_state(hysteresis=3)  # a nonfinite_tracker of 1: saved without it
    scaler = ls.get_loss_scale(state["opt_state"])
    assert int(scaler.nonfinite_tracker) == 1
    # ...and with the failure copy of the wrapper's register that issue 41 removed
    old_scaler = {"loss_scale": scaler.loss_scale, "growth_tracker": scaler.growth_tracker,
                  "failure": scaler.failure, "growth_mirror": scaler.growth_tracker}
    old = {**state, "opt_state": state["opt_state"]._replace(scaler=old_scaler)}
    changes = (*FIELD_CHANGES, SCALER_ADDED, SCALER_REMOVED)
    with ocp.CheckpointManager(tmp_path, item_handlers=ocp.StandardCheckpointHandler()) as mngr:
        mngr.save(0, args=ocp.args.StandardSave(old))
        mngr.wait_until_finished()
        target = jax.eval_shape(lambda: make_state(hysteresis=3))
        as_saved = ls.target_as_saved(target, mngr.item_metadata(0), changes=changes)
        assert set(as_saved["opt_state"].scaler._fields) == set(old_scaler)
        restored = ls.upgrade_restored(mngr.restore(0, args=ocp.args.StandardRestore(
            as_saved)), target, changes=changes)
    new = ls.get_loss_scale(restored["opt_state"])
    assert isinstance(new, ls.DynamicLossScale) and new.hysteresis == 3
    assert float(new.loss_scale) == 8.0 and int(new.nonfinite_tracker) == 0
    assert new.nonfinite_tracker.dtype == jnp.int32


def test_every_declared_change_matches_todays_fields():
    fresh = ls.with_loss_scaling(optax.sgd(1.0)).init(jnp.zeros(2))
    fields = {"LossScalingState": set(ls.LossScalingState._fields),  # and the scaler it holds
              "DynamicLossScale": set(upgrade.leaf_names(fresh.scaler))}
    ahead = []
    for change in FIELD_CHANGES:
        assert change.like in fields[change.node], change
        if isinstance(change, FieldRemoved):
            assert change.name not in fields[change.node], change
        elif change.name in fields[change.node]:  # its value has the field's own dtype
            assert getattr(fresh, change.name).dtype == np.dtype(change.dtype), change
            assert getattr(fresh, change.like).shape == getattr(fresh, change.name).shape
        else:
            ahead.append(change.name)
    assert ahead == []  # every declared change is of a field that exists today


def test_orbax_restore_passes_orbaxs_own_error_through(tmp_path):
    state = make_state()
    with ocp.CheckpointManager(tmp_path) as mngr:
        mngr.save(0, args=ls.orbax_save_args(state))
        mngr.wait_until_finished()
        other = jax.eval_shape(lambda: {**make_state(), "extra": jnp.zeros(3)})
        with pytest.raises(ValueError, match="'extra'") as error:
            ls.orbax_restore(mngr, other)
    assert "loss_scaling" not in str(error.value)  # Orbax's, about the params
