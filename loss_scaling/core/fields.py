"""Every field of a loss-scale state, declared once.

* :class:`DynamicConfig`: a ``DynamicLossScale``'s settings. Each field's metadata says
  how it is checked (:mod:`loss_scaling.core.validation`), how a checkpoint's value of it
  is read, which growth rule has it and whether it changes the leaves' structure.
* :data:`LEAVES`: the leaves of the three kinds, in flattening order: dtype, shape,
  which growth rule has each, and the range a saved value must lie in.

Construction and flatten/unflatten (:mod:`loss_scaling.core.scalers`), the JSON state
dict, the flax record, Orbax, the nnx integration and docs/checkpoints.md's table of
compared options read them here; the headroom rule's own options and leaves are its
(:mod:`loss_scaling.core.headroom`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from loss_scaling._errors import Failure, show
from loss_scaling.core import headroom
from loss_scaling.core.validation import (
    backoff_factor,
    float32_where,
    integers_in_range,
    positive_int32,
    positive_normal_float32,
    scale_in_range,
)

# -------------------------------------------------------------------- the configuration

INTERVAL = "interval"
GROWTH_RULES = (INTERVAL, headroom.RULE)


def _optional_scale(name: str) -> Callable[[Any], float | None]:
    return lambda value: None if value is None else positive_normal_float32(name, value)


def _growth(value: Any) -> str:
    if not isinstance(value, str) or value not in GROWTH_RULES:
        raise ValueError(f"growth must be 'interval' (the default) or 'headroom', got "
                         f"{show(value)}.")
    return value


def setting(check: Callable[[Any], Any], read: str, doc: str, rule: str | None = None,
            shapes_leaves: bool = False, default: Any = dataclasses.MISSING) -> Any:
    """A :class:`DynamicConfig` field.

    Args:
      check: the value checked and normalised (a ValueError naming the setting).
      read: how a checkpoint's value is read before the check: ``"number"`` (a float32
        value exactly), ``"integer"``, ``"scale"`` (a positive normal float32, or None),
        ``"dtype"`` (a dtype's name) or ``"name"`` (a str, as it is).
      doc: what it decides.
      rule: ``None`` for every growth rule, else the one it belongs to (shown, in a repr
        and a state dict, only for that rule).
      shapes_leaves: whether another value changes the leaves (their number or shape).
      default: the dataclass default (the rule's options: ``None`` for the other rule).
    """
    return dataclasses.field(default=default, metadata={
        "check": check, "read": read, "doc": doc, "rule": rule,
        "shapes_leaves": shapes_leaves})


@dataclasses.dataclass(frozen=True)
class DynamicConfig:
    """The static configuration of a :class:`DynamicLossScale` (hashable aux data)."""

    growth_factor: float = setting(
        lambda v: float32_where("growth_factor", v, lambda x: np.isfinite(x) and x > 1.0,
                                "be finite and > 1 as a float32"),
        "number", "Growth multiplier.")
    backoff_factor: float = setting(backoff_factor, "number", "Backoff multiplier.")
    growth_interval: int = setting(lambda v: positive_int32("growth_interval", v), "integer",
                                   "Clean steps per growth.")
    hysteresis: int = setting(lambda v: positive_int32("hysteresis", v), "integer",
                              "Non-finite steps per backoff.")
    min_scale: float | None = setting(_optional_scale("min_scale"), "scale",
                                      "Backoff floor, or None.")
    max_scale: float | None = setting(_optional_scale("max_scale"), "scale",
                                      "Growth ceiling, or None.")
    # growth="headroom" only (None for the interval rule: its repr and state dict unchanged)
    growth: str = setting(_growth, "name", "The growth rule, 'interval' or 'headroom'.",
                          rule=headroom.RULE, shapes_leaves=True, default=INTERVAL)
    headroom_margin: float | None = setting(
        headroom.check_margin, "number", "Headroom kept below the dtype's largest value.",
        rule=headroom.RULE, default=None)
    headroom_window: int | None = setting(
        headroom.check_window, "integer", "Clean steps whose maxima count.",
        rule=headroom.RULE, shapes_leaves=True, default=None)
    headroom_dtype: str | None = setting(
        headroom.check_dtype, "dtype", "The compute dtype whose range counts.",
        rule=headroom.RULE, default=None)


SETTINGS: tuple[dataclasses.Field[Any], ...] = dataclasses.fields(DynamicConfig)
"""The settings, in declaration order (the order they are checked in)."""
SETTING_NAMES = tuple(f.name for f in SETTINGS)


def dynamic_config(**settings: Any) -> DynamicConfig:
    """Checks every setting of a :class:`DynamicLossScale` but its scale, in declaration
    order; the growth rule's options default for that rule (the other rule takes none)."""
    checked = {f.name: f.metadata["check"](settings[f.name]) for f in SETTINGS
               if f.metadata["rule"] is None}
    growth = _growth(settings.get("growth", INTERVAL))
    options = {name: settings.get(name) for name in headroom.OPTIONS}
    if growth == INTERVAL:
        headroom.refuse_options_without_rule(options)
        return DynamicConfig(**checked)
    checked["growth"] = growth
    for f in SETTINGS:
        if f.name in headroom.OPTIONS:
            value = options[f.name]
            checked[f.name] = f.metadata["check"](
                headroom.DEFAULTS[f.name] if value is None else value)
    return DynamicConfig(**checked)


def shown(growth: str) -> tuple[str, ...]:
    """The settings a config of the rule ``growth`` shows (repr, state dict): every
    rule's, and its own rule's (``growth`` and the headroom options only for
    ``growth="headroom"``)."""
    return tuple(f.name for f in SETTINGS if f.metadata["rule"] in (None, growth))


def structure_settings() -> tuple[str, ...]:
    """The settings whose value changes the leaves (their number or shape)."""
    return tuple(f.name for f in SETTINGS if f.metadata["shapes_leaves"])


# ------------------------------------------------------------------------- the leaves


class Leaf(NamedTuple):
    """One leaf of a loss-scale state.

    Attributes:
      name: its attribute.
      dtype: ``"float32"`` or ``"int32"``.
      rule: ``None`` for every dynamic scaler, else the growth rule that has it.
      window: ``headroom_window`` entries (else a scalar), before any replica axes.
      bounds: for an integer leaf, ``config -> (low, high, how high is named)``, the name
        a template of the config's name (``{c}``); ``None`` for a float leaf.
      doc: what it holds.
      alone_only: only a scaler on its own has it; one that a ``with_loss_scaling`` state
        holds does not (the wrapper's register holds the fact: ``failure``).
    """

    name: str
    dtype: str
    rule: str | None
    window: bool
    bounds: Callable[[DynamicConfig], tuple[int, int, str]] | None
    doc: str
    alone_only: bool = False


LEAVES: tuple[Leaf, ...] = (
    Leaf("loss_scale", "float32", None, False, None, "the factor"),
    Leaf("growth_tracker", "int32", None, False,
         lambda c: (0, c.growth_interval - 1, "{c}growth_interval - 1"),
         "clean steps since the last growth or backoff"),
    Leaf("nonfinite_tracker", "int32", None, False,
         lambda c: (0, c.hysteresis, "{c}hysteresis"),
         "non-finite steps in a row, up to hysteresis"),
    Leaf("failure", "int32", None, False,
         lambda c: (0, int(max(Failure)), "the largest loss_scaling.Failure code"),
         "the Failure code, 0 while healthy (held by a wrapper: the wrapper's `failure`)",
         alone_only=True),
    Leaf(headroom.HISTORY, "float32", headroom.RULE, True, None,
         "recent unscaled maxima of |g|, a ring"),
    Leaf("headroom_tracker", "int32", headroom.RULE, False, headroom.tracker_range,
         "clean steps recorded since the start or the last backoff"),
    Leaf("ceiling", "float32", headroom.RULE, False, None,
         "the scale growth may reach (below one that overflowed)"),
)
"""Every leaf of a ``DynamicLossScale``, in flattening order; a ``StaticLossScale``'s
one leaf is the first (``NoOpLossScale`` has none)."""
LEAF = {leaf.name: leaf for leaf in LEAVES}
LOSS_SCALE = "loss_scale"
FAILURE = "failure"


def dynamic_leaf_names(growth: str, alone: bool = True) -> tuple[str, ...]:
    """The leaves of a ``DynamicLossScale`` of the rule ``growth``, in flattening order:
    on its own (``alone``), or as a ``with_loss_scaling`` state holds it (no ``failure``:
    the wrapper's register is the one)."""
    return tuple(leaf.name for leaf in LEAVES
                 if leaf.rule in (None, growth) and (alone or not leaf.alone_only))


ALL_DYNAMIC_LEAF_NAMES = tuple(leaf.name for leaf in LEAVES)


def is_float(name: str) -> bool:
    """Whether the leaf ``name`` is float32 (else int32)."""
    return LEAF[name].dtype == "float32"


def dtype(name: str) -> np.dtype:
    return np.dtype(LEAF[name].dtype)


def ndim(name: str) -> int:
    """The rank of one leaf as the library builds it (before any replica axes)."""
    return 1 if LEAF[name].window else 0


def shape(name: str, config: DynamicConfig | None) -> tuple[int, ...]:
    """One leaf's shape as the library builds it (before any replica axes)."""
    if not LEAF[name].window:
        return ()
    assert config is not None and config.headroom_window is not None
    return (config.headroom_window,)


def initial_leaves(init_scale: float, config: DynamicConfig) -> tuple[jax.Array, ...]:
    """A new ``DynamicLossScale``'s leaves: the scale, zero counters, the rule's own."""
    zero = jnp.zeros((), jnp.int32)
    leaves: tuple[Any, ...] = (jnp.asarray(init_scale, jnp.float32), zero, zero, zero)
    if config.growth == headroom.RULE:
        leaves += headroom.initial_leaves(config)
    # Each leaf its own buffer: donating one never deletes another.
    return tuple(jnp.array(x) for x in leaves)


def check_leaf(name: str, value: Any, config: DynamicConfig | None, *, label: str,
               config_name: str, fix: str = "") -> None:
    """Every element of a saved leaf in its range under ``config`` (``None``: a static
    scale), else a ValueError naming it as ``label``; ``config_name`` prefixes the
    config's settings in the message (``"config."``, ``"the target's "``)."""
    leaf = LEAF[name]
    if leaf.bounds is not None:
        assert config is not None  # the only kind with integer leaves
        low, high, bound = leaf.bounds(config)
        integers_in_range(label, value, low, high, bound.format(c=config_name), fix)
    elif leaf.window:
        headroom.history_in_range(label, value)
    else:
        scale_in_range(label, value, config, where=config_name)

