"""Replay (``max_replays``): an overflowed batch recomputed at the backed-off scale inside
the same compiled step, applied, on every README path (issue 24, part 2).

The injected overflow: ``loss = sum(f16(w) * f16(x))``. Its backward pass is ``scale * x``
in float16, which overflows for ``x = 1000`` above a scale of 64 (128 * 1000 > 65504), and
is exact at or below it (a power-of-two scale times a float16 integer): the replayed step
must equal, bit for bit, the step that ran at the backed-off scale from the start.
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from bitwise import assert_bit_identical, assert_trees_close_in_ulps, bits
from flax import nnx
from step_paths import step_by

import loss_scaling as ls

NAN = float("nan")
BIG = jnp.array([1000.0, 2.0, 3.0])     # overflows above a scale of 64
SMALL = jnp.array([1.0, 2.0, 3.0])
EAGER_OR_JIT = pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit],
                                       ids=["eager", "jit"])
PATHS = ["plain", "fused", "train_state"]


def loss_fn(params, x):
    return jnp.sum(params["w"].astype(jnp.float16) * x.astype(jnp.float16)).astype(jnp.float32)


def make_tx(init_scale=256.0, max_replays=3, inner=None, **scaler_kwargs):
    scaler = ls.DynamicLossScale(init_scale=init_scale, growth_interval=100, **scaler_kwargs)
    return ls.with_loss_scaling(inner or optax.adam(0.1), scaler, max_replays=max_replays)


def make_step(tx, path, with_loss=True):
    """``step(params, opt_state, x) -> (params, opt_state)`` on one path, with value_fn."""
    apply = step_by(tx, path)

    def step(params, opt_state, x):
        loss, grads = ls.value_and_grad(loss_fn)(opt_state, params, x)
        extra = {"value_fn": lambda p: loss_fn(p, x)}
        if with_loss:
            extra["loss"] = loss
        return apply(grads, opt_state, params, **extra)
    return step


def counters(opt_state):
    m = ls.metrics(opt_state)
    return {k: m[k].item() for k in ("loss_scale", "growth_tracker", "skipped_steps",
                                     "replays", "last_step_replays", "nonfinite_loss_steps")}


def run(tx, path, x, maybe_jit, with_loss=True, params=None):
    params = {"w": jnp.array([0.5, -1.0, 2.0])} if params is None else params
    opt_state = tx.init(params)
    return (params, opt_state, *maybe_jit(make_step(tx, path, with_loss))(params, opt_state, x))


JIT_PATHS_AND_EAGER = pytest.mark.parametrize(
    "maybe_jit, path", [(jax.jit, p) for p in PATHS] + [(lambda f: f, "fused")],
    ids=[*PATHS, "fused_eager"])


@JIT_PATHS_AND_EAGER
@pytest.mark.parametrize("with_loss", [True, False], ids=["loss", "no_loss"])
def test_an_overflowed_batch_is_replayed_and_equals_the_step_at_the_backed_off_scale(
        maybe_jit, path, with_loss):
    _, _, params, opt_state = run(make_tx(), path, BIG, maybe_jit, with_loss)
    # 256 overflows, 128 overflows, 64 is finite: two replays, the batch applied.
    assert counters(opt_state) == {"loss_scale": 64.0, "growth_tracker": 1,
                                   "skipped_steps": 0, "replays": 2, "last_step_replays": 2,
                                   "nonfinite_loss_steps": 0}
    _, _, ref_params, ref_state = run(make_tx(init_scale=64.0, max_replays=0), path, BIG,
                                      maybe_jit, with_loss)
    assert_bit_identical(bits(ref_params), params)
    assert_bit_identical(bits(ref_state.inner_state), opt_state.inner_state)
    assert float(ls.metrics(opt_state)["grad_norm"]) == float(ls.metrics(ref_state)["grad_norm"])
    # A healthy batch next: no replay, the total kept.
    params, opt_state = maybe_jit(make_step(make_tx(), path, with_loss))(params, opt_state,
                                                                        SMALL)
    assert counters(opt_state)["replays"] == 2
    assert counters(opt_state)["last_step_replays"] == 0


@JIT_PATHS_AND_EAGER
def test_replays_used_up_or_a_floor_skip_with_params_bit_identical(maybe_jit, path):
    params, state0, new, opt_state = run(make_tx(max_replays=1), path, BIG, maybe_jit)
    assert_bit_identical(bits(params), new)
    assert_bit_identical(bits(state0.inner_state), opt_state.inner_state)
    # 256 -> 128 for the replay, which overflows too; the skip backs off once more.
    assert counters(opt_state) == {"loss_scale": 64.0, "growth_tracker": 0,
                                   "skipped_steps": 1, "replays": 1, "last_step_replays": 1,
                                   "nonfinite_loss_steps": 0}
    # min_scale: the scale cannot go lower, so there is nothing to replay.
    params, _, new, opt_state = run(make_tx(min_scale=256.0), path, BIG, maybe_jit)
    assert_bit_identical(bits(params), new)
    assert counters(opt_state)["replays"] == 0 and counters(opt_state)["skipped_steps"] == 1


@pytest.mark.parametrize("with_loss", [True, False], ids=["loss", "no_loss"])
@pytest.mark.parametrize("nonfinite_loss", ["backoff", "skip"])
def test_a_nonfinite_loss_is_still_skipped(with_loss, nonfinite_loss):
    maybe_jit, path = jax.jit, "fused"
    scaler = ls.DynamicLossScale(init_scale=256.0)
    tx = ls.with_loss_scaling(optax.sgd(0.1), scaler, max_replays=3,
                              nonfinite_loss=nonfinite_loss)
    params, _, new, opt_state = run(tx, path, jnp.array([NAN, 1.0, 1.0]), maybe_jit, with_loss)
    assert_bit_identical(bits(params), new)
    c = counters(opt_state)
    # With loss= the first pass shows it: no replay. Without, one replay finds the loss
    # non-finite, and the step is treated as a non-finite loss= is (one backoff or none).
    assert c["replays"] == (0 if with_loss else 1) and c["skipped_steps"] == 1
    assert c["nonfinite_loss_steps"] == 1
    assert c["loss_scale"] == (128.0 if nonfinite_loss == "backoff" else 256.0)


@pytest.mark.parametrize("scaler", [ls.StaticLossScale(256.0), ls.NoOpLossScale()],
                         ids=["static", "noop"])
def test_static_and_noop_scales_do_not_replay_and_need_no_value_fn(scaler):
    tx = ls.with_loss_scaling(optax.sgd(0.1), scaler, max_replays=2)
    params = {"w": jnp.ones(3)}
    opt_state = tx.init(params)
    grads = {"w": jnp.array([jnp.inf, 0.0, 0.0])}
    new, opt_state = jax.jit(functools.partial(ls.apply_gradients, tx))(grads, opt_state, params)
    assert_bit_identical(bits(params), new)
    assert counters(opt_state)["replays"] == 0


def test_bad_max_replays_and_a_missing_value_fn_are_clear_errors():
    for bad in (-1, 65, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"max_replays must be an integer.*Pass 0"):
            ls.with_loss_scaling(optax.sgd(0.1), max_replays=bad)
    tx = make_tx()
    params = {"w": jnp.ones(3)}
    with pytest.raises(ValueError, match=r"max_replays=3\).*value_fn=lambda params"):
        jax.jit(functools.partial(ls.apply_gradients, tx))({"w": jnp.ones(3)}, tx.init(params),
                                                           params)
    with pytest.raises(TypeError, match="value_fn must return the scalar loss"):
        ls.apply_gradients(tx, {"w": jnp.ones(3)}, tx.init(params), params,
                           value_fn=lambda p: p["w"])


def test_a_replaying_wrapper_compiles_once_and_retraces_nothing():
    tx = make_tx()
    step = jax.jit(make_step(tx, "fused"))
    params = {"w": jnp.array([0.5, -1.0, 2.0])}
    opt_state = tx.init(params)
    for x in (BIG, SMALL, BIG):
        params, opt_state = step(params, opt_state, x)
    assert step._cache_size() == 1
    assert counters(opt_state)["replays"] == 2 + 0 + 0  # the scale stayed at 64: no overflow


# -------------------------------------------- inner optimizers that take value_fn themselves


def test_lbfgs_inside_a_replaying_wrapper_gets_value_fn_and_the_replayed_grad():
    tx = make_tx(inner=optax.lbfgs())
    params = {"w": jnp.array([0.5, -1.0, 2.0])}

    def objective(p, x):  # bounded below: a quadratic plus the float16 product
        return loss_fn(p, x) + jnp.sum(p["w"] ** 2)

    @jax.jit
    def step(params, opt_state, x):
        value, grads = ls.value_and_grad(objective)(opt_state, params, x)
        return ls.apply_gradients(tx, grads, opt_state, params, value=value, grad=grads,
                                  value_fn=lambda p: objective(p, x))

    opt_state = tx.init(params)
    start = float(objective(params, BIG))
    for _ in range(3):
        params, opt_state = step(params, opt_state, BIG)
    assert counters(opt_state)["replays"] == 2 and counters(opt_state)["skipped_steps"] == 0
    assert float(objective(params, BIG)) < start


def test_sam_inside_a_replaying_wrapper_is_not_given_value_fn():
    inner = optax.contrib.sam(optax.sgd(0.1), optax.sgd(0.05), sync_period=2)
    tx = make_tx(inner=inner)
    _, _, params, opt_state = run(tx, "fused", BIG, jax.jit)
    assert counters(opt_state)["replays"] == 2 and counters(opt_state)["skipped_steps"] == 0


@pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit], ids=["eager", "jit"])
def test_sam_inside_a_chain_inside_a_replaying_wrapper_is_not_given_value_fn(maybe_jit):
    """Issue 33, item 6: the chain takes any keyword and hands value_fn to sam, which
    refuses it (a TypeError); the wrapper calls the chain again without it."""
    inner = optax.chain(optax.clip_by_global_norm(1.0),
                        optax.contrib.sam(optax.sgd(0.1), optax.sgd(0.05), sync_period=2))
    _, _, params, opt_state = run(make_tx(inner=inner), "fused", BIG, maybe_jit)
    assert counters(opt_state)["replays"] == 2 and counters(opt_state)["skipped_steps"] == 0
    ref_tx = make_tx(init_scale=64.0, max_replays=0, inner=inner)
    ref_params = {"w": jnp.array([0.5, -1.0, 2.0])}

    def ref_step(params, opt_state):  # no value_fn: sam refuses one given by the user
        grads = ls.value_and_grad(loss_fn)(opt_state, params, BIG)[1]
        return ls.apply_gradients(ref_tx, grads, opt_state, params)
    ref, _ = maybe_jit(ref_step)(ref_params, ref_tx.init(ref_params))
    assert_bit_identical(bits(ref), params)
    # A TypeError of the inner update that is not about value_fn is not swallowed.
    def refuse(updates, state, params=None, **extra):
        raise TypeError("something else")
    broken = optax.GradientTransformationExtraArgs(lambda p: (), refuse)
    with pytest.raises(TypeError, match="something else"):
        run(make_tx(inner=broken), "fused", SMALL, maybe_jit)


@EAGER_OR_JIT
@pytest.mark.parametrize("path", ["plain", "fused"])
def test_lookahead_inside_a_replaying_wrapper_replays_on_the_fast_params(maybe_jit, path):
    """Issue 33, item 5: value_fn is a function of the fast params, as the gradients are;
    the replayed step equals the step at the backed-off scale."""
    def run_lookahead(init_scale, max_replays):
        tx = make_tx(init_scale, max_replays, optax.lookahead(optax.sgd(0.1), 2, 0.5))
        params = optax.LookaheadParams.init_synced({"w": jnp.array([0.5, -1.0, 2.0])})
        opt_state = tx.init(params)

        def step(params, opt_state):
            loss, grads = ls.value_and_grad(loss_fn)(opt_state, params.fast, BIG)
            extra = dict(loss=loss, value_fn=lambda p: loss_fn(p, BIG))
            if path == "plain":
                updates, opt_state = tx.update(grads, opt_state, params, **extra)
                return optax.apply_updates(params, updates), opt_state
            return ls.apply_gradients(tx, grads, opt_state, params, **extra)
        return maybe_jit(step)(params, opt_state)

    params, opt_state = run_lookahead(256.0, 3)
    assert counters(opt_state)["replays"] == 2 and counters(opt_state)["skipped_steps"] == 0
    ref_params, ref_state = run_lookahead(64.0, 0)
    assert_bit_identical(bits(ref_params), params)
    assert_bit_identical(bits(ref_state.inner_state), opt_state.inner_state)


@EAGER_OR_JIT
def test_replay_without_params_is_a_clear_error(maybe_jit):
    """Issue 33, item 7: not "'NoneType' object is not subscriptable" from the loss."""
    tx = make_tx()
    params = {"w": jnp.array([0.5, -1.0, 2.0])}
    grads = {"w": jnp.full(3, jnp.inf)}
    with pytest.raises(ValueError, match=r"max_replays=3\).*got params=None: pass them, "
                                         r"`tx.update\(grads, opt_state, params"):
        maybe_jit(lambda g, s: tx.update(g, s, value_fn=lambda p: loss_fn(p, BIG)))(
            grads, tx.init(params))


@EAGER_OR_JIT
def test_a_replayed_step_stays_at_the_backed_off_scale_with_growth_interval_1(maybe_jit):
    """Issue 33, item 8 (docs/replay.md, Semantics 3): the growth due on the replayed step
    is not taken; the next clean step grows, so the batch replays every other step."""
    scaler = ls.DynamicLossScale(init_scale=256.0, growth_interval=1)
    tx = ls.with_loss_scaling(optax.sgd(0.0), scaler, max_replays=3)
    step = maybe_jit(make_step(tx, "fused"))
    params = {"w": jnp.array([0.5, -1.0, 2.0])}
    opt_state = tx.init(params)
    seen = []
    for _ in range(4):
        params, opt_state = step(params, opt_state, BIG)
        c = counters(opt_state)
        seen.append((c["loss_scale"], c["growth_tracker"], c["last_step_replays"]))
    assert seen == [(64.0, 0, 2), (128.0, 0, 0), (64.0, 0, 1), (128.0, 0, 0)]
    # growth_interval=100: the replayed step counts as clean (growth_tracker 1).
    _, _, _, opt_state = run(make_tx(), "fused", BIG, maybe_jit)
    assert counters(opt_state)["growth_tracker"] == 1


# ----------------------------------------------------------------------------------- nnx


class Net(nnx.Module):
    """BatchNorm and Dropout in float32, then the float16 product that overflows."""

    def __init__(self, rngs):
        self.bn = nnx.BatchNorm(3, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.w = nnx.Param(jnp.array([0.5, -1.0, 2.0]))

    def __call__(self, x):
        h = self.dropout(self.bn(x)) + x
        return jnp.sum(self.w[...].astype(jnp.float16) * h.astype(jnp.float16))


def nnx_loss(model, x):
    return nnx_float32(model(x))


def nnx_float32(y):
    return y.astype(jnp.float32)


def nnx_setup(init_scale, max_replays):
    model = Net(nnx.Rngs(0, dropout=1))
    optimizer = ls.nnx.Optimizer(model, make_tx(init_scale, max_replays, optax.sgd(0.1)),
                                 wrt=nnx.Param)
    return model, optimizer


@nnx.jit
def nnx_step(model, optimizer, x):
    loss, grads = ls.value_and_grad(nnx_loss)(optimizer, model, x)
    optimizer.update(model, grads, value_fn=lambda m: nnx_loss(m, x), loss=loss)


def nnx_other(model):
    """The bits of everything but the params (key arrays as their data)."""
    state = nnx.as_pure(nnx.state(model, nnx.Not(nnx.Param)))
    return bits(jax.tree.map(lambda v: jax.random.key_data(v) if jnp.issubdtype(
        v.dtype, jax.dtypes.prng_key) else v, state))


def test_nnx_replay_runs_on_a_copy_with_the_rng_state_after_the_first_pass():
    x = jnp.array([[1000.0, 2.0, 3.0], [900.0, 1.0, 2.0]])
    model, optimizer = nnx_setup(256.0, 6)
    nnx_step(model, optimizer, x)
    c = counters(optimizer)
    assert c["replays"] >= 1 and c["skipped_steps"] == 0 and c["loss_scale"] < 256.0
    # Reference: one first pass (BatchNorm statistics and RNG counts advance once), then
    # the gradient at the final scale from the model as that pass left it: the replay's
    # dropout mask is the next one of the stream; its own state updates are discarded.
    ref, ref_opt = nnx_setup(c["loss_scale"], 0)
    ls.value_and_grad(nnx_loss)(ref_opt, ref, x)             # the first pass
    after_first_pass = nnx_other(ref)
    _, grads = ls.value_and_grad(nnx_loss)(ref_opt, ref, x)  # the replay's pass
    # The model holds the first pass's statistics and RNG counts, not the replay's.
    assert all(np.array_equal(a, b)
               for a, b in zip(after_first_pass, nnx_other(model), strict=True))
    want = jax.tree.map(lambda p, g: p - 0.1 * g / c["loss_scale"],
                        nnx.as_pure(nnx.state(ref, nnx.Param)), nnx.as_pure(grads))
    assert_trees_close_in_ulps(nnx.as_pure(nnx.state(model, nnx.Param)), want, max_ulps=2)


# ------------------------------------------------------------------------------- Equinox


class EqxNet(eqx.Module):
    w: jax.Array

    def __call__(self, x, key):
        h = eqx.nn.Dropout(0.5)(x, key=key) + x
        return jnp.sum(self.w.astype(jnp.float16) * h.astype(jnp.float16)).astype(jnp.float32)


@EAGER_OR_JIT
def test_equinox_replay_with_the_same_key_equals_the_step_at_the_backed_off_scale(maybe_jit):
    key = jax.random.key(3)

    def train(init_scale, max_replays):
        model = EqxNet(jnp.array([0.5, -1.0, 2.0]))
        tx = make_tx(init_scale, max_replays, optax.sgd(0.1))
        opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))

        def step(model, opt_state):
            loss_of = lambda m: m(BIG, key)  # noqa: E731
            loss, grads = ls.value_and_grad(loss_of)(opt_state, model)
            return ls.equinox.apply_gradients(tx, grads, opt_state, model, loss=loss,
                                              value_fn=loss_of)
        return maybe_jit(step)(model, opt_state)

    model, opt_state = train(256.0, 6)
    c = counters(opt_state)
    assert c["replays"] >= 1 and c["skipped_steps"] == 0
    ref_model, _ = train(c["loss_scale"], 0)
    assert_bit_identical(bits(ref_model), model)   # the key is explicit: the same mask
