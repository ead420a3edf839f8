"""The one validator of every loss-scale setting and range (construction, state dicts and
flax records all use it).
"""

from __future__ import annotations

import dataclasses
import numbers
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loss_scaling._errors import Failure, show

_F32 = np.finfo(np.float32)
_INT32_MAX = int(np.iinfo(np.int32).max)


def _is_traced(value: Any) -> bool:
    return isinstance(value, jax.core.Tracer)


def _real(name: str, value: Any) -> float:
    """``value`` as a Python float, refusing bools, strings, tracers and non-scalars."""
    if _is_traced(value):
        raise ValueError(
            f"{name} must be a concrete number, got a traced value {show(value)}: construct loss "
            "scales outside `jit` (a state passed into `jit` keeps its configuration)."
        )
    # numpy registers timedelta64 as an integer type (numbers.Real); its 0-d arrays, like
    # datetime64 and object ones, convert to a number silently: none of them is a number.
    dtype = getattr(value, "dtype", None)
    numeric = dtype is None or (isinstance(dtype, np.dtype) and (
        dtype.kind in "iu" or jnp.issubdtype(dtype, jnp.floating)))
    if isinstance(value, (bool, np.bool_)) or not numeric or not (
        isinstance(value, numbers.Real)
        or (isinstance(value, (np.ndarray, jax.Array)) and value.shape == ())
    ):
        raise ValueError(
            f"{name} must be a real number, got {show(value)} of type {type(value).__name__}.")
    try:
        return float(value)
    except OverflowError:  # an int beyond the float range
        return float("inf")


def _float32(value: float) -> np.float32:
    with np.errstate(over="ignore", under="ignore"):
        return np.float32(value)


def positive_normal_float32(name: str, value: Any) -> float:
    """Validates a scale-like value: finite, positive and normal *as float32*."""
    as_f32 = _float32(_real(name, value))
    if not (np.isfinite(as_f32) and as_f32 >= _F32.tiny):
        raise ValueError(
            f"{name} must be a finite, positive, normal float32 (between {_F32.tiny} and "
            f"{_F32.max}), got {show(value)}."
        )
    return float(as_f32)


def int_in_range(name: str, value: Any, low: int, high: int, hint: str = "") -> int:
    """``value`` as a Python int in ``[low, high]``, else a ValueError naming it (+ ``hint``)."""
    if isinstance(value, (bool, np.bool_)) or _is_traced(value):
        raise ValueError(f"{name} must be an integer, got {show(value)}.{hint}")
    try:
        as_int = operator.index(value)
    except TypeError:
        raise ValueError(
            f"{name} must be an integer, got {show(value)} of type {type(value).__name__}."
            f"{hint}") from None
    if not low <= as_int <= high:
        raise ValueError(
            f"{name} must be an integer in [{low}, {high}], got {show(value)}.{hint}")
    return as_int


def flag(name: str, value: Any, hint: str = "") -> bool:
    """``value`` as a Python bool (a bool or a numpy bool), else a ValueError naming it:
    a string such as ``"false"`` is truthy and would switch the option on."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {show(value)} of type "
                         f"{type(value).__name__}.{hint}")
    return bool(value)


def positive_int32(name: str, value: Any) -> int:
    return int_in_range(name, value, 1, _INT32_MAX)


def _growth_factor(value: Any) -> float:
    as_f32 = _float32(_real("growth_factor", value))
    if not (np.isfinite(as_f32) and as_f32 > 1.0):
        raise ValueError(f"growth_factor must be finite and > 1 as a float32, got {show(value)}.")
    return float(as_f32)


def _backoff_factor(value: Any) -> float:
    as_f32 = _float32(_real("backoff_factor", value))
    if not (0.0 < as_f32 < 1.0):
        raise ValueError(
            f"backoff_factor must lie in the open interval (0, 1) as a float32, got {show(value)}."
        )
    if as_f32 < _F32.tiny:
        # XLA on CPU reads a subnormal operand as 0: every backoff would give a zero scale,
        # so the first overflow would fail the run.
        raise ValueError(
            f"backoff_factor must be a normal float32 (at least {_F32.tiny}), got "
            f"{show(value)}: a subnormal factor is read as 0 on CPU, so the first backoff "
            "would leave the normal float32 range and fail the run.")
    return float(as_f32)


@dataclasses.dataclass(frozen=True)
class DynamicConfig:
    """The static configuration of a :class:`DynamicLossScale` (hashable aux data)."""

    growth_factor: float
    backoff_factor: float
    growth_interval: int
    hysteresis: int
    min_scale: float | None
    max_scale: float | None
    # growth="headroom" only (None for the interval rule, whose config, repr and state
    # dict are exactly those of the versions before headroom growth).
    growth: str = "interval"
    headroom_margin: float | None = None
    headroom_window: int | None = None
    headroom_dtype: str | None = None


GROWTH_RULES = ("interval", "headroom")
HEADROOM_OPTIONS = ("headroom_margin", "headroom_window", "headroom_dtype")
HEADROOM_DEFAULTS = {"headroom_margin": 2.0**4, "headroom_window": 16,
                     "headroom_dtype": "float16"}
_BASE_FIELDS = ("growth_factor", "backoff_factor", "growth_interval", "hysteresis",
                "min_scale", "max_scale")
MAX_WINDOW = 2**16


def config_fields(config: DynamicConfig) -> tuple[str, ...]:
    """The fields a config shows (repr, state dict): the interval rule's six, and for
    ``growth="headroom"`` also ``growth`` and the headroom options."""
    if config.growth == "interval":
        return _BASE_FIELDS
    return (*_BASE_FIELDS, "growth", *HEADROOM_OPTIONS)


def _margin(value: Any) -> float:
    as_f32 = _float32(_real("headroom_margin", value))
    if not (np.isfinite(as_f32) and as_f32 >= 1.0 and np.frexp(as_f32)[0] == 0.5):
        raise ValueError(
            f"headroom_margin must be a power of two >= 1 (the factor kept free between "
            f"the recent gradient maximum and the dtype's largest value), got "
            f"{show(value)}: use e.g. {HEADROOM_DEFAULTS['headroom_margin']} (2**4).")
    return float(as_f32)


def _window(value: Any) -> int:
    window = positive_int32("headroom_window", value)
    if window > MAX_WINDOW:
        raise ValueError(
            f"headroom_window must be an integer in [1, {MAX_WINDOW}] (the state holds one "
            f"float32 per step of the window), got {show(value)}.")
    return window


def _headroom_dtype(value: Any) -> str:
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating) or (
            float(jnp.finfo(dtype).max) > float(_F32.max)):
        raise ValueError(
            f"headroom_dtype must be a floating dtype no wider than float32 (the compute "
            f"dtype whose range the gradients must fit), got {show(value)}: use e.g. "
            "jnp.float16 (the default) or 'bfloat16'.")
    return dtype.name


def _growth_options(growth: Any, options: dict[str, Any]) -> dict[str, Any]:
    """The growth rule and its options, checked (the interval rule takes none)."""
    if not isinstance(growth, str) or growth not in GROWTH_RULES:
        raise ValueError(
            f"growth must be 'interval' (grow by growth_factor after growth_interval clean "
            f"steps, the default) or 'headroom' (grow from the measured gradient maximum), "
            f"got {show(growth)}.")
    given = [name for name, value in options.items() if value is not None]
    if growth == "interval":
        if given:
            raise ValueError(
                f"{', '.join(given)} apply only to growth='headroom', got "
                + ", ".join(f"{n}={show(options[n])}" for n in given)
                + " with growth='interval': pass growth='headroom', or drop them.")
        return {}
    options = {n: HEADROOM_DEFAULTS[n] if v is None else v for n, v in options.items()}
    return {"growth": growth, "headroom_margin": _margin(options["headroom_margin"]),
            "headroom_window": _window(options["headroom_window"]),
            "headroom_dtype": _headroom_dtype(options["headroom_dtype"])}


def validate_dynamic_config(
    *, init_scale: Any, growth_factor: Any, backoff_factor: Any, growth_interval: Any,
    hysteresis: Any, min_scale: Any, max_scale: Any, growth: Any = "interval",
    headroom_margin: Any = None, headroom_window: Any = None, headroom_dtype: Any = None,
) -> tuple[DynamicConfig, float]:
    """Checks every argument of :class:`DynamicLossScale`; returns the config and scale."""
    init = positive_normal_float32("init_scale", init_scale)
    config = DynamicConfig(
        growth_factor=_growth_factor(growth_factor),
        backoff_factor=_backoff_factor(backoff_factor),
        growth_interval=positive_int32("growth_interval", growth_interval),
        hysteresis=positive_int32("hysteresis", hysteresis),
        min_scale=None if min_scale is None else positive_normal_float32("min_scale", min_scale),
        max_scale=None if max_scale is None else positive_normal_float32("max_scale", max_scale),
        **_growth_options(growth, {"headroom_margin": headroom_margin,
                                   "headroom_window": headroom_window,
                                   "headroom_dtype": headroom_dtype}),
    )
    if config.min_scale is not None and config.min_scale > init:
        raise ValueError(f"min_scale ({min_scale!r}) must not exceed init_scale ({init_scale!r}).")
    if config.max_scale is not None and config.max_scale < init:
        raise ValueError(
            f"max_scale ({max_scale!r}) must not be below init_scale ({init_scale!r}).")
    return config, init


def scale_range(config: DynamicConfig | None) -> tuple[float, float]:
    """``[low, high]`` for a loss scale under ``config`` (``None`` for a static scale):
    float32's normal range, narrowed by ``min_scale`` / ``max_scale``. The one statement
    of the range, for construction, state dicts, flax records and restores."""
    low, high = float(_F32.tiny), float(_F32.max)
    if config is not None:
        low = max(low, config.min_scale or low)
        high = min(high, config.max_scale or high)
    return low, high


def counter_ranges(config: DynamicConfig) -> dict[str, tuple[int, int, str]]:
    """Per integer leaf of a dynamic state, ``(low, high, how high is named)``."""
    ranges = {
        "growth_tracker": (0, config.growth_interval - 1, "config.growth_interval - 1"),
        "nonfinite_tracker": (0, config.hysteresis, "config.hysteresis"),
        "failure": (0, int(max(Failure)), "the largest loss_scaling.Failure code"),
    }
    if config.growth == "headroom":
        assert config.headroom_window is not None
        ranges["headroom_tracker"] = (0, 2 * config.headroom_window - 1,
                                      "2 * config.headroom_window - 1")
    return ranges


def history_problem(values: np.ndarray) -> str | None:
    """Why ``values`` is not a valid ``grad_max_history`` (finite, >= 0 float32), or None."""
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        as_f32 = np.asarray(values).astype(np.float32)
    if not np.all(np.isfinite(as_f32) & (as_f32 >= 0)):
        return "every entry must be a finite float32 >= 0 (an unscaled gradient maximum)"
    return None
