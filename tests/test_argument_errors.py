"""Arguments at their edges: a wrong value or an argument in the wrong place gets an
error that names the argument, the value and the fix, eagerly and under ``jit``.
"""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import loss_scaling as ls

EAGER_OR_JIT = pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit],
                                       ids=["eager", "jit"])


# ---------------------------------------------------- item 11: underflow_diagnostics


@pytest.mark.parametrize("value", ["false", "False", 0, 1, None, np.array([True])])
def test_underflow_diagnostics_must_be_a_bool(value):
    with pytest.raises(ValueError, match=r"underflow_diagnostics must be True or False, got "
                                         r".* of type .*Pass True to record"):
        ls.with_loss_scaling(optax.sgd(0.1), underflow_diagnostics=value)


@pytest.mark.parametrize("value", [False, True, np.bool_(True)])
def test_underflow_diagnostics_takes_bools(value):
    tx = ls.with_loss_scaling(optax.sgd(0.1), underflow_diagnostics=value)
    metrics = ls.metrics(tx.init({"w": jnp.ones(2)}))
    assert ("zero_grad_fraction" in metrics) == bool(value)


# -------------------------------------- item 12: has_aux given to the returned function


def loss_with_aux(params, x):
    loss = jnp.sum(params["w"] * x)
    return loss, {"loss": loss}


@EAGER_OR_JIT
@pytest.mark.parametrize(("option", "value"), [("has_aux", True), ("argnums", 1)])
def test_value_and_grad_options_given_to_the_returned_function(maybe_jit, option, value):
    tx = ls.with_loss_scaling(optax.sgd(0.1))
    params = {"w": jnp.ones(2)}
    opt_state = tx.init(params)
    with pytest.raises(TypeError, match=rf"{option}={value} was given to the function that "
                                        r"`loss_scaling.value_and_grad` returned.*"
                                        rf"`ls.value_and_grad\(loss_with_aux, {option}="
                                        rf"{value}\)\(state, \*args\)`"):
        maybe_jit(lambda s, p: ls.value_and_grad(loss_with_aux)(
            s, p, jnp.ones(2), **{option: value}))(opt_state, params)
    # Where it belongs, it works; a loss function that takes such a keyword gets it.
    (loss, aux), _ = maybe_jit(lambda s, p: ls.value_and_grad(loss_with_aux, has_aux=True)(
        s, p, jnp.ones(2)))(opt_state, params)
    assert float(loss) == float(aux["loss"]) == 2.0

    def takes_it(params, has_aux):
        return jnp.sum(params["w"]) * (2.0 if has_aux else 1.0)
    loss, _ = ls.value_and_grad(takes_it)(opt_state, params, has_aux=True)
    assert float(loss) == 4.0


def test_has_aux_given_to_the_returned_function_on_nnx():
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = ls.nnx.Optimizer(model, ls.with_loss_scaling(optax.sgd(0.1)), wrt=nnx.Param)

    def loss_fn(model, x):
        return jnp.mean(model(x)), None
    with pytest.raises(TypeError, match=r"`ls.value_and_grad\(loss_fn, has_aux=True\)"):
        ls.value_and_grad(loss_fn)(optimizer, model, jnp.ones((1, 2)), has_aux=True)


# ------------------------------------- item 14: a transformation or a model, not a state


def transformation_and_models():
    return [
        (ls.with_loss_scaling(optax.adam(1e-3)), r"this is an optax .*Transformation.*, the "
         r"optimizer itself, not its state.*pass the state `tx.init\(params\)` returned"),
        (nnx.Linear(2, 2, rngs=nnx.Rngs(0)), r"this is a model \(an instance of flax.nnx"
         r".*Linear\), not an optimizer.*pass the optimizer"),
        (eqx.nn.Linear(2, 2, key=jax.random.key(0)), r"a model \(an instance of equinox"),
        (nn.Dense(3), r"a model \(an instance of flax.linen.*Dense\)"),
    ]


@pytest.mark.parametrize("function", [ls.get_loss_scale, ls.metrics, ls.check])
@pytest.mark.parametrize("index", range(4), ids=["tx", "nnx", "equinox", "linen"])
def test_a_transformation_or_a_model_is_named_with_what_to_pass(function, index):
    wrong, match = transformation_and_models()[index]
    with pytest.raises(ValueError, match=match):
        function(wrong)


def test_other_states_without_a_loss_scale_keep_the_general_message():
    with pytest.raises(ValueError, match="No loss scale found in this optimizer "
                                                  "state: build the optimizer with"):
        ls.get_loss_scale(optax.adam(1e-3).init({"w": jnp.ones(2)}))


# ----------------------------------------------------- item 15: a number as the scaler


@EAGER_OR_JIT
@pytest.mark.parametrize("number", [32768.0, 1024, np.float32(8.0)])
def test_a_number_as_the_scaler_is_named_by_its_value(maybe_jit, number):
    shown = repr(np.asarray(number).item())
    for function in (ls.scale, ls.unscale):
        with pytest.raises(TypeError, match=rf"state must be a loss-scale state .*got the "
                                            rf"number {shown} \(an object of type .*\).*"
                                            rf"`ls.StaticLossScale\({shown}\)`"):
            maybe_jit(lambda x, f=function: f(number, x))(jnp.float32(2.0))
    assert float(ls.scale(ls.StaticLossScale(float(number)), jnp.float32(2.0))) == \
        2.0 * float(number)
