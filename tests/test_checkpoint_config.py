"""A saved configuration against the target's (loss_scaling/checkpoint/config.py):
``ls.check_same_config`` lists every difference, ``ls.restore_with_config`` adopts the
target's configuration keeping the saved values, and docs/checkpoints.md's table of the
options a restore checks is the code's list.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from checkpoint_states import (
    CUSTOM_CONFIG,
    INVALID,
    MAYBE_JIT,
    NAN,
    TINY,
    assert_bit_identical,
    config_of,
    corrupt,
    dynamic_after_overflows,
    dynamic_both_trackers,
    saved_state,
    target,
)

import loss_scaling as ls
from loss_scaling import check_same_config, restore_with_config, state_dict


@pytest.mark.parametrize("as_dict", [False, True], ids=["scaler", "dict"])
def test_check_same_config_accepts_the_same_configuration(as_dict):
    saved = saved_state()
    check_same_config(state_dict(saved) if as_dict else saved, target())
    check_same_config(ls.StaticLossScale(8.0), ls.StaticLossScale(8.0))
    check_same_config(ls.NoOpLossScale(), ls.NoOpLossScale())


@pytest.mark.parametrize("as_dict", [False, True], ids=["scaler", "dict"])
def test_a_static_factor_is_configuration_refused_unless_adopted(as_dict):
    saved = ls.StaticLossScale(128.0)
    saved = state_dict(saved) if as_dict else saved
    with pytest.raises(ValueError, match=r"loss_scale \(a StaticLossScale's factor\): saved "
                                         r"128.0, target 1024.0"):
        check_same_config(saved, ls.StaticLossScale(1024.0))
    # Adopting the configuration: the target's factor; an abstract target has none.
    assert float(restore_with_config(saved, ls.StaticLossScale(1024.0)).loss_scale) == 1024.0
    abstract = jax.eval_shape(lambda: ls.StaticLossScale(1024.0))
    check_same_config(saved, abstract)
    assert float(restore_with_config(saved, abstract).loss_scale) == 128.0


@pytest.mark.parametrize("as_dict", [False, True], ids=["scaler", "dict"])
def test_check_same_config_lists_every_difference(as_dict):
    saved = saved_state()
    new = target(growth_interval=100, hysteresis=1, max_scale=None)
    with pytest.raises(ValueError) as info:
        check_same_config(state_dict(saved) if as_dict else saved, new)
    message = str(info.value)
    assert "growth_interval: saved 5, target 100" in message
    assert "hysteresis: saved 3, target 1" in message
    assert f"max_scale: saved {2.0**20 + 1.0!r}, target None" in message
    for same in ("growth_factor", "backoff_factor", "min_scale"):
        assert f"{same}:" not in message
    assert "restore_with_config" in message


def test_check_same_config_refuses_another_kind_and_bad_input():
    with pytest.raises(ValueError, match="kind: saved 'dynamic', target 'static'"):
        check_same_config(saved_state(), ls.StaticLossScale(2.0))
    with pytest.raises(ValueError, match=INVALID):
        check_same_config(corrupt(("values", "loss_scale"), NAN), target())
    with pytest.raises(TypeError):
        check_same_config(saved_state(), {"growth_interval": 5})


@MAYBE_JIT
@pytest.mark.parametrize("as_dict", [False, True], ids=["scaler", "dict"])
def test_restore_with_config_keeps_saved_values_under_new_config(as_dict, maybe_jit):
    saved = saved_state()
    new = target(growth_interval=4, hysteresis=1, min_scale=0.5, max_scale=None)
    s = restore_with_config(state_dict(saved) if as_dict else saved, new)
    assert config_of(s) == config_of(new)
    assert s.loss_scale.dtype == jnp.float32 and s.growth_tracker.dtype == jnp.int32
    assert np.float32(s.loss_scale).tobytes() == np.float32(saved.loss_scale).tobytes()
    assert int(s.growth_tracker) == 3 and int(s.nonfinite_tracker) == 0
    grown = maybe_jit(ls.update)(s, True)   # the 4th clean step grows under the new config
    assert float(grown.loss_scale) == float(
        np.float32(saved.loss_scale) * np.float32(CUSTOM_CONFIG["growth_factor"]))
    assert int(grown.growth_tracker) == 0


def test_restore_with_config_clamps_the_trackers():
    saved = dynamic_both_trackers()                   # trackers (4, 3)
    s = restore_with_config(saved, target(growth_interval=2, hysteresis=2))
    assert (int(s.growth_tracker), int(s.nonfinite_tracker)) == (1, 2)
    s = restore_with_config(saved, target(growth_interval=1000, hysteresis=10))
    assert (int(s.growth_tracker), int(s.nonfinite_tracker)) == (4, 3)
    assert state_dict(s)["config"]["growth_interval"] == 1000


def test_restore_with_config_with_the_same_config_is_the_saved_state():
    saved = dynamic_after_overflows()
    assert_bit_identical(restore_with_config(saved, target()), saved)
    assert_bit_identical(restore_with_config(ls.StaticLossScale(64.0), ls.StaticLossScale(64.0)),
                         ls.StaticLossScale(64.0))
    assert_bit_identical(restore_with_config(ls.NoOpLossScale(), ls.NoOpLossScale()),
                         ls.NoOpLossScale())


def test_restore_with_config_refuses_a_scale_outside_the_new_bounds():
    saved = saved_state()                              # scale ~330
    with pytest.raises(ValueError, match="min_scale"):
        restore_with_config(saved, target(min_scale=512.0))
    with pytest.raises(ValueError, match="max_scale"):
        restore_with_config(saved, target(max_scale=256.0))


def test_restore_with_config_refuses_other_kinds_and_invalid_saved_state():
    with pytest.raises(ValueError, match="kind"):
        restore_with_config(saved_state(), ls.StaticLossScale(2.0))
    with pytest.raises(ValueError, match="kind"):
        restore_with_config(state_dict(ls.NoOpLossScale()), target())
    with pytest.raises(ValueError, match="values.growth_tracker"):
        restore_with_config(corrupt(("values", "growth_tracker"), 5), target(growth_interval=9))
    with pytest.raises(TypeError):
        restore_with_config(saved_state(), None)


def test_restore_with_config_keeps_a_failure_and_the_targets_layout():
    failed = jax.jit(ls.update)(ls.DynamicLossScale(init_scale=TINY), False)
    assert int(failed.failure) != 0
    adopted = restore_with_config(failed, ls.DynamicLossScale(init_scale=1.0, min_scale=TINY))
    assert int(adopted.failure) == int(failed.failure)    # never healed silently
    with pytest.raises(ls.LossScaleError):
        ls.check(adopted)
    replicated = jax.tree.map(lambda x: jnp.stack([x, x]), target())
    s = restore_with_config(saved_state(), replicated)
    assert all(leaf.shape == (2,) for leaf in jax.tree.leaves(s))
    assert s.loss_scale.tolist() == [float(saved_state().loss_scale)] * 2
    static = restore_with_config(ls.StaticLossScale(8.0), jax.tree.map(
        lambda x: jnp.stack([x, x]), ls.StaticLossScale(4.0)))
    assert static.loss_scale.tolist() == [4.0, 4.0]


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
