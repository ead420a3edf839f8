"""flax linen: a ``TrainState`` with the fused loss-scaled step."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from flax.training import train_state

from loss_scaling import _registry
from loss_scaling.lookup import refuse_misplaced_wrapper
from loss_scaling.wrapper import provenance
from loss_scaling.wrapper.transform import apply_gradients

__all__ = ["TrainState"]

CALLER = provenance.Caller(
    call="state.apply_gradients(grads=grads)",
    recipe="ls.value_and_grad(loss_fn)(state, state.params, batch)")
"""How the trace-time messages name this entry point and its recipe."""


class TrainState(train_state.TrainState):
    """``flax.training.train_state.TrainState`` with the fused loss-scaled step.

    Build it with ``tx=with_loss_scaling(...)`` and pass the gradients of the *scaled*
    loss. ``apply_gradients`` runs the inner update and the parameter update under one
    skip decision (:func:`loss_scaling.apply_gradients`); ``step`` counts every call,
    skipped ones included (``loss_scaling.metrics(state)`` counts the skips).

    For ``nn.BatchNorm``, subclass it as flax's examples do (``class
    TrainState(ls.TrainState): batch_stats: Any``; docs/linen.md) and pass
    ``apply_gradients(grads=..., batch_stats=...)``. Fields passed there are stored on a
    skipped step too, as in flax's dynamic-scale recipe: an overflow is a property of the
    scaled backward pass, not of the forward pass. (Not a field of this class: it would
    change the tree of every saved ``ls.TrainState``.)

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
        the others go to ``tx`` (``value_fn=`` for ``optax.lbfgs``, or the loss a replay
        differentiates again, docs/replay.md). As in flax, when the params hold the
        ``_overwrite_with_gradient`` collection (``flax.linen.fp8_ops``), only
        ``params["params"]`` is stepped; that collection's "gradients" are its new values,
        assigned unchecked, on skipped steps too."""
        fields = {f.name for f in dataclasses.fields(self)}
        replace = {k: v for k, v in kwargs.items() if k in fields}
        extra = {k: v for k, v in kwargs.items() if k not in fields}
        if loss is not None:
            extra["loss"] = loss
        overwrite = isinstance(grads, Mapping) and OVERWRITE_WITH_GRADIENT in grads
        grads_with_opt = grads["params"] if overwrite else grads
        params_with_opt = self.params["params"] if overwrite else self.params
        if overwrite and callable(extra.get("value_fn")):  # a loss of params["params"]
            value_fn, rest = extra["value_fn"], self.params[OVERWRITE_WITH_GRADIENT]
            extra["value_fn"] = lambda p: value_fn({"params": p,
                                                    OVERWRITE_WITH_GRADIENT: rest})
        with provenance.called_as(CALLER):
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
        refuse_misplaced_wrapper(state.opt_state)
        return state


def _is_model(x: Any) -> bool:
    return isinstance(x, nn.Module)


# Registered on import: the package root imports this module (flax linen is a dependency).
_registry.register("flax.linen", _registry.Hooks(is_model=_is_model))
