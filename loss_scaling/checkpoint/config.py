"""Comparing a saved configuration with the target's, and adopting the target's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from loss_scaling.checkpoint.state_dict import (
    build,
    is_concrete,
    kind_of,
    parse,
    place_like,
    state_dict,
    static_factor,
)
from loss_scaling.core import fields, headroom
from loss_scaling.core.scalers import (
    DynamicLossScale,
    LossScale,
    StaticLossScale,
    holds_failure,
    with_failure,
)
from loss_scaling.core.validation import scale_in_range

USE_RESTORE_WITH_CONFIG = (
    "To keep the saved loss scale and counters under the target's configuration, use "
    "`loss_scaling.restore_with_config(saved, target)` (on a whole optimizer state or "
    "TrainState: `loss_scaling.restore_loss_scale(state, saved, adopt_config=True)`); to "
    "keep the saved configuration, build the optimizer with it."
)


def _config_differences(saved: Any, target: LossScale) -> list[str]:
    """Every field on which ``saved`` and ``target`` disagree, as readable lines."""
    target_kind = kind_of(target)
    saved_kind, saved_config, values = parse(
        saved if isinstance(saved, Mapping) else state_dict(saved))
    if saved_kind != target_kind:
        return [f"kind: saved {saved_kind!r}, target {target_kind!r}"]
    if isinstance(target, StaticLossScale):
        # A static factor is configuration held in a leaf: compared, never adopted silently.
        saved_factor, target_factor = values["loss_scale"], static_factor(target)
        if target_factor is not None and saved_factor != target_factor:
            return [f"loss_scale (a StaticLossScale's factor): saved {saved_factor!r}, "
                    f"target {target_factor!r}"]
    if saved_config is None or not isinstance(target, DynamicLossScale):
        return []
    return [f"{name}: saved {getattr(saved_config, name)!r}, "
            f"target {getattr(target.config, name)!r}"
            for name in fields.SETTING_NAMES
            if getattr(saved_config, name) != getattr(target.config, name)]


def check_same_config(saved: LossScale | Mapping[str, Any], target: LossScale) -> None:
    """Raises unless ``saved`` has the same kind and configuration as ``target``.

    The check a restore makes by default before it lets saved values into a freshly
    configured run: a changed setting is an error, never adopted (or dropped) silently.
    A ``StaticLossScale``'s factor counts as configuration (compared when ``target`` is
    concrete: an abstract target from ``jax.eval_shape`` has no value to compare).

    Args:
      saved: the saved state, as a loss-scale state or a dict from :func:`state_dict`
        (validated).
      target: the freshly configured loss-scale state.

    Raises:
      ValueError: listing every differing field with both values (or if ``saved`` is an
        invalid state dict).
      TypeError: if ``target`` or ``saved`` is not a loss-scale state (or a dict).

    Examples:
      >>> import loss_scaling as ls
      >>> from loss_scaling import check_same_config
      >>> check_same_config(ls.DynamicLossScale(), ls.DynamicLossScale())
      >>> check_same_config(ls.DynamicLossScale(),
      ...                   ls.DynamicLossScale(growth_interval=100, min_scale=1.0))
      Traceback (most recent call last):
      ...
      ValueError: the saved loss-scale configuration differs from the target's:
        growth_interval: saved 2000, target 100
        min_scale: saved None, target 1.0
      ...
      >>> check_same_config(ls.StaticLossScale(128.0), ls.StaticLossScale(1024.0))
      Traceback (most recent call last):
      ...
      ValueError: the saved loss-scale configuration differs from the target's:
        loss_scale (a StaticLossScale's factor): saved 128.0, target 1024.0
      ...
    """
    refuse_differences(saved, target, USE_RESTORE_WITH_CONFIG)


def refuse_differences(saved: LossScale | Mapping[str, Any], target: LossScale,
                       fix: str) -> None:
    """:func:`check_same_config` with the caller's fix (Orbax names its own)."""
    differences = _config_differences(saved, target)
    if differences:
        raise ValueError("the saved loss-scale configuration differs from the target's:\n  "
                         + "\n  ".join(differences) + "\n" + fix)


def restore_with_config(saved: LossScale | Mapping[str, Any], target: LossScale) -> LossScale:
    """The saved values under the target's configuration: the explicit way to adopt it.

    The result has ``target``'s configuration and ``saved``'s ``loss_scale``; the counters
    are clamped into the new ranges (``growth_tracker <= growth_interval - 1``,
    ``nonfinite_tracker <= hysteresis``); the scale is not: one outside the target's
    ``[min_scale, max_scale]`` is an error. Into a ``growth="headroom"`` target the saved
    gradient-max history is kept if its window has the target's length (else it starts
    over) and the ceiling is clamped into the target's range. A ``StaticLossScale``'s
    factor *is* its configuration: the result has the target's (the saved one when the
    target is abstract and has no value).

    Args:
      saved: the saved state, as a loss-scale state or a dict from :func:`state_dict`
        (validated against its own configuration first).
      target: a freshly configured state of the same kind.

    Returns:
      A new state of the target's kind and configuration.

    Raises:
      ValueError: if the kinds differ, if ``saved`` is invalid, or if the saved
        ``loss_scale`` lies outside the target's ``[min_scale, max_scale]``.
      TypeError: if ``target`` or ``saved`` is not a loss-scale state (or a dict).

    Examples:
      >>> import loss_scaling as ls
      >>> from loss_scaling import restore_with_config
      >>> saved = ls.DynamicLossScale(init_scale=256.0, growth_interval=2000)
      >>> for _ in range(150):
      ...     saved = ls.update(saved, True)
      >>> s = restore_with_config(saved, ls.DynamicLossScale(growth_interval=100))
      >>> float(s.loss_scale), int(s.growth_tracker), s.growth_interval
      (256.0, 99, 100)
      >>> float(ls.update(s, True).loss_scale)   # the 100th clean step grows
      512.0
      >>> float(restore_with_config(ls.StaticLossScale(128.0),
      ...                           ls.StaticLossScale(1024.0)).loss_scale)
      1024.0
    """
    target_kind = kind_of(target)
    kind, _, values = parse(saved if isinstance(saved, Mapping) else state_dict(saved))
    if kind != target_kind:
        raise ValueError(f"kind: saved {kind!r}, target {target_kind!r}. restore_with_config "
                         "keeps the kind; to change it, build the new state from the saved "
                         "scale, e.g. `ls.StaticLossScale(float(saved.loss_scale))`.")
    if isinstance(target, StaticLossScale):
        factor = static_factor(target)
        return _in_layout(build(kind, None, values if factor is None
                                else {"loss_scale": factor}), target)
    if not isinstance(target, DynamicLossScale):
        return build(kind, None, values)
    config = target.config
    scale = values["loss_scale"]
    scale_in_range("the saved loss_scale", scale, config, where="the target's ",
                   fix=" Widen the target's range, or keep the saved configuration.")
    return _in_layout(build("dynamic", config, {
        "loss_scale": scale,
        "growth_tracker": min(values["growth_tracker"], config.growth_interval - 1),
        "nonfinite_tracker": min(values["nonfinite_tracker"], config.hysteresis),
        "failure": values["failure"],   # sticky: a new configuration does not heal a run
        **headroom.adopted(values, config),
    }), target)


def _in_layout(scaler: LossScale, target: LossScale) -> LossScale:
    """``scaler`` (scalars) in the layout of a concrete ``target`` (replicated, sharded);
    a ``failure`` in the layout of the counters where ``target`` has none (a wrapper's)."""
    if not all(map(is_concrete, jax.tree.leaves(target))):
        return scaler
    if isinstance(target, DynamicLossScale) and not holds_failure(target):
        target = with_failure(target, target.growth_tracker)
    return jax.tree.map(place_like, scaler, target)

