"""Train-step helpers: gradients of the scaled loss, and a fused flax TrainState."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax.training import train_state

from loss_scaling import tree
from loss_scaling.lookup import get_loss_scale
from loss_scaling.transform import SCALER_TYPES, apply_gradients

__all__ = ["TrainState", "value_and_grad"]


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

    Args:
      fun: the loss function; returns a scalar loss (or ``(loss, aux)``).
      argnums: as in ``jax.value_and_grad``, counted over ``fun``'s arguments.
      has_aux: as in ``jax.value_and_grad``.

    Returns:
      ``f(state, *args, **kwargs) -> (loss, grads)`` or ``((loss, aux), grads)``.

    Examples:
      >>> import jax.numpy as jnp
      >>> import loss_scaling as ls
      >>> grad_fn = ls.value_and_grad(lambda w: jnp.sum(w ** 2))
      >>> loss, grads = grad_fn(ls.StaticLossScale(8.0), jnp.array([1.0, 2.0]))
      >>> loss, grads
      (Array(5., dtype=float32), Array([16., 32.], dtype=float32))
    """

    def wrapped(state: Any, *args: Any, **kwargs: Any) -> Any:
        scaler = state if isinstance(state, SCALER_TYPES) else get_loss_scale(state)

        def scaled(*args: Any, **kwargs: Any) -> Any:
            out = fun(*args, **kwargs)
            loss, aux = out if has_aux else (out, None)
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
        finite; other keyword arguments replace fields, as in flax."""
        extra = {} if loss is None else {"loss": loss}
        params, opt_state = apply_gradients(self.tx, grads, self.opt_state, self.params,
                                            **extra)
        return self.replace(step=self.step + 1, params=params, opt_state=opt_state, **kwargs)
