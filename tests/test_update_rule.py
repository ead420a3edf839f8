"""Randomized test of the DynamicLossScale update rule against a pure-Python reference model.

The model restates the rule from the ``DynamicLossScale`` docstring and the seed contract
(DESIGN.md) in numpy float32 arithmetic, so that scale values can be compared bit for bit:

* clean step: ``growth_tracker += 1``, ``nonfinite_tracker = 0``; on the
  ``growth_interval``-th consecutive clean step, ``scale *= growth_factor`` (capped at
  ``max_scale``) and the tracker resets; a growth to a non-finite scale is skipped, and the
  tracker still resets;
* non-finite step: ``growth_tracker = 0``, ``nonfinite_tracker = min(+1, hysteresis)``;
  when it reaches ``hysteresis``, ``scale *= backoff_factor`` (floored at ``min_scale``);
  without ``min_scale``, a result below the smallest normal float32 fails closed: eagerly
  ``update`` raises; under ``jit`` the state records the failure, keeps its last valid
  values, and never changes again (the model checks the frozen state on every later step).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

import loss_scaling as ls

F32 = np.finfo(np.float32)
TINY = float(F32.tiny)
F32_MAX = float(F32.max)


# ------------------------------------------------------------------------ reference model


class FailClosed(Exception):
    """The model's verdict: this step must fail with a loss-scale error."""


@dataclasses.dataclass(frozen=True)
class Model:
    scale: np.float32
    growth_tracker: int
    nonfinite_tracker: int


def f32(x: Any) -> np.float32:
    with np.errstate(all="ignore"):
        return np.float32(x)


def model_init(config: dict) -> Model:
    return Model(f32(config["init_scale"]), 0, 0)


def model_step(config: dict, m: Model, finite: bool) -> Model:
    """One step of the rule, in float32; raises FailClosed where the rule fails closed."""
    with np.errstate(all="ignore"):
        if finite:
            tracker = m.growth_tracker + 1
            scale = m.scale
            if tracker == config["growth_interval"]:
                tracker = 0
                grown = np.float32(m.scale * f32(config["growth_factor"]))
                if config["max_scale"] is not None:
                    grown = min(grown, f32(config["max_scale"]))
                if np.isfinite(grown):
                    scale = np.float32(grown)
            return Model(scale, tracker, 0)

        streak = min(m.nonfinite_tracker + 1, config["hysteresis"])
        scale = m.scale
        if streak == config["hysteresis"]:
            scale = np.float32(m.scale * f32(config["backoff_factor"]))
            if config["min_scale"] is not None:
                scale = max(scale, f32(config["min_scale"]))
            if not scale >= F32.tiny:      # zero and float32 subnormals alike
                raise FailClosed
        return Model(np.float32(scale), 0, streak)


def test_model_matches_the_documented_examples():
    """The model itself, on the hand-checked sequence of the DynamicLossScale docstring."""
    config = dict(init_scale=1024.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2,
                  hysteresis=1, min_scale=None, max_scale=None)
    m = model_step(config, model_init(config), True)
    assert (m.scale, m.growth_tracker) == (1024.0, 1)
    m = model_step(config, m, True)
    assert (m.scale, m.growth_tracker) == (2048.0, 0)
    assert model_step(config, m, False).scale == 1024.0
    with pytest.raises(FailClosed):
        model_step(dict(config, init_scale=TINY), model_init(dict(config, init_scale=TINY)), False)


# ----------------------------------------------------------------------------- strategies

INIT_SPECIALS = [TINY, 1.5 * TINY, 2.0**-125, F32_MAX, F32_MAX / 2, 2.0**127, 1.0, 2.0**15]


@st.composite
def configs(draw) -> dict:
    if draw(st.booleans()):
        init = f32(draw(st.sampled_from(INIT_SPECIALS)))
    else:
        mantissa = draw(st.sampled_from([1.0, 1.5, 1.75, 1.2345678]))
        exponent = draw(st.integers(-126, 127))
        init = f32(mantissa * 2.0**exponent)
    assert np.isfinite(init) and init >= F32.tiny
    config = dict(
        init_scale=float(init),
        growth_factor=draw(st.sampled_from([1.5, 2.0, 3.0, 1000.0, 2.0**64])),
        backoff_factor=draw(st.sampled_from([0.5, 0.25, 1e-3, 0.9])),
        growth_interval=draw(st.integers(1, 5)),
        hysteresis=draw(st.integers(1, 3)),
        min_scale=None,
        max_scale=None,
    )
    if draw(st.booleans()):
        below = f32(float(init) * 2.0 ** -draw(st.integers(0, 40)))
        config["min_scale"] = float(max(below, f32(TINY)))
    if draw(st.booleans()):
        config["max_scale"] = min(float(init) * 2.0 ** draw(st.integers(0, 40)), F32_MAX)
    return config


# Runs of equal flags, so that growth intervals, hysteresis and long backoffs all happen.
steps_strategy = st.lists(
    st.tuples(st.booleans(), st.integers(1, 8)), max_size=8
).map(lambda runs: [flag for flag, n in runs for _ in range(n)][:30])


def cfg(**overrides) -> dict:
    base = dict(init_scale=2.0**15, growth_factor=2.0, backoff_factor=0.5, growth_interval=1,
                hysteresis=1, min_scale=None, max_scale=None)
    return dict(base, **overrides)


# --------------------------------------------------------------------------------- checks


def assert_matches(state: ls.DynamicLossScale, m: Model, where: str) -> None:
    got = np.asarray(state.loss_scale)
    assert got.dtype == np.float32 and state.growth_tracker.dtype == jnp.int32, where
    assert got.view(np.uint32) == np.asarray(m.scale, np.float32).view(np.uint32), (
        f"{where}: scale {got!r} != model {m.scale!r}")
    assert int(state.growth_tracker) == m.growth_tracker, where
    assert int(state.nonfinite_tracker) == m.nonfinite_tracker, where


def run_against_model(config: dict, steps: list[bool]) -> None:
    eager = ls.DynamicLossScale(**config)
    jitted = eager
    step = jax.jit(ls.update)           # compiled once for this configuration
    m = model_init(config)
    assert_matches(eager, m, "init")
    for i, finite in enumerate(steps):
        where = f"step {i} ({'finite' if finite else 'non-finite'}) of {steps} with {config}"
        try:
            previous, m = m, model_step(config, m, finite)
        except FailClosed:
            event("fail closed")
            with pytest.raises(ls.LossScaleError, match="loss scale backoff failed"):
                ls.update(eager, finite)
            # Under jit: recorded, sticky, the last valid values kept on every later step.
            for later in [finite, *steps[i + 1:]]:
                jitted = step(jitted, jnp.asarray(later))
                assert int(jitted.failure) == ls.Failure.BACKOFF_UNDERFLOW, where
                assert_matches(jitted, m, "jit, after the failure, " + where)
            with pytest.raises(ls.LossScaleError, match="loss scale backoff failed"):
                ls.check(jitted)
            return
        if finite and m.growth_tracker == 0 and m.scale == previous.scale:
            event("growth skipped or capped")
        elif not finite and m.scale != previous.scale:
            event("backoff")
        eager = ls.update(eager, finite)
        jitted = step(jitted, jnp.asarray(finite))
        assert_matches(eager, m, "eager " + where)
        assert_matches(jitted, m, "jit " + where)
        assert int(jitted.failure) == 0 and ls.check(jitted) is None, where


@settings(max_examples=60, deadline=None)
@given(config=configs(), steps=steps_strategy)
# Growth that overflows float32 is skipped; the tracker still resets.
@example(config=cfg(init_scale=2.0**127), steps=[True, True, True])
@example(config=cfg(init_scale=F32_MAX, growth_factor=1.5, growth_interval=2),
         steps=[True, True, False, True, True])
@example(config=cfg(init_scale=2.0**100, growth_factor=2.0**64), steps=[True, True, True])
# ... unless max_scale caps it first.
@example(config=cfg(init_scale=2.0**120, growth_factor=2.0**64, max_scale=F32_MAX),
         steps=[True, True, False, True])
@example(config=cfg(init_scale=3.0, growth_factor=1000.0, max_scale=1e6), steps=[True] * 4)
# Fail closed: directly, after hysteresis, after a growth, and through a long run.
@example(config=cfg(init_scale=TINY), steps=[False])
@example(config=cfg(init_scale=TINY, hysteresis=3), steps=[False, False, True, False, False,
                                                           False])
@example(config=cfg(init_scale=2.0**-126, growth_interval=1), steps=[True, False, False, False])
@example(config=cfg(init_scale=1.0, backoff_factor=1e-3), steps=[False] * 30)
@example(config=cfg(init_scale=1.5 * TINY, backoff_factor=0.9), steps=[False] * 10)
# min_scale clamps instead of failing.
@example(config=cfg(init_scale=1.0, backoff_factor=1e-3, min_scale=TINY), steps=[False] * 30)
@example(config=cfg(init_scale=1.0, backoff_factor=0.25, min_scale=0.1, hysteresis=2),
         steps=[False] * 6 + [True] * 3)
def test_update_matches_reference_model(config, steps):
    run_against_model(config, steps)


def test_examples_reach_the_interesting_branches():
    """The targeted examples above really do hit growth overflow and fail-closed."""
    m = model_init(cfg(init_scale=2.0**127))
    m = model_step(cfg(init_scale=2.0**127), m, True)
    assert m.scale == f32(2.0**127) and m.growth_tracker == 0       # growth skipped
    config = cfg(init_scale=1.0, backoff_factor=1e-3)
    m = model_init(config)
    with pytest.raises(FailClosed):
        for _ in range(30):
            m = model_step(config, m, False)
    config = cfg(init_scale=1.0, backoff_factor=1e-3, min_scale=TINY)
    m = model_init(config)
    for _ in range(30):
        m = model_step(config, m, False)
    assert m.scale == f32(TINY)
