"""Replacing the loss scale inside optax states, TrainStates and nnx states by a saved one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import optax

from loss_scaling._registry import hooks as framework_hooks
from loss_scaling.checkpoint.config import (
    USE_RESTORE_WITH_CONFIG,
    refuse_differences,
    restore_with_config,
)
from loss_scaling.checkpoint.state_dict import from_state_dict, place_like, state_dict
from loss_scaling.core.scalers import LossScale, without_failure
from loss_scaling.lookup import get_loss_scale
from loss_scaling.wrapper.state import LossScalingState, carried_failure


def restore_loss_scale(
    state: Any,
    saved: LossScale | Mapping[str, Any],
    *,
    adopt_config: bool = False,
    path: str | None = None,
) -> Any:
    """``state`` with its loss scale replaced by the saved one: the last step of a resume.

    An array checkpoint stores the loss scale's values but not its configuration, which
    comes from the restore target: save :func:`state_dict` next to the arrays and pass
    it here. A configuration that differs from the saved one is an error
    (:func:`check_same_config`) unless ``adopt_config=True``
    (:func:`restore_with_config`).

    Args:
      state: an optax state holding one :func:`~loss_scaling.with_loss_scaling` state
        (however nested), a flax ``TrainState``, an ``nnx.Optimizer`` or an ``nnx.State``
        of one.
      saved: a dict from :func:`state_dict` (validated) or a loss-scale state.
      adopt_config: keep ``state``'s configuration instead of requiring the saved one.
      path: which loss scale, when ``state`` holds several (as for
        :func:`~loss_scaling.get_loss_scale`).

    Returns:
      A new state of the same structure, the loss scale's leaves new, each in the
      layout of the leaf it replaces (a ``replicate``-d state's device axis, a
      ``NamedSharding``, multi-host). An ``nnx.Optimizer`` is updated in place and
      returned; an ``nnx.State`` is not modified (pass the new one to ``nnx.update``).

    Raises:
      ValueError: if the configurations differ (unless ``adopt_config``), if ``saved``
        is invalid or of another kind, or if ``state`` holds no loss scale (or several
        and ``path`` picks none).

    Examples:
      >>> import json, jax.numpy as jnp, optax
      >>> import loss_scaling as ls
      >>> def make_tx(growth_interval):
      ...     scaler = ls.DynamicLossScale(init_scale=256.0, growth_interval=growth_interval)
      ...     return ls.with_loss_scaling(optax.sgd(0.1), scaler)
      >>> params = jnp.zeros(2)
      >>> opt_state = make_tx(10).update(jnp.ones(2), make_tx(10).init(params), params)[1]
      >>> saved = json.loads(json.dumps(ls.state_dict(ls.get_loss_scale(opt_state))))
      >>> fresh = make_tx(100).init(params)          # resumed with a new growth_interval
      >>> ls.restore_loss_scale(fresh, saved)
      Traceback (most recent call last):
      ...
      ValueError: the saved loss-scale configuration differs from the target's: ...
      >>> s = ls.get_loss_scale(ls.restore_loss_scale(fresh, saved, adopt_config=True))
      >>> float(s.loss_scale), int(s.growth_tracker), s.growth_interval
      (256.0, 1, 100)
    """
    target = get_loss_scale(state, path)  # clear errors for none or several
    return replace_loss_scale(state, resolve(saved, target, adopt_config=adopt_config), path)


def resolve(saved: LossScale | Mapping[str, Any], target: LossScale, *,
            adopt_config: bool, fix: str = USE_RESTORE_WITH_CONFIG) -> LossScale:
    """The scaler a restore gives: ``saved`` checked against ``target``'s configuration
    (a difference refused with ``fix``), or (``adopt_config``) the saved values under it."""
    if adopt_config:
        return restore_with_config(saved, target)
    refuse_differences(saved, target, fix)
    return from_state_dict(saved if isinstance(saved, Mapping) else state_dict(saved))


def replace_loss_scale(state: Any, new: LossScale, path: str | None = None) -> Any:
    """``state`` with the loss scale ``get_loss_scale(state, path)`` picks replaced by
    ``new`` (a scalar state on its own), placed in the layout of the leaves it replaces;
    the wrapper's failure register takes a failed scaler's code (:func:`carried_failure`)."""
    target = get_loss_scale(state, path)
    new = jax.tree.map(place_like, new, target)
    for hooks in framework_hooks():  # a framework's own state (a mutable nnx.Optimizer)
        if hooks.replace_scale is not None:
            replaced = hooks.replace_scale(state, new, path)
            if replaced is not NotImplemented:
                return replaced
    target_leaves = jax.tree.leaves(without_failure(target))  # the scaler's, not the register
    if not target_leaves:  # a NoOpLossScale: nothing to restore
        return state

    # get_loss_scale returns the state's own leaves: they identify the wrapper to replace.
    def is_target(_: Any, node: Any) -> bool:
        leaves = jax.tree.leaves(node.scaler) if isinstance(node, LossScalingState) else []
        return len(leaves) == len(target_leaves) and all(
            a is b for a, b in zip(leaves, target_leaves, strict=True))

    found = optax.tree_utils.tree_get_all_with_path(
        state, LossScalingState.__name__, filtering=is_target)
    if len(found) != 1:
        raise ValueError(
            f"restore_loss_scale found {len(found)} loss-scale states holding the arrays of "
            "the one `get_loss_scale(state, path)` picks; it replaces exactly one: give "
            "each loss scale its own arrays.")

    old = found[0][1]
    held = without_failure(new)
    out = optax.tree_utils.tree_set(state, is_target, LossScalingState=old._replace(
        scaler=held, failure=carried_failure(old.failure, new)))
    if any(a is not b for a, b in zip(
            jax.tree.leaves(without_failure(get_loss_scale(out, path))),
            jax.tree.leaves(held), strict=True)):
        # optax.tree_utils.tree_set does not reach a wrapper inside another's inner state.
        raise ValueError(
            "restore_loss_scale cannot replace a loss scale nested inside another "
            "with_loss_scaling's inner state.")
    return out
