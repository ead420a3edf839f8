"""Finding the wrapper's state inside any optimizer state."""

from __future__ import annotations

from typing import Any

import optax

from loss_scaling import _registry
from loss_scaling._errors import NoLossScaleFound
from loss_scaling.core.scalers import SCALER_TYPES, LossScale
from loss_scaling.wrapper import placement
from loss_scaling.wrapper.state import LossScalingState, scaler_alone

NOT_A_STATE = {
    "transformation": (
        "No loss scale found: this is {what}, the optimizer itself, not its state: pass the "
        "state `tx.init(params)` returned (your opt_state), or a TrainState / nnx.Optimizer "
        "holding it."),
    "model": (
        "No loss scale found: this is a model ({what}), not an optimizer: pass the optimizer "
        "(`ls.nnx.Optimizer`), the TrainState or the opt_state built with "
        "`loss_scaling.with_loss_scaling(...)`."),
}


def _not_a_state(x: Any) -> str | None:
    """The message for a transformation or a model passed where a state was wanted, else
    None. A framework's model is its integration's to recognise (``Hooks.is_model``)."""
    if isinstance(x, optax.GradientTransformation):
        return NOT_A_STATE["transformation"].format(what=f"an optax {type(x).__name__}")
    if _registry.first_answer(lambda h: h.is_model and h.is_model(x) or None):
        return NOT_A_STATE["model"].format(
            what=f"an instance of {type(x).__module__}.{type(x).__qualname__}")
    return None


def unwrap_frameworks(x: Any) -> Any:
    """``x`` with the containers of imported frameworks (an ``nnx.Optimizer``, an
    ``nnx.State``, ``nnx.Variable``) replaced by the optax states they hold: the
    integrations' hooks (:mod:`loss_scaling._registry`); a pure-optax state passes through."""
    for hooks in _registry.hooks():
        if hooks.unwrap is not None:
            x = hooks.unwrap(x)
    return x


def refuse_misplaced_wrapper(opt_state: Any) -> None:
    """Raises ``ValueError`` if a wrapper state is not the outermost transformation (inside
    ``optax.MultiSteps``, after a clip in ``optax.chain``, ...) of any state
    :func:`get_loss_scale` accepts (:mod:`loss_scaling.wrapper.placement`)."""
    placement.refuse_not_outermost(unwrap_frameworks(opt_state))


def all_wrapper_states(opt_state: Any) -> list[tuple[str, LossScalingState]]:
    """Every wrapper state with its key path (of any state :func:`get_loss_scale` accepts)."""
    return placement.wrapper_states_in(unwrap_frameworks(opt_state))


def get_loss_scale(opt_state: Any, path: str | None = None) -> LossScale:
    """The loss-scale state inside a (possibly nested) optax state.

    Finds the :func:`with_loss_scaling` state inside ``optax.chain``, ``MultiSteps``,
    ``inject_hyperparams``, ``masked`` / ``multi_transform``, a flax ``TrainState`` (or its
    ``opt_state``) and a ``flax.nnx.Optimizer`` (or its ``opt_state``, ``nnx.state`` of it,
    or the state from ``nnx.split`` of it: for those two, build it as
    ``loss_scaling.nnx.Optimizer``, which keeps the configuration in the state), also
    inside dicts, lists and nested ``nnx.State`` (the ``{"model": nnx.state(model),
    "optimizer": nnx.state(optimizer)}`` an Orbax checkpoint saves).

    Args:
      opt_state: an optimizer state, TrainState or nnx Optimizer (a loss-scale state
        itself is returned as it is).
      path: when there are several loss scales, which one: its key path as listed in the
        error message (e.g. ``".inner_states['generator'].inner_state"``), or any part of
        it that only one of them contains (e.g. ``"['generator']"``).

    Returns:
      The loss-scale state (its leaves as arrays: the optimizer state's own). A
      ``DynamicLossScale`` comes with the wrapper's failure register as its ``failure``,
      so that its state dict and :func:`check` say whether the run failed.

    Raises:
      ValueError: if there is no loss scale, or several and ``path`` does not pick one
        (the message lists their paths); TypeError if ``path`` is not a string.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import loss_scaling as ls
      >>> tx = ls.with_loss_scaling(optax.adam(1e-3))
      >>> checkpoint = {"params": jnp.zeros(3), "opt_state": tx.init(jnp.zeros(3))}
      >>> float(ls.get_loss_scale(checkpoint).loss_scale)
      32768.0
    """
    if isinstance(opt_state, SCALER_TYPES):  # already the loss scale (ls.check takes it too)
        return opt_state
    return scaler_alone(wrapper_state(opt_state, path))


def wrapper_state(opt_state: Any, path: str | None = None) -> LossScalingState:
    """The one wrapper state in ``opt_state`` that ``path`` picks (as for
    :func:`get_loss_scale`, whose errors it raises)."""
    if path is not None and not isinstance(path, str):
        raise TypeError(f"path must be a string (a key path, or a part of one, such as "
                        f"\"['generator']\") or None, got {path!r}.")
    every = found = all_wrapper_states(opt_state)
    if path is not None:
        exact = [(p, s) for p, s in found if p == path]
        found = exact or [(p, s) for p, s in found if path in p]
    if len(found) == 1:
        return found[0][1]
    if not found and every:
        paths = ", ".join(repr(p) for p, _ in every)
        raise NoLossScaleFound(
            f"No loss scale found at path {path!r} in this optimizer state; it holds "
            f"{len(every)}, at paths {paths}: pass one of them (or a part of it) as `path=`.")
    if not found:
        wrong = _not_a_state(opt_state)
        if wrong is not None:
            raise NoLossScaleFound(wrong)
        where = "" if path is None else f" at path {path!r}"
        raise NoLossScaleFound(
            f"No loss scale found{where} in this optimizer state: build the optimizer with "
            "`loss_scaling.with_loss_scaling(...)` and pass its state (or a TrainState / "
            "nnx.Optimizer holding it).")
    paths = ", ".join(repr(p) for p, _ in found)
    raise ValueError(
        f"Found {len(found)} loss scales, at paths {paths}: pass `path=` with one of them.")
