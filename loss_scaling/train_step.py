"""Train-step helpers: gradients of the scaled loss, and a fused flax TrainState."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from flax.training import train_state

from loss_scaling import tree
from loss_scaling.lookup import get_loss_scale, refuse_wrapper_inside_multisteps
from loss_scaling.transform import SCALER_TYPES, apply_gradients

__all__ = ["TrainState", "value_and_grad"]

WRONG_FIRST_ARGUMENT = (
    "The function returned by `loss_scaling.value_and_grad(loss_fn)` takes the loss scale "
    "first, then loss_fn's arguments: `ls.value_and_grad(loss_fn)(optimizer, model, *args)` "
    "for flax nnx (the nnx.Optimizer or ls.nnx.Optimizer built with "
    "`ls.with_loss_scaling(...)`), `(state, state.params, *args)` for a TrainState, "
    "`(opt_state, params, *args)` for optax, or a loss-scale state first. Got {what} as the "
    "first argument{hint}."
)


def describe(x: Any) -> str:
    """``x``'s type, for error messages."""
    return f"an object of type {type(x).__module__}.{type(x).__qualname__}"


AUX_NOT_A_PAIR = (
    "`value_and_grad({name}, has_aux=True)`: with has_aux=True the function must return "
    "a pair `(loss, aux)`, but {name} returned {what}. Return `loss, aux`, or pass "
    "has_aux=False if it returns the loss only."
)
PAIR_WITHOUT_AUX = (
    "`value_and_grad({name}, has_aux=False)`: with has_aux=False the function must return "
    "the scalar loss only, but {name} returned {what}. If it returns `(loss, aux)`, pass "
    "has_aux=True."
)


def _describe_output(out: Any) -> str:
    """What a loss function returned, without its (possibly traced) values."""
    if isinstance(out, (tuple, list)):
        parts = ", ".join(_describe_output(x) for x in out[:4])
        more = ", ..." if len(out) > 4 else ""
        return f"a {type(out).__name__} of {len(out)} elements ({parts}{more})"
    if hasattr(out, "shape") and hasattr(out, "dtype"):
        return f"an array of shape {tuple(out.shape)} and dtype {out.dtype}"
    if isinstance(out, dict):
        return f"a dict with keys {sorted(map(str, out))[:6]}"
    return describe(out)


def split_loss_and_aux(fun: Callable[..., Any], out: Any, has_aux: bool) -> tuple[Any, Any]:
    """``(loss, aux)`` from ``fun``'s output, or an error naming ``has_aux`` and the output.

    Checked before the loss is scaled, so that no message shows scaled values (the
    output of a function with ``has_aux=False`` that returns ``(loss, aux)`` would
    otherwise be scaled as a whole, aux included).
    """
    name = getattr(fun, "__name__", None) or "loss_fn"
    if name == "<lambda>":
        name = "loss_fn"
    if has_aux:
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError(AUX_NOT_A_PAIR.format(name=name, what=_describe_output(out)))
        return out[0], out[1]
    if isinstance(out, (tuple, list, dict)):
        raise TypeError(PAIR_WITHOUT_AUX.format(name=name, what=_describe_output(out)))
    return out, None


def scaler_of_state(state: Any) -> Any:
    """The loss scale that ``state`` holds, or an error saying what the first argument is."""
    if isinstance(state, SCALER_TYPES):
        return state
    if isinstance(state, jax.Array):
        raise TypeError(WRONG_FIRST_ARGUMENT.format(
            what=describe(state), hint=" (an array: did you forget the loss scale?)"))
    try:
        return get_loss_scale(state)
    except ValueError as e:
        if not str(e).startswith("No loss scale found"):
            raise  # several loss scales: that message already says what to do
        raise ValueError(WRONG_FIRST_ARGUMENT.format(
            what=describe(state), hint=f", which holds no loss scale ({e})")) from None


def _framework(state: Any, args: tuple[Any, ...], kwargs: Any,
               argnums: int | tuple[int, ...]) -> str | None:
    """``"nnx"`` or ``"equinox"`` when the arguments hold that framework's modules.

    Looks only at frameworks already imported: a module of one cannot exist otherwise.
    """
    if "flax.nnx" in sys.modules:
        from loss_scaling import nnx as ls_nnx

        if ls_nnx.contains_graph_nodes((state, args, kwargs)):
            return "nnx"
    if "equinox" in sys.modules:
        from loss_scaling import equinox as ls_eqx

        nums = (argnums,) if isinstance(argnums, int) else argnums
        if ls_eqx.contains_modules([args[i] for i in nums if i < len(args)]):
            return "equinox"
    return None


def value_and_grad(
    fun: Callable[..., Any],
    argnums: int | tuple[int, ...] = 0,
    has_aux: bool = False,
) -> Callable[..., Any]:
    """Like ``jax.value_and_grad``, differentiating the scaled loss.

    The returned function takes the loss scale first: a loss-scale state or any state
    :func:`get_loss_scale` accepts (an opt_state, a TrainState, an nnx Optimizer), then
    ``fun``'s arguments. It returns the *unscaled* loss (and aux) with the *scaled*
    gradients, ready for ``tx.update`` / :func:`apply_gradients`. Pass the loss on
    (``loss=loss``) so that a non-finite loss is told apart from an overflow.

    Framework modules get their framework's semantics: when an argument is a flax
    ``nnx`` Module, this is :func:`loss_scaling.nnx.value_and_grad` (``nnx.value_and_grad``:
    only the optimizer's ``wrt`` variables are differentiated; RNG streams, BatchNorm
    statistics and other variables are updated in place); when a differentiated argument
    is an ``equinox.Module``, :func:`loss_scaling.equinox.filter_value_and_grad`
    (``eqx.filter_value_and_grad``: the floating-point arrays are differentiated, other
    leaves get ``None``). Plain pytrees get ``jax.value_and_grad``.

    Args:
      fun: the loss function; returns a scalar loss (or ``(loss, aux)``).
      argnums: as in ``jax.value_and_grad``, counted over ``fun``'s arguments.
      has_aux: as in ``jax.value_and_grad``.

    Returns:
      ``f(state, *args, **kwargs) -> (loss, grads)`` or ``((loss, aux), grads)``.

    Raises:
      TypeError / ValueError: at call time, when the first argument is not (and does not
        hold) a loss scale: e.g. the model passed first, or the optimizer forgotten.
      TypeError: when ``fun``'s output does not match ``has_aux`` (a bare loss with
        ``has_aux=True``, a tuple or list with ``has_aux=False``), naming both.

    Examples:
      >>> import jax.numpy as jnp
      >>> import loss_scaling as ls
      >>> grad_fn = ls.value_and_grad(lambda w: jnp.sum(w ** 2))
      >>> loss, grads = grad_fn(ls.StaticLossScale(8.0), jnp.array([1.0, 2.0]))
      >>> loss, grads
      (Array(5., dtype=float32), Array([16., 32.], dtype=float32))
    """

    def wrapped(state: Any, *args: Any, **kwargs: Any) -> Any:
        framework = _framework(state, args, kwargs, argnums)
        if framework == "nnx":
            from loss_scaling import nnx as ls_nnx

            return ls_nnx.value_and_grad(fun, argnums, has_aux)(state, *args, **kwargs)
        if framework == "equinox":
            from loss_scaling import equinox as ls_eqx

            return ls_eqx.filter_value_and_grad(fun, argnums, has_aux)(state, *args, **kwargs)
        scaler = scaler_of_state(state)

        def scaled(*args: Any, **kwargs: Any) -> Any:
            loss, aux = split_loss_and_aux(fun, fun(*args, **kwargs), has_aux)
            return tree.scale(scaler, loss), (loss, aux)

        (_, (loss, aux)), grads = jax.value_and_grad(scaled, argnums, has_aux=True)(
            *args, **kwargs)
        return ((loss, aux), grads) if has_aux else (loss, grads)

    return wrapped


class TrainState(train_state.TrainState):
    """``flax.training.train_state.TrainState`` with the fused loss-scaled step.

    Build it with ``tx=with_loss_scaling(...)`` and pass the gradients of the *scaled*
    loss. ``apply_gradients`` runs the inner update and the parameter update under one
    skip decision (:func:`loss_scaling.apply_gradients`); ``step`` counts every call,
    skipped ones included (``loss_scaling.metrics(state)`` counts the skips).

    For ``nn.BatchNorm``, subclass it as flax's own examples subclass flax's TrainState
    (``class TrainState(ls.TrainState): batch_stats: Any``; docs/linen.md has the whole
    step): ``create(..., batch_stats=...)`` sets the field and ``apply_gradients(grads=...,
    batch_stats=...)`` stores the forward pass's new statistics. Like every field passed
    there, they are stored on a skipped step too, as in flax's dynamic-scale recipe: the
    forward pass is as valid as without loss scaling (an overflow is a property of the
    scaled backward pass); only ``params`` and ``opt_state`` stay bit-identical. (Not a
    field of this class: it would change the tree of every saved ``ls.TrainState``, and
    Orbax and ``flax.serialization`` would refuse the checkpoints saved without it.)

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import loss_scaling as ls
      >>> state = ls.TrainState.create(
      ...     apply_fn=None, params=jnp.array([1.0, 2.0]),
      ...     tx=ls.with_loss_scaling(optax.sgd(0.5), ls.StaticLossScale(4.0)))
      >>> grad_fn = ls.value_and_grad(lambda w: jnp.sum(w ** 2))
      >>> loss, grads = grad_fn(state, state.params)     # grads are scaled by 4
      >>> state = state.apply_gradients(grads=grads, loss=loss)
      >>> state.params, int(state.step)
      (Array([0., 0.], dtype=float32), 1)
    """

    def apply_gradients(self, *, grads: Any, loss: Any = None, **kwargs: Any) -> TrainState:
        """Applies the scaled ``grads``, skipping the step if they (or ``loss``) are not
        finite. Keyword arguments that name fields of the state replace them, as in flax;
        the others are the optimizer's extra arguments (``value=``, ``grad=``,
        ``value_fn=`` for ``optax.lbfgs`` and the line searches), forwarded to ``tx``.

        As flax's ``TrainState`` does, when the params hold flax's
        ``_overwrite_with_gradient`` collection (the amax histories and scales of the
        ``flax.linen.fp8_ops`` layers), the optimizer steps only ``params["params"]``:
        that collection's "gradients" are its new values, assigned as they are (neither
        unscaled nor checked), on skipped steps too.
        """
        fields = {f.name for f in dataclasses.fields(self)}
        replace = {k: v for k, v in kwargs.items() if k in fields}
        extra = {k: v for k, v in kwargs.items() if k not in fields}
        if loss is not None:
            extra["loss"] = loss
        overwrite = _has_overwrite(grads)
        grads_with_opt = grads["params"] if overwrite else grads
        params_with_opt = self.params["params"] if overwrite else self.params
        new_params, opt_state = apply_gradients(self.tx, grads_with_opt, self.opt_state,
                                                params_with_opt, **extra)
        if overwrite:
            new_params = {"params": new_params,
                          OVERWRITE_WITH_GRADIENT: grads[OVERWRITE_WITH_GRADIENT]}
        return self.replace(step=self.step + 1, params=new_params, opt_state=opt_state,
                            **replace)

    @classmethod
    def create(cls, *, apply_fn: Any, params: Any, tx: Any, **kwargs: Any) -> TrainState:
        """As flax's ``create`` (``tx`` initialised on ``params["params"]`` when the params
        hold the ``_overwrite_with_gradient`` collection); refuses the wrapper inside
        ``optax.MultiSteps``."""
        state = super().create(apply_fn=apply_fn, params=params, tx=tx, **kwargs)
        refuse_wrapper_inside_multisteps(state.opt_state)
        return state


def _has_overwrite(tree: Any) -> bool:
    return isinstance(tree, Mapping) and OVERWRITE_WITH_GRADIENT in tree
