"""What a skipped step records and guards: the per-leaf overflow flags, the skip guard,
non-finite losses, several loss scales in one optimizer, and the float16 / bfloat16 switch.

Every feature eagerly and under ``jit`` (with donation where a step is jitted), through the
plain optax path (``tx.update`` + ``apply_updates``), the fused ``ls.apply_gradients`` and
``ls.TrainState``; and the docs' code blocks for these features (docs/diagnostics.md,
docs/optax_wrapper.md, docs/float16_bfloat16.md), with assertions on what they leave behind.
"""

from __future__ import annotations

import collections
import functools
import re
from typing import NamedTuple

import chex
import doc_blocks
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from bitwise import assert_bit_identical, bits
from hypothesis import example, given, settings
from hypothesis import strategies as st
from step_paths import DONATING_JIT, EAGER_OR_DONATING_JIT, PATHS, step_by

import loss_scaling as ls
from loss_scaling.core import numerics as ls_numerics
from loss_scaling.core import update as ls_update

pytestmark = pytest.mark.filterwarnings(  # float16 params on purpose: test_diagnostics.py
    r"ignore:with_loss_scaling. the params .* are b?float16:UserWarning")

NAN, INF = float("nan"), float("inf")



def count_ops(hlo_text):
    """Instructions per opcode in an HLO module's text."""
    ops = collections.Counter()
    for line in hlo_text.splitlines():
        match = re.search(r" = \S+ ([a-z][\w-]*)\(", line)
        if match:
            ops[match.group(1)] += 1
    return ops


# ------------------------------------------------------------------ overflow diagnostics

def nested_params():
    # jax.tree.leaves order: dec.b, dec.w, enc.b, enc.w, head.0, head.1
    return {
        "enc": {"w": jnp.full((3, 2), 0.5), "b": jnp.zeros(2)},
        "dec": {"w": jnp.full((2, 2), -0.25), "b": jnp.ones(2)},
        "head": [jnp.ones(2), jnp.full((2,), 2.0)],
    }


def grads_with(bad):
    """Finite gradients except for the leaves named in ``bad`` (dotted path -> value)."""
    grads = jax.tree.map(lambda p: jnp.full_like(p, 8.0), nested_params())
    for name, value in bad.items():
        outer, inner = name.split(".")
        key = int(inner) if outer == "head" else inner
        grads[outer][key] = grads[outer][key].at[0].set(value)
    return grads


@EAGER_OR_DONATING_JIT
@PATHS
def test_per_leaf_flags_name_exactly_the_bad_leaves(maybe_jit, path):
    tx = ls.with_loss_scaling(optax.sgd(0.5), ls.DynamicLossScale(init_scale=8.0))
    params = nested_params()
    opt_state = tx.init(params)
    assert opt_state.nonfinite_grads.dtype == jnp.bool_
    assert opt_state.nonfinite_grads.tolist() == [False] * 6
    step = maybe_jit(step_by(tx, path))

    # A skip: exactly enc.b (inf) and head.1 (NaN) are flagged.
    before = bits(params)
    params, opt_state = step(grads_with({"enc.b": INF, "head.1": NAN}), opt_state, params)
    assert_bit_identical(before, params)
    assert opt_state.nonfinite_grads.tolist() == [False, False, True, False, False, True]
    assert ls.nonfinite_grad_paths(opt_state, params) == ["enc.b", "head.1"]
    count = ls.metrics(opt_state)["nonfinite_grad_leaves"]
    assert isinstance(count, jax.Array) and count.dtype == jnp.int32 and int(count) == 2

    # A clean step is applied and keeps the flags of the last skipped step.
    before = bits(params)
    params, opt_state = step(grads_with({}), opt_state, params)
    assert bool(opt_state.last_step_applied)
    np.testing.assert_array_equal(params["dec"]["b"], jnp.zeros(2))  # 1 - 0.5 * 8 / 4
    assert bits(params)[0].tobytes() != before[0].tobytes()
    assert ls.nonfinite_grad_paths(opt_state, params) == ["enc.b", "head.1"]
    assert int(ls.metrics(opt_state)["nonfinite_grad_leaves"]) == 2

    # The next skip replaces them.
    params, opt_state = step(grads_with({"dec.w": -INF}), opt_state, params)
    assert opt_state.nonfinite_grads.tolist() == [False, True, False, False, False, False]
    assert ls.nonfinite_grad_paths(opt_state, params) == ["dec.w"]
    assert int(ls.metrics(opt_state)["nonfinite_grad_leaves"]) == 1
    assert int(ls.metrics(opt_state)["skipped_steps"]) == 2


def test_overflow_on_unscale_is_flagged_per_leaf():
    """A float16 leaf whose values are finite but which stays above float16's range after
    unscaling (a tiny scale) is the overflowing leaf; the float32 leaf beside it is not."""
    tx = ls.with_loss_scaling(optax.sgd(1.0), ls.StaticLossScale(2.0**-4))
    params = {"a": jnp.zeros(2, jnp.float16), "b": jnp.zeros(2)}
    opt_state = tx.init(params)
    grads = {"a": jnp.array([60000.0, 1.0], jnp.float16), "b": jnp.array([60000.0, 1.0])}
    params, opt_state = jax.jit(step_by(tx, "fused"))(grads, opt_state, params)
    assert ls.nonfinite_grad_paths(opt_state, params) == ["a"]


def test_metrics_count_is_computed_in_graph():
    tx = ls.with_loss_scaling(optax.sgd(1.0))
    params = nested_params()

    @jax.jit
    def step_and_count(grads, opt_state, params):
        params, opt_state = ls.apply_gradients(tx, grads, opt_state, params)
        return ls.metrics(opt_state)["nonfinite_grad_leaves"]

    grads = grads_with({"enc.w": NAN, "dec.b": INF, "head.0": NAN})
    assert int(step_and_count(grads, tx.init(params), params)) == 3


def test_nonfinite_grad_paths_refuses_another_structure_and_finds_none_when_clean():
    tx = ls.with_loss_scaling(optax.sgd(1.0))
    params = nested_params()
    opt_state = tx.init(params)
    assert ls.nonfinite_grad_paths(opt_state, params) == []
    with pytest.raises(ValueError, match="6 non-finite flags"):
        ls.nonfinite_grad_paths(opt_state, {"w": jnp.ones(2)})


@EAGER_OR_DONATING_JIT
def test_integer_leaves_are_never_flagged(maybe_jit):
    tx = ls.with_loss_scaling(optax.sgd(1.0), ls.StaticLossScale(2.0))
    params = {"w": jnp.ones(2), "count": jnp.int32(3)}
    opt_state = tx.init(params)
    assert opt_state.nonfinite_grads.shape == (2,)
    step = maybe_jit(step_by(tx, "fused"))
    params, opt_state = step({"w": jnp.array([1.0, INF]), "count": jnp.int32(0)}, opt_state,
                             params)
    assert opt_state.nonfinite_grads.tolist() == [False, True]
    assert ls.nonfinite_grad_paths(opt_state, params) == ["w"]
    params, opt_state = step({"w": jnp.array([2.0, 4.0]), "count": jnp.int32(0)}, opt_state,
                             params)
    chex.assert_trees_all_equal(params, {"w": jnp.array([0.0, -1.0]), "count": jnp.int32(3)})


@EAGER_OR_DONATING_JIT
@PATHS
def test_empty_params_tree(maybe_jit, path):
    tx = ls.with_loss_scaling(optax.sgd(1.0))
    params = {}
    opt_state = tx.init(params)
    assert opt_state.nonfinite_grads.shape == (0,)
    step = maybe_jit(step_by(tx, path))
    params, opt_state = step({}, opt_state, params)
    assert bool(opt_state.last_step_applied)
    params, opt_state = step({}, opt_state, params, loss=jnp.float32(NAN))  # still skipped
    assert not bool(opt_state.last_step_applied)
    m = ls.metrics(opt_state)
    assert (int(m["nonfinite_grad_leaves"]), int(m["nonfinite_loss_steps"])) == (0, 1)
    assert ls.nonfinite_grad_paths(opt_state, params) == []


# ------------------------------------------------------------------ the skip guard

def guarded(limit=3, **options):
    return ls.with_loss_scaling(
        optax.sgd(0.5), ls.DynamicLossScale(init_scale=1024.0, growth_interval=100),
        max_consecutive_skips=limit, **options)


def fails_closed(maybe_jit, step, *args, **kwargs):
    """Runs the step that must fail: eagerly it raises at once; under a donating jit it
    records the failure, and ls.check raises the same error on the host."""
    with pytest.raises(ls.LossScaleError) as info:
        params, opt_state = jax.block_until_ready(step(*args, **kwargs))
        assert maybe_jit is DONATING_JIT, "an eager step must raise at once"
        assert bool(ls.metrics(opt_state)["failed"])
        ls.check(opt_state, params)
    return str(info.value)


@EAGER_OR_DONATING_JIT
@PATHS
def test_guard_fails_at_exactly_the_nth_consecutive_skip(maybe_jit, path):
    tx = guarded(limit=3)
    params = nested_params()
    opt_state = tx.init(params)
    step = maybe_jit(step_by(tx, path))
    bad, good = grads_with({"dec.w": NAN}), grads_with({})
    # Two skips, then a clean step resets the count; two more skips still pass.
    for grads in (bad, bad, good, bad, bad):
        params, opt_state = jax.block_until_ready(step(grads, opt_state, params))
    assert int(ls.metrics(opt_state)["consecutive_skips"]) == 2
    assert float(ls.get_loss_scale(opt_state).loss_scale) == 64.0  # 1024 / 2**4
    message = fails_closed(maybe_jit, step, grads_with({"enc.b": INF, "dec.w": NAN}),
                           opt_state, params)
    assert "3 consecutive optimizer steps skipped (max_consecutive_skips=3)" in message
    assert "the loss scale is now 32.0" in message
    assert "Gradient leaves non-finite on the last skipped step: dec.w, enc.b." in message


@EAGER_OR_DONATING_JIT
def test_guard_names_a_nonfinite_loss(maybe_jit):
    tx = guarded(limit=2, nonfinite_loss="skip")
    params = nested_params()
    opt_state = tx.init(params)
    step = maybe_jit(step_by(tx, "fused"))
    params, opt_state = step(grads_with({}), opt_state, params, loss=jnp.float32(INF))
    message = fails_closed(maybe_jit, step, grads_with({}), opt_state, params,
                           loss=jnp.float32(NAN))
    assert "2 consecutive optimizer steps skipped (max_consecutive_skips=2)" in message
    assert "the loss scale is now 1024.0" in message  # "skip" leaves the scale alone
    assert "none (the loss was non-finite)" in message


def test_guard_limit_one_fails_on_the_first_skip_and_validates():
    tx = guarded(limit=1)
    params = nested_params()
    with pytest.raises(ls.LossScaleError, match="1 consecutive"):
        step_by(tx, "plain")(grads_with({"head.0": NAN}), tx.init(params), params)
    for bad in (0, -1, 2.5, True):
        with pytest.raises((ValueError, TypeError), match="max_consecutive_skips"):
            guarded(limit=bad)
    with pytest.raises(ValueError, match="nonfinite_loss"):
        ls.with_loss_scaling(optax.sgd(1.0), nonfinite_loss="ignore")


def jaxpr_text(tx, path):
    params = nested_params()
    return str(jax.make_jaxpr(step_by(tx, path))(grads_with({}), tx.init(params), params))


@pytest.mark.parametrize("path", ["plain", "fused"])
@pytest.mark.parametrize("options, has_callback", [
    ({}, False),  # the default: failures are state
    ({"scaler": ls.DynamicLossScale(min_scale=1.0)}, False),
    ({"scaler": ls.NoOpLossScale()}, False),
    ({"scaler": ls.StaticLossScale(8.0)}, False),
    ({"max_consecutive_skips": 5}, False),
    ({"nonfinite_loss": "skip", "max_consecutive_skips": 5}, False),
    ({"on_failure": "raise"}, True),  # the opt-in immediate raise
    ({"on_failure": "raise", "max_consecutive_skips": 5}, True),
])
def test_callbacks_are_compiled_only_when_asked_for(path, options, has_callback):
    tx = ls.with_loss_scaling(optax.sgd(1.0), **options)
    assert ("callback" in jaxpr_text(tx, path)) is has_callback
    params = nested_params()
    lowered = jax.jit(step_by(tx, path)).lower(grads_with({}), tx.init(params), params,
                                                 loss=jnp.float32(1.0))
    assert ("callback" in lowered.as_text().lower()) is has_callback


# ------------------------------------------------------------------ non-finite losses

def loss_tx(mode, hysteresis=1):
    return ls.with_loss_scaling(
        optax.adam(0.1),
        ls.DynamicLossScale(init_scale=1024.0, growth_interval=3, hysteresis=hysteresis),
        nonfinite_loss=mode)


@EAGER_OR_DONATING_JIT
@PATHS
@pytest.mark.parametrize("mode", ["skip", "backoff"])
@pytest.mark.parametrize("bad_grads", [True, False], ids=["nan_grads", "finite_grads"])
def test_nonfinite_loss_skips_and_is_counted(maybe_jit, path, mode, bad_grads):
    tx = loss_tx(mode)
    params = nested_params()
    opt_state = tx.init(params)
    step = maybe_jit(step_by(tx, path))
    params, opt_state = step(grads_with({}), opt_state, params, loss=jnp.float32(1.0))
    assert int(ls.get_loss_scale(opt_state).growth_tracker) == 1
    before = bits((params, opt_state.inner_state))

    grads = grads_with({"enc.w": NAN} if bad_grads else {})
    params, opt_state = step(grads, opt_state, params, loss=jnp.float32(NAN))

    assert_bit_identical(before, (params, opt_state.inner_state))
    m = ls.metrics(opt_state)
    assert (int(m["nonfinite_loss_steps"]), int(m["skipped_steps"])) == (1, 1)
    assert not bool(m["last_step_applied"])
    scaler = ls.get_loss_scale(opt_state)
    if mode == "skip":  # not an overflow: scale and trackers untouched
        assert (float(scaler.loss_scale), int(scaler.growth_tracker)) == (1024.0, 1)
    else:               # treated as an overflow
        assert (float(scaler.loss_scale), int(scaler.growth_tracker)) == (512.0, 0)
    assert ls.nonfinite_grad_paths(opt_state, params) == (["enc.w"] if bad_grads else [])

    # A finite loss with overflowing gradients still backs off under either mode.
    params, opt_state = step(grads_with({"dec.b": INF}), opt_state, params,
                             loss=jnp.float32(2.0))
    m = ls.metrics(opt_state)
    assert (int(m["nonfinite_loss_steps"]), int(m["skipped_steps"])) == (1, 2)
    assert float(m["loss_scale"]) == (512.0 if mode == "skip" else 256.0)


class Counters(NamedTuple):
    """The wrapper's counters as the docs define them (a pure-Python reference model)."""

    skipped_steps: int = 0
    consecutive_skips: int = 0
    nonfinite_loss_steps: int = 0
    consecutive_nonfinite_losses: int = 0
    failure: int = 0
    failure_skips: int = 0


def model_counters(m: Counters, grads_finite: bool, loss_finite: bool,
                   max_consecutive_skips: int | None,
                   max_nonfinite_losses: int | None) -> Counters:
    """One step: applied iff healthy, the gradients and the loss finite; a skip counts in
    a row until an applied step; a non-finite loss counts in a row until a finite one;
    the first limit reached (the skips', then the losses') fails the run for good."""
    applied = m.failure == 0 and grads_finite and loss_finite
    m = m._replace(skipped_steps=m.skipped_steps + (not applied),
                   consecutive_skips=0 if applied else m.consecutive_skips + 1,
                   nonfinite_loss_steps=m.nonfinite_loss_steps + (not loss_finite),
                   consecutive_nonfinite_losses=(0 if loss_finite
                                                 else m.consecutive_nonfinite_losses + 1))
    if m.failure:
        return m
    if max_consecutive_skips is not None and m.consecutive_skips >= max_consecutive_skips:
        return m._replace(failure=int(ls.Failure.TOO_MANY_SKIPS),
                          failure_skips=m.consecutive_skips)
    if max_nonfinite_losses is not None and \
            m.consecutive_nonfinite_losses >= max_nonfinite_losses:
        return m._replace(failure=int(ls.Failure.NONFINITE_LOSS),
                          failure_skips=m.consecutive_nonfinite_losses)
    return m


@settings(max_examples=20, deadline=None)  # each example compiles its step
@given(steps=st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=24),
       max_consecutive_skips=st.one_of(st.none(), st.integers(1, 8)),
       max_nonfinite_losses=st.one_of(st.none(), st.integers(1, 5)),
       nonfinite_loss=st.sampled_from(["backoff", "skip"]),
       path=st.sampled_from(["plain", "fused"]))
@example(steps=[(False, True)] * 15 + [(False, False)], max_consecutive_skips=None,
         max_nonfinite_losses=16, nonfinite_loss="backoff", path="fused")
def test_the_counters_follow_the_reference_model(steps, max_consecutive_skips,
                                                 max_nonfinite_losses, nonfinite_loss, path):
    """Scripted steps of (gradients finite, loss finite) against :func:`model_counters`;
    a skipped step leaves the params bit-identical. The example is issue 42's (item 2):
    fifteen overflows with a finite loss, then one NaN loss, must not fail the run."""
    tx = ls.with_loss_scaling(optax.sgd(0.5), ls.StaticLossScale(4.0),
                              max_consecutive_skips=max_consecutive_skips,
                              max_nonfinite_losses=max_nonfinite_losses,
                              nonfinite_loss=nonfinite_loss)
    params = jnp.array([1.0, -2.0])
    opt_state = tx.init(params)
    step = jax.jit(step_by(tx, path))
    m = Counters()
    for i, (grads_finite, loss_finite) in enumerate(steps):
        grads = jnp.array([4.0, 8.0] if grads_finite else [4.0, INF])
        before = bits(params)
        params, opt_state = step(grads, opt_state, params,
                                 loss=jnp.float32(1.0 if loss_finite else NAN))
        m = model_counters(m, grads_finite, loss_finite, max_consecutive_skips,
                           max_nonfinite_losses)
        got = Counters(*(int(getattr(opt_state, name)) for name in Counters._fields))
        assert got == m, f"after step {i} of {steps}"
        if m.consecutive_skips:
            assert_bit_identical(before, params)


@pytest.mark.parametrize("mode, trackers", [("skip", (0, 0)), ("backoff", (0, 1))])
def test_skip_mode_leaves_the_hysteresis_tracker_alone(mode, trackers):
    tx = loss_tx(mode, hysteresis=2)
    params = nested_params()
    step = jax.jit(step_by(tx, "fused"))
    params, opt_state = step(grads_with({}), tx.init(params), params, loss=jnp.float32(NAN))
    scaler = ls.get_loss_scale(opt_state)
    assert (int(scaler.growth_tracker), int(scaler.nonfinite_tracker)) == trackers
    assert float(scaler.loss_scale) == 1024.0


def test_value_and_grad_returns_the_unscaled_loss_for_the_update():
    def loss_fn(params, x):
        return jnp.mean(jnp.log(x @ params["w"])), x.shape[0]

    tx = ls.with_loss_scaling(optax.sgd(0.1), ls.StaticLossScale(64.0), nonfinite_loss="skip")
    params = {"w": jnp.ones(3)}
    opt_state = tx.init(params)
    grad_fn = jax.jit(ls.value_and_grad(loss_fn, has_aux=True))
    (loss, aux), grads = grad_fn(opt_state, params, jnp.ones((2, 3)))
    assert float(loss) == pytest.approx(np.log(3.0)) and int(aux) == 2
    np.testing.assert_allclose(grads["w"], 64.0 / 3.0 * np.ones(3), rtol=1e-6)
    (loss, _), grads = grad_fn(opt_state, params, -jnp.ones((2, 3)))  # log(-3)
    assert np.isnan(float(loss))
    new_params, opt_state = ls.apply_gradients(tx, grads, opt_state, params, loss=loss)
    chex.assert_trees_all_equal(new_params, params)
    assert int(ls.metrics(opt_state)["nonfinite_loss_steps"]) == 1


# ---------------------------------------------------------------- the docs' blocks

# The blocks of docs/diagnostics.md, docs/optax_wrapper.md and docs/float16_bfloat16.md for
# these features, found by their `<!-- block: name=... -->` markers; tests/test_docs.py runs
# every block, and these tests assert on what each one leaves in its namespace.
SNIPPETS = {"diagnostics": "diagnostics.md", "guard": "diagnostics.md",
            "nonfinite_loss": "diagnostics.md", "gan": "optax_wrapper.md",
            "dtype": "float16_bfloat16.md"}


def run_snippet(name):
    return doc_blocks.namespace(doc_blocks.named(SNIPPETS[name], name))


def test_docs_diagnostics_snippet():
    ns = run_snippet("diagnostics")
    assert ns["flags"].tolist() == [False, True, False]
    assert isinstance(ns["count"], jax.Array) and int(ns["count"]) == 1
    assert ns["names"] == ["dec.w"]
    assert not bool(ls.metrics(ns["opt_state"])["last_step_applied"])


def test_docs_guard_snippet():
    ns = run_snippet("guard")
    assert "3 consecutive optimizer steps skipped (max_consecutive_skips=3)" in ns["message"]
    assert "the loss scale is now 4096.0" in ns["message"]
    assert "non-finite on the last skipped step: w." in ns["message"]
    # The failure is state: the step that failed and every later one leave params alone.
    assert bool(ls.metrics(ns["opt_state"])["failed"])
    params, opt_state = ns["step"](ns["bad"], ns["opt_state"], ns["params"])
    chex.assert_trees_all_equal(params, {"w": jnp.ones(2)})
    with pytest.raises(ls.LossScaleError, match="max_consecutive_skips=3"):
        ls.check(opt_state)


def test_docs_nonfinite_loss_snippet():
    ns = run_snippet("nonfinite_loss")
    m = ns["metrics"]
    assert np.isnan(float(ns["loss"]))
    assert (int(m["nonfinite_loss_steps"]), int(m["skipped_steps"])) == (1, 1)
    assert float(m["loss_scale"]) == 32768.0 and int(m["growth_tracker"]) == 1


def test_docs_gan_snippet_backs_off_only_the_overflowing_scaler():
    ns = run_snippet("gan")
    train_step, params, opt_state = ns["train_step"], ns["params"], ns["opt_state"]
    z, real = ns["z"], ns["real"]
    assert all(bool(m["last_step_applied"]) for m in ns["metrics"].values())
    for _ in range(2):
        params, opt_state, metrics = train_step(params, opt_state, z, real)

    # Outliers in the real batch: the discriminator's float16 backward pass overflows at
    # 2**15; the generator's loss does not see the real batch.
    gen_before, disc_before = bits(params["gen"]), bits(params["disc"])
    outliers = jnp.full((8, 4), -1e4)
    params, opt_state, metrics = train_step(params, opt_state, z, outliers)
    assert not bool(metrics["disc"]["last_step_applied"])
    assert bool(metrics["gen"]["last_step_applied"])
    assert float(metrics["disc"]["loss_scale"]) == 2.0**14
    assert float(metrics["gen"]["loss_scale"]) == 2.0**15
    assert_bit_identical(disc_before, params["disc"])
    assert bits(params["gen"])[0].tobytes() != gen_before[0].tobytes()
    assert ls.nonfinite_grad_paths(opt_state, params["disc"], path="['disc']") == ["w"]
    assert int(metrics["disc"]["nonfinite_grad_leaves"]) == 1
    assert int(metrics["gen"]["nonfinite_grad_leaves"]) == 0

    # Each scaler backs off on its own until its loss fits; the other keeps its scale.
    for _ in range(30):
        params, opt_state, metrics = train_step(params, opt_state, z, outliers)
        if bool(metrics["disc"]["last_step_applied"]):
            break
    assert bool(metrics["disc"]["last_step_applied"])
    assert float(metrics["disc"]["loss_scale"]) < 2.0**14
    assert float(metrics["gen"]["loss_scale"]) == 2.0**15
    assert int(metrics["gen"]["skipped_steps"]) == 0
    chex.assert_tree_all_finite(params)
    assert float(ls.get_loss_scale(opt_state, path="['gen']").loss_scale) == 2.0**15


def test_docs_dtype_snippet():
    ns = run_snippet("dtype")
    assert isinstance(ns["scales"]["float16"], ls.DynamicLossScale)
    assert float(ns["scales"]["float16"].loss_scale) == 2.0**15
    assert isinstance(ns["scales"]["bfloat16"], ls.NoOpLossScale)


# ------------------------------------------------------------------ the bfloat16 switch

def mlp_loss(params, x, dtype):
    h = jnp.tanh(x.astype(dtype) @ params["w1"].astype(dtype))
    return jnp.mean((h @ params["w2"].astype(dtype)).astype(jnp.float32) ** 2)


MLP_PARAMS = {"w1": jnp.full((4, 8), 0.1), "w2": jnp.full((8, 2), 0.2)}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@EAGER_OR_DONATING_JIT
def test_loss_scale_for_in_a_wrapper_train_step(dtype, maybe_jit):
    tx = ls.with_loss_scaling(optax.sgd(0.1), ls.loss_scale_for(dtype, init_scale=2.0**10))
    params = jax.tree.map(jnp.copy, MLP_PARAMS)  # donated under jit
    opt_state = tx.init(params)
    x = jnp.ones((4, 4))
    loss_fn = functools.partial(mlp_loss, x=x, dtype=dtype)

    def step(x, opt_state, params):
        loss, grads = ls.value_and_grad(loss_fn)(opt_state, params)
        return (loss, grads), *ls.apply_gradients(tx, grads, opt_state, params, loss=loss)

    (loss, grads), new_params, opt_state = maybe_jit(step)(x, opt_state, params)
    plain = jax.grad(loss_fn)(MLP_PARAMS)
    if dtype == jnp.bfloat16:  # NoOp: the gradients are the plain ones (bit for bit eagerly)
        assert isinstance(ls.get_loss_scale(opt_state), ls.NoOpLossScale)
        chex.assert_trees_all_close(grads, plain, rtol=1e-2)
        if maybe_jit is not DONATING_JIT:
            chex.assert_trees_all_equal(grads, plain)
        assert float(ls.metrics(opt_state)["loss_scale"]) == 1.0
    else:                      # Dynamic: scaled by 2**10, and grows its tracker
        assert int(ls.get_loss_scale(opt_state).growth_tracker) == 1
        chex.assert_trees_all_close(jax.tree.map(lambda g: g / 2.0**10, grads), plain,
                                    rtol=1e-2)
    expected = jax.tree.map(lambda p, g: p - 0.1 * g, MLP_PARAMS, plain)
    chex.assert_trees_all_close(new_params, expected, rtol=1e-2)
    assert float(loss) == pytest.approx(float(loss_fn(MLP_PARAMS)), rel=1e-2)


def noop_step(tx, use_scale):
    def step(params, opt_state, x):
        loss_fn = functools.partial(mlp_loss, x=x, dtype=jnp.bfloat16)
        if use_scale:
            s = ls.get_loss_scale(opt_state)
            grads = jax.grad(lambda p: ls.scale(s, loss_fn(p)))(params)
        else:
            grads = jax.grad(loss_fn)(params)
        return ls.apply_gradients(tx, grads, opt_state, params)

    return step


def compiled_ops(step, tx):
    return count_ops(jax.jit(step).lower(MLP_PARAMS, tx.init(MLP_PARAMS), jnp.ones((4, 4)))
                     .compile().as_text())


def jaxpr_of(step, tx):
    return str(jax.make_jaxpr(step)(MLP_PARAMS, tx.init(MLP_PARAMS), jnp.ones((4, 4))))


@pytest.mark.parametrize("path", ["plain", "fused"])
def test_noop_scale_unscale_and_update_add_no_ops_to_the_wrapper_step(monkeypatch, path):
    """With NoOpLossScale, a wrapper step written with ``ls.scale`` compiles to the same
    HLO op counts as one written without, and taking ``unscale`` and ``update`` out of the
    wrapper changes nothing either. What remains is the wrapper's skip check (a reduction
    per leaf and a conditional), by design."""

    def step_with(tx, use_scale):
        step = noop_step(tx, use_scale)
        if path == "fused":
            return step

        def plain(params, opt_state, x):  # the same gradients, the optax contract
            grads = jax.grad(lambda p: mlp_loss(p, x, jnp.bfloat16))(params)
            if use_scale:
                s = ls.get_loss_scale(opt_state)
                grads = jax.grad(lambda p: ls.scale(s, mlp_loss(p, x, jnp.bfloat16)))(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        return plain

    noop = ls.with_loss_scaling(optax.sgd(0.1), ls.NoOpLossScale())
    static = ls.with_loss_scaling(optax.sgd(0.1), ls.StaticLossScale(2.0))
    with_scale = {"noop": compiled_ops(step_with(noop, True), noop),
                  "static": compiled_ops(step_with(static, True), static)}
    assert with_scale["noop"] == compiled_ops(step_with(noop, False), noop)
    noop_jaxpr = jaxpr_of(step_with(noop, True), noop)
    static_muls = jaxpr_of(step_with(static, True), static).count(" mul ")

    monkeypatch.setattr(ls_numerics, "unscale_tree", lambda grads, inverse: grads)
    monkeypatch.setattr(ls_update, "update", lambda state, finite, **_: state)
    jax.clear_caches()
    without = {"noop": compiled_ops(step_with(noop, True), noop),
               "static": compiled_ops(step_with(static, True), static)}
    assert with_scale["noop"] == without["noop"]
    assert noop_jaxpr == jaxpr_of(step_with(noop, True), noop)  # not even before XLA
    # The comparison can see an unscale: with a static scale, taking it out removes the
    # multiplications (counted in the jaxpr: XLA may duplicate the scalar reciprocal into
    # several fusions, which blurs the compiled counts).
    assert static_muls > jaxpr_of(step_with(static, True), static).count(" mul ")
    assert with_scale["noop"]["divide"] == 0


def test_noop_jaxpr_has_no_scaling_arithmetic():
    """In the jaxpr too: the NoOp step's equations are the plain step's."""
    noop = ls.with_loss_scaling(optax.sgd(0.1), ls.NoOpLossScale())
    opt_state, x = noop.init(MLP_PARAMS), jnp.ones((4, 4))
    jaxprs = [jax.make_jaxpr(noop_step(noop, use_scale))(MLP_PARAMS, opt_state, x)
              for use_scale in (True, False)]
    assert str(jaxprs[0]) == str(jaxprs[1])


@EAGER_OR_DONATING_JIT
@PATHS
def test_noop_wrapper_still_skips_nonfinite_steps(maybe_jit, path):
    tx = ls.with_loss_scaling(optax.adam(0.1), ls.loss_scale_for(jnp.bfloat16))
    params = nested_params()
    opt_state = tx.init(params)
    step = maybe_jit(step_by(tx, path))
    before = bits((params, opt_state.inner_state))
    params, opt_state = step(grads_with({"head.1": NAN}), opt_state, params)
    assert_bit_identical(before, (params, opt_state.inner_state))
    assert ls.nonfinite_grad_paths(opt_state, params) == ["head.1"]
    params, opt_state = step(grads_with({}), opt_state, params)
    assert bool(opt_state.last_step_applied)
    assert int(ls.metrics(opt_state)["skipped_steps"]) == 1
    assert isinstance(ls.get_loss_scale(opt_state), ls.NoOpLossScale)
