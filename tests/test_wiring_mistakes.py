"""Wiring mistakes (docs/common_mistakes.md) that used to be silent.

The wrapper outermost, enforced wherever the library sees the whole optimizer state;
a loss differentiated without the scale (warned while the step is traced, under both
growth rules) or scaled twice (refused); a forward pass that keeps failing ends the run,
named. Each test also shows the harm the check prevents.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from bitwise import assert_bit_identical, bits
from flax import nnx
from flax.training import train_state

import loss_scaling as ls

NAN = float("nan")
MAYBE_JIT = pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit], ids=["eager", "jit"])


def wrapped(inner=None):
    return ls.with_loss_scaling(inner or optax.sgd(0.1), ls.DynamicLossScale(init_scale=8.0))


# ------------------------------------------------------------- 1. the wrapper outermost

OUTSIDE = {
    "clip_before": (lambda: optax.chain(optax.clip_by_global_norm(1.0), wrapped()),
                    r"optax.chain.*chained before it.*sees the scaled gradients.*1/scale"),
    "decay_after": (lambda: optax.chain(wrapped(), optax.add_decayed_weights(0.1)),
                    r"optax.chain.*chained after it.*runs on the\s+steps the wrapper skips"),
    "inject": (lambda: optax.inject_hyperparams(
        lambda learning_rate: wrapped(optax.sgd(learning_rate)))(learning_rate=0.1),
               r"optax.inject_hyperparams.*counts the skipped steps"),
    "masked": (lambda: optax.masked(wrapped(), {"w": True, "v": False}),
               r"optax.masked.*still scaled"),
    "apply_if_finite": (lambda: optax.apply_if_finite(wrapped(), 3),
                        r"ApplyIfFiniteState.*sees the scaled gradients"),
    "group_without_wrapper": (lambda: optax.multi_transform(
        {"a": wrapped(), "b": optax.sgd(0.1)}, {"w": "a", "v": "b"}),
        r"group 'b' has no wrapper of its own.*scaled gradients"),
}
FIX = r"ls.with_loss_scaling\(optax.chain\(optax.clip_by_global_norm"
PARAMS = {"w": jnp.array([1.0, 2.0]), "v": jnp.array([3.0])}


def loss_fn(params):
    return jnp.sum(params["w"] ** 2) + jnp.sum(params["v"] ** 2)


@pytest.mark.parametrize("outside", OUTSIDE)
def test_a_transformation_outside_the_wrapper_is_refused_wherever_the_state_is_seen(outside):
    make, why = OUTSIDE[outside]
    tx = make()
    opt_state = tx.init(PARAMS)
    grads = jax.tree.map(jnp.ones_like, PARAMS)
    calls = {
        "value_and_grad": lambda: ls.value_and_grad(loss_fn)(opt_state, PARAMS),
        "apply_gradients": lambda: ls.apply_gradients(tx, grads, opt_state, PARAMS),
        "apply_gradients_jit": lambda: jax.jit(
            lambda g, s, p: ls.apply_gradients(tx, g, s, p))(grads, opt_state, PARAMS),
        "check": lambda: ls.check(opt_state),
        "metrics": lambda: ls.metrics(opt_state),
        "metrics_jit": lambda: jax.jit(ls.metrics)(opt_state),
        "TrainState.create": lambda: ls.TrainState.create(apply_fn=None, params=PARAMS,
                                                          tx=tx),
        "flax TrainState": lambda: ls.check(train_state.TrainState.create(
            apply_fn=None, params=PARAMS, tx=tx)),
        "checkpoint dict": lambda: ls.metrics({"params": PARAMS, "opt_state": opt_state}),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=why) as info:
            call()
        assert "outermost" in str(info.value) and FIX.replace("\\", "") in str(info.value), name
    # ls.get_loss_scale still reads the scale (to scale a loss, or to restore).
    assert float(ls.get_loss_scale(opt_state).loss_scale) == 8.0


def test_a_wrapper_wrapped_again_is_refused():
    # Unscaled twice, by two loss scales: every step 1/scale the size it should be.
    with pytest.raises(TypeError, match=r"already a `ls.with_loss_scaling\(...\)`.*unscaled "
                                        r"twice"):
        ls.with_loss_scaling(wrapped())
    rebuilt = optax.GradientTransformationExtraArgs(wrapped().init, wrapped().update)
    with pytest.raises(TypeError, match="unscaled twice"):
        ls.with_loss_scaling(rebuilt)


def test_the_integrations_refuse_it_too():
    tx = OUTSIDE["clip_before"][0]()
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="chained before it"):
        ls.nnx.Optimizer(model, tx, wrt=nnx.Param)
    eqx_model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    params = eqx.filter(eqx_model, eqx.is_inexact_array)
    opt_state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    with pytest.raises(ValueError, match="chained before it"):
        ls.equinox.apply_gradients(tx, grads, opt_state, eqx_model)
    with pytest.raises(ValueError, match="chained before it"):
        ls.value_and_grad(lambda m: jnp.sum(m.weight))(opt_state, eqx_model)


def test_the_plain_update_of_an_outer_chain_is_refused_and_the_fix_does_the_right_thing():
    # The wrapper's own update sees that optax.chain runs it with something after (or
    # before) it: refused in the plain path too, not only where the state is seen.
    params = jnp.array([1.0])
    decay_after = optax.chain(ls.with_loss_scaling(optax.sgd(0.1)),
                              optax.add_decayed_weights(0.1))
    with pytest.raises(ValueError, match="chained after it"):
        decay_after.update(jnp.array([NAN]), decay_after.init(params), params)
    fixed = ls.with_loss_scaling(optax.chain(optax.sgd(0.1), optax.add_decayed_weights(0.1)))
    new, _ = ls.apply_gradients(fixed, jnp.array([NAN]), fixed.init(params), params)
    assert float(new[0]) == 1.0  # the skipped step keeps the params
    scaled = jnp.array([2.0**15])  # the gradient 1.0, scaled
    clip_before = optax.chain(optax.clip_by_global_norm(1.0), ls.with_loss_scaling(optax.sgd(1.0)))
    with pytest.raises(ValueError, match="chained before it"):
        jax.jit(clip_before.update)(scaled, clip_before.init(params), params)
    fixed = ls.with_loss_scaling(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0)))
    new, _ = ls.apply_gradients(fixed, scaled, fixed.init(params), params)
    assert float(new[0]) == 0.0  # unscaled, then clipped: the true step


@MAYBE_JIT
def test_harmless_wrappings_are_allowed(maybe_jit):
    # One wrapper per multi_transform group (a loss scale per loss), a chain of the wrapper
    # alone, and containers that are no transformation.
    groups = optax.multi_transform({"a": wrapped(), "b": wrapped()}, {"w": "a", "v": "b"})
    alone = optax.chain(wrapped())
    for tx, path in ((groups, "['a']"), (alone, None)):
        opt_state = tx.init(PARAMS)
        grads = jax.tree.map(lambda p: 8.0 * p, PARAMS)
        params, opt_state = maybe_jit(lambda g, s, p, tx=tx: ls.apply_gradients(tx, g, s, p))(
            grads, opt_state, PARAMS)
        assert float(params["w"][0]) == pytest.approx(0.9)
        ls.check(opt_state, path=path)
        assert int(maybe_jit(functools.partial(ls.metrics, path=path))(opt_state)[
            "skipped_steps"]) == 0
    ls.check({"params": PARAMS, "opt_state": wrapped().init(PARAMS)})
    ls.TrainState.create(apply_fn=None, params=PARAMS, tx=wrapped())


# --------------------------------------------------------- 2. scaling forgotten or doubled

def _forgetful_step(tx, fused):
    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(loss_fn)(params)  # the mistake
        if fused:
            return ls.apply_gradients(tx, grads, opt_state, params, loss=loss)
        updates, opt_state = tx.update(grads, opt_state, params, loss=loss)
        return optax.apply_updates(params, updates), opt_state
    return step


@pytest.mark.parametrize("growth", ["interval", "headroom"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain"])
def test_a_loss_differentiated_without_the_scale_is_named_at_the_first_step(growth, fused):
    tx = ls.with_loss_scaling(optax.sgd(0.1), ls.DynamicLossScale(growth=growth))
    params, opt_state = PARAMS, tx.init(PARAMS)
    step = _forgetful_step(tx, fused)
    with pytest.warns(ls.LossScaleWarning, match=r"computed from the params without the "
                                                 r"loss scale.*ls.value_and_grad\(loss_fn\)"):
        new, _ = step(params, opt_state)
    # The harm: a step 1/32768 of the true one, with nothing overflowing to say so.
    assert float(new["w"][0]) == pytest.approx(1.0 - 0.1 * 2.0 / 2**15)


@pytest.mark.parametrize("growth", ["interval", "headroom"])
def test_no_false_alarm_for_scaled_losses_or_gradients_passed_in(growth):
    tx = ls.with_loss_scaling(optax.sgd(0.1), ls.DynamicLossScale(growth=growth))
    opt_state = tx.init(PARAMS)

    def with_ls(params, opt_state):
        loss, grads = ls.value_and_grad(loss_fn)(opt_state, params)
        return ls.apply_gradients(tx, grads, opt_state, params, loss=loss)

    def with_scale(params, opt_state):
        s = ls.get_loss_scale(opt_state)
        grads = jax.grad(lambda p: ls.scale(s, loss_fn(p)))(params)
        return ls.apply_gradients(tx, grads, opt_state, params)

    def by_hand(params, opt_state):  # the scale read and multiplied in by hand
        factor = ls.get_loss_scale(opt_state).loss_scale
        grads = jax.grad(lambda p: loss_fn(p) * factor)(params)
        return ls.apply_gradients(tx, grads, opt_state, params)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in (with_ls, with_scale, by_hand):
            new, _ = jax.jit(step)(PARAMS, opt_state)
            assert float(new["w"][0]) == pytest.approx(1.0 - 0.1 * 2.0)
        # Gradients passed into the traced step (computed elsewhere) cannot be judged.
        grads = jax.grad(loss_fn)(PARAMS)
        jax.jit(lambda g, s, p: ls.apply_gradients(tx, g, s, p))(grads, opt_state, PARAMS)


def _warning(run):
    with pytest.warns(ls.LossScaleWarning, match="without the loss scale") as record:
        run()
    return str(record[0].message)


def test_forgotten_scaling_is_named_for_nnx_equinox_and_train_state_by_their_own_calls():
    # Each message names the call the user made and the recipe with their arguments.
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = ls.nnx.Optimizer(model, ls.with_loss_scaling(optax.sgd(0.1)), wrt=nnx.Param)
    x = jnp.ones((3, 2))

    @nnx.jit
    def nnx_step(model, optimizer, x):
        grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)  # the mistake
        optimizer.update(model, grads)

    message = _warning(lambda: nnx_step(model, optimizer, x))
    assert message.startswith("optimizer.update(model, grads):")
    assert "ls.apply_gradients" not in message and "(`nnx.grad` instead" in message
    assert "ls.value_and_grad(loss_fn)(optimizer, model, batch)" in message

    eqx_model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    tx = ls.with_loss_scaling(optax.sgd(0.1))
    opt_state = tx.init(eqx.filter(eqx_model, eqx.is_inexact_array))

    @eqx.filter_jit
    def eqx_step(model, opt_state, x):
        grads = eqx.filter_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
        return ls.equinox.apply_gradients(tx, grads, opt_state, model)

    message = _warning(lambda: eqx_step(eqx_model, opt_state, x))
    assert message.startswith("ls.equinox.apply_gradients(tx, grads, opt_state, model):")
    assert "ls.value_and_grad(loss_fn)(opt_state, model, batch)" in message

    state = ls.TrainState.create(apply_fn=None, params=PARAMS, tx=wrapped())
    message = _warning(lambda: jax.jit(
        lambda s: s.apply_gradients(grads=jax.grad(loss_fn)(s.params)))(state))
    assert message.startswith("state.apply_gradients(grads=grads):")
    assert "ls.value_and_grad(loss_fn)(state, state.params, batch)" in message


@MAYBE_JIT
def test_ls_scale_inside_a_loss_given_to_value_and_grad_is_refused(maybe_jit):
    tx = wrapped()
    opt_state = tx.init(PARAMS)

    def doubled(params):  # the mistake: ls.value_and_grad scales it again
        return ls.scale(ls.get_loss_scale(opt_state), loss_fn(params))

    with pytest.raises(ValueError, match=r"function given to ls.value_and_grad returned was "
                                         r"already scaled.*scaled twice"):
        maybe_jit(ls.value_and_grad(doubled))(opt_state, PARAMS)
    # Outside it, ls.scale works as before, and an inner ls.value_and_grad inside a loss
    # (a meta-gradient) scales its own loss without complaint.
    assert float(ls.scale(ls.get_loss_scale(opt_state), jnp.float32(2.0))) == 16.0

    def outer(params):
        inner_loss, _ = ls.value_and_grad(loss_fn)(ls.StaticLossScale(2.0), params)
        return inner_loss

    loss, _ = maybe_jit(ls.value_and_grad(outer))(opt_state, PARAMS)
    assert float(loss) == 14.0


def test_double_scaling_is_refused_for_nnx_and_equinox():
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = ls.nnx.Optimizer(model, ls.with_loss_scaling(optax.sgd(0.1)), wrt=nnx.Param)
    scale = ls.get_loss_scale(optimizer)
    with pytest.raises(ValueError, match="scaled twice"):
        ls.value_and_grad(lambda m: ls.scale(scale, jnp.sum(m.kernel[...])))(optimizer, model)
    eqx_model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    s = ls.StaticLossScale(4.0)
    with pytest.raises(ValueError, match="scaled twice"):
        ls.value_and_grad(lambda m: ls.scale(s, jnp.sum(m.weight)))(s, eqx_model)


# ------------------------------------------------- 3. a forward pass that keeps failing

def _run_nonfinite_losses(tx, steps, maybe_jit):
    params = jnp.array([1.0, 2.0])
    opt_state = tx.init(params)
    step = maybe_jit(lambda g, s, p, loss: ls.apply_gradients(tx, g, s, p, loss=loss))
    for _ in range(steps):
        params, opt_state = step(jnp.array([NAN, 1.0]), opt_state, params, jnp.float32(NAN))
    return params, opt_state


@pytest.mark.parametrize("policy", ["backoff", "skip"])
def test_a_loss_that_stays_nonfinite_fails_the_run_early_and_names_the_forward_pass(policy):
    tx = ls.with_loss_scaling(optax.sgd(0.1), nonfinite_loss=policy)
    params, opt_state = _run_nonfinite_losses(tx, 15, jax.jit)
    ls.check(opt_state)  # 15 in a row: not yet
    params, opt_state = _run_nonfinite_losses(tx, 16, jax.jit)
    with pytest.raises(ls.LossScaleError, match=r"loss was not finite \(inf/NaN\) on 16 "
                                                r"consecutive steps.*forward pass.*"
                                                r"find_overflow"):
        ls.check(opt_state)
    assert int(opt_state.failure) == ls.Failure.NONFINITE_LOSS
    want_scale = 2.0**15 / 2**16 if policy == "backoff" else 2.0**15
    assert float(ls.get_loss_scale(opt_state).loss_scale) == want_scale
    with pytest.raises(ls.LossScaleError, match="forward pass"):
        ls.check(ls.get_loss_scale(opt_state))  # the scaler records it too
    # Sticky and fail-closed: a finite step after it is skipped, the params stay.
    before = np.asarray(params)
    params, opt_state = jax.jit(lambda g, s, p: ls.apply_gradients(tx, g, s, p))(
        jnp.array([1.0, 1.0]), opt_state, params)
    assert np.array_equal(np.asarray(params).view(np.uint32), before.view(np.uint32))
    assert int(ls.metrics(opt_state)["skipped_steps"]) == 17


def test_eagerly_it_raises_at_the_step_that_fails():
    tx = ls.with_loss_scaling(optax.sgd(0.1), max_nonfinite_losses=3)
    _run_nonfinite_losses(tx, 2, lambda f: f)
    with pytest.raises(ls.LossScaleError, match="on 3 consecutive steps"):
        _run_nonfinite_losses(tx, 3, lambda f: f)


def test_overflowing_gradients_with_a_finite_loss_do_not_trigger_it():
    tx = ls.with_loss_scaling(optax.sgd(0.1), ls.DynamicLossScale(min_scale=1.0))
    params = jnp.array([1.0, 2.0])
    opt_state = tx.init(params)
    step = jax.jit(lambda g, s, p, loss: ls.apply_gradients(tx, g, s, p, loss=loss))
    for _ in range(40):
        params, opt_state = step(jnp.array([NAN, 1.0]), opt_state, params, jnp.float32(1.0))
    ls.check(opt_state)
    # Off: the old behaviour, skipping on.
    tx = ls.with_loss_scaling(optax.sgd(0.1), max_nonfinite_losses=None,
                              nonfinite_loss="skip")
    _, opt_state = _run_nonfinite_losses(tx, 40, jax.jit)
    ls.check(opt_state)


@pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit], ids=["eager", "jit"])
def test_overflow_skips_before_a_nonfinite_loss_do_not_count_towards_it(maybe_jit):
    """Issue 42, item 2: fifteen overflow skips with a finite loss, then one NaN loss,
    ended the run as NONFINITE_LOSS (every skip in the streak was counted). What counts
    is the losses: consecutive steps whose loss= is non-finite."""
    tx = ls.with_loss_scaling(optax.sgd(0.1), ls.DynamicLossScale(min_scale=1.0))
    params = jnp.array([1.0, 2.0])
    opt_state = tx.init(params)
    step = maybe_jit(lambda g, s, p, loss: ls.apply_gradients(tx, g, s, p, loss=loss))
    overflow = jnp.array([jnp.inf, 1.0])
    for _ in range(15):
        params, opt_state = step(overflow, opt_state, params, jnp.float32(1.0))
    for n in range(1, 16):
        params, opt_state = step(overflow, opt_state, params, jnp.float32(NAN))
        assert int(opt_state.consecutive_nonfinite_losses) == n
        assert int(opt_state.consecutive_skips) == 15 + n
        ls.check(opt_state)
    # A finite loss ends the streak, though the step is still skipped for its gradients.
    params, opt_state = step(overflow, opt_state, params, jnp.float32(1.0))
    assert int(opt_state.consecutive_nonfinite_losses) == 0
    ls.check(opt_state)
    for _ in range(15):
        params, opt_state = step(overflow, opt_state, params, jnp.float32(NAN))
    ls.check(opt_state)
    if maybe_jit is jax.jit:
        params, opt_state = step(overflow, opt_state, params, jnp.float32(NAN))
        with pytest.raises(ls.LossScaleError, match="not finite .* on 16 consecutive steps"):
            ls.check(opt_state)
    else:
        with pytest.raises(ls.LossScaleError, match="not finite .* on 16 consecutive steps"):
            step(overflow, opt_state, params, jnp.float32(NAN))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "16"])
def test_max_nonfinite_losses_is_validated(bad):
    with pytest.raises((ValueError, TypeError), match="max_nonfinite_losses"):
        ls.with_loss_scaling(optax.sgd(0.1), max_nonfinite_losses=bad)


def test_the_compiled_default_step_is_unchanged_without_a_loss():
    # max_nonfinite_losses compiles only into steps given a loss=, and the trace-time
    # checks compile nothing: the default step's program is the one without them (its
    # lowered text was also compared with the commit before issue 33: identical).
    params = jnp.array([1.0, 2.0])
    grads = jnp.array([NAN, 2.0])
    for fused in (True, False):
        texts = []
        for limit in (ls.with_loss_scaling(optax.adam(1e-3)),
                      ls.with_loss_scaling(optax.adam(1e-3), max_nonfinite_losses=None)):
            tx = limit
            if fused:
                step = jax.jit(lambda g, s, p, tx=tx: ls.apply_gradients(tx, g, s, p))
            else:
                step = jax.jit(lambda g, s, p, tx=tx: tx.update(g, s, p))
            texts.append(step.lower(grads, tx.init(params), params).as_text())
        assert texts[0] == texts[1]


def test_a_headroom_scale_grown_past_2_64_without_an_overflow_is_suspicious():
    # What tracing cannot see (gradients passed into the step): the run-time fallback.
    # The headroom rule on an unscaled loss grows by large factors, fewer than
    # SUSPICIOUS_GROWTHS times, and stops at float32's top: 20 growths never came.
    tx = ls.with_loss_scaling(optax.sgd(1e-3), ls.DynamicLossScale(growth="headroom",
                                                                   headroom_window=1))
    params = {"w": jnp.ones(3)}
    opt_state = tx.init(params)
    step = jax.jit(lambda g, s, p: ls.apply_gradients(tx, g, s, p))
    grads = {"w": jnp.full(3, 1e-3)}  # the same small gradients at any scale
    for _ in range(3):
        ls.check(opt_state)  # no warning yet (warnings are errors)
        params, opt_state = step(grads, opt_state, params)
    m = ls.metrics(opt_state)
    assert float(m["loss_scale"]) > 2.0**64 and int(m["clean_growths"]) < 20
    assert bool(m["scale_suspicious"])
    with pytest.warns(ls.LossScaleWarning, match="without a single overflow"):
        ls.check(opt_state)


# ------------------------------- 4. chains, containers and what each place can know

class OwnTrainState(NamedTuple):
    """A user's own train state, as many JAX codebases write it."""
    params: Any
    opt_state: Any


class OwnCount(NamedTuple):
    count: jax.Array


def own_decay():
    """A transformation of the user's own, stateless: its state is ``()``."""
    def update(updates, state, params=None):
        return jax.tree.map(lambda u, p: u - 0.1 * p, updates, params), state
    return optax.GradientTransformation(lambda params: (), update)


def own_counted_decay():
    """The same with a NamedTuple state of its own (not optax's)."""
    def update(updates, state, params=None):
        return (jax.tree.map(lambda u, p: u - 0.1 * p, updates, params),
                OwnCount(state.count + 1))
    return optax.GradientTransformation(lambda params: OwnCount(jnp.zeros((), jnp.int32)),
                                        update)


def _plain_step(tx):
    def step(g, s, p):
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates)
    return step


def _fused_step(tx):
    return lambda g, s, p: ls.apply_gradients(tx, g, s, p)[0]


@MAYBE_JIT
def test_two_wrappers_chained_are_refused_as_unscaled_twice(maybe_jit):
    # The gradients would be unscaled by each wrapper: divided by the scale twice.
    for tx in (optax.chain(wrapped(), wrapped()),
               optax.chain(wrapped(), optax.chain(wrapped())),
               optax.named_chain(("a", wrapped()), ("b", wrapped()))):
        opt_state = tx.init(PARAMS)
        grads = jax.tree.map(lambda p: 8.0 * 2 * p, PARAMS)
        for step in (_plain_step(tx), _fused_step(tx)):
            with pytest.raises(ValueError, match=r"twice.*one after the other.*unscales the "
                                                 r"updates of the first again"):
                maybe_jit(step)(grads, opt_state, PARAMS)


@MAYBE_JIT
def test_two_wrappers_side_by_side_are_accepted(maybe_jit):
    # A GAN: two optimizers, two states in one tuple, each updated with its own tx.
    g_tx, d_tx = wrapped(), wrapped(optax.adam(1e-3))
    states = (g_tx.init(PARAMS), d_tx.init(PARAMS))

    def step(states, params):
        (g_loss, g_grads) = ls.value_and_grad(loss_fn)(states[0], params)
        d_loss, d_grads = ls.value_and_grad(loss_fn)(states[1], params)
        g_params, g_state = ls.apply_gradients(g_tx, g_grads, states[0], params, loss=g_loss)
        updates, d_state = d_tx.update(d_grads, states[1], params, loss=d_loss)
        return g_params, (g_state, d_state)

    g_params, states = maybe_jit(step)(states, PARAMS)
    assert float(g_params["w"][0]) == pytest.approx(0.8)
    ls.check(states, path="[0]")
    assert int(maybe_jit(functools.partial(ls.metrics, path="[1]"))(states)[
        "skipped_steps"]) == 0


AFTER = {"own_empty": own_decay, "own_named": own_counted_decay,
         "decay": lambda: optax.add_decayed_weights(0.1),
         "adam": lambda: optax.adam(0.1)}


@pytest.mark.parametrize("after", AFTER)
@MAYBE_JIT
def test_anything_chained_after_the_wrapper_is_refused_where_it_runs(after, maybe_jit):
    # On a skipped step the transformation after the wrapper would still move the params
    # (1.0 -> 0.9 for the decays): refused in both paths, eagerly and under jit.
    params = jnp.array([1.0])
    tx = optax.chain(ls.with_loss_scaling(optax.sgd(0.1)), AFTER[after]())
    opt_state = tx.init(params)
    for step in (_plain_step(tx), _fused_step(tx)):
        with pytest.raises(ValueError, match=r"optax.chain.*chained after it.*move on a "
                                             r"skipped step.*outermost"):
            maybe_jit(step)(jnp.array([NAN]), opt_state, params)


def test_an_empty_state_after_the_wrapper_is_refused_where_only_the_state_is_seen():
    # A state () or EmptyState() beside the wrapper's holds no optimizer: a chain's.
    params = jnp.array([1.0])
    for make in (own_decay, lambda: optax.add_decayed_weights(0.1)):
        opt_state = optax.chain(ls.with_loss_scaling(optax.sgd(0.1)), make()).init(params)
        for call in (ls.check, ls.metrics,
                     lambda s: ls.value_and_grad(jnp.sum)(s, params)):
            with pytest.raises(ValueError, match="chained after it"):
                call(opt_state)


@pytest.mark.parametrize("after", AFTER)
@MAYBE_JIT
def test_the_fix_keeps_a_skipped_step_bit_identical(after, maybe_jit):
    params = {"w": jnp.array([1.0, -0.0]), "v": jnp.array([3.0])}
    tx = ls.with_loss_scaling(optax.chain(optax.sgd(0.1), AFTER[after]()))
    opt_state = tx.init(params)
    nan = {"w": jnp.array([NAN, 1.0]), "v": jnp.array([1.0])}
    before = bits((params, opt_state.inner_state))
    for step in (_plain_step(tx), _fused_step(tx)):
        new = maybe_jit(step)(nan, opt_state, params)
        assert_bit_identical(before[:len(jax.tree.leaves(params))], new)


@MAYBE_JIT
def test_a_users_named_tuple_train_state_is_accepted(maybe_jit):
    tx = wrapped()
    state = OwnTrainState(PARAMS, tx.init(PARAMS))

    def step(state):
        loss, grads = ls.value_and_grad(loss_fn)(state, state.params)
        params, opt_state = ls.apply_gradients(tx, grads, state.opt_state, state.params,
                                               loss=loss)
        new = OwnTrainState(params, opt_state)
        return new, ls.metrics(new)

    new, metrics = maybe_jit(step)(state)
    assert float(new.params["w"][0]) == pytest.approx(0.8)
    assert int(metrics["skipped_steps"]) == 0
    ls.check(new)
    assert float(ls.get_loss_scale(new).loss_scale) == 8.0


OTHER_OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-3),
    "sgd": lambda: optax.sgd(0.1),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
    "counted": own_counted_decay,
}
CONTAINERS = {
    "tuple": lambda a, b: (a, b),
    "tuple_reversed": lambda a, b: (b, a),
    "list": lambda a, b: [a, b],
    "dict": lambda a, b: {"generator": a, "critic": b},
    "named_tuple": lambda a, b: OwnTrainState(a, b),
}


@pytest.mark.parametrize("container", CONTAINERS)
@pytest.mark.parametrize("other", OTHER_OPTIMIZERS)
def test_a_container_of_complete_optimizer_states_is_accepted(container, other):
    # The wrapper's state beside another optimizer's, in any container.
    states = CONTAINERS[container](wrapped().init(PARAMS), OTHER_OPTIMIZERS[other]().init(PARAMS))
    ls.check(states)
    assert int(jax.jit(ls.metrics)(states)["skipped_steps"]) == 0
    loss, grads = jax.jit(ls.value_and_grad(loss_fn))(states, PARAMS)
    assert float(grads["w"][0]) == 8.0 * 2.0
    ls.TrainState.create(apply_fn=None, params=PARAMS, tx=wrapped())  # its own tx: fine


@pytest.mark.parametrize("other", ["adam", "inject_hyperparams", "counted"])
def test_a_chain_whose_state_looks_like_a_container_is_refused_where_its_update_runs(other):
    # optax.chain(wrapper, adam)'s state is exactly the tuple (wrapper state, adam state):
    # the state alone cannot tell, so check/metrics accept it, and the update refuses it.
    tx = optax.chain(wrapped(), OTHER_OPTIMIZERS[other]())
    opt_state = tx.init(PARAMS)
    ls.check(opt_state)
    grads = jax.tree.map(jnp.ones_like, PARAMS)
    ts = ls.TrainState.create(apply_fn=None, params=PARAMS, tx=tx)
    for step in (lambda: tx.update(grads, opt_state, PARAMS),
                 lambda: jax.jit(tx.update)(grads, opt_state, PARAMS),
                 lambda: ls.apply_gradients(tx, grads, opt_state, PARAMS),
                 lambda: jax.jit(lambda ts: ts.apply_gradients(grads=grads))(ts)):
        with pytest.raises(ValueError, match="chained after it"):
            step()
