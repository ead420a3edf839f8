"""A flax ``TrainState`` whose ``apply_gradients`` takes the fused, skip-exact path."""

from __future__ import annotations

from typing import Any

from flax.training import train_state

from loss_scaling.transform import apply_gradients

__all__ = ["TrainState"]


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
      >>> state = state.apply_gradients(grads=grads)
      >>> state.params, int(state.step)
      (Array([0., 0.], dtype=float32), 1)
    """

    def apply_gradients(self, *, grads: Any, **kwargs: Any) -> TrainState:
        """Applies the scaled ``grads`` (skipping the step if they are not finite)."""
        params, opt_state = apply_gradients(self.tx, grads, self.opt_state, self.params)
        return self.replace(step=self.step + 1, params=params, opt_state=opt_state, **kwargs)
