"""The one validator of every loss-scale setting and range, for construction and every
checkpoint format: :func:`scale_in_range` (the one range check of a loss scale),
:func:`counter_ranges`. Each raises a ``ValueError`` naming the argument, the value and
the fix; a checkpoint format prefixes its own context.
"""

from __future__ import annotations

import dataclasses
import numbers
import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loss_scaling._errors import Failure, show

_F32 = np.finfo(np.float32)
_INT32_MAX = int(np.iinfo(np.int32).max)


def _is_traced(value: Any) -> bool:
    return isinstance(value, jax.core.Tracer)


def _float32(name: str, value: Any) -> np.float32:
    """``value`` as a float32, refusing bools, strings, tracers and non-scalars."""
    if _is_traced(value):
        raise ValueError(f"{name} must be a concrete number, got a traced value {show(value)}: "
                         "construct loss scales outside `jit`.")
    # numpy counts timedelta64 as an integer (numbers.Real); its 0-d arrays, like datetime64
    # and object ones, convert to a number silently: none of them is a number.
    dtype = getattr(value, "dtype", None)
    numeric = dtype is None or (isinstance(dtype, np.dtype) and (
        dtype.kind in "iu" or jnp.issubdtype(dtype, jnp.floating)))
    if isinstance(value, (bool, np.bool_)) or not numeric or not (
            isinstance(value, numbers.Real)
            or (isinstance(value, (np.ndarray, jax.Array)) and value.shape == ())):
        raise ValueError(
            f"{name} must be a real number, got {show(value)} of type {type(value).__name__}.")
    try:
        number = float(value)
    except OverflowError:  # an int beyond the float range
        number = float("inf")
    with np.errstate(over="ignore", under="ignore"):
        return np.float32(number)


def _float32_where(name: str, value: Any, ok: Callable[[np.float32], Any], must: str,
                   fix: str = "") -> float:
    """``value`` as a float32 for which ``ok`` holds, else "``name`` must ``must``, got ..."."""
    as_f32 = _float32(name, value)
    if not ok(as_f32):
        raise ValueError(f"{name} must {must}, got {show(value)}{fix}.")
    return float(as_f32)


def positive_normal_float32(name: str, value: Any) -> float:
    """Validates a scale-like value: finite, positive and normal *as float32*."""
    return _float32_where(name, value, lambda x: np.isfinite(x) and x >= _F32.tiny,
                          f"be a finite, positive, normal float32 (between {_F32.tiny} and "
                          f"{_F32.max})")


def int_in_range(name: str, value: Any, low: int, high: int, hint: str = "") -> int:
    """``value`` as a Python int in ``[low, high]``, else a ValueError naming it (+ ``hint``)."""
    try:
        if isinstance(value, (bool, np.bool_)) or _is_traced(value):
            raise TypeError
        as_int = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {show(value)} of type "
                         f"{type(value).__name__}.{hint}") from None
    if not low <= as_int <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {show(value)}."
                         f"{hint}")
    return as_int


def flag(name: str, value: Any, hint: str = "") -> bool:
    """``value`` as a Python bool; a string such as ``"false"`` is truthy and is refused."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {show(value)} of type "
                         f"{type(value).__name__}.{hint}")
    return bool(value)


def positive_int32(name: str, value: Any) -> int:
    return int_in_range(name, value, 1, _INT32_MAX)


def _backoff_factor(value: Any) -> float:
    _float32_where("backoff_factor", value, lambda x: 0.0 < x < 1.0,
                   "lie in the open interval (0, 1) as a float32")
    # XLA on CPU reads a subnormal operand as 0.
    return _float32_where("backoff_factor", value, lambda x: x >= _F32.tiny,
                          f"be a normal float32 (at least {_F32.tiny})", ": CPUs read a "
                          "subnormal factor as 0, so the first backoff would fail the run")


@dataclasses.dataclass(frozen=True)
class DynamicConfig:
    """The static configuration of a :class:`DynamicLossScale` (hashable aux data)."""

    growth_factor: float
    backoff_factor: float
    growth_interval: int
    hysteresis: int
    min_scale: float | None
    max_scale: float | None
    # growth="headroom" only (None for the interval rule: its repr and state dict unchanged)
    growth: str = "interval"
    headroom_margin: float | None = None
    headroom_window: int | None = None
    headroom_dtype: str | None = None


GROWTH_RULES = ("interval", "headroom")
HEADROOM_OPTIONS = ("headroom_margin", "headroom_window", "headroom_dtype")
HEADROOM_DEFAULTS = {"headroom_margin": 2.0**4, "headroom_window": 16, "headroom_dtype": "float16"}
INTERVAL_FIELDS = ("growth_factor", "backoff_factor", "growth_interval", "hysteresis",
                   "min_scale", "max_scale")
MAX_WINDOW = 2**16


def config_fields(config: DynamicConfig) -> tuple[str, ...]:
    """The fields a config shows (repr, state dict): the interval rule's six, and for
    ``growth="headroom"`` also ``growth`` and the headroom options."""
    if config.growth == "interval":
        return INTERVAL_FIELDS
    return (*INTERVAL_FIELDS, "growth", *HEADROOM_OPTIONS)


def _headroom_dtype(value: Any) -> str:
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating) or (
            float(jnp.finfo(dtype).max) > float(_F32.max)):
        raise ValueError(f"headroom_dtype must be a floating dtype no wider than float32, got "
                         f"{show(value)}: use e.g. jnp.float16 (the default) or 'bfloat16'.")
    return dtype.name


def _growth_options(growth: Any, options: dict[str, Any]) -> dict[str, Any]:
    """The growth rule and its options, checked (the interval rule takes none)."""
    if not isinstance(growth, str) or growth not in GROWTH_RULES:
        raise ValueError(f"growth must be 'interval' (the default) or 'headroom', got "
                         f"{show(growth)}.")
    given = [name for name, value in options.items() if value is not None]
    if growth == "interval":
        if given:
            raise ValueError(f"{', '.join(given)} apply only to growth='headroom', got "
                             + ", ".join(f"{n}={show(options[n])}" for n in given)
                             + ": pass growth='headroom', or drop them.")
        return {}
    options = {n: HEADROOM_DEFAULTS[n] if v is None else v for n, v in options.items()}
    margin = _float32_where(
        "headroom_margin", options["headroom_margin"],
        lambda x: np.isfinite(x) and x >= 1.0 and np.frexp(x)[0] == 0.5,
        "be a power of two >= 1", ": use e.g. 16.0 (the default, 2**4)")
    return {"growth": growth, "headroom_margin": margin,
            "headroom_window": int_in_range("headroom_window", options["headroom_window"],
                                            1, MAX_WINDOW),
            "headroom_dtype": _headroom_dtype(options["headroom_dtype"])}


def dynamic_config(
    *, growth_factor: Any, backoff_factor: Any, growth_interval: Any, hysteresis: Any,
    min_scale: Any, max_scale: Any, growth: Any = "interval", headroom_margin: Any = None,
    headroom_window: Any = None, headroom_dtype: Any = None,
) -> DynamicConfig:
    """Checks every setting of a :class:`DynamicLossScale` but its scale."""
    return DynamicConfig(
        growth_factor=_float32_where("growth_factor", growth_factor,
                                     lambda x: np.isfinite(x) and x > 1.0,
                                     "be finite and > 1 as a float32"),
        backoff_factor=_backoff_factor(backoff_factor),
        growth_interval=positive_int32("growth_interval", growth_interval),
        hysteresis=positive_int32("hysteresis", hysteresis),
        min_scale=None if min_scale is None else positive_normal_float32("min_scale", min_scale),
        max_scale=None if max_scale is None else positive_normal_float32("max_scale", max_scale),
        **_growth_options(growth, {"headroom_margin": headroom_margin,
                                   "headroom_window": headroom_window,
                                   "headroom_dtype": headroom_dtype}),
    )


def scale_range(config: DynamicConfig | None) -> tuple[float, float]:
    """``[low, high]`` for a loss scale under ``config`` (``None`` for a static scale):
    float32's normal range, narrowed by ``min_scale`` / ``max_scale``."""
    low, high = float(_F32.tiny), float(_F32.max)
    if config is not None:
        low = max(low, config.min_scale or low)
        high = min(high, config.max_scale or high)
    return low, high


def scale_in_range(name: str, value: Any, config: DynamicConfig | None, *, where: str = "",
                   fix: str = "") -> None:
    """The one range check of a loss scale: every element of ``value`` a float32 in
    :func:`scale_range`, else a ValueError naming ``name``, the value, the bounds (the
    config's as ``{where}min_scale``) and ``fix``."""
    low, high = scale_range(config)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        as_f32 = np.asarray(value).astype(np.float32)
    if not np.all(np.isfinite(as_f32) & (as_f32 >= low) & (as_f32 <= high)):
        bounds = ("float32's normal range" if config is None else
                  f"{where}min_scale={config.min_scale!r}, {where}max_scale={config.max_scale!r}")
        raise ValueError(f"{name} must be a float32 in [{low!r}, {high!r}] ({bounds}), got "
                         f"{show(value)}.{fix}")


def counter_ranges(config: DynamicConfig) -> dict[str, tuple[int, int, str]]:
    """Per integer leaf of a dynamic state under ``config``: ``(low, high, how high is
    named)``, the name a template of the config's name (``{c}``)."""
    ranges = {"growth_tracker": (0, config.growth_interval - 1, "{c}growth_interval - 1"),
              "nonfinite_tracker": (0, config.hysteresis, "{c}hysteresis"),
              "failure": (0, int(max(Failure)), "the largest loss_scaling.Failure code")}
    if config.headroom_window is not None:
        ranges["headroom_tracker"] = (0, 2 * config.headroom_window - 1,
                                      "2 * {c}headroom_window - 1")
    return ranges


def counter_in_range(name: str, value: Any, config: DynamicConfig, *, where: str = "",
                     config_name: str = "config.", fix: str = "") -> None:
    """Every element of the counter ``value`` (named ``where + name``) in its range."""
    low, high, bound = counter_ranges(config)[name]
    array = np.asarray(value)
    if not (array.min(initial=low) >= low and array.max(initial=low) <= high):
        raise ValueError(f"{where}{name} must be an integer in [{low}, "
                         f"{bound.format(c=config_name)}] = [{low}, {high}], got "
                         f"{show(value)}.{fix}")


def history_in_range(name: str, values: Any) -> None:
    """A ``grad_max_history``: every entry a finite float32 >= 0 (an unscaled maximum)."""
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        as_f32 = np.asarray(values).astype(np.float32)
    if not np.all(np.isfinite(as_f32) & (as_f32 >= 0)):
        raise ValueError(f"{name}: every entry must be a finite float32 >= 0, got "
                         f"{show(values)}.")
