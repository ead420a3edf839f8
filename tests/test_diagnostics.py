"""Errors, warnings and diagnostics a user can act on.

* ``tx.init`` warns, naming the leaves, when params are float16 and the inner optimizer
  keeps its state in their dtype (Adam's eps is 0 there); integer and bool params pass
  through the wrapper as through optax.
* ``underflow_diagnostics=True``: per step, per leaf and overall, the fraction of exact
  zeros and of nonzero entries below float16's smallest normal once unscaled, against a
  NumPy computation; nothing compiled when off.
* The mis-use detector: 20 growths in a row without an overflow make
  ``metrics(...)["scale_suspicious"]`` true and ``ls.check`` warn.
* Every error names the argument, the value and the fix, eagerly and under ``jit``.
"""

from __future__ import annotations

import collections
import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from bitwise import assert_bit_identical, bits
from hypothesis import given, settings
from hypothesis import strategies as st

import loss_scaling as ls

NAN = float("nan")
MAYBE_JIT = pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit], ids=["eager", "jit"])
PATHS = pytest.mark.parametrize("path", ["plain", "fused"])
F16_TINY = float(np.finfo(np.float16).tiny)


def make_step(tx, path):
    def step(grads, opt_state, params, **extra):
        if path == "fused":
            return ls.apply_gradients(tx, grads, opt_state, params, **extra)
        updates, opt_state = tx.update(grads, opt_state, params, **extra)
        return optax.apply_updates(params, updates), opt_state
    return step


# ------------------------------------------------------------------ float16 params, ints


@pytest.mark.parametrize("inner", [optax.adam(1e-3), optax.adamw(1e-3), optax.sgd(0.1, 0.9)],
                         ids=["adam", "adamw", "sgd_momentum"])
@pytest.mark.parametrize("trace", ["eager", "eval_shape"])
def test_float16_params_with_optimizer_state_in_their_dtype_warn_at_init(inner, trace):
    tx = ls.with_loss_scaling(inner)
    params = {"dense": {"w": jnp.ones((2, 2), jnp.float16)}, "b": jnp.zeros(2)}
    init = tx.init if trace == "eager" else functools.partial(jax.eval_shape, tx.init)
    with pytest.warns(ls.LossScaleWarning, match=r"the params dense\.w are float16 "
                      r".*Adam's eps=1e-8 is 0 in float16.*Keep float32 master params"):
        init(params)


def test_float32_params_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ls.with_loss_scaling(optax.adam(1e-3)).init({"w": jnp.ones(2)})
        ls.with_loss_scaling(optax.sgd(0.1)).init({"w": jnp.ones(2)})


@pytest.mark.parametrize("inner", ["adam", "sgd"])
@pytest.mark.parametrize("trace", ["eager", "eval_shape"])
@pytest.mark.parametrize("dtype, bits", [(jnp.bfloat16, 8), (jnp.float16, 11)])
def test_narrow_params_warn_at_init_whatever_the_optimizer(inner, trace, dtype, bits):
    """bfloat16 params lose every update below ~1/256 of the param (8 significant bits),
    float16 ones below ~1/2048: a stateless optimizer does not help, so the warning does
    not depend on its state (float16 with Adam gets the state's warning instead)."""
    tx = ls.with_loss_scaling(optax.adam(1e-3) if inner == "adam" else optax.sgd(0.1),
                              ls.loss_scale_for(dtype))
    params = {"dense": {"w": jnp.ones((2, 2), dtype)}, "b": jnp.zeros(2)}
    init = tx.init if trace == "eager" else functools.partial(jax.eval_shape, tx.init)
    name = jnp.dtype(dtype).name
    if inner == "adam" and dtype == jnp.float16:  # Adam's moments are float16 too
        match = r"the params dense\.w are float16 and the wrapped optimizer keeps its state"
    else:
        match = (rf"the params dense\.w are {name}\. {name} keeps {bits} significant bits, "
                 rf"so an update smaller than about 1/{2**bits} of a param rounds away .*"
                 r"Keep float32 master params")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        init(params)
    assert len(caught) == 1 and caught[0].category is ls.LossScaleWarning, caught
    assert re.search(match, str(caught[0].message)), caught[0].message


def test_bfloat16_params_really_lose_small_updates_which_is_why_we_warn():
    params = jnp.ones(4, jnp.bfloat16)
    updates = jnp.full(4, -1e-3, jnp.bfloat16)     # a 1e-3 step of sgd
    np.testing.assert_array_equal(optax.apply_updates(params, updates), params)


def test_float16_params_really_break_adam_which_is_why_we_warn():
    params = jnp.ones(4, jnp.float16)
    inner = optax.adam(1e-3)
    updates, _ = inner.update(jnp.zeros(4, jnp.float16), inner.init(params), params)
    assert np.isnan(np.asarray(optax.apply_updates(params, updates), np.float32)).all()


@PATHS
@MAYBE_JIT
def test_integer_and_bool_params_pass_through_as_in_optax(maybe_jit, path):
    inner = optax.adam(0.1)
    tx = ls.with_loss_scaling(inner, ls.StaticLossScale(4.0))
    params = {"w": jnp.ones(3), "count": jnp.arange(3, dtype=jnp.int32),
              "mask": jnp.asarray([True, False])}
    grads = {"w": jnp.full(3, 4.0), "count": jnp.zeros(3, jnp.int32),
             "mask": jnp.zeros(2, jnp.bool_)}
    opt_state = tx.init(params)
    step = maybe_jit(make_step(tx, path))
    new_params, opt_state = step(grads, opt_state, params)
    # As optax: the integer and bool params are untouched, the float one steps.
    want, _ = inner.update({"w": jnp.ones(3), "count": grads["count"], "mask": grads["mask"]},
                           inner.init(params), params)
    want = optax.apply_updates(params, want)
    for name in ("count", "mask"):
        np.testing.assert_array_equal(new_params[name], params[name])
        assert new_params[name].dtype == params[name].dtype
    np.testing.assert_allclose(new_params["w"], want["w"], rtol=1e-6)
    # A second step with the same state types (no retrace on a dtype drift), and a skip.
    new_params, opt_state = step(grads, opt_state, new_params)
    bad = dict(grads, w=jnp.asarray([NAN, 1.0, 1.0]))
    before = bits(new_params)
    skipped, opt_state = step(bad, opt_state, new_params)
    assert_bit_identical(before, skipped)


# -------------------------------------------------------------------- underflow stats


def numpy_fractions(grads: dict, scale: float) -> tuple[list[float], list[float]]:
    zero, small = [], []
    for g in jax.tree.leaves(grads):
        g = np.asarray(g, np.float64)
        unscaled = np.abs(g * np.float64(np.float32(1.0 / np.float64(scale))))
        zero.append(float(np.mean(unscaled == 0)))
        small.append(float(np.mean((unscaled > 0) & (unscaled < F16_TINY))))
    return zero, small


# Leaf sizes: one entry, a middle one and a large one. They are fixed so that the two jitted
# steps below compile once for the whole search (the scale is a leaf of the state, not of
# the step: a new one does not recompile); hypothesis varies the values, the scale and
# where the zeros are, which is what the fractions depend on.
UNDERFLOW_SIZES = (1, 57, 299)
UNDERFLOW_TX = ls.with_loss_scaling(optax.sgd(0.1), ls.StaticLossScale(1.0),
                                    underflow_diagnostics=True)
UNDERFLOW_STEPS = (jax.jit(make_step(UNDERFLOW_TX, "fused")),
                   jax.jit(make_step(UNDERFLOW_TX, "plain")))


@settings(max_examples=12, deadline=None)  # (eager: below)
@given(seed=st.integers(0, 2**31 - 1), exponent=st.integers(0, 24))
def test_underflow_fractions_match_numpy_on_random_gradients(seed, exponent):
    rng = np.random.default_rng(seed)
    scale = 2.0**exponent
    grads = {}
    for i, n in enumerate(UNDERFLOW_SIZES):
        g = rng.standard_normal(n) * 10.0 ** rng.uniform(-12, 0, n)
        g[rng.random(n) < 0.2] = 0.0
        grads[f"leaf{i}"] = jnp.asarray(g * scale, jnp.float32)
    tx = ls.with_loss_scaling(optax.sgd(0.1), ls.StaticLossScale(scale),
                              underflow_diagnostics=True)
    params = jax.tree.map(jnp.zeros_like, grads)
    zero, small = numpy_fractions(grads, scale)
    sizes = np.asarray([g.size for g in jax.tree.leaves(grads)], np.float64)
    for step in UNDERFLOW_STEPS:  # compiled for scale 1; this example's scale is in the state
        _, opt_state = step(grads, tx.init(params), params)
        assert float(ls.get_loss_scale(opt_state).loss_scale) == scale
        m = ls.metrics(opt_state)
        np.testing.assert_allclose(m["zero_grad_fraction_per_leaf"], zero, rtol=1e-6)
        np.testing.assert_allclose(m["small_grad_fraction_per_leaf"], small, rtol=1e-6)
        np.testing.assert_allclose(m["zero_grad_fraction"], np.dot(zero, sizes) / sizes.sum(),
                                   rtol=1e-5)
        np.testing.assert_allclose(m["small_grad_fraction"], np.dot(small, sizes) / sizes.sum(),
                                   rtol=1e-5)


def test_underflow_statistics_show_what_a_larger_scale_recovers():
    """The same true gradients: float16 compute underflows at scale 1, not at 2**15."""
    true = jnp.asarray([1e-9, 3e-6, 1e-2, 0.5], jnp.float32)
    fractions = {}
    for scale in (1.0, 2.0**15):
        g16 = (true * scale).astype(jnp.float16)                  # a float16 backward pass
        tx = ls.with_loss_scaling(optax.sgd(0.1), ls.StaticLossScale(scale),
                                  underflow_diagnostics=True)
        _, state = tx.update({"w": g16}, tx.init({"w": true}), {"w": true})
        m = ls.metrics(state)
        fractions[scale] = (float(m["zero_grad_fraction"]), float(m["small_grad_fraction"]))
    assert fractions[1.0] == (0.25, 0.25)          # 1e-9 lost (zero), 3e-6 subnormal
    # At 2**15 nothing is lost to zero: 1e-9 and 3e-6 survive the float16 backward pass;
    # unscaled they are still below float16's normal range (why the scale is needed).
    assert fractions[2.0**15] == (0.0, 0.5)


def count_ops(hlo: str) -> collections.Counter:
    return collections.Counter(re.findall(r"= \S+ (\w[\w-]*)\(", hlo))


@PATHS
def test_nothing_is_compiled_when_the_diagnostics_are_off(path):
    params = {"a": jnp.ones((8, 8)), "b": jnp.ones(8)}

    def ops(**options):
        tx = ls.with_loss_scaling(optax.adam(1e-3), **options)
        step = jax.jit(make_step(tx, path))
        return count_ops(step.lower(params, tx.init(params), params).compile().as_text())

    off, default, on = ops(underflow_diagnostics=False), ops(), ops(underflow_diagnostics=True)
    assert off == default
    assert sum(on.values()) > sum(off.values())
    assert ls.with_loss_scaling(optax.sgd(1.0)).init(params).underflow is None
    assert not {k for k in ls.metrics(ls.with_loss_scaling(optax.sgd(1.0)).init(params))
                if "fraction" in k}


# ---------------------------------------------------------------- the mis-use detector


@PATHS
def test_an_unscaled_loss_makes_the_scale_suspicious_and_check_warns(path):
    """Forgetting ``ls.scale``: the gradients never overflow, the scale climbs forever."""
    tx = ls.with_loss_scaling(optax.sgd(1e-3), ls.DynamicLossScale(growth_interval=1))
    params = {"w": jnp.ones(3)}
    opt_state = tx.init(params)
    step = jax.jit(make_step(tx, path))
    grads = {"w": jnp.full(3, 1e-3)}       # the same small gradients at any scale
    for i in range(ls.SUSPICIOUS_GROWTHS):
        assert not bool(ls.metrics(opt_state)["scale_suspicious"]), i
        ls.check(opt_state)                  # no warning yet (filterwarnings = error)
        params, opt_state = step(grads, opt_state, params)
    m = ls.metrics(opt_state)
    assert int(m["clean_growths"]) == ls.SUSPICIOUS_GROWTHS and bool(m["scale_suspicious"])
    with pytest.warns(ls.LossScaleWarning, match=r"grew 20 times in a row without a single "
                      r"overflow .*not scaled"):
        ls.check(opt_state)
    # One overflow resets it: a scaled loss overflows sooner or later.
    params, opt_state = step({"w": jnp.asarray([NAN, 0.0, 0.0])}, opt_state, params)
    assert int(ls.metrics(opt_state)["clean_growths"]) == 0
    ls.check(opt_state)


def headroom_run(dtype, scaled, gradient=1e-3, steps=6):
    """A headroom run (a window of 1) of a loss whose gradients are ``gradient``:
    differentiated through ``ls.value_and_grad`` (``scaled``) or with ``jax.grad``
    (the scale forgotten), with ``ls.check`` after every step (warnings are errors)."""
    tx = ls.with_loss_scaling(optax.sgd(1e-3), ls.DynamicLossScale(
        growth="headroom", headroom_window=1, headroom_dtype=dtype))
    params = {"w": jnp.ones(3)}
    opt_state = tx.init(params)

    def loss_fn(p):
        return jnp.sum(p["w"]) * gradient

    @jax.jit
    def step(params, opt_state):
        if scaled:
            _, grads = ls.value_and_grad(loss_fn)(opt_state, params)
        else:  # what the trace-time check warns about: the run-time fallback's case
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ls.LossScaleWarning)
                grads = jax.grad(loss_fn)(params)
                return ls.apply_gradients(tx, grads, opt_state, params)
        return ls.apply_gradients(tx, grads, opt_state, params)

    seen = []
    for _ in range(steps):
        params, opt_state = step(params, opt_state)
        m = ls.metrics(opt_state)
        seen.append((float(m["loss_scale"]), bool(m["scale_suspicious"])))
    return opt_state, seen


@pytest.mark.parametrize("gradient", [1e-3, 1e-12, 1e3])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_headroom_growth_past_2_64_with_a_wide_dtype_is_not_suspicious(dtype, gradient):
    """Issue 42, item 12: with headroom_dtype bfloat16 or float32 the headroom rule grows,
    as designed, far past 2**64 (here to float32's top) from the measured gradients of a
    scaled loss; ls.check warned on every call. A scale that follows the measured
    gradients is no mis-use."""
    opt_state, seen = headroom_run(dtype, scaled=True, gradient=gradient)
    assert all(scale >= 2.0**64 for scale, _ in seen)
    assert not any(suspicious for _, suspicious in seen)
    ls.check(opt_state)  # no warning (filterwarnings = error)


def test_headroom_growth_with_float16_stays_low_and_is_not_suspicious():
    opt_state, seen = headroom_run("float16", scaled=True)
    assert seen[-1] == (2.0**21, False)  # 65504 / 16 / 1e-3, a power of two
    ls.check(opt_state)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
def test_headroom_growth_on_a_forgotten_scale_is_still_suspicious(dtype):
    """The scale grows but the gradients do not follow it: the maxima the rule records
    (the gradients divided by the scale) fall below 2**-48, which no gradient of a model
    that needs a scale past 2**64 is. With a wide dtype the first growth goes to
    float32's top; the window's next entry, recorded at that scale, gives it away."""
    opt_state, seen = headroom_run(dtype, scaled=False)
    assert seen[-1][0] >= 2.0**64 and seen[-1][1]
    assert not seen[0][1]  # not before the rule has seen the scale run away
    with pytest.warns(ls.LossScaleWarning, match="without a single overflow"):
        ls.check(opt_state)


def test_a_scaled_loss_overflows_and_is_never_suspicious():
    tx = ls.with_loss_scaling(optax.sgd(1e-3), ls.DynamicLossScale(init_scale=1.0,
                                                                   growth_interval=1))
    params = jnp.ones(3)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
        loss_fn = lambda p: jnp.sum((p.astype(jnp.float16) * 1e3) ** 2)  # noqa: E731
        _, grads = ls.value_and_grad(loss_fn)(opt_state, params)
        return ls.apply_gradients(tx, grads, opt_state, params)

    for _ in range(60):
        params, opt_state = step(params, opt_state)
        assert int(ls.metrics(opt_state)["clean_growths"]) < ls.SUSPICIOUS_GROWTHS
    assert int(ls.metrics(opt_state)["skipped_steps"]) > 0


# ----------------------------------------------------------------------- error messages


@pytest.mark.parametrize("call, match", [
    (lambda: ls.with_loss_scaling(optax.sgd(1.0), skip="fast"),
     r"skip must be 'auto', 'cond' or 'select', got 'fast'"),
    (lambda: ls.with_loss_scaling(optax.sgd(1.0), on_failure="log"),
     r"on_failure must be 'record' .* got 'log'"),
    (lambda: ls.with_loss_scaling(optax.sgd(1.0), max_consecutive_skips=0),
     r"max_consecutive_skips must be an integer in \[1, 2147483647\], got 0"),
    (lambda: ls.with_loss_scaling(optax.sgd(1.0), nonfinite_loss="ignore"),
     r"nonfinite_loss must be 'backoff' or 'skip', got 'ignore'"),
    (lambda: ls.DynamicLossScale(init_scale=-1.0),
     r"init_scale must be a finite, positive, normal float32 .*got -1\.0"),
    (lambda: ls.update(ls.DynamicLossScale(), jnp.ones(2, bool)),
     r"grads_finite must be a scalar bool .*got Array\(\[ True,  True\]"),
])
def test_errors_name_the_argument_the_value_and_the_fix(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_the_opt_in_raise_under_jit_is_what_the_docs_quote():
    """With ``on_failure="raise"`` JAX wraps the error: a ``JaxRuntimeError`` whose text
    holds ``LossScaleError: <the message>`` (the guide quotes this)."""
    tx = ls.with_loss_scaling(optax.sgd(1.0), ls.DynamicLossScale(init_scale=2.0**-126),
                              on_failure="raise")
    params = jnp.ones(2)
    step = jax.jit(make_step(tx, "fused"))
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        jax.block_until_ready(step(jnp.asarray([NAN, 0.0]), tx.init(params), params))
    text = str(info.value)
    assert "LossScaleError: loss scale backoff failed: the loss scale 1.1754943508222875e-38" \
        in text


@pytest.mark.parametrize("path", ["plain", "fused"])
def test_check_and_nonfinite_grad_paths_name_lookahead_leaves_alike(path):
    # optax.lookahead takes LookaheadParams(fast, slow) but gradients of `fast` only: the
    # names of both helpers come from one function, the failure message's too.
    tx = ls.with_loss_scaling(optax.lookahead(optax.sgd(0.1), sync_period=2,
                                              slow_step_size=0.5), max_consecutive_skips=2)
    params = optax.LookaheadParams.init_synced({"enc": {"w": jnp.ones(2)}, "b": jnp.ones(3)})
    opt_state = tx.init(params)
    step = jax.jit(make_step(tx, path))
    grads = {"enc": {"w": jnp.asarray([1.0, NAN])}, "b": jnp.ones(3)}
    for _ in range(2):
        _, opt_state = step(grads, opt_state, params)
    assert ls.nonfinite_grad_paths(opt_state, params) == ["enc.w"]
    with pytest.raises(ls.LossScaleError, match=r"non-finite on the last skipped step: enc\.w\."):
        ls.check(opt_state, params=params)


AUX_MISUSES = pytest.mark.parametrize("has_aux, returns, match", [
    (True, lambda loss, w: loss, r"has_aux=True.*pair `\(loss, aux\)`.*returned an array "
                                 r"of shape \(\) and dtype float32"),
    (True, lambda loss, w: (loss, w, w), r"has_aux=True.*returned a tuple of 3 elements"),
    (False, lambda loss, w: (loss, {"w": w}), r"has_aux=False.*scalar loss only.*returned "
                                              r"a tuple of 2 elements.*pass has_aux=True"),
    (False, lambda loss, w: [loss, w], r"has_aux=False.*returned a list of 2 elements"),
], ids=["true-bare-loss", "true-triple", "false-pair", "false-list"])


@AUX_MISUSES
@MAYBE_JIT
def test_value_and_grad_has_aux_misuse_names_has_aux_and_the_output(has_aux, returns, match,
                                                                    maybe_jit):
    # Clearer than jax.value_and_grad's messages, and never showing the aux scaled.
    def loss_fn(w):
        return returns(jnp.sum(w ** 2), w * 3.0)

    grad_fn = maybe_jit(ls.value_and_grad(loss_fn, has_aux=has_aux))
    with pytest.raises(TypeError, match=match) as info:
        grad_fn(ls.StaticLossScale(8.0), jnp.ones(2))
    assert "value_and_grad(loss_fn" in str(info.value) and "24" not in str(info.value)
    # What JAX accepts still works: a list pair, and any aux (a string, an object).
    for out in ([jnp.float32(1.0), jnp.ones(2)], (jnp.float32(1.0), "note")):
        (loss, aux), _ = ls.value_and_grad(lambda w, out=out: out, has_aux=True)(
            ls.StaticLossScale(8.0), jnp.ones(2))
        assert float(loss) == 1.0 and aux is out[1]


def test_the_getting_started_check_shows_a_model_that_needs_loss_scaling():
    # docs/getting_started.md, "Does my model need loss scaling at all?": the unscaled
    # float16 step flushes gradients to zero that the scaled one keeps.
    import doc_blocks

    ns = doc_blocks.namespace(doc_blocks.named("getting_started.md", "need_scaling"))
    (zero_unscaled, _), (zero_scaled, _) = ns["unscaled"], ns["scaled"]
    assert 0.05 < zero_unscaled < 0.2                  # the page says "about 10%"
    assert zero_scaled < zero_unscaled / 10
