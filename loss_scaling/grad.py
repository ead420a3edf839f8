"""Gradients of the scaled loss: :func:`value_and_grad`, dispatching to the integrations."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax

from loss_scaling import _registry
from loss_scaling._errors import NoLossScaleFound, show
from loss_scaling.core import tree
from loss_scaling.core.scalers import SCALER_TYPES
from loss_scaling.lookup import get_loss_scale, refuse_misplaced_wrapper
from loss_scaling.wrapper import provenance

__all__ = ["value_and_grad"]

WRONG_FIRST_ARGUMENT = (
    "The function returned by `loss_scaling.value_and_grad(loss_fn)` takes the loss scale "
    "first, then loss_fn's arguments: `ls.value_and_grad(loss_fn)(optimizer, model, *args)` "
    "for flax nnx, `(state, state.params, *args)` for a TrainState, `(opt_state, params, "
    "*args)` for optax, or a loss-scale state first. Got {what} as the first argument{hint}."
)


ARGNUMS_BEYOND_ARGS = (
    "argnums={argnums!r} names an argument of loss_fn beyond the {count} given after the "
    "loss scale: call `ls.value_and_grad(loss_fn)({holder}, model, *args)`."
)


def argnums_within(argnums: int | Sequence[int], args: tuple[Any, ...],
                   holder: str) -> tuple[int, ...]:
    """``argnums`` as a tuple, or a TypeError if one is beyond ``args``."""
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if any(i >= len(args) for i in nums):
        raise TypeError(ARGNUMS_BEYOND_ARGS.format(argnums=argnums, count=len(args),
                                                   holder=holder))
    return nums


AUX_NOT_A_PAIR = (
    "`value_and_grad({name}, has_aux=True)`: the function must return a pair `(loss, aux)`, "
    "but {name} returned {what}. Return `loss, aux`, or pass has_aux=False."
)
PAIR_WITHOUT_AUX = (
    "`value_and_grad({name}, has_aux=False)`: the function must return the scalar loss "
    "only, but {name} returned {what}. If it returns `(loss, aux)`, pass has_aux=True."
)

OPTION_TO_RETURNED_FUNCTION = (
    "{option}={value!r} was given to the function that `loss_scaling.value_and_grad` "
    "returned, which passes its keyword arguments on to {name}; {option} is an option of "
    "value_and_grad itself: `ls.value_and_grad({name}, {option}={value!r})(state, *args)`."
)


def _refuse_misplaced_options(fun: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    """``has_aux=`` / ``argnums=`` given to the returned function, which ``fun`` does not
    take: a TypeError naming where they go (else JAX's "keyword arguments could not be
    resolved to positions")."""
    for option in ("has_aux", "argnums"):
        if option not in kwargs:
            continue
        try:
            parameters = inspect.signature(fun).parameters
        except (TypeError, ValueError):
            return
        if option not in parameters:
            raise TypeError(OPTION_TO_RETURNED_FUNCTION.format(
                option=option, value=kwargs[option],
                name=getattr(fun, "__name__", "loss_fn")))


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
    return show(out, type_only=True)


def split_loss_and_aux(fun: Callable[..., Any], out: Any, has_aux: bool) -> tuple[Any, Any]:
    """``(loss, aux)`` from ``fun``'s output, or an error naming ``has_aux`` and the output.

    Checked before the loss is scaled, so that no message shows scaled values (the
    output of a function with ``has_aux=False`` that returns ``(loss, aux)`` would
    otherwise be scaled as a whole, aux included).
    """
    name = getattr(fun, "__name__", None)
    name = name if name and name != "<lambda>" else "loss_fn"
    if has_aux:
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError(AUX_NOT_A_PAIR.format(name=name, what=_describe_output(out)))
        return out[0], out[1]
    if isinstance(out, (tuple, list, dict)):
        raise TypeError(PAIR_WITHOUT_AUX.format(name=name, what=_describe_output(out)))
    return out, None


def scaled_loss(fun: Callable[..., Any], has_aux: bool, scaler: Any, /, *args: Any,
                **kwargs: Any) -> tuple[Any, tuple[Any, Any]]:
    """``(scaled loss, (loss, aux))`` of ``fun``: the one place the loss functions given
    to ``value_and_grad`` (and the integrations') are called and scaled. A loss that
    ``fun`` scaled already is refused (read from the program, not from a call made while
    ``fun`` runs: a jitted ``fun`` may come from JAX's cache without running)."""
    loss, aux = split_loss_and_aux(fun, fun(*args, **kwargs), has_aux)
    if provenance.scaled_in_forward(loss):
        raise ValueError(provenance.SCALED_TWICE)
    return tree.scale_loss(scaler, loss), (loss, aux)


def scaler_of_state(state: Any) -> Any:
    """The loss scale that ``state`` holds, or an error saying what the first argument is."""
    if isinstance(state, SCALER_TYPES):
        return state
    if isinstance(state, jax.Array):
        raise TypeError(WRONG_FIRST_ARGUMENT.format(
            what=show(state, type_only=True), hint=" (an array: did you forget the loss scale?)"))
    refuse_misplaced_wrapper(state)
    try:
        return get_loss_scale(state)
    except NoLossScaleFound as e:  # several loss scales: that message already says what to do
        raise ValueError(WRONG_FIRST_ARGUMENT.format(
            what=show(state, type_only=True), hint=f", which holds no loss scale ({e})")) from None


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

    Framework modules get their framework's semantics: for an ``nnx`` Module argument this
    is :func:`loss_scaling.nnx.value_and_grad`, for a differentiated ``equinox.Module``
    :func:`loss_scaling.equinox.filter_value_and_grad`; plain pytrees get
    ``jax.value_and_grad``.

    Args:
      fun: the loss function; returns a scalar loss (or ``(loss, aux)``).
      argnums: as in ``jax.value_and_grad``, counted over ``fun``'s arguments.
      has_aux: as in ``jax.value_and_grad``.

    Returns:
      ``f(state, *args, **kwargs) -> (loss, grads)`` or ``((loss, aux), grads)``.

    Raises:
      TypeError: at call time, when the first argument is not a loss scale's holder (the
        model passed first), when ``fun``'s output does not match ``has_aux``, or when
        ``has_aux=`` / ``argnums=`` is given to the returned function.
      ValueError: when the first argument holds no loss scale, or the wrapper inside
        another transformation, or when the loss ``fun`` returns was scaled already
        (``ls.scale`` in ``fun``: scaled twice; one inside an inner backward pass, a
        gradient penalty's, is fine).

    Examples:
      >>> import jax.numpy as jnp
      >>> import loss_scaling as ls
      >>> grad_fn = ls.value_and_grad(lambda w: jnp.sum(w ** 2))
      >>> loss, grads = grad_fn(ls.StaticLossScale(8.0), jnp.array([1.0, 2.0]))
      >>> loss, grads
      (Array(5., dtype=float32), Array([16., 32.], dtype=float32))
    """

    def wrapped(state: Any, *args: Any, **kwargs: Any) -> Any:
        _refuse_misplaced_options(fun, kwargs)
        # The framework whose modules the arguments hold (only imported ones are asked:
        # a module of one cannot exist otherwise); plain pytrees get jax.value_and_grad.
        for hooks in _registry.hooks():
            factory = hooks.value_and_grad and hooks.value_and_grad(state, args, kwargs, argnums)
            if factory is not None:
                return factory(fun, argnums, has_aux)(state, *args, **kwargs)
        scaler = scaler_of_state(state)

        def scaled(*args: Any, **kwargs: Any) -> Any:
            return scaled_loss(fun, has_aux, scaler, *args, **kwargs)

        (_, (loss, aux)), grads = jax.value_and_grad(scaled, argnums, has_aux=True)(
            *args, **kwargs)
        return ((loss, aux), grads) if has_aux else (loss, grads)

    return wrapped
