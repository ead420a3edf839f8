"""``ls.restore_loss_scale`` (loss_scaling/checkpoint/restore.py): a saved loss scale
restored into optimizer states, in the layout of the leaves it replaces; and a restored
failure stays a failure on every route (issue 22).
"""

from __future__ import annotations

import json

import flax.serialization
import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
import pytest
from checkpoint_states import (
    PARAMS,
    assert_bit_identical,
)

import loss_scaling as ls


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
