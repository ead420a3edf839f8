"""Reading numbers out of untrusted dicts, with messages that name the field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loss_scaling._errors import show
from loss_scaling.core.scalers import DynamicLossScale, NoOpLossScale, StaticLossScale
from loss_scaling.core.validation import (
    _BASE_FIELDS,
    DynamicConfig,
    positive_normal_float32,
)

FORMAT_VERSION = 1
"""The version :func:`state_dict` writes and :func:`from_state_dict` reads."""

_TOP_KEYS = ("format_version", "kind", "config", "values")
_CONFIG_KEYS = {
    "noop": (),
    "static": (),
    "dynamic": tuple(f.name for f in dataclasses.fields(DynamicConfig)),
}
# The interval rule's dict has only these config keys (as before headroom growth);
# growth="headroom" has all of _CONFIG_KEYS["dynamic"] and these values too.
INTERVAL_CONFIG_KEYS = _BASE_FIELDS
HEADROOM_VALUE_KEYS = ("grad_max_history", "headroom_tracker", "ceiling")
_VALUE_KEYS = {
    "noop": (),
    "static": ("loss_scale",),
    "dynamic": ("loss_scale", "growth_tracker", "nonfinite_tracker"),
}
_KIND_OF_TYPE: dict[type, str] = {
    NoOpLossScale: "noop",
    StaticLossScale: "static",
    DynamicLossScale: "dynamic",
}
_F32 = np.finfo(np.float32)
_INT64_BOUND = 2**63


_INVALID = "invalid loss-scale state dict: "
_USE_RESTORE_WITH_CONFIG = (
    "To keep the saved loss scale and counters under the target's configuration, use "
    "`loss_scaling.restore_with_config(saved, target)` (on a whole optimizer state or "
    "TrainState: `loss_scaling.restore_loss_scale(state, saved, adopt_config=True)`); to "
    "keep the saved configuration, build the optimizer with it."
)


def _mapping(name: str | None, value: Any, keys: tuple[str, ...],
             optional: tuple[str, ...] = ()) -> Mapping[str, Any]:
    """``value`` as a mapping with exactly ``keys`` (and any of ``optional``); ``name`` None
    for the top level."""
    what = "the state dict" if name is None else name
    prefix = "" if name is None else f"{name}."
    if not isinstance(value, Mapping):
        raise InvalidStateDict(
            f"{_INVALID}{what} must be a dict, got {show(value)} of type "
            f"{type(value).__name__}."
        )
    missing = [prefix + k for k in keys if k not in value]
    extra = [prefix + (k if isinstance(k, str) and k.isidentifier() else show(k))
             for k in value if not (isinstance(k, str) and (k in keys or k in optional))]
    if missing or extra:
        problems = []
        if missing:
            problems.append("missing key(s) " + ", ".join(missing))
        if extra:
            problems.append("unexpected key(s) " + ", ".join(extra))
        raise InvalidStateDict(
            f"{_INVALID}{what}: {'; '.join(problems)}. It must have exactly the keys "
            f"{list(keys)}."
        )
    return value


def _scalar_item(name: str, value: Any) -> Any:
    """A concrete 0-d numeric array as its Python scalar; anything else unchanged.

    datetime64, timedelta64 and object arrays (and numpy's datetime / timedelta scalars,
    which numpy counts as integers) are refused: ``.item()`` would turn them into numbers.
    """
    if isinstance(value, jax.core.Tracer):
        raise InvalidStateDict(f"{_INVALID}{name} must be a concrete number, got a traced value.")
    dtype = getattr(value, "dtype", None)
    if isinstance(dtype, np.dtype) and not (
            dtype.kind in "biufc" or jnp.issubdtype(dtype, jnp.floating)):
        raise InvalidStateDict(
            f"{_INVALID}{name} must be a number, got {show(value)} of dtype {dtype}.")
    if isinstance(value, (np.ndarray, jax.Array)) and value.shape == ():
        return value.item()
    return value


def _number(name: str, value: Any) -> float:
    """A real number (int or float, not bool) as a Python float; range not checked."""
    value = _scalar_item(name, value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        raise InvalidStateDict(
            f"{_INVALID}{name} must be a number, got {show(value)} of type "
            f"{type(value).__name__}."
        )
    try:
        return float(value)
    except OverflowError:
        raise InvalidStateDict(
            f"{_INVALID}{name} must be a finite number, got {show(value)}."
        ) from None


def _integer(name: str, value: Any) -> int:
    """An integer (not bool, not float) as a Python int in the int64 range."""
    value = _scalar_item(name, value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InvalidStateDict(
            f"{_INVALID}{name} must be an integer, got {show(value)} of type "
            f"{type(value).__name__}."
        )
    as_int = int(value)
    if not -_INT64_BOUND <= as_int < _INT64_BOUND:
        raise InvalidStateDict(f"{_INVALID}{name} is out of range: got {show(value)}.")
    return as_int


def _scale(name: str, value: Any) -> float:
    number = _number(name, value)
    try:
        as_f32 = positive_normal_float32(name, number)
    except ValueError as error:
        raise InvalidStateDict(_prefixed(error)) from None
    return _exact_float32(name, number, as_f32)


_NOT_FLOAT32 = (
    "{prefix}{name} is {value!r}, which float32 does not represent exactly: the nearest "
    "float32 values are {below!r} and {above!r}. A state dict holds float32 values exactly "
    "(state_dict writes them so, and a JSON round trip keeps them): write one of those."
)


def _exact_float32(name: str, value: float, as_f32: float | None = None,
                   below_normal: bool = False) -> float:
    """``value`` if float32 holds it exactly; a ValueError naming both neighbours if not.

    A value outside float32's finite normal range is left to the range checks (their
    message says what the range is), except with ``below_normal`` (a
    ``grad_max_history`` entry, which may be 0 or subnormal): then a value between
    float32's subnormals, or below the smallest, is refused too."""
    with np.errstate(over="ignore", under="ignore"):
        rounded = np.float32(value)
    lowest = 0.0 if below_normal else _F32.tiny
    if (as_f32 is None and not (np.isfinite(rounded) and abs(rounded) >= lowest)) \
            or float(rounded) == value:
        return value
    step = np.float32(np.inf if float(rounded) < value else -np.inf)
    below, above = sorted((float(rounded), float(np.nextafter(rounded, step))))
    raise InvalidStateDict(_NOT_FLOAT32.format(prefix=_INVALID, name=name, value=value,
                                               below=below, above=above))


class InvalidStateDict(ValueError):
    """A state dict refused, the message prefixed with ``invalid loss-scale state dict: ``."""


def _prefixed(error: ValueError) -> str:
    """A core validator's message (it names the argument) as a state-dict message."""
    return str(error) if isinstance(error, InvalidStateDict) else _INVALID + str(error)


def _in_range(name: str, value: int, low: int, high: int, bound: str) -> int:
    if not low <= value <= high:
        raise InvalidStateDict(
            f"{_INVALID}{name} must be an integer in [{low}, {bound}] = [{low}, {high}], "
            f"got {value}."
        )
    return value


def place_like(value: Any, like: Any) -> Any:
    """``value`` (a scalar) in the layout of the leaf ``like``: its shape (a replicated
    state's leading device axes) and its sharding (``NamedSharding`` or pmap's, on one
    host or many: each device gets its copy from this host's value)."""
    shape = tuple(np.shape(like))
    host = np.broadcast_to(np.asarray(value), shape)
    sharding = getattr(like, "sharding", None)
    if sharding is None or isinstance(like, jax.core.Tracer):
        return jnp.asarray(host)
    return jax.make_array_from_callback(shape, sharding, lambda index: host[index])
