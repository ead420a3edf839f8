"""Equinox: filtered gradients of the scaled loss, and the fused step on a Module (README.md).

Reached as ``loss_scaling.equinox``, imported on first use.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import equinox as eqx
import jax
import optax

from loss_scaling import _registry
from loss_scaling.core.tree import any_leaf
from loss_scaling.grad import argnums_within, scaled_loss, scaler_of_state
from loss_scaling.lookup import all_wrapper_states
from loss_scaling.wrapper import provenance
from loss_scaling.wrapper.transform import apply_gradients as _apply_gradients

__all__ = ["apply_gradients", "filter_value_and_grad"]

CALLER = provenance.Caller(
    call="ls.equinox.apply_gradients(tx, grads, opt_state, model)", grad="`eqx.filter_grad`",
    recipe="ls.value_and_grad(loss_fn)(opt_state, model, batch)")
"""How the trace-time messages name this entry point and its recipe."""


def filter_value_and_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
) -> Callable[..., Any]:
    """``eqx.filter_value_and_grad`` of the scaled loss: unscaled loss (and aux), scaled grads.

    The returned function takes the loss scale's holder first (the optax state, or
    anything :func:`~loss_scaling.get_loss_scale` accepts), then ``fun``'s arguments. The
    floating arrays of the arguments at ``argnums`` are differentiated; their other
    leaves get ``None`` gradients, as in Equinox.

    Args:
      fun: the loss function; returns a scalar loss (or ``(loss, aux)``).
      argnums: which of ``fun``'s arguments to differentiate (Equinox's own takes only
        the first).
      has_aux: whether ``fun`` returns ``(loss, aux)``.

    Returns:
      ``f(opt_state, *args, **kwargs) -> (loss, grads)`` or ``((loss, aux), grads)``.

    Examples:
      >>> import jax, jax.numpy as jnp, equinox as eqx, optax
      >>> import loss_scaling as ls
      >>> model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
      >>> tx = ls.with_loss_scaling(optax.sgd(0.1), ls.StaticLossScale(8.0))
      >>> opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
      >>> loss_fn = lambda model, x: jnp.sum(model(x) ** 2)
      >>> loss, grads = ls.equinox.filter_value_and_grad(loss_fn)(opt_state, model, jnp.ones(2))
      >>> true_loss, true_grads = eqx.filter_value_and_grad(loss_fn)(model, jnp.ones(2))
      >>> bool(loss == true_loss), bool(jnp.all(grads.weight == 8 * true_grads.weight))
      (True, True)
    """
    def wrapped(state: Any, *args: Any, **kwargs: Any) -> Any:
        scaler = scaler_of_state(state)
        nums = argnums_within(argnums, args, "opt_state")
        parts = {i: eqx.partition(args[i], eqx.is_inexact_array) for i in nums}

        def scaled(diff: dict[int, Any]) -> Any:
            full = list(args)
            for i in nums:
                full[i] = eqx.combine(diff[i], parts[i][1])
            return scaled_loss(fun, has_aux, scaler, *full, **kwargs)

        diff = {i: parts[i][0] for i in nums}
        (_, (loss, aux)), grads = jax.value_and_grad(scaled, has_aux=True)(diff)
        grads = grads[argnums] if isinstance(argnums, int) else tuple(grads[i] for i in nums)
        return ((loss, aux), grads) if has_aux else (loss, grads)

    return wrapped


def apply_gradients(
    tx: optax.GradientTransformation,
    grads: Any,
    opt_state: optax.OptState,
    model: Any,
    **extra_args: Any,
) -> tuple[Any, optax.OptState]:
    """The fused step on an Equinox model: ``(model, opt_state) -> (model, opt_state)``.

    :func:`loss_scaling.apply_gradients` on the model's floating arrays that have a
    gradient (the tree ``tx.init`` was given); its other leaves (integer and bool arrays,
    arrays frozen with ``eqx.partition``) come back as they are, as with
    ``eqx.apply_updates``. A skipped step returns every array bit-identical.

    Args:
      tx: the transformation (ideally from :func:`~loss_scaling.with_loss_scaling`).
      grads: gradients of the scaled loss, ``None`` for non-arrays (as
        :func:`filter_value_and_grad` returns them).
      opt_state: ``tx``'s state, initialised with
        ``tx.init(eqx.filter(model, eqx.is_inexact_array))``.
      model: the Equinox model.
      **extra_args: forwarded to the inner update; ``loss=`` is also checked. With
        ``max_replays``, ``value_fn=lambda model: loss_fn(model, batch)`` takes the
        *model*: a replay calls it on the model rebuilt from the arrays it replays
        (docs/replay.md).

    Returns:
      ``(new_model, new_opt_state)``.

    Raises:
      ValueError: if ``opt_state`` was initialised on ``eqx.filter(model, eqx.is_array)``
        of a model that holds integer or bool arrays (they have no gradients), or if
        ``grads`` does not have the model's structure.

    Examples:
      >>> import jax, jax.numpy as jnp, equinox as eqx, optax
      >>> import loss_scaling as ls
      >>> model = eqx.nn.Linear(2, 1, use_bias=False, key=jax.random.key(0))
      >>> tx = ls.with_loss_scaling(optax.sgd(0.5), ls.StaticLossScale(4.0))
      >>> opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
      >>> grads = eqx.tree_at(lambda m: m.weight, model, jnp.full((1, 2), 4.0))  # scaled
      >>> new_model, opt_state = ls.equinox.apply_gradients(tx, grads, opt_state, model)
      >>> bool(jnp.all(new_model.weight == model.weight - 0.5))
      True
    """
    params, static = _trained_part(model, grads)
    _refuse_state_of_all_arrays(opt_state, params, model)
    value_fn = extra_args.get("value_fn")
    if callable(value_fn):  # the model's loss, as the trained arrays' loss
        extra_args["value_fn"] = lambda p: value_fn(eqx.combine(p, static))
    with provenance.called_as(CALLER):
        params, opt_state = _apply_gradients(tx, grads, opt_state, params, **extra_args)
    return eqx.combine(params, static), opt_state


GRADS_NOT_OF_MODEL = (
    "grads must have the model's structure, with None where a leaf is not trained (as "
    "`ls.value_and_grad` returns them for the model or its trainable part from "
    "`eqx.partition`): {error}"
)


def _trained_part(model: Any, grads: Any) -> tuple[Any, Any]:
    """``(trained, rest)`` of ``model``: its floating arrays that have a gradient (not
    those frozen with ``eqx.partition``, whose gradients are None), and everything else."""
    has_grad = jax.tree.map(lambda g: g is not None, grads, is_leaf=lambda g: g is None)
    try:
        trained, rest = eqx.partition(model, has_grad)
    except ValueError as error:
        raise ValueError(GRADS_NOT_OF_MODEL.format(error=error)) from None
    trained, others = eqx.partition(trained, eqx.is_inexact_array)
    return trained, eqx.combine(others, rest)


INITIALISED_WITH_IS_ARRAY = (
    "opt_state was initialised for {arrays} arrays, which is eqx.filter(model, "
    "eqx.is_array): it includes the model's {other} integer or bool arrays ({names}), "
    "which have no gradients and are not trained. Initialise the optimizer with "
    "`tx.init(eqx.filter(model, eqx.is_inexact_array))` ({inexact} floating-point arrays)."
)


def _refuse_state_of_all_arrays(opt_state: Any, params: Any, model: Any) -> None:
    """A clear error for a state built on ``eqx.is_array`` of a model with int/bool arrays
    (else the wrapper blames the gradients' structure). Static shapes only: jit-safe."""
    arrays = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    inexact = len(jax.tree.leaves(params))
    if len(arrays) == inexact:
        return
    for _, state in all_wrapper_states(opt_state):
        if state.nonfinite_grads.shape[-1:] == (len(arrays),):
            others = [jax.tree_util.keystr(path, simple=True, separator=".")
                      for path, leaf in jax.tree_util.tree_leaves_with_path(model)
                      if eqx.is_array(leaf) and not eqx.is_inexact_array(leaf)]
            shown = ", ".join(others[:5]) + (" ..." if len(others) > 5 else "")
            raise ValueError(INITIALISED_WITH_IS_ARRAY.format(
                arrays=len(arrays), other=len(arrays) - inexact, names=shown,
                inexact=inexact))


def _value_and_grad_for(state: Any, args: tuple[Any, ...], kwargs: Any,
                        argnums: int | Sequence[int]) -> Callable[..., Any] | None:
    """``loss_scaling.value_and_grad``'s hook: this module's when a differentiated
    argument holds an ``equinox.Module``."""
    nums = (argnums,) if isinstance(argnums, int) else argnums
    is_module = lambda x: isinstance(x, eqx.Module)  # noqa: E731
    return (filter_value_and_grad
            if any_leaf(is_module, [args[i] for i in nums if i < len(args)]) else None)


def _is_model(x: Any) -> bool:
    return isinstance(x, eqx.Module)


def _modules(root: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """The Equinox Modules in ``root`` (itself: ``()``) by their key paths, for the
    debugging tools' layer names."""
    if not prefix and isinstance(root, eqx.Module):
        yield (), root
    is_child = lambda x: x is not root and isinstance(x, eqx.Module)  # noqa: E731
    for path, child in jax.tree_util.tree_flatten_with_path(root, is_leaf=is_child)[0]:
        if isinstance(child, eqx.Module):
            keys = (*prefix, *(jax.tree_util.keystr((k,), simple=True) for k in path))
            yield keys, child
            yield from _modules(child, keys)


_registry.register("equinox", _registry.Hooks(value_and_grad=_value_and_grad_for,
                                              is_model=_is_model, modules=_modules))
