"""with_loss_scaling / apply_gradients / get_loss_scale / metrics / value_and_grad.

Known values in the shape of optax's ``_conditionality_test.py`` (scalar params, ``sgd(1.0)``,
scripted good / NaN / inf sequences), bit-identity of skipped steps, equality with the inner
optimizer on finite steps, fail-closed runs, extra args, fresh buffers and tracing.
Every step runs eagerly, under ``jit`` and under ``jit`` with the opt_state and params donated.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from bitwise import assert_bit_identical, assert_trees_close_in_ulps, bits

import loss_scaling as ls
from loss_scaling.wrapper.state import options_of

NAN, INF = float("nan"), float("inf")

# Several tests here use float16 / bfloat16 params on purpose (dtype handling of skips);
# the init warnings about them are tested in test_diagnostics.py.
pytestmark = [
    pytest.mark.filterwarnings(r"ignore:with_loss_scaling. the params .* are float16:UserWarning"),
    pytest.mark.filterwarnings(r"ignore:with_loss_scaling. the params .* are bfloat16:UserWarning"),
]

# Every step function below has the signature step(grads, opt_state, params, **extra_args)
# -> (params, opt_state), so one donation pattern fits all of them.
DONATING_JIT = functools.partial(jax.jit, donate_argnums=(1, 2))
MAYBE_JIT = pytest.mark.parametrize(
    "maybe_jit", [lambda f: f, jax.jit, DONATING_JIT], ids=["eager", "jit", "jit_donate"])
EAGER_OR_DONATING_JIT = pytest.mark.parametrize(
    "maybe_jit", [lambda f: f, DONATING_JIT], ids=["eager", "jit_donate"])
SKIPS = pytest.mark.parametrize("skip", ["cond", "select"])
PATHS = pytest.mark.parametrize("path", ["plain", "fused"])


def plain_step(tx):
    """The plain optax contract: tx.update, then optax.apply_updates outside it."""

    def step(grads, opt_state, params, **extra_args):
        updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
        return optax.apply_updates(params, updates), opt_state

    return step


def fused_step(tx):
    def step(grads, opt_state, params, **extra_args):
        return ls.apply_gradients(tx, grads, opt_state, params, **extra_args)

    return step


STEPS = {"plain": plain_step, "fused": fused_step}




def scaled(tree, factor, dtype=None):
    """``tree * factor`` in float32, cast back to each leaf's dtype (what jax.grad yields)."""
    return jax.tree.map(
        lambda x: (jnp.asarray(x, jnp.float32) * factor).astype(dtype or jnp.asarray(x).dtype),
        tree)


def wrapper_counters(opt_state):
    m = ls.metrics(opt_state)
    return (float(m["loss_scale"]), int(m["growth_tracker"]), int(m["skipped_steps"]),
            int(m["consecutive_skips"]), bool(m["last_step_applied"]))


# ---------------------------------------------------------------- known values (sgd(1.0))

# (true gradient, then expected: param, loss scale, growth tracker, skipped, consecutive,
# last finite). DynamicLossScale(init_scale=4, growth_interval=2): backoff halves, the 2nd
# consecutive clean step doubles.
SCRIPT = [
    (1.0, -1.0, 4.0, 1, 0, 0, True),
    (NAN, -1.0, 2.0, 0, 1, 1, False),
    (INF, -1.0, 1.0, 0, 2, 2, False),
    (2.0, -3.0, 1.0, 1, 2, 0, True),
    (3.0, -6.0, 2.0, 0, 2, 0, True),     # growth
    (-INF, -6.0, 1.0, 0, 3, 1, False),
    (4.0, -10.0, 1.0, 1, 3, 0, True),
]


@MAYBE_JIT
@SKIPS
@PATHS
def test_scripted_sequence_known_values(maybe_jit, skip, path):
    tx = ls.with_loss_scaling(
        optax.sgd(1.0), ls.DynamicLossScale(init_scale=4.0, growth_interval=2), skip=skip)
    params = jnp.float32(0.0)
    opt_state = tx.init(params)
    step = maybe_jit(STEPS[path](tx))
    for g, want_param, *want_counters in SCRIPT:
        factor = ls.get_loss_scale(opt_state).loss_scale
        params, opt_state = step(jnp.float32(g) * factor, opt_state, params)
        assert float(params) == want_param
        assert wrapper_counters(opt_state) == tuple(want_counters)


@EAGER_OR_DONATING_JIT
@SKIPS
@PATHS
def test_adam_count_and_moments_do_not_advance_on_skips(maybe_jit, skip, path):
    tx = ls.with_loss_scaling(optax.adam(0.1), ls.StaticLossScale(8.0), skip=skip)
    params = jnp.array([1.0, -2.0])
    opt_state = tx.init(params)
    step = maybe_jit(STEPS[path](tx))
    for g, want_count in [([1.0, 2.0], 1), ([NAN, 1.0], 1), ([1.0, INF], 1), ([3.0, 1.0], 2)]:
        before = bits(opt_state.inner_state)
        params, opt_state = step(jnp.array(g) * 8.0, opt_state, params)
        assert int(opt_state.inner_state[0].count) == want_count
        if not np.isfinite(g).all():
            assert_bit_identical(before, opt_state.inner_state)


@MAYBE_JIT
@SKIPS
def test_inject_hyperparams_schedule_does_not_advance_on_skips(maybe_jit, skip):
    schedule = optax.linear_schedule(1.0, 0.0, transition_steps=4)
    tx = ls.with_loss_scaling(
        optax.inject_hyperparams(optax.sgd)(learning_rate=schedule), ls.StaticLossScale(2.0),
        skip=skip)
    params = jnp.float32(0.0)
    opt_state = tx.init(params)
    step = maybe_jit(plain_step(tx))
    # lr: 1.0 at count 0, 0.75 at count 1, ...; skipped steps must not consume the schedule.
    for g, want_count, want_param in [(1.0, 1, -1.0), (NAN, 1, -1.0), (INF, 1, -1.0),
                                      (1.0, 2, -1.75), (2.0, 3, -2.75)]:
        params, opt_state = step(jnp.float32(g) * 2.0, opt_state, params)
        assert int(opt_state.inner_state.count) == want_count
        assert float(params) == want_param


# --------------------------------------------------------------- skipped steps: bit-exact


def awkward_params(subnormals: bool):
    """Signed zeros, extremes and infinities in float16, bfloat16 and float32.

    Subnormals only where asked: XLA on CPU flushes float32/bfloat16 (and float64)
    subnormals to zero in
    *any* arithmetic (``p + -0.0`` included), so ``optax.apply_updates`` cannot keep them
    on any step; the fused path returns the params untouched.
    """
    out = {}
    for dtype in (jnp.float16, jnp.bfloat16, jnp.float32):
        fi = jnp.finfo(dtype)
        values = [0.0, -0.0, 1.0, -1.5, float(fi.max), -float(fi.max), float(fi.tiny), INF, -INF]
        if subnormals or dtype == jnp.float16:   # float16 computes in float32: no flush
            values += [float(fi.smallest_subnormal), -float(fi.smallest_subnormal)]
        out[jnp.dtype(dtype).name] = jnp.array(values, dtype)
    return out


@MAYBE_JIT
@SKIPS
@PATHS
def test_skipped_step_leaves_params_and_inner_state_bit_identical(maybe_jit, skip, path):
    params = awkward_params(subnormals=path == "fused")
    # adamw with weight decay updates even zero gradients: a skip must not leak through.
    tx = ls.with_loss_scaling(optax.adamw(0.1, weight_decay=0.5), ls.DynamicLossScale(),
                              skip=skip)
    opt_state = tx.init(params)
    step = maybe_jit(STEPS[path](tx))
    # One finite step first, so the inner state is not all zeros.
    good = jax.tree.map(lambda p: jnp.ones_like(p), params)
    params, opt_state = step(good, opt_state, params)
    bad = dict(good, float32=good["float32"].at[3].set(NAN),
               float16=good["float16"].at[0].set(-INF))
    params_bits, inner_bits = bits(params), bits(opt_state.inner_state)
    params, opt_state = step(bad, opt_state, params)
    assert_bit_identical(params_bits, params)
    assert_bit_identical(inner_bits, opt_state.inner_state)
    assert not bool(opt_state.last_step_applied)


@pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit], ids=["eager", "jit"])
@SKIPS
def test_skipped_updates_are_negative_zeros_in_param_dtypes(maybe_jit, skip):
    params = awkward_params(subnormals=False)
    tx = ls.with_loss_scaling(optax.adam(0.1), skip=skip)
    bad = jax.tree.map(lambda p: jnp.full_like(p, NAN), params)
    updates, _ = maybe_jit(tx.update)(bad, tx.init(params), params)
    chex.assert_trees_all_equal_dtypes(updates, params)
    for u in jax.tree.leaves(updates):
        assert np.all(np.signbit(np.asarray(u, np.float32))) and not np.any(u)


# ------------------------------------------------------- long runs: never apply, fail closed


@SKIPS
@PATHS
def test_fifty_non_finite_steps_never_touch_params(skip, path):
    scaler = ls.DynamicLossScale(init_scale=2.0**15, min_scale=1.0)
    tx = ls.with_loss_scaling(optax.adam(0.1), scaler, skip=skip)
    params = {"w": jnp.array([1.0, -0.0, 3.0]), "h": jnp.array([0.5, 0.0], jnp.float16)}
    opt_state = tx.init(params)
    step = jax.jit(STEPS[path](tx), donate_argnums=(1, 2))
    bad = {"w": jnp.array([NAN, 1.0, 1.0]), "h": jnp.array([INF, 1.0], jnp.float16)}
    params_bits, inner_bits = bits(params), bits(opt_state.inner_state)
    scales = []
    for _ in range(50):
        params, opt_state = step(bad, opt_state, params)
        assert_bit_identical(params_bits, params)
        scales.append(float(opt_state.scaler.loss_scale))
    assert_bit_identical(inner_bits, opt_state.inner_state)
    assert scales[:16] == [2.0**(14 - i) for i in range(15)] + [1.0]   # backs off, then floor
    assert set(scales[15:]) == {1.0}
    assert wrapper_counters(opt_state) == (1.0, 0, 50, 50, False)
    # And the run recovers on the first finite step.
    good = {"w": jnp.array([1.0, 1.0, 1.0]), "h": jnp.array([1.0, 1.0], jnp.float16)}
    params, opt_state = step(good, opt_state, params)
    assert float(params["w"][0]) < 1.0
    assert wrapper_counters(opt_state) == (1.0, 1, 50, 0, True)


@PATHS
def test_without_min_scale_an_eager_run_fails_closed_at_once(path):
    # 2**-120 reaches the smallest normal float32 (2**-126) after 6 backoffs; the 7th fails.
    tx = ls.with_loss_scaling(optax.sgd(1.0), ls.DynamicLossScale(init_scale=2.0**-120))
    params = jnp.array([1.0, 2.0])
    opt_state = tx.init(params)
    step = STEPS[path](tx)
    params_bits = bits(params)
    steps_done = 0
    with pytest.raises(ls.LossScaleError, match="loss scale backoff failed"):
        for _ in range(50):
            params, opt_state = step(jnp.array([NAN, 1.0]), opt_state, params)
            assert_bit_identical(params_bits, params)   # never an update before failing
            steps_done += 1
    assert steps_done == 6


@PATHS
@pytest.mark.parametrize("skip", ["auto", "cond", "select"])
def test_a_donated_jit_run_fails_closed_as_state_and_loses_nothing(path, skip):
    """The failure is recorded (no callback, no raise inside the donated step): params
    and inner state stay readable, bit-identical to before the failing step, every later
    step is skipped (finite ones too), the scale stays at its last valid value, the
    counters count, ls.check raises the full message, and the state checkpoints."""
    tx = ls.with_loss_scaling(optax.adam(0.1), ls.DynamicLossScale(init_scale=2.0**-120),
                              skip=skip)
    params = {"w": jnp.array([1.0, 2.0]), "b": jnp.array([-0.0, 3.0])}
    opt_state = tx.init(params)
    step = jax.jit(STEPS[path](tx), donate_argnums=(1, 2))
    good = {"w": jnp.array([1.0, 1.0]), "b": jnp.array([1.0, 1.0])}
    params, opt_state = step(good, opt_state, params)            # one applied step
    params_bits, inner_bits = bits(params), bits(opt_state.inner_state)
    bad = {"w": jnp.array([NAN, 1.0]), "b": jnp.array([1.0, 1.0])}
    for i in range(12):
        grads = bad if i < 8 else good
        params, opt_state = step(grads, opt_state, params)
        assert_bit_identical(params_bits, params)
        assert_bit_identical(inner_bits, opt_state.inner_state)
        assert float(opt_state.scaler.loss_scale) == max(2.0**(-121 - i), 2.0**-126)
        assert bool(ls.metrics(opt_state)["failed"]) == (i >= 6)
    assert int(opt_state.failure) == ls.Failure.BACKOFF_UNDERFLOW
    assert wrapper_counters(opt_state)[2:] == (12, 12, False)
    with pytest.raises(ls.LossScaleError, match=r"loss scale 1\.17549\d*e-38 times "
                       r"backoff_factor 0\.5 gives 5\.8774\d*e-39, below the smallest normal"):
        ls.check(opt_state)
    # Readable and checkpointable: the arrays were never deleted.
    host_params, host_state = jax.device_get((params, opt_state))
    assert_bit_identical(params_bits, host_params)
    # One register (issue 41): the state's scaler holds no failure; the scaler that
    # get_loss_scale returns carries the state's, so its state dict says failed.
    assert host_state.scaler.failure is None
    assert "failure" not in ls.state_dict(host_state.scaler)["values"]
    d = ls.state_dict(ls.get_loss_scale(host_state))
    assert d["values"]["failure"] == ls.Failure.BACKOFF_UNDERFLOW
    assert int(ls.from_state_dict(d).failure) == ls.Failure.BACKOFF_UNDERFLOW


@PATHS
def test_max_consecutive_skips_fails_closed_as_state_naming_the_leaves(path):
    tx = ls.with_loss_scaling(optax.sgd(1.0), ls.DynamicLossScale(min_scale=1.0),
                              max_consecutive_skips=3)
    params = {"enc": jnp.ones(2), "dec": jnp.ones(2)}
    opt_state = tx.init(params)
    step = jax.jit(STEPS[path](tx), donate_argnums=(1, 2))
    bad = {"enc": jnp.ones(2), "dec": jnp.array([INF, 1.0])}
    for _ in range(5):
        params, opt_state = step(bad, opt_state, params)
    params, opt_state = step({"enc": jnp.ones(2), "dec": jnp.ones(2)}, opt_state, params)
    chex.assert_trees_all_equal(params, {"enc": jnp.ones(2), "dec": jnp.ones(2)})
    assert int(opt_state.failure) == ls.Failure.TOO_MANY_SKIPS
    assert float(opt_state.scaler.loss_scale) == 2.0**12      # frozen at the failing step
    with pytest.raises(ls.LossScaleError, match=r"^3 consecutive optimizer steps skipped.*"
                       r"non-finite on the last skipped step: dec\."):
        ls.check(opt_state, params)
    with pytest.raises(ls.LossScaleError, match=r"last skipped step: leaf #0\."):
        ls.check(opt_state)        # jax.tree.leaves order: "dec" sorts first


@PATHS
@pytest.mark.parametrize("bad_scale", [-32768.0, 0.0, NAN, INF])
def test_an_unvalidated_bad_scale_never_produces_an_update(path, bad_scale):
    """A state that reached the step without validation (pickle, tree_unflatten, Orbax
    without restore_loss_scale): with scale -32768 an [inf, 1, 1] gradient used to pass."""
    for scaler in (ls.DynamicLossScale(), ls.StaticLossScale(2.0)):
        tx = ls.with_loss_scaling(optax.sgd(1.0), scaler)
        params = jnp.ones(3)
        opt_state = tx.init(params)
        leaves, treedef = jax.tree.flatten(opt_state)
        leaves[0] = jnp.float32(bad_scale)                    # the scaler's loss_scale
        opt_state = jax.tree.unflatten(treedef, leaves)
        step = jax.jit(STEPS[path](tx))
        for grads in (jnp.array([INF, 1.0, 1.0]), jnp.ones(3)):
            new_params, opt_state = step(grads, opt_state, params)
            assert_bit_identical(bits(params), new_params)
        assert int(opt_state.failure) == ls.Failure.INVALID_SCALE
        with pytest.raises(ls.LossScaleError, match="not a finite, positive, normal float32"):
            ls.check(opt_state)


@PATHS
def test_on_failure_raise_is_the_opt_in_callback(path):
    tx = ls.with_loss_scaling(optax.sgd(1.0), ls.DynamicLossScale(init_scale=2.0**-126),
                              on_failure="raise")
    params = jnp.ones(2)
    opt_state = tx.init(params)
    step = jax.jit(STEPS[path](tx))
    with pytest.raises(jax.errors.JaxRuntimeError, match="loss scale backoff failed"):
        jax.block_until_ready(step(jnp.array([NAN, 1.0]), opt_state, params))


def test_optax_apply_if_finite_applies_a_non_finite_update_we_never_do():
    """Why this library differs: apply_if_finite gives up after N errors (fail-open)."""
    params = jnp.array([1.0])
    nan = jnp.array([NAN])

    theirs = optax.apply_if_finite(optax.sgd(1.0), max_consecutive_errors=3)
    state = theirs.init(params)
    applied = []
    for _ in range(5):
        updates, state = theirs.update(nan, state, params)
        applied.append(bool(np.isnan(optax.apply_updates(params, updates)).any()))
    assert applied == [False, False, False, True, True]

    ours = ls.with_loss_scaling(optax.sgd(1.0), ls.DynamicLossScale(min_scale=1.0))
    state = ours.init(params)
    for _ in range(5):
        updates, state = ours.update(nan, state, params)
        assert float(optax.apply_updates(params, updates)[0]) == 1.0


# ------------------------------------------------------------ finite steps equal the inner

INNERS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw_wd": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "clip_adam": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
}


def finite_case():
    """float32 and float16 leaves in one tree (mixed precision, as a model holds them)."""
    params = {"a": jnp.array([0.5, -1.0, 2.0]), "b": jnp.array([[0.25, -0.75]], jnp.float16)}
    # Global norm of each true gradient > 1, so the clip in "clip_adam" is active.
    true_grads = [
        {"a": jnp.array([1.5, -0.5, 3.0]), "b": jnp.array([[2.0, -1.25]], jnp.float16)},
        {"a": jnp.array([0.5, 0.125, -3.0]), "b": jnp.array([[1.0, 0.25]], jnp.float16)},
        {"a": jnp.array([-2.0, 1.0, 0.75]), "b": jnp.array([[0.5, 4.0]], jnp.float16)},
    ]
    return params, true_grads


# Every (skip, path) pair with adam; two per other inner (compiles are the test's cost).
ALL_PAIRS = [("cond", "plain"), ("cond", "fused"), ("select", "plain"), ("select", "fused")]
FINITE_CASES = {
    "adam-jit_donate": ("adam", DONATING_JIT, ALL_PAIRS),
    "adamw_wd-jit_donate": ("adamw_wd", DONATING_JIT, [("cond", "plain"), ("select", "fused")]),
    "sgd_momentum-jit_donate": ("sgd_momentum", DONATING_JIT,
                                [("select", "plain"), ("cond", "fused")]),
    "clip_adam-jit_donate": ("clip_adam", DONATING_JIT, [("cond", "plain"), ("cond", "fused")]),
    "adam-eager": ("adam", lambda f: f, [("cond", "plain"), ("cond", "fused")]),
}


@pytest.mark.parametrize("case", FINITE_CASES)
def test_finite_steps_equal_inner_on_true_gradients(case):
    inner_name, maybe_jit, pairs = FINITE_CASES[case]
    factor = 2.0**12
    params, true_grads = finite_case()
    inner = INNERS[inner_name]()
    ref_params, ref_state = params, inner.init(params)
    runs = {}
    for skip, path in pairs:
        tx = ls.with_loss_scaling(inner, ls.StaticLossScale(factor), skip=skip)
        own = jax.tree.map(jnp.copy, params)      # each run donates its own buffers
        runs[skip, path] = (maybe_jit(STEPS[path](tx)), tx.init(own), own)
    for grads in true_grads:
        updates, ref_state = inner.update(grads, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)
        for key, (step, opt_state, p) in runs.items():
            p, opt_state = step(scaled(grads, factor), opt_state, p)
            runs[key] = (step, opt_state, p)
            chex.assert_trees_all_equal_dtypes(p, ref_params)
            # Equal up to the rounding of differently fused float16 arithmetic, which depends
            # on the CPU (tests/bitwise.py): a few ulps of each leaf's dtype, where a step
            # taken on scaled or unclipped gradients is hundreds of ulps away. Clipping by
            # the global norm couples the leaves: every leaf then has float16's precision.
            close = functools.partial(assert_trees_close_in_ulps, max_ulps=8, floor=1e-3,
                                      ulp_dtype=jnp.float16 if inner_name == "clip_adam" else None)
            close(p, ref_params)
            close(opt_state.inner_state, ref_state)


@pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit], ids=["eager", "jit"])
@SKIPS
@PATHS
def test_clipping_inside_the_inner_chain_sees_true_gradients(maybe_jit, skip, path):
    factor = 2.0**10
    params = jnp.zeros(2)
    true_grads = jnp.array([3.0, 4.0])         # global norm 5 > 1
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
    tx = ls.with_loss_scaling(inner, ls.StaticLossScale(factor), skip=skip)
    new_params, _ = maybe_jit(STEPS[path](tx))(true_grads * factor, tx.init(params), params)
    # Clipped to norm 1: -[0.6, 0.8]. Clipping the scaled grads would give a norm of 1/1024.
    chex.assert_trees_all_close(new_params, jnp.array([-0.6, -0.8]), rtol=1e-6)
    ref_updates, _ = inner.update(true_grads, inner.init(params), params)
    chex.assert_trees_all_close(new_params, ref_updates, rtol=1e-6)


# -------------------------------------------------------------------------- extra args


def scale_by_value():
    """A transformation that *requires* an extra arg: multiplies the updates by ``value``."""

    def init_fn(params):
        del params
        return optax.ScaleByScheduleState(count=jnp.zeros((), jnp.int32))

    def update_fn(updates, state, params=None, *, value):
        del params
        updates = jax.tree.map(lambda u: u * value, updates)
        return updates, optax.ScaleByScheduleState(count=state.count + 1)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


@EAGER_OR_DONATING_JIT
@SKIPS
@PATHS
def test_extra_args_reach_the_inner_transformation(maybe_jit, skip, path):
    tx = ls.with_loss_scaling(optax.chain(optax.sgd(1.0), scale_by_value()),
                              ls.StaticLossScale(4.0), skip=skip)
    params = jnp.array([1.0, 2.0])
    opt_state = tx.init(params)
    step = maybe_jit(STEPS[path](tx))
    params, opt_state = step(jnp.array([4.0, 8.0]), opt_state, params, value=jnp.float32(3.0))
    chex.assert_trees_all_close(params, jnp.array([-2.0, -4.0]))
    params, opt_state = step(jnp.array([NAN, 8.0]), opt_state, params, value=jnp.float32(3.0))
    chex.assert_trees_all_close(params, jnp.array([-2.0, -4.0]))
    assert int(opt_state.inner_state[1].count) == 1


@pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit], ids=["eager", "jit"])
def test_reduce_on_plateau_receives_value_and_is_frozen_by_skips(maybe_jit):
    plateau = optax.contrib.reduce_on_plateau(patience=1, factor=0.5, cooldown=0)
    tx = ls.with_loss_scaling(optax.chain(optax.sgd(1.0), plateau), ls.StaticLossScale(2.0))
    params = jnp.float32(0.0)
    opt_state = tx.init(params)
    update = maybe_jit(tx.update)
    _, opt_state = update(jnp.float32(2.0), opt_state, params, value=jnp.float32(5.0))
    assert float(opt_state.inner_state[1].best_value) == 5.0
    before = bits(opt_state.inner_state)
    _, opt_state = update(jnp.float32(NAN), opt_state, params, value=jnp.float32(1.0))
    assert_bit_identical(before, opt_state.inner_state)
    _, opt_state = update(jnp.float32(2.0), opt_state, params, value=jnp.float32(2.0))
    assert float(opt_state.inner_state[1].best_value) == 2.0


@pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit], ids=["eager", "jit"])
def test_params_by_keyword_and_omitted(maybe_jit):
    # MultiSteps passes params by keyword; sgd needs no params at all.
    params = jnp.array([1.0, 2.0])
    tx = ls.with_loss_scaling(optax.adamw(0.1, weight_decay=0.5), ls.StaticLossScale(2.0))
    by_position = maybe_jit(tx.update)(jnp.array([2.0, 2.0]), tx.init(params), params)
    by_keyword = maybe_jit(tx.update)(jnp.array([2.0, 2.0]), tx.init(params), params=params)
    chex.assert_trees_all_equal(by_position, by_keyword)
    sgd = ls.with_loss_scaling(optax.sgd(1.0), ls.StaticLossScale(2.0))
    updates, _ = maybe_jit(sgd.update)(jnp.array([2.0, 2.0]), sgd.init(params))
    chex.assert_trees_all_equal(updates, jnp.array([-1.0, -1.0]))


# ------------------------------------------------------------- state: buffers, traces, dtypes


@pytest.mark.parametrize(
    "scaler", [ls.DynamicLossScale(init_scale=8.0), ls.StaticLossScale(8.0)],
    ids=["dynamic", "static"])
@PATHS
def test_init_hands_out_fresh_buffers_that_survive_donation(scaler, path):
    tx = ls.with_loss_scaling(optax.adam(0.1), scaler)
    params = jnp.array([1.0, 2.0])
    opt_state = tx.init(params)
    for mine, theirs in zip(jax.tree.leaves(ls.get_loss_scale(opt_state)),
                            jax.tree.leaves(scaler), strict=True):
        assert mine is not theirs
    step = jax.jit(STEPS[path](tx), donate_argnums=(1, 2))
    params, opt_state = step(jnp.array([NAN, 1.0]), opt_state, params)
    params, opt_state = step(jnp.array([1.0, 1.0]), opt_state, params)
    assert float(scaler.loss_scale) == 8.0                  # the caller's scaler is intact
    again = tx.init(jnp.array([1.0, 2.0]))                    # and init still works
    assert float(again.scaler.loss_scale) == 8.0
    params, again = step(jnp.array([1.0, 1.0]), again, jnp.array([1.0, 2.0]))
    assert bool(again.last_step_applied)


def state_dtypes(opt_state):
    return jax.tree.map(lambda x: jnp.asarray(x).dtype, opt_state)


@SKIPS
@PATHS
def test_no_retrace_and_stable_dtypes_across_steps(skip, path):
    tx = ls.with_loss_scaling(optax.adam(0.1), ls.DynamicLossScale(growth_interval=1),
                              skip=skip)
    params = {"w": jnp.ones(3, jnp.float16), "b": jnp.zeros(2)}
    opt_state = tx.init(params)
    wrapper_dtypes = state_dtypes(opt_state._replace(inner_state=None))
    assert set(jax.tree.leaves(wrapper_dtypes)) == {
        jnp.dtype(jnp.float32), jnp.dtype(jnp.int32), jnp.dtype(jnp.bool_)}
    assert opt_state.skipped_steps.dtype == jnp.int32
    assert opt_state.last_step_applied.dtype == jnp.bool_
    first_dtypes = state_dtypes(opt_state)
    first_structure = jax.tree.structure(opt_state)
    chex.clear_trace_counter()

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(grads, opt_state, params):
        return STEPS[path](tx)(grads, opt_state, params)

    good = jax.tree.map(jnp.ones_like, params)
    bad = dict(good, b=jnp.array([INF, 0.0]))
    for grads in (good, bad, good, good, bad):
        params, opt_state = step(grads, opt_state, params)
        assert jax.tree.leaves(state_dtypes(opt_state)) == jax.tree.leaves(first_dtypes)
        assert jax.tree.structure(opt_state) == first_structure
        chex.assert_trees_all_equal_dtypes(params, {"w": jnp.ones(3, jnp.float16),
                                                    "b": jnp.zeros(2)})


def test_eval_shape_init_and_tree_map_to_none():
    tx = ls.with_loss_scaling(optax.adam(0.1), ls.DynamicLossScale(hysteresis=2, min_scale=4.0))
    params = {"w": jnp.ones(3, jnp.float16)}
    shapes = jax.eval_shape(tx.init, params)
    concrete = tx.init(params)
    assert jax.tree.structure(shapes) == jax.tree.structure(concrete)
    chex.assert_trees_all_equal_shapes_and_dtypes(shapes, concrete)
    assert shapes.scaler.min_scale == 4.0 and shapes.scaler.hysteresis == 2
    nones = jax.tree.map(lambda _: None, concrete)
    assert isinstance(nones, ls.LossScalingState)
    assert nones.scaler.hysteresis == 2 and nones.skipped_steps is None
    # And back: None -> arrays rebuilds the same state.
    rebuilt = jax.tree.unflatten(jax.tree.structure(concrete), jax.tree.leaves(concrete))
    chex.assert_trees_all_equal(rebuilt, concrete)


# ------------------------------------------------------------------------- metrics


@pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit], ids=["eager", "jit"])
@pytest.mark.parametrize(
    "scaler, tracker", [(ls.DynamicLossScale(init_scale=16.0), 1),
                        (ls.StaticLossScale(16.0), 0), (ls.NoOpLossScale(), 0)],
    ids=["dynamic", "static", "noop"])
def test_metrics_are_arrays_with_documented_keys(maybe_jit, scaler, tracker):
    tx = ls.with_loss_scaling(optax.sgd(1.0), scaler)
    params = jnp.zeros(2)
    opt_state = tx.init(params)
    _, opt_state = tx.update(jnp.ones(2), opt_state, params)
    _, opt_state = tx.update(jnp.array([NAN, 1.0]), opt_state, params)
    _, opt_state = tx.update(jnp.ones(2), opt_state, params)
    m = maybe_jit(ls.metrics)(opt_state)
    assert set(m) == {"loss_scale", "growth_tracker", "skipped_steps", "consecutive_skips",
                      "last_step_applied", "nonfinite_loss_steps",
                      "consecutive_nonfinite_losses", "nonfinite_grad_leaves", "failed",
                      "failure", "clean_growths",
                      "scale_suspicious", "grad_norm", "replays", "last_step_replays"}
    for value in m.values():
        assert isinstance(value, jax.Array) and value.shape == ()
    assert {k: v.dtype for k, v in m.items()} == {
        "loss_scale": jnp.float32, "growth_tracker": jnp.int32, "skipped_steps": jnp.int32,
        "consecutive_skips": jnp.int32, "last_step_applied": jnp.bool_,
        "nonfinite_loss_steps": jnp.int32, "consecutive_nonfinite_losses": jnp.int32,
        "nonfinite_grad_leaves": jnp.int32,
        "failed": jnp.bool_, "failure": jnp.int32, "clean_growths": jnp.int32,
        "scale_suspicious": jnp.bool_, "grad_norm": jnp.float32, "replays": jnp.int32,
        "last_step_replays": jnp.int32}
    assert not bool(m["failed"]) and int(m["failure"]) == 0
    # The one leaf was non-finite on the last skipped step; the flags outlive clean steps.
    assert int(m["nonfinite_grad_leaves"]) == 1 and int(m["nonfinite_loss_steps"]) == 0
    want_scale = 8.0 if isinstance(scaler, ls.DynamicLossScale) else float(scaler.loss_scale)
    assert wrapper_counters(opt_state) == (want_scale, tracker, 1, 0, True)


def test_metrics_is_pure_reads_with_no_host_callback():
    opt_state = ls.with_loss_scaling(optax.chain(optax.clip(1.0), optax.sgd(1.0))).init(
        jnp.zeros(2))
    jaxpr = jax.make_jaxpr(ls.metrics)(opt_state)
    # Reads of existing leaves plus one count over the per-leaf flags and the scalar
    # comparisons of scale_suspicious and last_step_applied: no callback, no transfer.
    assert not [e for e in jaxpr.eqns if "callback" in e.primitive.name]
    assert {e.primitive.name for e in jaxpr.eqns} <= {"reduce_sum", "convert_element_type",
                                                      "eq", "ne", "ge", "gt", "and", "or"}


# ------------------------------------------------------------------ counters saturate


def test_counters_saturate_instead_of_wrapping():
    tx = ls.with_loss_scaling(optax.sgd(1.0), ls.DynamicLossScale(min_scale=1.0))
    params = jnp.zeros(1)
    top = jnp.iinfo(jnp.int32).max
    opt_state = tx.init(params)._replace(skipped_steps=jnp.int32(top),
                                         consecutive_skips=jnp.int32(top))
    _, opt_state = jax.jit(tx.update)(jnp.array([NAN]), opt_state, params)
    assert int(opt_state.skipped_steps) == top and int(opt_state.consecutive_skips) == top
    assert not bool(opt_state.last_step_applied)  # derived from the saturated counter


# ----------------------------------------------------------------------- value_and_grad


@pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit], ids=["eager", "jit"])
@pytest.mark.parametrize("holder", ["scaler", "opt_state", "chain_of_one", "train_state"])
def test_value_and_grad_returns_unscaled_loss_and_scaled_grads(maybe_jit, holder):
    scaler = ls.DynamicLossScale(init_scale=2.0**10)
    tx = ls.with_loss_scaling(optax.sgd(1.0), scaler)
    w = jnp.array([1.0, -2.0])
    source = {"scaler": scaler, "opt_state": tx.init(w),
              "chain_of_one": optax.chain(tx).init(w),
              "train_state": {"params": w, "opt_state": tx.init(w)}}[holder]

    def loss_fn(w, x):
        return jnp.sum((w * x) ** 2)

    x = jnp.array([0.5, 3.0])
    loss, grads = maybe_jit(ls.value_and_grad(loss_fn))(source, w, x)
    true_loss, true_grads = jax.value_and_grad(loss_fn)(w, x)
    assert loss.dtype == jnp.float32 and float(loss) == float(true_loss)
    chex.assert_trees_all_equal(grads, true_grads * 2.0**10)


@pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit], ids=["eager", "jit"])
def test_value_and_grad_argnums_has_aux_and_float16(maybe_jit):
    s = ls.StaticLossScale(2.0**8)

    def loss_fn(a, b, *, c):
        loss = jnp.sum(a * b * c).astype(jnp.float16)
        return loss, {"pred": a * b}

    a = jnp.array([1.0, 2.0], jnp.float16)
    b = jnp.array([3.0, -1.0], jnp.float16)
    grad_fn = maybe_jit(ls.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True))
    (loss, aux), (ga, gb) = grad_fn(s, a, b, c=jnp.float16(2.0))
    assert loss.dtype == jnp.float16 and float(loss) == 2.0   # unscaled, its own dtype
    chex.assert_trees_all_equal(aux, {"pred": a * b})
    assert ga.dtype == gb.dtype == jnp.float16
    # d/da = b*c, d/db = a*c, times 256; 8 * 256 would be fine in float16 too.
    chex.assert_trees_all_equal(ga, (b * 2 * 256).astype(jnp.float16))
    chex.assert_trees_all_equal(gb, (a * 2 * 256).astype(jnp.float16))


def test_value_and_grad_then_update_is_a_full_unscaled_step():
    tx = ls.with_loss_scaling(optax.sgd(0.5), ls.DynamicLossScale(init_scale=2.0**14))
    w = jnp.array([1.0, 2.0])
    opt_state = tx.init(w)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(w, opt_state):
        loss, grads = ls.value_and_grad(lambda w: jnp.sum(w**2))(opt_state, w)
        w, opt_state = ls.apply_gradients(tx, grads, opt_state, w)
        return w, opt_state, loss

    w, opt_state, loss = train_step(w, opt_state)
    assert float(loss) == 5.0
    chex.assert_trees_all_equal(w, jnp.array([0.0, 0.0]))


# ---------------------------------------------------------------- argument validation


@pytest.mark.parametrize("skip", ["Cond", "where", None, 1])
def test_bad_skip_is_a_value_error_naming_skip(skip):
    with pytest.raises(ValueError, match="skip") as info:
        ls.with_loss_scaling(optax.sgd(1.0), skip=skip)
    assert repr(skip) in str(info.value)


@pytest.mark.parametrize("scaler", [2.0**15, "dynamic", {"loss_scale": 1.0}, optax.sgd(1.0)],
                         ids=["float", "str", "dict", "optimizer"])
def test_bad_scaler_is_a_type_error_naming_scaler(scaler):
    with pytest.raises(TypeError, match="scaler"):
        ls.with_loss_scaling(optax.sgd(1.0), scaler)


def test_default_scaler_and_auto_skip():
    tx = ls.with_loss_scaling(optax.sgd(1.0))
    opt_state = tx.init(jnp.zeros(2))
    assert isinstance(opt_state.scaler, ls.DynamicLossScale)
    assert float(opt_state.scaler.loss_scale) == 2.0**15
    assert type(tx) is optax.GradientTransformationExtraArgs  # optax's own (issue 41)
    options = options_of(tx.update)  # where the fused path finds them
    assert options.skip == "auto" and options.on_failure == "record"


def test_apply_gradients_falls_back_for_other_transformations():
    params = jnp.array([1.0, 2.0])
    tx = optax.sgd(1.0)
    new_params, _ = ls.apply_gradients(tx, jnp.array([1.0, 1.0]), tx.init(params), params)
    chex.assert_trees_all_equal(new_params, jnp.array([0.0, 1.0]))
    # A chain of the wrapper alone (nothing outside it): the fallback still skips via
    # tx.update.
    chained = optax.chain(ls.with_loss_scaling(optax.sgd(1.0), ls.StaticLossScale(2.0)))
    new_params, state = ls.apply_gradients(chained, jnp.array([NAN, 1.0]),
                                           chained.init(params), params)
    chex.assert_trees_all_equal(new_params, params)
    assert int(ls.metrics(state)["skipped_steps"]) == 1


def test_apply_gradients_refuses_a_transformation_outside_the_wrapper():
    params = jnp.array([1.0, 2.0])
    tx = optax.chain(optax.identity(), ls.with_loss_scaling(optax.sgd(1.0),
                                                            ls.StaticLossScale(2.0)))
    for maybe_jit in (lambda f: f, jax.jit):
        with pytest.raises(ValueError, match=r"inside another transformation \(optax.chain.*"
                                             r"chained before it.*sees the scaled gradients.*"
                                             r"Put the wrapper outermost"):
            maybe_jit(lambda g, s, p: ls.apply_gradients(tx, g, s, p))(
                jnp.array([2.0, 2.0]), tx.init(params), params)
    # A transformation rebuilt around the wrapper's own update keeps the fused path:
    # it compiles to the very program of the wrapper itself.
    wrapper = ls.with_loss_scaling(optax.sgd(1.0), ls.StaticLossScale(2.0))
    rebuilt = optax.GradientTransformationExtraArgs(wrapper.init, wrapper.update)
    nan = jnp.array([NAN, 2.0])

    def fused_text(tx):
        step = jax.jit(lambda g, s, p: ls.apply_gradients(tx, g, s, p))
        return step.lower(nan, tx.init(params), params).as_text()

    assert fused_text(rebuilt) == fused_text(wrapper)
    same, _ = ls.apply_gradients(rebuilt, nan, rebuilt.init(params), params)
    assert np.array_equal(same, params)
    # The wrapper outermost keeps the fused path (warnings are errors).
    outer = ls.with_loss_scaling(optax.chain(optax.identity(), optax.sgd(1.0)),
                                 ls.StaticLossScale(2.0))
    ls.apply_gradients(outer, jnp.array([2.0, 2.0]), outer.init(params), params)
    # One wrapper per multi_transform group (nothing else outside them) is allowed: the
    # plain path.
    groups = optax.multi_transform(
        {g: ls.with_loss_scaling(optax.sgd(1.0), ls.StaticLossScale(2.0)) for g in "ab"},
        {"a": "a", "b": "b"})
    two = {"a": params, "b": params}
    ls.apply_gradients(groups, jax.tree.map(lambda p: 2 * p, two), groups.init(two), two)


# ------------------------------------------------------------ the step's fixed cost

_NOT_KERNELS = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant"}


def executable_kernels(compiled: Any) -> int:
    """The kernels of an XLA executable: the instructions of its entry and control-flow
    computations (conditional branches included, taken or not), fusion bodies excluded.
    On XLA CPU each costs about a microsecond per run: the fixed cost of a step."""
    text = compiled.as_text()
    fusion_bodies = set(re.findall(r"calls=%([\w.\-]+)", text))
    count, computation = 0, None
    for line in text.splitlines():
        header = re.match(r"^(?:ENTRY )?%([\w.\-]+) .*\{$", line.rstrip())
        if header:
            computation = header.group(1)
        elif line.startswith("}"):
            computation = None
        elif computation is not None and computation not in fusion_bodies:
            op = re.search(r"= [^=]*? ([\w\-]+)\(", line)
            count += bool(op and op.group(1) not in _NOT_KERNELS)
    return count


def test_the_default_fused_step_adds_a_fixed_number_of_kernels_whatever_the_leaf_count():
    """Small leaves are screened and tested together (``tree.leaf_groups``), so a model of
    many small leaves (the dispatch-bound case) pays the check once, not once per leaf
    or per leaf size: 80 leaves of 80 sizes cost the same few kernels over a bare adam
    step as 10 leaves of 10 sizes do (kernels in the branch not taken count too)."""
    inner = optax.adam(1e-3)
    tx = ls.with_loss_scaling(inner)

    def bare(params, opt_state, grads):
        updates, opt_state = inner.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def fused(params, opt_state, grads):
        return ls.apply_gradients(tx, grads, opt_state, params)

    def overhead(n_leaves: int) -> int:
        params = {f"w{i:03d}": jnp.ones((3, 5 + i)) for i in range(n_leaves)}
        kernels = {}
        for name, step, init in (("bare", bare, inner.init), ("fused", fused, tx.init)):
            compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
                params, init(params), params).compile()
            kernels[name] = executable_kernels(compiled)
        assert kernels["bare"] >= 2 * n_leaves  # the count sees the adam kernels
        return kernels["fused"] - kernels["bare"]

    few, many = overhead(10), overhead(80)
    assert many - few <= 8, (few, many)
    assert few <= 60, few


@pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit], ids=["eager", "jit"])
def test_too_many_skips_is_one_register_the_scaler_and_its_state_dict_carry_it(maybe_jit):
    tx = ls.with_loss_scaling(optax.sgd(1.0), ls.DynamicLossScale(init_scale=2.0**10),
                              max_consecutive_skips=2)
    params = jnp.ones(2)
    opt_state = tx.init(params)
    step = maybe_jit(lambda g, s, p: tx.update(g, s, p)[1])
    opt_state = step(jnp.array([NAN, 1.0]), opt_state, params)
    if maybe_jit is jax.jit:
        opt_state = step(jnp.array([NAN, 1.0]), opt_state, params)
    else:
        with pytest.raises(ls.LossScaleError, match="consecutive optimizer steps skipped"):
            step(jnp.array([NAN, 1.0]), opt_state, params)
        return
    with pytest.raises(ls.LossScaleError, match="consecutive optimizer steps skipped"):
        ls.check(opt_state)
    scaler = ls.get_loss_scale(opt_state)
    with pytest.raises(ls.LossScaleError, match="max_consecutive_skips"):
        ls.check(scaler)   # the scaler alone says so too
    saved = json.loads(json.dumps(ls.state_dict(scaler)))
    assert saved["values"]["failure"] == ls.Failure.TOO_MANY_SKIPS
    fresh = ls.restore_loss_scale(tx.init(params), saved)
    with pytest.raises(ls.LossScaleError):   # the restored run is still failed
        ls.check(fresh)
    fused = jax.jit(lambda g, s, p: ls.apply_gradients(tx, g, s, p))
    new_params, _ = fused(jnp.ones(2), fresh, params)
    chex.assert_trees_all_equal(new_params, params)   # and skips every step


@PATHS
def test_one_failure_register(path):
    # Issue 41: a dynamic scaler held by the wrapper has no failure leaf of its own (it
    # was a copy of the state's, written every step); get_loss_scale gives it the state's.
    tx = ls.with_loss_scaling(optax.sgd(1.0), ls.DynamicLossScale(init_scale=8.0),
                              max_consecutive_skips=2)
    params = jnp.ones(2)
    opt_state = tx.init(params)
    step = jax.jit(STEPS[path](tx))
    for _ in range(3):
        params, opt_state = step(jnp.array([INF, 1.0]), opt_state, params)
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        opt_state)[0] if jax.tree_util.keystr(p).endswith("failure")]
    assert names == [".failure"]
    assert int(opt_state.failure) == ls.Failure.TOO_MANY_SKIPS
    scaler = ls.get_loss_scale(opt_state)
    assert int(scaler.failure) == ls.Failure.TOO_MANY_SKIPS and scaler.failure is opt_state.failure
    assert ls.state_dict(scaler)["values"]["failure"] == ls.Failure.TOO_MANY_SKIPS
    with pytest.raises(ls.LossScaleError, match="consecutive optimizer steps skipped"):
        ls.check(scaler)
    # A scaler taken from the state's field and stepped on its own gets its own register.
    alone = ls.update(opt_state.scaler, jnp.asarray(True))
    assert alone.leaf_names[:4] == ("loss_scale", "growth_tracker", "nonfinite_tracker",
                                    "failure") and int(alone.failure) == 0
