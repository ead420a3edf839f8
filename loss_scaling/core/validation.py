"""The checks of one value, for construction and every checkpoint format: a float32 with
a property (:func:`float32_where`, :func:`positive_normal_float32`), an integer in a
range, a flag, and the one range check of a loss scale (:func:`scale_in_range`). Each
raises a ``ValueError`` naming the argument, the value and the fix; a checkpoint format
prefixes its own context. Which check each setting and leaf takes is declared once, in
:mod:`loss_scaling.core.fields`.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from loss_scaling._errors import show

F32 = np.finfo(np.float32)
"""float32's limits: ``F32.tiny`` (the smallest normal) and ``F32.max``."""
INT32_MAX = int(np.iinfo(np.int32).max)


class ScaleBounds(Protocol):
    """What the range check of a scale reads of a configuration
    (:class:`loss_scaling.core.fields.DynamicConfig`): typed by its shape, so that this
    module, the lowest of the core, imports none of the modules above it."""

    @property
    def min_scale(self) -> float | None: ...

    @property
    def max_scale(self) -> float | None: ...


def is_traced(value: Any) -> bool:
    """Whether ``value`` is a tracer (inside ``jit``, ``grad``, ``vmap``, ...)."""
    return isinstance(value, jax.core.Tracer)


def _float32(name: str, value: Any) -> np.float32:
    """``value`` as a float32, refusing bools, strings, tracers and non-scalars."""
    if is_traced(value):
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


def float32_where(name: str, value: Any, ok: Callable[[np.float32], Any], must: str,
                  fix: str = "") -> float:
    """``value`` as a float32 for which ``ok`` holds, else "``name`` must ``must``, got ..."."""
    as_f32 = _float32(name, value)
    if not ok(as_f32):
        raise ValueError(f"{name} must {must}, got {show(value)}{fix}.")
    return float(as_f32)


def positive_normal_float32(name: str, value: Any) -> float:
    """Validates a scale-like value: finite, positive and normal *as float32*."""
    return float32_where(name, value, lambda x: np.isfinite(x) and x >= F32.tiny,
                          f"be a finite, positive, normal float32 (between {F32.tiny} and "
                          f"{F32.max})")


def int_in_range(name: str, value: Any, low: int, high: int, hint: str = "") -> int:
    """``value`` as a Python int in ``[low, high]``, else a ValueError naming it (+ ``hint``)."""
    try:
        if isinstance(value, (bool, np.bool_)) or is_traced(value):
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
    """An integer in ``[1, 2**31 - 1]``."""
    return int_in_range(name, value, 1, INT32_MAX)


def backoff_factor(value: Any) -> float:
    """A ``backoff_factor``: in (0, 1) and normal as a float32."""
    float32_where("backoff_factor", value, lambda x: 0.0 < x < 1.0,
                   "lie in the open interval (0, 1) as a float32")
    # XLA on CPU reads a subnormal operand as 0.
    return float32_where("backoff_factor", value, lambda x: x >= F32.tiny,
                          f"be a normal float32 (at least {F32.tiny})", ": CPUs read a "
                          "subnormal factor as 0, so the first backoff would fail the run")


def normal_float32(values: Any) -> np.ndarray:
    """Host side, elementwise: whether each value is a finite, positive, normal float32
    (the in-graph test of a step is ``loss_scaling.core.update.is_positive_normal``)."""
    as_f32 = np.asarray(values).astype(np.float32)
    return np.isfinite(as_f32) & (as_f32 >= F32.tiny)


def scale_range(config: ScaleBounds | None) -> tuple[float, float]:
    """``[low, high]`` for a loss scale under ``config`` (``None`` for a static scale):
    float32's normal range, narrowed by ``min_scale`` / ``max_scale``."""
    low, high = float(F32.tiny), float(F32.max)
    if config is not None:
        low = max(low, config.min_scale or low)
        high = min(high, config.max_scale or high)
    return low, high


def scale_in_range(name: str, value: Any, config: ScaleBounds | None, *, where: str = "",
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


def integers_in_range(name: str, value: Any, low: int, high: int, bound: str,
                      fix: str = "") -> None:
    """Every element of the integer array ``value`` in ``[low, high]``, else a ValueError
    naming ``name``, the value and how ``high`` is named (``bound``)."""
    array = np.asarray(value)
    if not (array.min(initial=low) >= low and array.max(initial=low) <= high):
        raise ValueError(f"{name} must be an integer in [{low}, {bound}] = [{low}, {high}], "
                         f"got {show(value)}.{fix}")
