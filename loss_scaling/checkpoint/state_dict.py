"""The JSON state-dict format: :func:`state_dict`, :func:`from_state_dict`, and reading
values out of untrusted dicts (field by field, then :mod:`loss_scaling.core.validation`;
every refusal names the field) and off devices. README.md says why.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loss_scaling._errors import show
from loss_scaling.core import fields, validation
from loss_scaling.core.fields import DynamicConfig
from loss_scaling.core.scalers import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    dynamic_from_leaves,
    leaf_names,
    require_scaler,
)
from loss_scaling.core.validation import F32

FORMAT_VERSION = 1
"""The version :func:`state_dict` writes and :func:`from_state_dict` reads."""

_INVALID = "invalid loss-scale state dict: "
_TOP_KEYS = ("format_version", "kind", "config", "values")
_KIND_OF_TYPE: dict[type, str] = {
    NoOpLossScale: "noop", StaticLossScale: "static", DynamicLossScale: "dynamic"}
KINDS = tuple(_KIND_OF_TYPE.values())
OPTIONAL_VALUES = (fields.FAILURE,)
"""Values a dict holds only when set: a healthy state's dict has no ``failure``."""


def config_keys(kind: str, growth: Any = fields.INTERVAL) -> tuple[str, ...]:
    """The keys of a ``kind`` dict's ``config`` (a dynamic one's: those its rule shows)."""
    if kind != "dynamic":
        return ()
    return fields.shown(growth if growth in fields.GROWTH_RULES else fields.INTERVAL)


def value_keys(kind: str, growth: Any = fields.INTERVAL) -> tuple[str, ...]:
    """The keys of a ``kind`` dict's ``values`` (:data:`OPTIONAL_VALUES` included)."""
    if kind == "noop":
        return ()
    if kind == "static":
        return (fields.LOSS_SCALE,)
    return fields.dynamic_leaf_names(
        growth if growth in fields.GROWTH_RULES else fields.INTERVAL)


# ----------------------------------------------------------- reading untrusted fields


def _mapping(name: str | None, value: Any, keys: tuple[str, ...],
             optional: tuple[str, ...] = ()) -> Mapping[str, Any]:
    """``value`` as a mapping with exactly ``keys`` (and any of ``optional``); ``name`` None
    for the top level."""
    what = "the state dict" if name is None else name
    prefix = "" if name is None else f"{name}."
    if not isinstance(value, Mapping):
        raise ValueError(f"{what} must be a dict, got {show(value)} of type "
                         f"{type(value).__name__}.")
    missing = [prefix + k for k in keys if k not in value]
    extra = [prefix + (k if isinstance(k, str) and k.isidentifier() else show(k))
             for k in value if not (isinstance(k, str) and (k in keys or k in optional))]
    if missing or extra:
        problems = ([f"missing key(s) {', '.join(missing)}"] if missing else []) + (
            [f"unexpected key(s) {', '.join(extra)}"] if extra else [])
        raise ValueError(f"{what}: {'; '.join(problems)}. It must have exactly the keys "
                         f"{list(keys)}.")
    return value


def _scalar_item(name: str, value: Any) -> Any:
    """A concrete 0-d numeric array as its Python scalar; anything else unchanged.
    datetime64, timedelta64 and object arrays (numpy counts the first two as integers)
    are refused: ``.item()`` would turn them into numbers."""
    dtype = getattr(value, "dtype", None)
    if isinstance(dtype, np.dtype) and not (
            dtype.kind in "biufc" or jnp.issubdtype(dtype, jnp.floating)):
        raise ValueError(f"{name} must be a number, got {show(value)} of dtype {dtype}.")
    if isinstance(value, (np.ndarray, jax.Array)) and value.shape == ():
        return value.item()
    return value


def _number(name: str, value: Any, below_normal: bool = False) -> float:
    """A real number (int or float, not bool) that float32 holds exactly, as a Python
    float. Its range is the validator's, except with ``below_normal`` (a
    ``grad_max_history`` entry, which may be 0 or subnormal)."""
    value = _scalar_item(name, value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(
            value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a number, got {show(value)} of type "
                         f"{type(value).__name__}.")
    try:
        number = float(value)
    except OverflowError:
        raise ValueError(f"{name} must be a finite number, got {show(value)}.") from None
    with np.errstate(over="ignore", under="ignore"):
        rounded = np.float32(number)
    if float(rounded) == number or not (
            np.isfinite(rounded) and abs(rounded) >= (0.0 if below_normal else F32.tiny)):
        return number  # exact, or out of range: the range check names the range
    below, above = sorted((float(rounded), float(np.nextafter(
        rounded, np.float32(np.inf if float(rounded) < number else -np.inf)))))
    raise ValueError(f"{name} is {number!r}, which float32 does not represent exactly: the "
                     f"nearest float32 values are {below!r} and {above!r}; a state dict "
                     "holds float32 values exactly: write one of those.")


def _integer(name: str, value: Any) -> int:
    """An integer (not bool, not float) as a Python int; its range is the validator's."""
    value = _scalar_item(name, value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {show(value)} of type "
                         f"{type(value).__name__}.")
    return int(value)


def _scale(name: str, value: Any) -> float:
    return validation.positive_normal_float32(name, _number(name, value))


# --------------------------------------------------------------------- the format


def parse(d: Any) -> tuple[str, DynamicConfig | None, dict[str, Any]]:
    """Validates a state dict; returns its kind, its config (dynamic only) and values."""
    try:
        return _parse_fields(d)
    except ValueError as error:
        raise ValueError(_INVALID + str(error)) from None


def _parse_fields(d: Any) -> tuple[str, DynamicConfig | None, dict[str, Any]]:
    d = _mapping(None, d, _TOP_KEYS)
    version = d["format_version"]
    if isinstance(version, (bool, np.bool_)) or not isinstance(version, (int, np.integer)) \
            or version != FORMAT_VERSION:
        raise ValueError(f"format_version must be the integer {FORMAT_VERSION} (the one this "
                         f"loss_scaling reads), got {show(version)}.")
    kind = d["kind"]
    if not isinstance(kind, str) or kind not in KINDS:
        raise ValueError(f"unknown kind {show(kind)}: expected one of {list(KINDS)}.")
    growth = d["config"].get("growth") if isinstance(d["config"], Mapping) else None
    # Exactly the keys its rule shows: an interval dict has the keys it had before
    # headroom growth existed, a headroom dict every setting.
    raw_config = _mapping("config", d["config"], config_keys(kind, growth))
    keys = value_keys(kind, growth)
    raw_values = _mapping("values", d["values"], tuple(k for k in keys if k not in
                                                       OPTIONAL_VALUES),
                          optional=tuple(k for k in keys if k in OPTIONAL_VALUES))
    if kind == "noop":
        return kind, None, {}
    loss_scale = _scale("values.loss_scale", raw_values[fields.LOSS_SCALE])
    if kind == "static":
        return kind, None, {fields.LOSS_SCALE: loss_scale}
    config = _parse_config(raw_config)
    values: dict[str, Any] = {fields.LOSS_SCALE: loss_scale}
    for name in keys:
        label = f"values.{name}"
        raw = raw_values.get(name, 0)  # an optional value: 0
        if fields.ndim(name):
            length = fields.shape(name, config)[0]
            if not isinstance(raw, (list, tuple)) or len(raw) != length:
                raise ValueError(f"{label} must be a list of config.headroom_window = "
                                 f"{length} numbers, got {show(raw)}.")
            values[name] = [_number(f"{label}[{i}]", x, below_normal=True)
                            for i, x in enumerate(raw)]
        elif name != fields.LOSS_SCALE:
            values[name] = (_scale(label, raw) if fields.is_float(name)
                            else _integer(label, raw))
        fields.check_leaf(name, values[name], config, label=label, config_name="config.")
    return kind, config, values


def _parse_config(raw: Mapping[str, Any]) -> DynamicConfig:
    """A dynamic config: each setting read as its declaration says (the message names
    the one at fault), then checked by it, the messages naming ``config.<setting>``."""
    reads = {f.name: f.metadata["read"] for f in fields.SETTINGS}
    settings: dict[str, Any] = {}
    for name, value in raw.items():
        field = f"config.{name}"
        read = reads[name]
        if read == "number":
            settings[name] = _number(field, value)
        elif read == "integer":
            settings[name] = _integer(field, value)
        elif read == "scale":
            settings[name] = None if value is None else _scale(field, value)
        elif read == "dtype" and not isinstance(value, str):
            raise ValueError(f"{field} must be a dtype name (a str such as 'float16'), got "
                             f"{show(value)} of type {type(value).__name__}.")
        else:
            settings[name] = value
    for name in fields.SETTING_NAMES:  # the other rule's options: not in the dict
        settings.setdefault(name, None if name != "growth" else fields.INTERVAL)
    try:
        return fields.dynamic_config(**settings)
    except ValueError as error:  # names the argument (growth_factor, backoff_factor)
        raise ValueError(f"config.{error}") from None


def build(kind: str, config: DynamicConfig | None, values: dict[str, Any]) -> LossScale:
    """The state :func:`parse` read (checked values, Python numbers), as float32 / int32
    arrays."""
    if kind == "noop":
        return NoOpLossScale()
    if kind == "static":
        return StaticLossScale(values[fields.LOSS_SCALE])
    assert config is not None
    return dynamic_from_leaves(config, tuple(
        jnp.asarray(np.asarray(values.get(name, 0), fields.dtype(name)))
        for name in fields.dynamic_leaf_names(config.growth)))


# ------------------------------------------------- leaves on the host, and back


def kind_of(scaler: Any) -> str:
    """The ``kind`` of a loss-scale state (a TypeError naming anything else)."""
    require_scaler("state", scaler)
    return _KIND_OF_TYPE[type(scaler)]


def host_array(leaf: Any) -> np.ndarray:
    """A concrete leaf on the host; a replicated array that spans other hosts' devices
    (multi-host ``NamedSharding``) is read from this host's own copy."""
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        if not leaf.is_fully_replicated:
            raise ValueError(f"a loss-scale leaf of shape {leaf.shape} is sharded across "
                             "hosts: the loss scale must be replicated.")
        return np.asarray(leaf.addressable_data(0))
    return np.asarray(leaf)


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


def is_concrete(leaf: Any) -> bool:
    """Whether a leaf holds values (not a placeholder: None, ShapeDtypeStruct, a tracer)."""
    return leaf is not None and not isinstance(
        leaf, (jax.ShapeDtypeStruct, jax.core.Tracer)) and hasattr(leaf, "shape")


def static_factor(scaler: StaticLossScale) -> float | None:
    """The factor of a concrete static scaler (one value, replicated or not); None for a
    placeholder (an abstract target carries no factor)."""
    if not is_concrete(scaler.loss_scale):
        return None
    values = np.unique(host_array(scaler.loss_scale).astype(np.float32))
    if values.size != 1:
        raise ValueError(
            f"the StaticLossScale's replicas disagree: loss_scale {show(values.tolist())}.")
    return float(values[0])


def _read(name: str, leaf: Any, integer: bool, ndim: int = 0) -> Any:
    """A scalar leaf as a Python number (``ndim=1``: a vector leaf as a list of floats)."""
    if isinstance(leaf, jax.core.Tracer):
        raise ValueError(f"state_dict needs concrete values, but {name} is traced: call it "
                         "outside jit, on the state a compiled step returned.")
    array = host_array(leaf)
    if array.ndim != ndim:
        raise ValueError(
            f"state_dict needs {'scalar' if ndim == 0 else 'vector'} values, but {name} has "
            f"shape {array.shape}. A replicated state (pmap) has a leading device axis: save "
            "one replica, e.g. `jax.tree.map(lambda x: x[0], scaler)`.")
    if array.dtype.kind not in ("iu" if integer else "f"):
        raise ValueError(f"state_dict needs {'an integer' if integer else 'a floating'} "
                         f"{name}, got dtype {array.dtype}.")
    if integer:
        return int(array)
    with np.errstate(over="ignore", under="ignore"):
        as_f32 = array.astype(np.float32)
    return [float(x) for x in as_f32] if ndim else float(as_f32)


def state_dict(scaler: LossScale) -> dict[str, Any]:
    """A loss-scale state as a plain, JSON-compatible dict.

    ``{"format_version": 1, "kind": ..., "config": {...}, "values": {...}}`` holding only
    str, int, float and None. ``kind`` is ``"noop"``, ``"static"`` or ``"dynamic"``; a
    dynamic ``config`` has every constructor setting but ``init_scale``. Floats are
    float32 values, so ``json.dumps`` / ``json.loads`` round trips are bit-exact. The dict
    is checked as :func:`from_state_dict` checks it: one that cannot be restored is
    never written.

    Args:
      scaler: a ``NoOpLossScale``, ``StaticLossScale`` or ``DynamicLossScale`` with
        concrete scalar values (not inside ``jit``; one replica of a ``pmap``-ed state).

    Returns:
      A new dict.

    Raises:
      ValueError: if a value is traced, not a scalar, or invalid (e.g. a NaN scale).
      TypeError: if ``scaler`` is not a loss-scale state.

    Examples:
      >>> import json
      >>> import loss_scaling as ls
      >>> from loss_scaling import state_dict, from_state_dict
      >>> s = ls.update(ls.DynamicLossScale(init_scale=1024.0, growth_interval=100), True)
      >>> d = state_dict(s)
      >>> d["kind"], d["values"]
      ('dynamic', {'loss_scale': 1024.0, 'growth_tracker': 1, 'nonfinite_tracker': 0})
      >>> d["config"]["growth_interval"]
      100
      >>> restored = from_state_dict(json.loads(json.dumps(d)))
      >>> float(restored.loss_scale), int(restored.growth_tracker)
      (1024.0, 1)
      >>> state_dict(ls.StaticLossScale(128.0))
      {'format_version': 1, 'kind': 'static', 'config': {}, 'values': {'loss_scale': 128.0}}
    """
    kind = kind_of(scaler)
    config = getattr(scaler, "config", None)
    settings = {} if config is None else {
        name: getattr(config, name) for name in fields.shown(config.growth)}
    values = {name: _read(name, getattr(scaler, name), integer=not fields.is_float(name),
                          ndim=fields.ndim(name)) for name in leaf_names(scaler)}
    # The values as from_state_dict checks them: one that cannot be restored is never
    # written (a NaN scale, a counter out of range).
    try:
        for name, value in values.items():
            fields.check_leaf(name, value, config, label=f"values.{name}",
                              config_name="config.")
    except ValueError as error:
        raise ValueError(_INVALID + str(error)) from None
    for name in OPTIONAL_VALUES:  # written only when set: a healthy state's dict is unchanged
        if values.get(name) == 0:
            del values[name]
    return {"format_version": FORMAT_VERSION, "kind": kind, "config": settings,
            "values": values}


def from_state_dict(d: Any) -> LossScale:
    """Rebuilds a loss-scale state from a dict made by :func:`state_dict`.

    Validated as construction validates its arguments, and more: exactly the expected
    keys at every level, the expected types (ints where floats are expected, bools
    never), a known ``format_version`` and ``kind``, the scale within ``[min_scale,
    max_scale]``, the counters within their ranges. Every float must be a float32 value
    exactly, as :func:`state_dict` writes it: a hand-written ``16777217.0`` is refused
    (naming float32's neighbours), never rounded silently.

    Args:
      d: the dict (e.g. from ``json.loads``).

    Returns:
      A ``NoOpLossScale``, ``StaticLossScale`` or ``DynamicLossScale`` whose leaves are
      float32 / int32 scalar arrays.

    Raises:
      ValueError: naming the field at fault, for anything that is not a valid state dict.
        No other exception escapes for any JSON-like ``d`` (dicts, lists, strings,
        numbers, bools and None, however nested or large).

    Examples:
      >>> from loss_scaling import from_state_dict
      >>> d = {"format_version": 1, "kind": "static", "config": {},
      ...      "values": {"loss_scale": 1024}}
      >>> from_state_dict(d)
      StaticLossScale(loss_scale=Array(1024., dtype=float32))
      >>> d["values"]["loss_scale"] = float("nan")
      >>> from_state_dict(d)
      Traceback (most recent call last):
      ...
      ValueError: invalid loss-scale state dict: values.loss_scale must be a finite, ...
    """
    return build(*parse(d))
