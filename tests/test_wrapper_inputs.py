"""What the wrapper accepts: inner states, extra arguments, dtypes.

Each test here is the regression test of one defect a user reached: a Python scalar in
the inner state, an eager skip that raised, ``loss=`` forwarded to optimizers that refuse
it, complex underflow fractions, dtypes without a zero, subnormal params, the wrapper
inside ``MultiSteps``, bfloat16 params, the gradient norm and flax's fp8 layers.
"""

from __future__ import annotations

import copy
import functools
import pickle

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from bitwise import assert_bit_identical, bits
from step_paths import EAGER_OR_DONATING_JIT, PATHS, step_by

import loss_scaling as ls

# Gradient and params trees in every float dtype on purpose: bfloat16 params warn at init
# (tested in test_diagnostics.py).
pytestmark = pytest.mark.filterwarnings(
    r"ignore:with_loss_scaling. the params .* are b?float16:UserWarning")

NAN, INF = float("nan"), float("inf")

# ------------------------------------------------------- 1. a Python scalar in the state


def python_scalar_state_sgd():
    """As optax's conditionality tests build it: an inner state holding a Python int."""
    return optax.GradientTransformationExtraArgs(
        lambda params: {"foo": 1},
        lambda updates, state, params=None, **extra: (jax.tree.map(jnp.negative, updates),
                                                       state))


@EAGER_OR_DONATING_JIT
@PATHS
@pytest.mark.parametrize("skip", ["cond", "select"])
def test_an_inner_state_holding_a_python_scalar_is_accepted(maybe_jit, path, skip):
    tx = ls.with_loss_scaling(python_scalar_state_sgd(), ls.StaticLossScale(4.0), skip=skip)
    params = jnp.array([1.0, 2.0])
    opt_state = tx.init(params)
    step = maybe_jit(step_by(tx, path))
    params, opt_state = step(jnp.array([4.0, 8.0]), opt_state, params)      # applied
    np.testing.assert_array_equal(params, [0.0, 0.0])
    before = bits(params)
    params, opt_state = step(jnp.array([NAN, 8.0]), opt_state, params)      # skipped
    assert_bit_identical(before, params)
    assert int(opt_state.inner_state["foo"]) == 1
    assert int(ls.metrics(opt_state)["skipped_steps"]) == 1


# ------------------------------------------- 2. an eager skip on a NaN loss never raises


@PATHS
@pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit], ids=["eager", "jit"])
def test_skip_mode_on_a_nan_loss_at_the_floor_never_fails_eager_or_jit(maybe_jit, path):
    """A backoff from 2**-126 would leave the float32 range; ``nonfinite_loss="skip"``
    discards that backoff on a NaN loss, so the step neither fails nor moves the scale."""
    tx = ls.with_loss_scaling(optax.sgd(1.0), ls.DynamicLossScale(init_scale=2.0**-126),
                              nonfinite_loss="skip")
    params = jnp.array([1.0, 2.0])
    opt_state = tx.init(params)
    step = maybe_jit(step_by(tx, path))
    params, opt_state = step(jnp.array([NAN, NAN]), opt_state, params, loss=jnp.float32(NAN))
    np.testing.assert_array_equal(params, [1.0, 2.0])
    ls.check(opt_state)
    assert float(ls.get_loss_scale(opt_state).loss_scale) == 2.0**-126
    # A finite loss with overflowing gradients is an overflow: the backoff fails (eagerly:
    # at once; under jit: recorded).
    if maybe_jit is jax.jit:
        _, opt_state = step(jnp.array([NAN, NAN]), opt_state, params, loss=jnp.float32(1.0))
        with pytest.raises(ls.LossScaleError, match="backoff"):
            ls.check(opt_state)
    else:
        with pytest.raises(ls.LossScaleError, match="backoff"):
            step(jnp.array([NAN, NAN]), opt_state, params, loss=jnp.float32(1.0))


# ------------------------------------------------- 7. complex leaves in the underflow stats


def test_complex_underflow_fractions_count_an_entry_zero_only_when_both_parts_are():
    """``0 + 1j`` is not zero; ``1e-6j`` is small (its modulus is below float16's tiny)."""
    tx = ls.with_loss_scaling(optax.sgd(0.1), ls.StaticLossScale(1.0), underflow_diagnostics=True)
    params = {"z": jnp.zeros(4, jnp.complex64)}
    opt_state = tx.init(params)
    grads = {"z": jnp.array([0.0, 1j, 1e-6j, 1e-6 + 1.0j], jnp.complex64)}
    _, opt_state = tx.update(grads, opt_state, params)
    m = ls.metrics(opt_state)
    zero, small = float(m["zero_grad_fraction"]), float(m["small_grad_fraction"])
    assert (zero, small) == (0.25, 0.25)
    assert 0.0 <= zero + small <= 1.0


# --------------------------------------- 8 / 14. every float dtype through a skipped step

# Every float dtype JAX has, and where a plain skipped step (optax.apply_updates: p + -0.0)
# flushes subnormal params on XLA CPU: the dtypes computed natively (float16, float8 and
# float4 compute in float32, where their subnormals are normal numbers). Measured; the
# docs (optax_wrapper.md, "A skipped step") say the same.
FLOAT_DTYPES = ["float64", "float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2",
                "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3b11fnuz", "float8_e3m4",
                "float8_e4m3", "float4_e2m1fn"]
CPU_FLUSHES_SUBNORMALS = {"float64", "float32", "bfloat16"}


def edge_values(dtype):
    fi = jnp.finfo(dtype)
    return np.array([1.0, -1.5, 0.0, -0.0, float(fi.tiny), float(fi.max), -float(fi.max),
                     float(fi.smallest_subnormal), -float(fi.smallest_subnormal)]).astype(dtype)


@pytest.mark.parametrize("path", ["plain", "fused"])
@pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit], ids=["eager", "jit"])
def test_a_skipped_step_keeps_every_float_dtype_bit_for_bit_but_where_xla_cpu_flushes(
        maybe_jit, path):
    with jax.enable_x64(True):
        params = {name: jnp.asarray(edge_values(getattr(jnp, name)))
                  for name in FLOAT_DTYPES if hasattr(jnp, name)}
        tx = ls.with_loss_scaling(optax.sgd(0.1))
        grads = jax.tree.map(lambda p: jnp.full(p.shape, NAN, p.dtype), params)
        new_params, opt_state = maybe_jit(step_by(tx, path))(grads, tx.init(params), params)
        assert not bool(opt_state.last_step_applied)
        flushes = path == "plain" and jax.default_backend() == "cpu"
        for name, before in params.items():
            after, want = np.asarray(new_params[name]), np.asarray(before)
            if flushes and name in CPU_FLUSHES_SUBNORMALS:  # to a zero of the same sign
                want = want.copy()
                want[-2:] = np.array([0.0, -0.0]).astype(want.dtype)
            np.testing.assert_array_equal(after.view(np.uint8), want.view(np.uint8),
                                          err_msg=name)


@pytest.mark.parametrize("trace", ["eager", "eval_shape"])
def test_params_in_a_dtype_without_zero_are_refused_at_init_naming_the_leaf(trace):
    """float8_e8m0fnu has no zero: a skipped plain step's -0.0 update was NaN in it."""
    tx = ls.with_loss_scaling(optax.sgd(0.1))
    params = {"w": jnp.ones(2), "mx": {"scale": jnp.ones(2, jnp.float8_e8m0fnu)}}
    init = tx.init if trace == "eager" else functools.partial(jax.eval_shape, tx.init)
    with pytest.raises(TypeError, match=r"'mx\.scale' is float8_e8m0fnu, a dtype without a "
                       r"zero.*float32"):
        init(params)


# ---------------------------------------- 15. the wrapper inside MultiSteps is refused


def test_the_wrapper_inside_multisteps_is_refused_wherever_the_state_is_seen():
    from flax import nnx

    tx = optax.MultiSteps(ls.with_loss_scaling(optax.sgd(1.0)), every_k_schedule=2)
    gt = tx.gradient_transformation()
    fix = r"ls\.with_loss_scaling\(optax\.MultiSteps\(inner, every_k_schedule=k\)\)"
    params = jnp.ones(2)
    opt_state = tx.init(params)
    for where in (ls.metrics, jax.jit(ls.metrics), ls.check):
        with pytest.raises(ValueError, match=r"inside `optax\.MultiSteps`.*" + fix):
            where(opt_state)
    nested = optax.chain(optax.identity(), gt).init(params)
    with pytest.raises(ValueError, match=r"at path '\[1\]'.*" + fix):
        ls.check(nested)
    with pytest.raises(ValueError, match=fix):
        ls.TrainState.create(apply_fn=None, params=params, tx=gt)
    with pytest.raises(ValueError, match=fix):
        ls.nnx.Optimizer(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), gt, wrt=nnx.Param)
    # The train step's own calls see the whole state too, eagerly and under jit.
    grad_fn = ls.value_and_grad(lambda w: jnp.sum(w ** 2))
    for maybe_jit in (lambda f: f, jax.jit):
        with pytest.raises(ValueError, match=fix):
            maybe_jit(grad_fn)(opt_state, params)
        with pytest.raises(ValueError, match=fix):
            maybe_jit(lambda g, s, p: ls.apply_gradients(tx, g, s, p))(params, opt_state, params)
    # The recommended order passes everywhere.
    good = ls.with_loss_scaling(optax.MultiSteps(optax.sgd(1.0), every_k_schedule=2))
    ls.check(ls.TrainState.create(apply_fn=None, params=params, tx=good))
    assert int(ls.metrics(good.init(params))["skipped_steps"]) == 0
    chained = optax.chain(good)  # a chain of the wrapper alone: nothing outside it
    state = chained.init(params)
    _, grads = grad_fn(state, params)
    _, state = ls.apply_gradients(chained, grads, state, params)
    assert int(ls.metrics(state)["skipped_steps"]) == 0


# ------------------------------ 4. loss= is the wrapper's: line searches, lbfgs and sam


def quadratic(params):
    return jnp.sum((params - jnp.array([1.0, -2.0])) ** 2)


LINE_SEARCH_INNERS = {
    "lbfgs": lambda: optax.lbfgs(),
    "backtracking": lambda: optax.chain(optax.sgd(1.0),
                                        optax.scale_by_backtracking_linesearch(10)),
    "sam": lambda: optax.contrib.sam(optax.sgd(0.1), optax.sgd(0.05), sync_period=2),
}


@pytest.mark.parametrize("inner", LINE_SEARCH_INNERS)
@pytest.mark.parametrize("with_loss", [True, False], ids=["loss", "no_loss"])
@PATHS
def test_line_searches_lbfgs_and_sam_run_inside_the_wrapper(inner, with_loss, path):
    tx = ls.with_loss_scaling(LINE_SEARCH_INNERS[inner](), ls.StaticLossScale(1024.0))
    params = jnp.zeros(2)
    opt_state = tx.init(params)
    step = step_by(tx, path)

    @functools.partial(jax.jit, static_argnames="nan_loss")
    def train_step(params, opt_state, nan_loss=False):
        loss, grads = ls.value_and_grad(quadratic)(opt_state, params)   # grads scaled
        extra = {} if inner == "sam" else {"value": loss, "grad": grads,
                                            "value_fn": quadratic}
        if with_loss:
            extra["loss"] = jnp.float32(NAN) if nan_loss else loss
        return step(grads, opt_state, params, **extra)

    start = float(quadratic(params))
    for _ in range(4):
        params, opt_state = train_step(params, opt_state)
    assert float(quadratic(params)) < 0.5 * start
    assert int(ls.metrics(opt_state)["skipped_steps"]) == 0
    if with_loss:  # a NaN loss still skips the step: the wrapper reads it
        before = bits(params)
        params, opt_state = train_step(params, opt_state, nan_loss=True)
        assert_bit_identical(before, params)
        assert int(ls.metrics(opt_state)["nonfinite_loss_steps"]) == 1


# --------------------------------------------------- 17. the gradient norm in ls.metrics


@PATHS
@pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit], ids=["eager", "jit"])
@pytest.mark.parametrize("scaler", [ls.DynamicLossScale(init_scale=2.0**10),
                                    ls.StaticLossScale(3.0), ls.NoOpLossScale()],
                         ids=["dynamic", "static", "noop"])
def test_metrics_grad_norm_is_the_unscaled_global_norm_and_nonfinite_on_a_skip(
        maybe_jit, path, scaler):
    tx = ls.with_loss_scaling(optax.sgd(0.1), scaler)
    true = {"a": jnp.array([3.0, 0.0], jnp.float16), "b": jnp.full((5000,), 0.01),
            "c": jnp.array([4.0 + 0.0j, 0.0 + 1.0j], jnp.complex64)}
    params = jax.tree.map(jnp.zeros_like, true)
    opt_state = tx.init(params)
    assert float(ls.metrics(opt_state)["grad_norm"]) == 0.0
    step = maybe_jit(step_by(tx, path))
    s = 1.0 if isinstance(scaler, ls.NoOpLossScale) else float(scaler.loss_scale)
    scaled = jax.tree.map(lambda g: (g * s).astype(g.dtype), true)
    params, opt_state = step(scaled, opt_state, params)
    norm = ls.metrics(opt_state)["grad_norm"]
    assert norm.dtype == jnp.float32 and norm.shape == ()
    want = float(optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.complex64), true)))
    np.testing.assert_allclose(float(norm), want, rtol=1e-5)  # float32 sums, any order
    scaled["b"] = scaled["b"].at[7].set(INF)
    params, opt_state = step(scaled, opt_state, params)
    assert not bool(opt_state.last_step_applied)
    assert float(ls.metrics(opt_state)["grad_norm"]) == np.inf
    scaled["b"] = scaled["b"].at[7].set(np.nan)  # a NaN reads inf as well
    params, opt_state = step(scaled, opt_state, params)
    assert float(ls.metrics(opt_state)["grad_norm"]) == np.inf


# ------------------------------------ 18. flax's fp8 layers and _overwrite_with_gradient


def test_ls_train_state_assigns_the_fp8_overwrite_collection_exactly_as_flax_does():
    import doc_blocks
    from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
    from flax.training import train_state

    ns = doc_blocks.namespace(doc_blocks.named("linen.md", "fp8"))
    state, x, y = ns["state"], ns["x"], ns["y"]
    assert int(state.step) == 3 and int(ls.metrics(state)["skipped_steps"]) == 0
    assert sorted(state.params) == [OVERWRITE_WITH_GRADIENT, "params"]
    # The optimizer holds the params only; the amax histories have moved (were assigned).
    assert jax.tree.structure(state.opt_state.inner_state[0].mu) == \
        jax.tree.structure(state.params["params"])
    history = state.params[OVERWRITE_WITH_GRADIENT]["Dense_0"]["Fp8DirectDotGeneralOp_0"]
    assert float(jnp.max(history["input_amax_history"])) > 0

    def loss_fn(variables, x):
        pred = state.apply_fn(variables, x.astype(jnp.float16))
        return jnp.mean((pred.astype(jnp.float32) - y) ** 2)

    flax_state = train_state.TrainState.create(apply_fn=state.apply_fn, params=state.params,
                                               tx=state.tx)
    flax_state = flax_state.replace(opt_state=state.opt_state)
    grad_fn = jax.jit(ls.value_and_grad(loss_fn))
    apply = jax.jit(lambda state, grads: state.apply_gradients(grads=grads))
    for i, batch in enumerate((x, 2 * x, x)):
        _, grads = grad_fn(state, state.params, batch)
        if i == 2:  # an overflow: skipped, and the collection still assigned
            grads["params"]["Dense_1"]["kernel"] *= jnp.inf
        new = apply(state, grads)
        reference = apply(flax_state, grads)   # flax's own TrainState, the plain path
        chex.assert_trees_all_equal(new.params[OVERWRITE_WITH_GRADIENT],
                                    reference.params[OVERWRITE_WITH_GRADIENT])
        chex.assert_trees_all_close(new.params["params"], reference.params["params"],
                                    rtol=1e-6)
        state, flax_state = new, reference.replace(opt_state=new.opt_state)
    assert int(ls.metrics(state)["skipped_steps"]) == 1


@PATHS
def test_a_jitted_step_traces_the_inner_update_once(path):
    """Compile time (issue 23): the plain step's skip takes its ``-0.0`` updates' types from
    the step branch; a second trace of the inner update (``jax.eval_shape``) doubled the
    tracing of a large optimizer."""
    traces = []
    adam = optax.adam(1e-3)

    def update(updates, state, params=None):
        traces.append(1)
        return adam.update(updates, state, params)

    tx = ls.with_loss_scaling(optax.GradientTransformation(adam.init, update))
    params = {"w": jnp.ones((3,)), "b": jnp.ones((2, 2))}
    opt_state = tx.init(params)
    step = jax.jit(step_by(tx, path))
    for grads in (params, jax.tree.map(lambda x: x * INF, params)):
        new_params, opt_state = step(grads, opt_state, params)
    assert len(traces) == 1
    chex.assert_trees_all_equal(new_params, params)  # the second step, skipped


# ------------------------------------ the wrong object where the wrapper's state belongs


@pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit], ids=["eager", "jit"])
def test_a_wrong_opt_state_is_a_type_error_naming_opt_state_and_the_fix(maybe_jit):
    from flax import nnx

    tx = ls.with_loss_scaling(optax.adam(1e-3))
    params = {"w": jnp.ones(3)}
    opt_state = tx.init(params)
    grads = {"w": jnp.ones(3)}
    fused = maybe_jit(lambda g, s, p: ls.apply_gradients(tx, g, s, p))
    plain = maybe_jit(lambda g, s, p: tx.update(g, s, p))
    head = r"opt_state must be the state that `tx.init\(params\)` returned.*got "
    scaler = ls.get_loss_scale(opt_state)
    for step, call in ((fused, r"ls\.apply_gradients"), (plain, r"tx\.update")):
        with pytest.raises(TypeError, match=call + r".*" + head + r".*DynamicLossScale\. "
                           r"That is the loss scale: pass the optimizer state"):
            step(grads, scaler, params)
        with pytest.raises(TypeError, match=head + r".*dict\. Are the arguments in order"):
            step(grads, params, opt_state)           # params and opt_state swapped
    chained = optax.chain(tx, optax.identity()).init(params)
    with pytest.raises(TypeError, match=head + r".*tuple\. It holds one at '\[0\]'"):
        fused(grads, chained, params)
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = ls.nnx.Optimizer(model, ls.with_loss_scaling(optax.sgd(0.1)), wrt=nnx.Param)
    with pytest.raises(TypeError, match=r"It holds one at '\.opt_state'.*"
                                        r"optimizer\.update\(model, grads\)"):
        ls.apply_gradients(optimizer.tx, grads, optimizer, model)
    # The inner optimizer as tx with the wrapper's state: named, not optax's chain error.
    with pytest.raises(TypeError, match=r"opt_state is a with_loss_scaling state, but tx "
                                        r"\(.*GradientTransformation.*\) is not the "
                                        r"transformation that made it"):
        ls.apply_gradients(optax.adam(1e-3), grads, opt_state, params)


@pytest.mark.parametrize("inner, match", [
    (ls.DynamicLossScale(), r"inner must be .* got .*DynamicLossScale\. That is a loss "
                            r"scale, which comes second: `ls\.with_loss_scaling\("
                            r"optax\.adam\(1e-3\), "),
    (optax.adam, r"inner must be .* got .*function\. That is a function: call it to "
                 r"build the optimizer, e\.g\. `optax\.adam\(1e-3\)`"),
    ({"lr": 1e-3}, r"inner must be an optax transformation .* got .*dict\.$"),
])
def test_with_loss_scaling_names_inner_when_it_is_not_an_optimizer(inner, match):
    with pytest.raises(TypeError, match=r"with_loss_scaling\(inner, scaler\): " + match):
        ls.with_loss_scaling(inner)


# ------------------------------- a migrating user's mistakes: errors that name the fix


@pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit], ids=["eager", "jit"])
def test_scaler_functions_given_an_optimizer_state_name_get_loss_scale(maybe_jit):
    opt_state = ls.with_loss_scaling(optax.adam(1e-3)).init({"w": jnp.ones(3)})
    calls = {
        "update": lambda s: ls.update(s, jnp.asarray(True)),
        "scale": lambda s: ls.scale(s, jnp.float32(1.0)),
        "unscale": lambda s: ls.unscale(s, jnp.ones(2)),
    }
    for name, call in calls.items():
        with pytest.raises(TypeError, match=r"^state must be a loss-scale state .* got an "
                           r"object of type loss_scaling\.wrapper\.state\.LossScalingState\. "
                           r".*`ls\.get_loss_scale\(opt_state\)` returns it\.") as info:
            maybe_jit(call)(opt_state)
        # The type, not the whole state (jit appends a note on a line of its own).
        assert len(str(info.value).splitlines()[0]) < 400, name
    with pytest.raises(TypeError, match=r"state must be a loss-scale state"):
        ls.state_dict(opt_state)
    with pytest.raises(TypeError, match=r"^scaler must be a loss-scale state .*builtins\.dict"):
        ls.with_loss_scaling(optax.sgd(1.0), {"loss_scale": 2.0})


def test_a_loss_scale_is_its_own_loss_scale_and_has_no_metrics():
    scaler = ls.DynamicLossScale(init_scale=8.0)
    assert ls.get_loss_scale(scaler) is scaler
    ls.check(scaler)
    with pytest.raises(TypeError, match=r"got a DynamicLossScale, a loss scale on its own.*"
                                        r"pass the optimizer state"):
        ls.metrics(scaler)


def test_check_inside_jit_says_it_is_host_side_and_what_to_use_instead():
    opt_state = ls.with_loss_scaling(optax.sgd(1.0)).init(jnp.ones(2))
    with pytest.raises(TypeError, match=r"cannot run inside jit.*ls\.metrics\(opt_state\)"
                                        r"\[\"failed\"\].*on_failure=\"raise\""):
        jax.jit(ls.check)(opt_state)
    ls.check(opt_state)  # on the host: fine


@pytest.mark.parametrize("scaler", [ls.NoOpLossScale(), ls.StaticLossScale(4.0),
                                    ls.DynamicLossScale()], ids=lambda s: type(s).__name__)
def test_gradscaler_methods_name_the_function_to_use(scaler):
    hints = {"scale": r"ls\.scale\(state, loss\)", "unscale_": r"unscales the gradients itself",
             "update": r"state = ls\.update\(state, grads_finite\)",
             "get_scale": r"state\.loss_scale", "state_dict": r"ls\.state_dict\(state\)",
             "load_state_dict": r"ls\.from_state_dict\(d\)", "step": r"ls\.apply_gradients"}
    for method, hint in hints.items():
        with pytest.raises(AttributeError, match=rf"no attribute '{method}': a loss-scale "
                                                 rf"state is an immutable pytree.*{hint}"):
            getattr(scaler, method)
    with pytest.raises(AttributeError, match=r"no attribute 'nothing_of_the_kind'$"):
        scaler.nothing_of_the_kind  # noqa: B018
    assert getattr(scaler, "nothing_of_the_kind", None) is None
    clone = pickle.loads(pickle.dumps(scaler))  # protocols still find what they look for
    assert repr(clone) == repr(scaler) and repr(copy.deepcopy(scaler)) == repr(scaler)
