"""What the trace-time checks read from the program (wrapper/provenance.py), beside the
nearest correct programs, which must pass without a warning (warnings are errors here).

Forgotten scaling without params, a loss scaled by another state's scale (a stale state, a
GAN's other optimizer), a static scale written as a constant, gradients made finite by
`jnp.nan_to_num` before the wrapper, a loss scaled inside a jitted function that comes from
JAX's cache, and PyTorch AMP's gradient-penalty recipe. Each mistake is also shown doing the
harm that the check names.
"""

from __future__ import annotations

import contextlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loss_scaling as ls

MAYBE_JIT = pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit], ids=["eager", "jit"])
PARAMS = {"w": jnp.array([1.0, 2.0]), "v": jnp.array([3.0])}
NAMED_FIX = r"ls.value_and_grad\(loss_fn\)\(opt_state, params, batch\)"


def loss_fn(params):
    return jnp.sum(params["w"] ** 2) + jnp.sum(params["v"] ** 2)


@contextlib.contextmanager
def no_warning():
    """Any warning fails the test (as pyproject's filterwarnings, stated here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


# ------------------------------------------- forgotten scaling, the usual optax call

def test_forgotten_scaling_is_named_when_tx_update_gets_no_params():
    tx = ls.with_loss_scaling(optax.sgd(0.1))

    @jax.jit
    def step(params, opt_state):
        grads = jax.grad(loss_fn)(params)  # the mistake
        updates, opt_state = tx.update(grads, opt_state)  # optax's usual call: no params
        return optax.apply_updates(params, updates), opt_state

    with pytest.warns(ls.LossScaleWarning, match=r"tx.update\(grads, opt_state.*without the "
                                                 r"loss scale.*" + NAMED_FIX):
        new, _ = step(PARAMS, tx.init(PARAMS))
    # The harm: a step 1/32768 of the true one.
    assert float(new["w"][0]) == pytest.approx(1.0 - 0.1 * 2.0 / 2**15)


def test_scaled_gradients_without_params_draw_no_warning():
    tx = ls.with_loss_scaling(optax.sgd(0.1))
    opt_state = tx.init(PARAMS)

    def with_ls(params, opt_state):
        _, grads = ls.value_and_grad(loss_fn)(opt_state, params)
        return tx.update(grads, opt_state)

    def scaled_after_the_backward_pass(params, opt_state):  # the factor applied by hand
        factor = ls.get_loss_scale(opt_state).loss_scale
        return tx.update(jax.tree.map(lambda g: g * factor, jax.grad(loss_fn)(params)),
                         opt_state)

    def passed_in_and_cast(grads, opt_state):  # computed elsewhere: cannot be judged
        return tx.update(jax.tree.map(lambda g: g.astype(jnp.float32) * 1.0, grads),
                         opt_state)

    with no_warning():
        for step in (with_ls, scaled_after_the_backward_pass):
            updates, _ = jax.jit(step)(PARAMS, opt_state)
            assert float(updates["w"][0]) == pytest.approx(-0.1 * 2.0)
        grads = jax.tree.map(lambda p: 2.0**15 * 2 * p, PARAMS)
        updates, _ = jax.jit(passed_in_and_cast)(grads, opt_state)
        assert float(updates["w"][0]) == pytest.approx(-0.1 * 2.0)


# --------------------------------------------- a static scale written as a constant

@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain"])
def test_a_static_scale_applied_as_its_own_constant_draws_no_warning(fused):
    scaler = ls.StaticLossScale(1024.0)
    tx = ls.with_loss_scaling(optax.sgd(0.1), scaler)
    opt_state = tx.init(PARAMS)

    def step_of(scaled_loss):
        def step(params, opt_state):
            grads = jax.grad(scaled_loss)(params)
            if fused:
                return ls.apply_gradients(tx, grads, opt_state, params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state
        return jax.jit(step)

    with no_warning():
        for scaled_loss in (lambda p: ls.scale(scaler, loss_fn(p)),  # the same scaler
                            lambda p: 1024.0 * loss_fn(p),  # the constant
                            lambda p: loss_fn(p) * jnp.float32(1024)):
            new, _ = step_of(scaled_loss)(PARAMS, opt_state)
            assert float(new["w"][0]) == pytest.approx(1.0 - 0.1 * 2.0)
    # The mistakes next to it are still named: the loss not scaled, or divided by the
    # same number (a mean over 1024 entries is no scaling).
    for unscaled in (loss_fn, lambda p: loss_fn(p) / 1024.0):
        with pytest.warns(ls.LossScaleWarning, match="without the loss scale"):
            step_of(unscaled)(PARAMS, opt_state)


# ---------------------------------------------- scaled, but by another state's scale

def test_a_stale_states_scale_is_named_not_jax_grad():
    tx = ls.with_loss_scaling(optax.sgd(0.1))
    stale = tx.init(PARAMS)
    current = tx.init(PARAMS)

    @jax.jit
    def passed_in(params, opt_state, old_state):
        loss, grads = ls.value_and_grad(loss_fn)(old_state, params)  # the mistake
        return ls.apply_gradients(tx, grads, opt_state, params, loss=loss)

    @jax.jit
    def captured(params, opt_state):  # a state from an earlier step, closed over
        loss, grads = ls.value_and_grad(loss_fn)(stale, params)
        return ls.apply_gradients(tx, grads, opt_state, params, loss=loss)

    for run in (lambda: passed_in(PARAMS, current, stale), lambda: captured(PARAMS, current)):
        with pytest.warns(ls.LossScaleWarning) as record:
            run()
        message = str(record[0].message)
        assert "another loss scale than the one this optimizer state holds" in message
        assert "before the last update" in message and "another optimizer's" in message
        assert "jax.grad" not in message


def test_a_gan_scaling_with_the_other_optimizers_state_is_named():
    g_tx = ls.with_loss_scaling(optax.sgd(0.1))
    d_tx = ls.with_loss_scaling(optax.sgd(0.1), ls.DynamicLossScale(init_scale=2.0**10))
    g_state, d_state = g_tx.init(PARAMS), d_tx.init(PARAMS)

    def step(g_params, d_params, g_state, d_state, swapped):
        g_holder, d_holder = (d_state, g_state) if swapped else (g_state, d_state)
        _, g_grads = ls.value_and_grad(loss_fn)(g_holder, g_params)
        _, d_grads = ls.value_and_grad(loss_fn)(d_holder, d_params)
        g_params, g_state = ls.apply_gradients(g_tx, g_grads, g_state, g_params)
        d_params, d_state = ls.apply_gradients(d_tx, d_grads, d_state, d_params)
        return g_params, d_params

    with no_warning():  # each loss with its own optimizer's scale
        g_params, _ = jax.jit(lambda *a: step(*a, swapped=False))(PARAMS, PARAMS, g_state,
                                                                    d_state)
    assert float(g_params["w"][0]) == pytest.approx(1.0 - 0.1 * 2.0)
    with pytest.warns(ls.LossScaleWarning, match="another optimizer's"):
        g_params, _ = jax.jit(lambda *a: step(*a, swapped=True))(PARAMS, PARAMS, g_state,
                                                                   d_state)
    # The harm: scaled by 2**10, unscaled by 2**15, the step 1/32 of the true one.
    assert float(g_params["w"][0]) == pytest.approx(1.0 - 0.1 * 2.0 / 32)


# --------------------------------------------- non-finite values made finite before it

SANITIZERS = {
    "nan_to_num": jnp.nan_to_num,
    "where_isfinite": lambda g: jnp.where(jnp.isfinite(g), g, 0.0),
    "where_isnan": lambda g: jnp.where(jnp.isnan(g), 0.0, g),
}


@pytest.mark.parametrize("sanitize", SANITIZERS)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain"])
def test_gradients_made_finite_before_the_wrapper_are_named(sanitize, fused):
    tx = ls.with_loss_scaling(optax.sgd(0.1))
    opt_state = tx.init(PARAMS)

    @jax.jit
    def step(params, opt_state):
        # A finite loss whose scaled backward pass overflows float32.
        loss, grads = ls.value_and_grad(lambda p: loss_fn(p) * 1e34)(opt_state, params)
        grads = jax.tree.map(SANITIZERS[sanitize], grads)  # the mistake
        if fused:
            return ls.apply_gradients(tx, grads, opt_state, params, loss=loss)
        updates, opt_state = tx.update(grads, opt_state, params, loss=loss)
        return optax.apply_updates(params, updates), opt_state

    with pytest.warns(ls.LossScaleWarning, match=r"made finite.*before.*the wrapper.*"
                                                 r"applies the step instead of skipping"):
        new, _ = step(PARAMS, opt_state)
    if sanitize == "nan_to_num":  # the harm: an overflow's inf became 3.4e38, and applied
        assert abs(float(new["w"][0])) > 1e30


def test_non_finite_values_handled_in_the_forward_pass_draw_no_warning():
    tx = ls.with_loss_scaling(optax.sgd(0.1))
    opt_state = tx.init(PARAMS)
    batch = jnp.array([1.0, jnp.inf, jnp.nan])

    def masked_loss(params, batch):
        x = jnp.nan_to_num(batch, posinf=0.0)  # cleaning the data inside the loss
        logits = params["w"][0] * jnp.array([1.0, 2.0, 3.0]) + jnp.array([0.0, -jnp.inf, 0.0])
        logits = jnp.where(jnp.isfinite(logits), logits, -1e9)  # masking, differentiated
        return jnp.sum(x) * loss_fn(params) + jax.nn.logsumexp(logits)

    @jax.jit
    def step(params, opt_state, batch):
        batch = jnp.where(jnp.isnan(batch), 0.0, batch)  # cleaning the data before it
        loss, grads = ls.value_and_grad(masked_loss)(opt_state, params, batch)
        logged = jax.tree.map(jnp.nan_to_num, grads)  # for a log line, not the update
        params, opt_state = ls.apply_gradients(tx, grads, opt_state, params, loss=loss)
        return params, opt_state, optax.tree.norm(logged)

    with no_warning():
        new, _, _ = step(PARAMS, opt_state, batch)
    assert np.isfinite(np.asarray(new["w"])).all()


# -------------------------------------------------------------- scaled twice, cached

@MAYBE_JIT
def test_a_jitted_loss_that_scales_is_refused_even_from_the_jit_cache(maybe_jit):
    tx = ls.with_loss_scaling(optax.sgd(0.1))
    opt_state = tx.init(PARAMS)

    @jax.jit
    def scaled_loss(params, scaler):
        return ls.scale(scaler, loss_fn(params))

    scaler = ls.get_loss_scale(opt_state)
    jax.grad(scaled_loss)(PARAMS, scaler)  # traced once: its jaxpr is cached now
    maybe_jit(lambda p, s: jax.grad(scaled_loss)(p, ls.get_loss_scale(s)))(PARAMS, opt_state)
    with pytest.raises(ValueError, match=r"scaled twice"):
        maybe_jit(lambda s, p: ls.value_and_grad(scaled_loss)(s, p, ls.get_loss_scale(s)))(
            opt_state, PARAMS)


@MAYBE_JIT
def test_a_cached_jitted_loss_without_ls_scale_is_accepted(maybe_jit):
    tx = ls.with_loss_scaling(optax.sgd(0.1))
    opt_state = tx.init(PARAMS)
    jitted = jax.jit(loss_fn)
    jax.grad(jitted)(PARAMS)
    with no_warning():
        loss, grads = maybe_jit(ls.value_and_grad(jitted))(opt_state, PARAMS)
    assert float(loss) == 14.0 and float(grads["w"][0]) == 2.0 * 2.0**15


# ------------------------------------------------- PyTorch AMP's gradient penalty

def _penalized_loss(params, scaler, x, y):
    """PyTorch's AMP examples, "Gradient penalty", in JAX: the inner backward pass of the
    scaled loss, unscaled before the penalty is computed from it."""
    def loss_of(p):
        return jnp.mean((x @ p["w"] + p["v"] - y) ** 2)

    # Scales the loss for the inner backward pass, producing scaled gradients.
    scaled_grads = jax.grad(lambda p: ls.scale(scaler, loss_of(p)))(params)
    # Unscaled gradients before the penalty (ls.unscale, as torch divides by the scale).
    grads = ls.unscale(scaler, scaled_grads)
    grad_norm = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads)))
    return loss_of(params) + grad_norm


def _true_penalized_loss(params, x, y):
    def loss_of(p):
        return jnp.mean((x @ p["w"] + p["v"] - y) ** 2)
    grads = jax.grad(loss_of)(params)
    return loss_of(params) + jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads)))


@MAYBE_JIT
def test_the_gradient_penalty_recipe_runs_inside_value_and_grad(maybe_jit):
    params = {"w": jnp.array([[0.5], [-1.0]]), "v": jnp.array([0.25])}
    x, y = jnp.array([[1.0, 2.0], [3.0, -1.0]]), jnp.array([[1.0], [0.0]])
    tx = ls.with_loss_scaling(optax.sgd(0.01), ls.DynamicLossScale(init_scale=2.0**10))
    opt_state = tx.init(params)

    def step(params, opt_state):
        scaler = ls.get_loss_scale(opt_state)
        loss, grads = ls.value_and_grad(_penalized_loss)(opt_state, params, scaler, x, y)
        new, opt_state = ls.apply_gradients(tx, grads, opt_state, params, loss=loss)
        return loss, grads, new

    with no_warning():
        loss, grads, new = maybe_jit(step)(params, opt_state)
    true_loss, true_grads = jax.value_and_grad(_true_penalized_loss)(params, x, y)
    np.testing.assert_allclose(float(loss), float(true_loss), rtol=1e-6)
    for g, t in zip(jax.tree.leaves(grads), jax.tree.leaves(true_grads), strict=True):
        np.testing.assert_allclose(np.asarray(g), 2.0**10 * np.asarray(t), rtol=1e-5)
    for n, p, t in zip(jax.tree.leaves(new), jax.tree.leaves(params), jax.tree.leaves(true_grads),
                       strict=True):
        np.testing.assert_allclose(np.asarray(n), np.asarray(p - 0.01 * t), rtol=1e-5)


@MAYBE_JIT
def test_r1_penalty_on_the_inputs_runs_inside_value_and_grad(maybe_jit):
    # R1: the penalty on the gradient with respect to the real inputs, scaled and unscaled.
    params = {"w": jnp.array([0.5, -1.0]), "v": jnp.array([0.25])}
    real = jnp.array([[1.0, 2.0], [3.0, -1.0]])

    def critic(p, x):
        return jnp.tanh(x @ p["w"] + p["v"][0])

    def r1_loss(p, scaler, x):
        scaled = jax.grad(lambda x: ls.scale(scaler, jnp.sum(critic(p, x))))(x)
        return -jnp.mean(critic(p, x)) + 5.0 * jnp.mean(ls.unscale(scaler, scaled) ** 2)

    def true_r1(p, x):
        return -jnp.mean(critic(p, x)) + 5.0 * jnp.mean(
            jax.grad(lambda x: jnp.sum(critic(p, x)))(x) ** 2)

    opt_state = ls.with_loss_scaling(optax.sgd(0.1)).init(params)
    with no_warning():
        _, grads = maybe_jit(lambda s, p: ls.value_and_grad(r1_loss)(
            s, p, ls.get_loss_scale(s), real))(opt_state, params)
    true = jax.grad(true_r1)(params, real)
    for g, t in zip(jax.tree.leaves(grads), jax.tree.leaves(true), strict=True):
        np.testing.assert_allclose(np.asarray(g), 2.0**15 * np.asarray(t), rtol=1e-5)


@MAYBE_JIT
def test_the_loss_of_the_penalty_recipe_scaled_again_is_still_refused(maybe_jit):
    params = {"w": jnp.array([[0.5], [-1.0]]), "v": jnp.array([0.25])}
    x, y = jnp.array([[1.0, 2.0]]), jnp.array([[1.0]])
    opt_state = ls.with_loss_scaling(optax.sgd(0.1)).init(params)

    def doubled(params, scaler):
        return ls.scale(scaler, _penalized_loss(params, scaler, x, y))

    with pytest.raises(ValueError, match="scaled twice"):
        maybe_jit(lambda s, p: ls.value_and_grad(doubled)(s, p, ls.get_loss_scale(s)))(
            opt_state, params)


# ------------------------------------------------------------------- nothing compiled

def test_the_checks_add_nothing_to_the_compiled_steps(monkeypatch):
    # The lowered text of the default steps is the same with the trace-time checks
    # turned off (they read the program; they add nothing to it).
    from loss_scaling.wrapper import provenance

    tx = ls.with_loss_scaling(optax.adam(1e-3))
    opt_state = tx.init(PARAMS)
    calls = []

    def texts():  # new functions each time: traced again, not taken from jit's cache
        def fused(params, opt_state):
            loss, grads = ls.value_and_grad(loss_fn)(opt_state, params)
            return ls.apply_gradients(tx, grads, opt_state, params, loss=loss)

        def plain(params, opt_state):
            loss, grads = ls.value_and_grad(loss_fn)(opt_state, params)
            updates, opt_state = tx.update(grads, opt_state, params, loss=loss)
            return optax.apply_updates(params, updates), opt_state

        return [jax.jit(step).lower(PARAMS, opt_state).as_text() for step in (fused, plain)]

    with_checks = texts()
    monkeypatch.setattr(provenance, "check_gradients", lambda *args: calls.append(args))
    monkeypatch.setattr(provenance, "scaled_in_forward", lambda loss: calls.append(loss))
    assert texts() == with_checks
    assert len(calls) == 4  # both checks were reached, and turned off, in both steps
