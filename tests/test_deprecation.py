"""Renamed public names keep answering under the old name, with a DeprecationWarning that
names the new one (loss_scaling/_deprecation.py)."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import optax
import pytest

import loss_scaling as ls
from loss_scaling import _deprecation
from loss_scaling._deprecation import RENAMES, Renamed


def skipped_state():
    tx = ls.with_loss_scaling(optax.sgd(1.0))
    state = tx.init(jnp.zeros(2))
    return tx.update(jnp.array([jnp.inf, 1.0]), state, jnp.zeros(2))[1]


@pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit], ids=["eager", "jit"])
def test_last_step_finite_warns_and_returns_last_step_applied(maybe_jit):
    for state in (ls.with_loss_scaling(optax.sgd(1.0)).init(jnp.zeros(2)), skipped_state()):
        with pytest.warns(DeprecationWarning, match=r"LossScalingState.last_step_finite is "
                          r"deprecated .*: use LossScalingState.last_step_applied") as record:
            old = maybe_jit(lambda s: s.last_step_finite)(state)
        assert record[0].filename == __file__  # pointed at the caller, not the library
        assert old.dtype == jnp.bool_ and bool(old) == bool(state.last_step_applied)


def test_the_new_names_do_not_warn():
    # filterwarnings = error: any warning here fails the test
    state = skipped_state()
    assert not bool(state.last_step_applied)
    assert "last_step_applied" in ls.metrics(state)


def test_every_rename_names_an_existing_new_name_and_no_longer_the_old_one():
    owners = {"LossScalingState": ls.LossScalingState, "loss_scaling": ls}
    for renamed in RENAMES:
        owner = owners[renamed.owner]
        if "." in renamed.new:  # outside the package: optax's, which the package names
            module, name = renamed.new.rsplit(".", 1)
            assert module == "optax", renamed  # loss_scaling.__getattr__ reads optax only
            assert hasattr(importlib.import_module(module), name), renamed
            assert renamed.old not in ls.__all__ and renamed.old not in vars(ls), renamed
            continue
        assert hasattr(owner, renamed.new), renamed
        if renamed.owner == "LossScalingState":  # a property, not a field: not saved
            assert renamed.old not in ls.LossScalingState._fields
            assert isinstance(getattr(owner, renamed.old), property)


def test_a_renamed_package_name_answers_through_the_package(monkeypatch):
    entry = Renamed("loss_scaling", "old_restore", "restore_loss_scale", since="a test")
    monkeypatch.setattr(_deprecation, "RENAMES", (*RENAMES, entry))
    with pytest.warns(DeprecationWarning, match=r"loss_scaling.old_restore is deprecated "
                      r"\(renamed in a test\): use loss_scaling.restore_loss_scale"):
        assert ls.old_restore is ls.restore_loss_scale
    lazy = Renamed("loss_scaling", "old_save_args", "orbax_save_args", since="a test")
    monkeypatch.setattr(_deprecation, "RENAMES", (entry, lazy))
    with pytest.warns(DeprecationWarning, match="use loss_scaling.orbax_save_args"):
        assert ls.old_save_args is ls.orbax_save_args
    with pytest.raises(AttributeError, match="no attribute 'never_existed'"):
        ls.never_existed  # noqa: B018


@pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit], ids=["eager", "jit"])
def test_loss_scaling_transformation_warns_and_is_optax_own_class(maybe_jit):
    # Issue 41: with_loss_scaling returns optax's GradientTransformationExtraArgs (its
    # options live on tx.update only); the old class name answers, with a warning.
    with pytest.warns(DeprecationWarning, match=r"loss_scaling.LossScalingTransformation is "
                      r"deprecated \(renamed in issue 41\): use "
                      r"optax.GradientTransformationExtraArgs") as record:
        cls = ls.LossScalingTransformation
    assert record[0].filename == __file__
    assert cls is optax.GradientTransformationExtraArgs
    tx = ls.with_loss_scaling(optax.sgd(1.0), ls.StaticLossScale(2.0))
    assert type(tx) is cls and not hasattr(tx, "options")
    params = jnp.ones(2)
    step = maybe_jit(lambda g, s, p: ls.apply_gradients(tx, g, s, p))
    new_params, _ = step(jnp.full(2, 2.0), tx.init(params), params)  # still the fused step
    assert new_params.tolist() == [0.0, 0.0]
