"""``DynamicLossScale(growth="headroom")``: the rule against a pure-Python reference model,
its validation, the wrapper's max from the finite screen, and checkpoints that resume it.

The model restates the rule of the ``DynamicLossScale`` docstring in numpy float32:

* clean step: ``growth_tracker += 1`` (0 and the ceiling times ``growth_factor``, capped
  at the top of the range, on the ``growth_interval``-th); on every clean step while
  ``headroom_tracker < window``, then on those with ``growth_tracker % window == 0``
  (before the step), the unscaled max ``|grads_max / scale|`` (float32 max if not
  finite) goes into slot ``headroom_tracker % window`` and ``headroom_tracker += 1``
  (from ``2 * window - 1`` back to ``window``); once
  ``headroom_tracker >= window`` the scale becomes ``T = min(2**floor(log2(ratio)),
  ceiling, top)`` with ``ratio = finfo(dtype).max / margin / max(history)`` if ``T`` is
  larger; a history of zeros gives ``T = min(scale * growth_factor, max_scale,
  ceiling)`` (the scale for a product beyond float32) and, if it grows,
  ``headroom_tracker = 0``;
* non-finite step: the interval rule's backoff (hysteresis, ``min_scale``, fail closed),
  and on a backoff ``ceiling = `` the backed-off scale and ``headroom_tracker = 0``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_update_rule as interval_rule
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_update_rule import FailClosed, f32

import loss_scaling as ls
from loss_scaling.core.update import backoff_now

pytestmark = pytest.mark.filterwarnings(  # float16 params on purpose: test_diagnostics.py
    r"ignore:with_loss_scaling. the params .* are b?float16:UserWarning")

F32 = np.finfo(np.float32)
TINY, F32_MAX = float(F32.tiny), float(F32.max)


# ------------------------------------------------------------------------ reference model


@dataclasses.dataclass(frozen=True)
class Model(interval_rule.Model):
    """The interval rule's model state and the headroom rule's three leaves."""

    history: tuple[np.float32, ...]
    headroom_tracker: int
    ceiling: np.float32


def top(config: dict) -> np.float32:
    return f32(F32_MAX if config["max_scale"] is None else min(config["max_scale"], F32_MAX))


def model_init(config: dict) -> Model:
    return Model(f32(config["init_scale"]), 0, 0, (f32(0),) * config["headroom_window"], 0,
                 top(config))


def power_of_two_below(ratio: np.float32) -> np.float32:
    if not ratio >= TINY:       # zero, and subnormal ratios (the rule reads their bits as 0)
        return f32(0)
    return f32(2.0 ** (np.frexp(ratio)[1] - 1))


def model_clean(config: dict, m: Model, grads_max: float) -> Model:
    with np.errstate(all="ignore"):
        window = config["headroom_window"]
        tracker = m.growth_tracker + 1
        lifts = tracker >= config["growth_interval"]
        ceiling = min(f32(m.ceiling * f32(config["growth_factor"])), top(config)) if lifts \
            else m.ceiling
        unscaled = np.abs(f32(f32(grads_max) / m.scale))
        unscaled = unscaled if np.isfinite(unscaled) else f32(F32_MAX)
        unscaled = unscaled if unscaled >= TINY else f32(0)   # XLA CPU flushes subnormals
        history, steps = list(m.history), m.headroom_tracker
        if steps < window or m.growth_tracker % window == 0:   # records this step's max
            history[steps % window] = unscaled
            steps = window if steps + 1 >= 2 * window else steps + 1
        limit = f32(float(jnp.finfo(jnp.dtype(config["headroom_dtype"])).max))
        ratio = min(f32(f32(limit / f32(config["headroom_margin"])) / max(history)),
                    f32(F32_MAX))
        target = min(power_of_two_below(ratio), ceiling, top(config))
        empty = not max(history) > 0
        if empty:   # nothing measured: one growth_factor, and the window starts over
            probe = f32(m.scale * f32(config["growth_factor"]))
            if config["max_scale"] is not None:
                probe = min(probe, f32(config["max_scale"]))
            target = min(probe if np.isfinite(probe) else m.scale, ceiling)
        grows = steps >= window and target > m.scale
        scale = target if grows else m.scale
        steps = 0 if grows and empty else steps
        return Model(f32(scale), 0 if lifts else tracker, 0, tuple(history), steps,
                     f32(ceiling))


def model_step(config: dict, m: Model, finite: bool, grads_max: float,
               always: bool = False) -> Model:
    """One step (``always``: backoff_now); raises FailClosed where the rule fails closed."""
    if finite:
        return model_clean(config, m, grads_max)
    streak = min(m.nonfinite_tracker + 1, config["hysteresis"])
    if not (always or streak == config["hysteresis"]):
        return dataclasses.replace(m, growth_tracker=0, nonfinite_tracker=streak)
    with np.errstate(all="ignore"):
        shrunk = f32(m.scale * f32(config["backoff_factor"]))
    if config["min_scale"] is not None:
        shrunk = max(shrunk, f32(config["min_scale"]))
    if not shrunk >= TINY:
        raise FailClosed
    return dataclasses.replace(m, scale=f32(shrunk), growth_tracker=0,
                               nonfinite_tracker=streak, headroom_tracker=0,
                               ceiling=f32(shrunk))


def assert_matches(state: ls.DynamicLossScale, m: Model, where: str) -> None:
    def bits(x: Any) -> bytes:
        return np.asarray(x, np.float32).tobytes()

    assert bits(state.loss_scale) == bits(m.scale), f"{where}: {state.loss_scale} != {m}"
    assert bits(state.ceiling) == bits(m.ceiling), f"{where}: {state.ceiling} != {m}"
    assert bits(state.grad_max_history) == bits(m.history), f"{where}: {state} != {m}"
    assert (int(state.growth_tracker), int(state.nonfinite_tracker),
            int(state.headroom_tracker)) == (m.growth_tracker, m.nonfinite_tracker,
                                             m.headroom_tracker), f"{where}: {state} != {m}"
    assert state.grad_max_history.dtype == jnp.float32 and state.ceiling.dtype == jnp.float32


def test_model_matches_the_documented_example():
    config = cfg(init_scale=1.0, headroom_window=2)
    m = model_init(config)
    for _ in range(2):
        m = model_step(config, m, True, 1.0)
    assert m.scale == 2048.0   # 2048 * 16 * 1 <= 65504 < 4096 * 16 * 1


# ----------------------------------------------------------------------------- strategies


def cfg(**overrides: Any) -> dict:
    base = dict(init_scale=2.0**15, growth_factor=2.0, backoff_factor=0.5, growth_interval=3,
                hysteresis=1, min_scale=None, max_scale=None, growth="headroom",
                headroom_margin=16.0, headroom_window=2, headroom_dtype="float16")
    return dict(base, **overrides)


@st.composite
def configs(draw: Any) -> dict:
    init = f32(draw(st.sampled_from([1.0, 1.5, 3.0])) * 2.0 ** draw(st.integers(-126, 40)))
    config = cfg(
        init_scale=float(init),
        growth_factor=draw(st.sampled_from([2.0, 1.5, 4.0])),
        backoff_factor=draw(st.sampled_from([0.5, 0.25, 0.9])),
        growth_interval=draw(st.integers(1, 4)),
        hysteresis=draw(st.integers(1, 3)),
        headroom_margin=draw(st.sampled_from([1.0, 2.0, 16.0, 2.0**10])),
        headroom_window=draw(st.integers(1, 4)),
        headroom_dtype=draw(st.sampled_from(["float16", "bfloat16", "float8_e4m3fn"])),
    )
    if draw(st.booleans()):
        config["min_scale"] = float(max(f32(init * 2.0 ** -draw(st.integers(0, 6))), f32(TINY)))
    if draw(st.booleans()):
        config["max_scale"] = min(float(init) * 2.0 ** draw(st.integers(0, 30)), F32_MAX)
    return config


GRAD_MAXIMA = st.one_of(
    st.sampled_from([0.0, 1.0, 3.0, 65504.0, 1e30, float("inf"), float("nan"), -2.0]),
    st.floats(1e-6, 1e6))
steps_strategy = st.lists(st.tuples(st.booleans(), st.integers(1, 5), GRAD_MAXIMA),
                          max_size=7).map(
    lambda runs: [(flag, g) for flag, n, g in runs for _ in range(n)][:24])


def run_against_model(config: dict, steps: list[tuple[bool, float]]) -> None:
    eager = jitted = ls.DynamicLossScale(**config)
    step = jax.jit(ls.update)
    m = model_init(config)
    assert_matches(eager, m, "init")
    for i, (finite, grads_max) in enumerate(steps):
        where = f"step {i} ({finite}, {grads_max}) of {steps} with {config}"
        peak = jnp.float32(grads_max)
        try:
            m = model_step(config, m, finite, grads_max)
        except FailClosed:
            with pytest.raises(ls.LossScaleError, match="loss scale backoff failed"):
                ls.update(eager, finite, grads_max=peak)
            for later, later_max in [(finite, grads_max), *steps[i + 1:]]:
                jitted = step(jitted, jnp.asarray(later), grads_max=jnp.float32(later_max))
                assert int(jitted.failure) == ls.Failure.BACKOFF_UNDERFLOW, where
                assert_matches(jitted, m, "jit, after the failure, " + where)
            return
        eager = ls.update(eager, finite, grads_max=peak)
        jitted = step(jitted, jnp.asarray(finite), grads_max=peak)
        assert_matches(eager, m, "eager " + where)
        assert_matches(jitted, m, "jit " + where)
        assert int(jitted.failure) == 0


@settings(max_examples=30, deadline=None)
@given(config=configs(), steps=steps_strategy)
# Growth to the target once the window is full; a backoff caps it below the overflowed
# scale until growth_interval clean steps lift the ceiling.
@example(config=cfg(init_scale=1.0), steps=[(True, 2.0)] * 3 + [(False, 0.0)]
         + [(True, 1.0)] * 8)
# Zero maxima: one growth_factor per window; tiny ones: the cap (max_scale, float32's
# max), never an inf scale.
@example(config=cfg(init_scale=1.0, headroom_margin=1.0), steps=[(True, 0.0)] * 3)
@example(config=cfg(init_scale=1.0, max_scale=1e6), steps=[(True, 1e-30)] * 3)
# Hysteresis, min_scale, fail closed.
@example(config=cfg(init_scale=2.0**-125, hysteresis=2),
         steps=[(False, 0.0), (True, 1.0), (False, 0.0), (False, 0.0), (False, 0.0),
                (False, 0.0), (True, 1.0)])
@example(config=cfg(init_scale=4.0, min_scale=2.0, backoff_factor=0.25),
         steps=[(False, 0.0)] * 3 + [(True, 1.0)] * 4)
def test_update_matches_reference_model(config, steps):
    run_against_model(config, steps)


@pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit], ids=["eager", "jit"])
@pytest.mark.parametrize("growth", ["interval", "headroom"])
def test_backoff_now_ignores_hysteresis(maybe_jit, growth):
    config = cfg(init_scale=1024.0, hysteresis=3, min_scale=256.0, growth=growth)
    if growth == "interval":
        config = {k: v for k, v in config.items() if not k.startswith("headroom")}
    s = ls.DynamicLossScale(**config)
    for expected in (512.0, 256.0, 256.0):   # clamped at min_scale
        s = maybe_jit(backoff_now)(s)
        assert float(s.loss_scale) == expected and int(s.failure) == 0
    assert int(s.nonfinite_tracker) == 3 and int(s.growth_tracker) == 0
    if growth == "headroom":
        m = model_init(config)
        for _ in range(3):
            m = model_step(config, m, False, 0.0, always=True)
        assert_matches(s, m, "backoff_now")
    # Below the normal range: recorded (never raised, eagerly neither), then frozen.
    tiny = maybe_jit(backoff_now)(ls.DynamicLossScale(init_scale=TINY))
    assert int(tiny.failure) == ls.Failure.BACKOFF_UNDERFLOW
    assert float(tiny.loss_scale) == TINY
    assert float(maybe_jit(backoff_now)(tiny).loss_scale) == TINY
    static = ls.StaticLossScale(8.0)
    assert backoff_now(static) is static


# ---------------------------------------------------------------------------- validation


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(growth="doubling"), "growth must be 'interval'.*'doubling'"),
    (dict(headroom_margin=16.0), "apply only to growth='headroom'.*pass growth='headroom'"),
    (dict(headroom_window=8, headroom_dtype="bfloat16"), "headroom_window, headroom_dtype"),
    (dict(growth="headroom", headroom_margin=3.0), "headroom_margin must be a power of two"),
    (dict(growth="headroom", headroom_margin=0.5), "headroom_margin must be a power of two"),
    (dict(growth="headroom", headroom_window=0), r"headroom_window must be an integer"),
    (dict(growth="headroom", headroom_window=2**16 + 1), r"headroom_window.*\[1, 65536\]"),
    (dict(growth="headroom", headroom_dtype=jnp.int8), "headroom_dtype must be a floating"),
    (dict(growth="headroom", headroom_dtype=jnp.float64), "no wider than float32"),
])
def test_bad_options_are_refused_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ls.DynamicLossScale(**kwargs)


def test_options_defaults_repr_and_unchanged_interval_state():
    s = ls.DynamicLossScale(growth="headroom", headroom_dtype=jnp.bfloat16)
    config = s.config
    assert (config.headroom_margin, config.headroom_window, config.headroom_dtype) == (
        16.0, 16, "bfloat16")
    assert s.growth == "headroom" and hash(config) == hash(dataclasses.replace(config))
    assert "growth='headroom'" in repr(s) and "ceiling=" in repr(s)
    assert s.grad_max_history.shape == (16,) and float(s.ceiling) == F32_MAX
    # The interval scaler keeps its 4 leaves, repr and state dict.
    interval = ls.DynamicLossScale()
    assert len(jax.tree.leaves(interval)) == 4 and interval.ceiling is None
    assert "growth=" not in repr(interval) and "growth" not in ls.state_dict(interval)["config"]


def test_update_needs_grads_max_for_headroom():
    s = ls.DynamicLossScale(growth="headroom")
    with pytest.raises(ValueError, match="needs grads_max=.*loss_scaling.grads_max"):
        ls.update(s, True)
    with pytest.raises(ValueError, match="grads_max must be a real scalar"):
        ls.update(s, True, grads_max=jnp.ones(2))
    with pytest.raises(ValueError, match="grads_max must be a real scalar"):
        ls.update(ls.DynamicLossScale(), True, grads_max=True)
    # Any other rule ignores it.
    assert float(ls.update(ls.DynamicLossScale(), True, grads_max=3.0).loss_scale) == 2.0**15
    assert isinstance(ls.update(ls.NoOpLossScale(), True, grads_max=3.0), ls.NoOpLossScale)


@pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit], ids=["eager", "jit"])
def test_grads_max(maybe_jit):
    tree = {"a": jnp.array([1.0, -5.0]), "b": jnp.array([3 + 4j], jnp.complex64),
            "h": jnp.array([-6.0], jnp.float16), "n": jnp.int32(100), "e": jnp.zeros(0)}
    assert float(maybe_jit(ls.grads_max)(tree)) == 6.0
    assert float(maybe_jit(ls.grads_max)({})) == 0.0


@pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit], ids=["eager", "jit"])
@pytest.mark.parametrize("size", [3, 100_000])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.complex64],
                         ids=lambda d: np.dtype(d).name)
def test_grads_max_of_a_non_finite_leaf_is_inf(maybe_jit, size, bad, dtype):
    """Issue 42, item 1: a NaN reads +inf, as the step reads it (``numerics.agree``). On
    XLA CPU a max over 100,000 entries dropped the NaN: 3.0 came back."""
    x = np.ones(size, dtype)
    x[-1] = 3
    x[size // 2] = bad
    tree = {"w": jnp.asarray(x), "b": jnp.ones(2), "n": jnp.int32(7)}
    assert float(maybe_jit(ls.grads_max)(tree)) == np.inf
    if dtype == np.complex64:
        x[size // 2] = complex(1.0, bad)
        assert float(maybe_jit(ls.grads_max)({"w": jnp.asarray(x)})) == np.inf


def test_pytree_placeholders_and_pickle():
    import pickle

    s = ls.update(ls.DynamicLossScale(growth="headroom", headroom_window=3), True,
                  grads_max=jnp.float32(5.0))
    assert len(jax.tree.leaves(s)) == 7
    none = jax.tree.map(lambda _: None, s)
    assert jax.tree.structure(none, is_leaf=lambda x: x is None).num_leaves == 7
    shapes = jax.eval_shape(lambda x: x, s)
    assert shapes.grad_max_history.shape == (3,)
    again = pickle.loads(pickle.dumps(s))
    assert again.config == s.config
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(again),
                                                    jax.tree.leaves(s), strict=True))
    keys = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(s)]
    assert keys[-3:] == [".grad_max_history", ".headroom_tracker", ".ceiling"]


# ---------------------------------------------------------------------- in the wrapper


PARAMS = {"w": jnp.full((80, 64), 0.5), "b": jnp.full((64,), 0.5),
          "h": jnp.full((16,), 0.5, jnp.float16)}


@jax.jit
def grads_at(i: Any, scale: jax.Array) -> dict[str, jax.Array]:
    """Scaled gradients with a max that changes from step to step; an overflow at step 4."""
    g = {k: (jnp.full(v.shape, 1e-3, v.dtype).at[(0,) * v.ndim].set(
        (2.0 ** (i % 3) if k == "w" else 0.5) * 1e-2)) for k, v in PARAMS.items()}
    g = jax.tree.map(lambda x: (x.astype(jnp.float32) * scale).astype(x.dtype), g)
    g["b"] = g["b"].at[3].set(jnp.where(i == 4, jnp.inf, g["b"][3]))
    return g


def headroom_tx(skip: str = "auto", **options: Any) -> Any:
    scaler = ls.DynamicLossScale(**{**dict(init_scale=8.0, growth="headroom",
                                           headroom_window=2, growth_interval=2), **options})
    return ls.with_loss_scaling(optax.sgd(1e-3), scaler, skip=skip)


# "small": leaves of at most 4096 entries only, screened together, whose max is read on
# every step (cheaper than a conditional); the rule must still see it only as it records.
@pytest.mark.parametrize(("api", "skip", "leaves"), [("fused", "cond", "all"),
                                                     ("plain", "select", "all"),
                                                     ("fused", "cond", "small")])
def test_wrapper_steps_the_rule_with_the_screens_max(api, skip, leaves):
    tx = headroom_tx(skip)
    model = {k: v for k, v in PARAMS.items() if leaves == "all" or v.size <= 4096}

    def step(params, opt_state, grads):
        if api == "fused":
            return ls.apply_gradients(tx, grads, opt_state, params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    step = jax.jit(step)
    params, opt_state = model, tx.init(model)
    expected = ls.get_loss_scale(opt_state)
    for i in range(7):
        grads = grads_at(i, ls.get_loss_scale(opt_state).loss_scale)
        if "w" not in model:  # the max that changes from step to step moves into "b"
            grads = {"b": grads["b"].at[0].set(grads["b"][0] * 2.0 ** (i % 3)),
                     "h": grads["h"]}
        params, opt_state = step(params, opt_state, grads)
        expected = ls.update(expected, ls.all_finite(ls.unscale(expected, grads)),
                             grads_max=ls.grads_max(grads))
        got = ls.get_loss_scale(opt_state)
        for name in expected.leaf_names:
            np.testing.assert_array_equal(getattr(got, name), getattr(expected, name),
                                          err_msg=f"{name} after step {i}")
    assert float(got.loss_scale) > 8.0 and float(got.ceiling) < F32_MAX   # grew, backed off
    metrics = ls.metrics(opt_state)
    peak = float(jnp.max(got.grad_max_history))
    assert float(metrics["grad_max_window"]) == peak
    np.testing.assert_allclose(float(metrics["headroom_log2"]),
                               np.log2(65504.0 / (float(got.loss_scale) * peak)), rtol=1e-6)
    assert float(metrics["scale_ceiling"]) == float(got.ceiling)
    assert "grad_max_window" not in ls.metrics(ls.with_loss_scaling(optax.sgd(1.0)).init(
        model))


# ---------------------------------------------------------- the rule at its edges


@pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit], ids=["eager", "jit"])
@pytest.mark.parametrize("size", [3, 5000], ids=["small-leaf", "large-leaf"])
@pytest.mark.parametrize(("dtype", "init_scale", "scaled"), [
    ("float32", 2.0**60, 1e20),     # a square would overflow float32: read inf, "no room"
    ("bfloat16", 2.0**60, 3e30),
    ("float32", 1.0, 1e-20),        # a square would flush to 0: an empty entry
    ("bfloat16", 1.0, 1e-30),
])
def test_the_recorded_max_is_the_true_max_across_float32s_range(
        maybe_jit, size, dtype, init_scale, scaled):
    """Issue 33, items 1-2: the max the wrapper records is ``ls.grads_max``'s, however
    large or small the scaled gradients are inside float32's normal range."""
    tx = ls.with_loss_scaling(optax.sgd(0.0), ls.DynamicLossScale(
        init_scale=init_scale, growth="headroom", headroom_dtype=dtype, headroom_window=4))
    params = {"w": jnp.zeros(size)}
    opt_state = tx.init(params)
    step = maybe_jit(lambda g, s: ls.apply_gradients(tx, g, s, params))
    for i in range(3):
        grads = {"w": jnp.full(size, scaled * 2.0**-i, jnp.float32)}
        _, opt_state = step(grads, opt_state)
        scaler = ls.get_loss_scale(opt_state)
        assert float(scaler.loss_scale) == init_scale   # the window is not full yet
        expected = np.float32(ls.grads_max(grads)) / np.float32(init_scale)
        assert float(scaler.grad_max_history[i]) == expected > 0, (i, scaler)
    # Off CPU the max is a sibling of the finite test's read: the same value.
    from loss_scaling.core import numerics
    big = {"w": jnp.full(size, scaled, jnp.float32), "c": jnp.array([scaled * 1j])}
    assert float(numerics._exact_test(big, None, None, True)[3]) == float(ls.grads_max(big))


@pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit], ids=["eager", "jit"])
def test_a_window_of_zeros_grows_one_factor_per_window(maybe_jit):
    """Issue 33, item 4: zero gradients measure nothing; the scale does not jump to
    2**127 (from which the first real gradients would back off 112 steps), it grows by
    ``growth_factor`` once per window, each growth starting a new window."""
    s = ls.DynamicLossScale(init_scale=1.0, growth="headroom", headroom_window=2,
                            growth_interval=1000)
    step = maybe_jit(lambda s, g: ls.update(s, True, grads_max=g))
    scales = []
    for _ in range(6):
        s = step(s, jnp.float32(0.0))
        scales.append(float(s.loss_scale))
    assert scales == [1.0, 2.0, 2.0, 4.0, 4.0, 8.0]
    capped = ls.DynamicLossScale(init_scale=2.0**127, growth="headroom", headroom_window=1)
    assert float(step(capped, jnp.float32(0.0)).loss_scale) == 2.0**127   # never inf
    # A measured max takes over once the window is full: 2048 * 16 * 1 <= 65504.
    for _ in range(2):
        s = step(s, jnp.float32(8.0))   # scaled by 8: an unscaled max of 1
    assert float(s.loss_scale) == 2048.0


@pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_headroom_log2_after_a_growth_is_at_least_the_margin(maybe_jit, dtype):
    """Issue 33, item 3: a growth that leaves exactly the margin reads log2(margin), not
    3.9999998 (a difference of three float32 logarithms)."""
    limit = float(jnp.finfo(jnp.dtype(dtype)).max)
    for target in (2.0**10, 2.0**-2, 2.0**60):
        peak = float(np.float32(limit / 16.0 / target))
        tx = ls.with_loss_scaling(optax.sgd(0.0), ls.DynamicLossScale(
            init_scale=2.0**-30, growth="headroom", headroom_window=1, headroom_dtype=dtype))
        params = {"w": jnp.zeros(3)}
        grads = {"w": jnp.full(3, peak * 2.0**-30, jnp.float32)}
        _, opt_state = ls.apply_gradients(tx, grads, tx.init(params), params)
        metrics = maybe_jit(ls.metrics)(opt_state)
        assert float(metrics["loss_scale"]) == target
        assert float(metrics["headroom_log2"]) >= 4.0, (dtype, target, metrics)
        np.testing.assert_allclose(float(metrics["headroom_log2"]), 4.0, atol=1e-6)


# ----------------------------------------------------------------------- checkpoints


@functools.lru_cache
def stepper(tx: Any) -> Any:
    return jax.jit(lambda p, s, g: ls.apply_gradients(tx, g, s, p))


def run(tx: Any, params: Any, opt_state: Any, steps: range) -> tuple[Any, Any]:
    step = stepper(tx)
    for i in steps:
        params, opt_state = step(params, opt_state,
                                 grads_at(i, ls.get_loss_scale(opt_state).loss_scale))
    return params, opt_state


def assert_bit_identical(a: Any, b: Any) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def test_restored_checkpoints_resume_the_history_bit_identically(tmp_path):
    tx = headroom_tx()
    whole = run(tx, PARAMS, tx.init(PARAMS), range(8))
    params, opt_state = run(tx, PARAMS, tx.init(PARAMS), range(3))
    saved = ls.get_loss_scale(opt_state)
    assert int(saved.headroom_tracker) > 0 and float(jnp.max(saved.grad_max_history)) > 0

    # The JSON state dict, into a freshly built optimizer state.
    text = json.dumps(ls.state_dict(saved))
    resumed = ls.restore_loss_scale(tx.init(PARAMS), json.loads(text))
    resumed = resumed._replace(inner_state=opt_state.inner_state)
    assert_bit_identical(ls.get_loss_scale(resumed), saved)
    assert_bit_identical(run(tx, params, resumed, range(3, 8)), whole)

    # flax bytes of the whole state.
    data = flax.serialization.to_bytes((params, opt_state))
    restored = ls.from_bytes((PARAMS, tx.init(PARAMS)), data)
    assert_bit_identical(restored, (params, opt_state))
    assert_bit_identical(run(tx, *restored, range(3, 8)), whole)


def test_restore_into_another_growth_rule_is_refused():
    tx = headroom_tx()
    opt_state = run(tx, PARAMS, tx.init(PARAMS), range(3))[1]
    saved = ls.get_loss_scale(opt_state)
    interval = ls.with_loss_scaling(optax.sgd(1e-3), ls.DynamicLossScale(init_scale=8.0,
                                                                          growth_interval=2))
    with pytest.raises(ValueError, match="growth: saved 'headroom', target 'interval'"):
        ls.restore_loss_scale(interval.init(PARAMS), ls.state_dict(saved))
    with pytest.raises(ValueError, match="the bytes hold a DynamicLossScale with growth="):
        ls.from_bytes(interval.init(PARAMS), flax.serialization.to_bytes(opt_state))
    other_window = headroom_tx(headroom_window=3).init(PARAMS)
    with pytest.raises(ValueError, match="headroom_window of 2, the target's is 3"):
        ls.from_bytes(other_window, flax.serialization.to_bytes(opt_state))
    # Adopting explicitly: the scale kept; a history of another length starts over.
    adopted = ls.restore_with_config(saved, other_window.scaler)
    assert float(adopted.loss_scale) == float(saved.loss_scale)
    assert int(adopted.headroom_tracker) == 0 and adopted.grad_max_history.shape == (3,)
    kept = ls.restore_with_config(saved, ls.DynamicLossScale(growth="headroom",
                                                             headroom_window=2))
    assert_bit_identical(kept.grad_max_history, saved.grad_max_history)
    back = ls.restore_with_config(saved, interval.init(PARAMS).scaler)
    assert len(jax.tree.leaves(back)) == 4


@pytest.mark.parametrize(("path", "value", "match"), [
    (("values", "grad_max_history"), [1.0], "list of config.headroom_window = 2"),
    (("values", "grad_max_history"), [1.0, float("inf")], "finite float32 >= 0"),
    # Issue 33, item 10: below the normal range too, never rounded silently.
    (("values", "grad_max_history"), [1e-45, 0.0],
     r"grad_max_history\[0\] is 1e-45, which float32 does not represent exactly: the "
     r"nearest float32 values are 0.0 and 1.401298464324817e-45"),
    (("values", "ceiling"), 0.0, "values.ceiling must be a finite, positive"),
    (("values", "headroom_tracker"), 4, r"headroom_tracker must be an integer in \[0, 2 \*"),
    (("config", "headroom_dtype"), 16, "headroom_dtype must be a dtype name"),
    # An interval dict has exactly the keys it had before headroom growth (issue 41:
    # the headroom keys beside growth='interval' were a shape nobody wrote).
    (("config", "growth"), "interval",
     r"unexpected key\(s\) config.growth, config.headroom_margin, config.headroom_window, "
     r"config.headroom_dtype"),
])
def test_invalid_headroom_state_dicts_are_refused(path, value, match):
    d = ls.state_dict(ls.DynamicLossScale(growth="headroom", headroom_window=2))
    d[path[0]][path[1]] = value
    if path == ("config", "growth"):
        for key in ("grad_max_history", "headroom_tracker", "ceiling"):
            del d["values"][key]
    with pytest.raises(ValueError, match=match):
        ls.from_state_dict(d)


def test_orbax_round_trip(tmp_path):
    import orbax.checkpoint as ocp

    tx = headroom_tx()

    def make() -> Any:
        return {"params": PARAMS, "opt_state": tx.init(PARAMS)}

    params, opt_state = run(tx, PARAMS, tx.init(PARAMS), range(3))
    with ocp.CheckpointManager(tmp_path) as mngr:
        mngr.save(0, args=ls.orbax_save_args({"params": params, "opt_state": opt_state}))
        mngr.wait_until_finished()
        state = ls.orbax_restore(mngr, jax.eval_shape(make))
    assert_bit_identical(state["opt_state"], opt_state)


def test_orbax_adopt_config_names_what_cannot_be_adopted_and_the_fix(tmp_path):
    """Issue 33, items 9 and 13: adopting another growth rule or headroom_window through
    Orbax is refused by name (not by Orbax's structure error), with the route that works;
    a plain config change points to orbax_restore's own adopt_config=True."""
    import orbax.checkpoint as ocp

    def make(**scaler: Any) -> Any:
        tx = ls.with_loss_scaling(optax.sgd(1e-3), ls.DynamicLossScale(init_scale=8.0,
                                                                        **scaler))
        return {"params": PARAMS, "opt_state": tx.init(PARAMS)}

    saved = make(growth="headroom", headroom_window=2)
    with ocp.CheckpointManager(tmp_path) as mngr:
        mngr.save(0, args=ls.orbax_save_args(saved))
        mngr.wait_until_finished()
        for scaler, what in [({}, r"growth \('interval' for the saved 'headroom'\)"),
                             (dict(growth="headroom", headroom_window=3),
                              r"headroom_window \(3 for the saved 2\)")]:
            target = jax.eval_shape(lambda scaler=scaler: make(**scaler))
            with pytest.raises(ValueError, match=r"orbax_restore\(\.\.\., adopt_config=True"
                                                 r"\) cannot adopt " + what):
                ls.orbax_restore(mngr, target, adopt_config=True)
            with pytest.raises(ValueError, match=what + " changes the loss scale's arrays, "
                                                 "so `adopt_config=True` cannot adopt it"):
                ls.orbax_restore(mngr, target)
        with pytest.raises(ValueError, match="(?s)growth_interval: saved 2000, target 7.*pass "
                                             "`adopt_config=True` to loss_scaling.orbax_"):
            ls.orbax_restore(mngr, jax.eval_shape(lambda: make(
                growth="headroom", headroom_window=2, growth_interval=7)))
        # The route the errors name: restore as saved, then move the loss scale over.
        restored = ls.orbax_restore(mngr, jax.eval_shape(
            lambda: make(growth="headroom", headroom_window=2)))
    new = make()
    new["opt_state"] = new["opt_state"]._replace(
        inner_state=restored["opt_state"].inner_state)
    new = ls.restore_loss_scale(new, ls.get_loss_scale(restored["opt_state"]),
                                adopt_config=True)
    assert ls.get_loss_scale(new["opt_state"]).growth == "interval"
    assert float(ls.get_loss_scale(new["opt_state"]).loss_scale) == 8.0
