"""The JSON state-dict format: :func:`state_dict`, :func:`from_state_dict`, and reading
values out of untrusted dicts (field by field, then :mod:`loss_scaling.core.validation`;
every refusal names the field) and off devices. README.md says why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loss_scaling._errors import show
from loss_scaling.core import validation
from loss_scaling.core.scalers import (
    DYNAMIC_LEAVES,
    FLOAT_LEAVES,
    HEADROOM_LEAVES,
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    leaf_names,
    leaf_ndim,
    require_scaler,
)
from loss_scaling.core.validation import DynamicConfig

FORMAT_VERSION = 1
"""The version :func:`state_dict` writes and :func:`from_state_dict` reads."""

_INVALID = "invalid loss-scale state dict: "
_TOP_KEYS = ("format_version", "kind", "config", "values")
_CONFIG_KEYS = {"noop": (), "static": (),
                "dynamic": tuple(f.name for f in dataclasses.fields(DynamicConfig))}
_VALUE_KEYS = {"noop": (), "static": ("loss_scale",),
               "dynamic": ("loss_scale", "growth_tracker", "nonfinite_tracker")}
# growth="headroom" has all of _CONFIG_KEYS["dynamic"] and these values too; the interval
# rule's dict has only INTERVAL_FIELDS as config keys (as before headroom growth).
HEADROOM_VALUE_KEYS = ("grad_max_history", "headroom_tracker", "ceiling")
_KIND_OF_TYPE: dict[type, str] = {
    NoOpLossScale: "noop", StaticLossScale: "static", DynamicLossScale: "dynamic"}
_F32 = np.finfo(np.float32)


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
            np.isfinite(rounded) and abs(rounded) >= (0.0 if below_normal else _F32.tiny)):
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


def _parse(d: Any) -> tuple[str, DynamicConfig | None, dict[str, Any]]:
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
    if not isinstance(kind, str) or kind not in _CONFIG_KEYS:
        raise ValueError(f"unknown kind {show(kind)}: expected one of {list(_CONFIG_KEYS)}.")
    config_keys, value_keys = _CONFIG_KEYS[kind], _VALUE_KEYS[kind]
    if kind == "dynamic":
        if isinstance(d["config"], Mapping) and d["config"].get("growth") == "headroom":
            value_keys += HEADROOM_VALUE_KEYS
        else:  # the others may be given, and the validator refuses headroom options
            config_keys = validation.INTERVAL_FIELDS
    raw_config = _mapping("config", d["config"], config_keys, optional=_CONFIG_KEYS[kind])
    raw_values = _mapping("values", d["values"], value_keys,
                          optional=("failure",) if kind == "dynamic" else ())
    if kind == "noop":
        return kind, None, {}
    loss_scale = _scale("values.loss_scale", raw_values["loss_scale"])
    if kind == "static":
        return kind, None, {"loss_scale": loss_scale}
    config = _parse_config(raw_config)
    validation.scale_in_range("values.loss_scale", loss_scale, config, where="config.")
    values: dict[str, Any] = {"loss_scale": loss_scale}
    for name in validation.counter_ranges(config):  # failure: optional
        values[name] = _integer(f"values.{name}", raw_values.get(name, 0))
        validation.counter_in_range(name, values[name], config, where="values.")
    if config.growth == "headroom":
        raw = raw_values["grad_max_history"]
        if not isinstance(raw, (list, tuple)) or len(raw) != config.headroom_window:
            raise ValueError(f"values.grad_max_history must be a list of "
                             f"config.headroom_window = {config.headroom_window} numbers, "
                             f"got {show(raw)}.")
        values["grad_max_history"] = [
            _number(f"values.grad_max_history[{i}]", x, below_normal=True)
            for i, x in enumerate(raw)]
        validation.history_in_range("values.grad_max_history", values["grad_max_history"])
        values["ceiling"] = _scale("values.ceiling", raw_values["ceiling"])
        validation.scale_in_range("values.ceiling", values["ceiling"], config, where="config.")
    return kind, config, values


def _parse_config(raw: Mapping[str, Any]) -> DynamicConfig:
    """A dynamic config: each field read on its own (the message names the one at
    fault), then checked by the validator, its messages naming ``config.<field>``."""
    settings: dict[str, Any] = {}
    for name, value in raw.items():
        field = f"config.{name}"
        if name in ("growth_factor", "backoff_factor", "headroom_margin"):
            settings[name] = _number(field, value)
        elif name in ("growth_interval", "hysteresis", "headroom_window"):
            settings[name] = _integer(field, value)
        elif name in ("min_scale", "max_scale"):
            settings[name] = None if value is None else _scale(field, value)
        elif name == "headroom_dtype" and not isinstance(value, str):
            raise ValueError(f"{field} must be a dtype name (a str such as 'float16'), got "
                             f"{show(value)} of type {type(value).__name__}.")
        else:
            settings[name] = value
    try:
        return validation.dynamic_config(**settings)
    except ValueError as error:  # names the argument (growth_factor, backoff_factor)
        raise ValueError(f"config.{error}") from None


def _build(kind: str, config: DynamicConfig | None, values: dict[str, Any]) -> LossScale:
    if kind == "noop":
        return NoOpLossScale()
    if kind == "static":
        return StaticLossScale(values["loss_scale"])
    assert config is not None
    names = HEADROOM_LEAVES if config.growth == "headroom" else DYNAMIC_LEAVES
    return DynamicLossScale._from_parts(config, tuple(jnp.asarray(np.asarray(
        values.get(name, 0), np.float32 if name in FLOAT_LEAVES else np.int32))
        for name in names))


# ------------------------------------------------- leaves on the host, and back


def _kind(scaler: Any) -> str:
    require_scaler("state", scaler)
    return _KIND_OF_TYPE[type(scaler)]


def _host_array(leaf: Any) -> np.ndarray:
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


def _concrete(leaf: Any) -> bool:
    return leaf is not None and not isinstance(
        leaf, (jax.ShapeDtypeStruct, jax.core.Tracer)) and hasattr(leaf, "shape")


def _static_factor(scaler: StaticLossScale) -> float | None:
    """The factor of a concrete static scaler (one value, replicated or not); None for a
    placeholder (an abstract target carries no factor)."""
    if not _concrete(scaler.loss_scale):
        return None
    values = np.unique(_host_array(scaler.loss_scale).astype(np.float32))
    if values.size != 1:
        raise ValueError(
            f"the StaticLossScale's replicas disagree: loss_scale {show(values.tolist())}.")
    return float(values[0])


def _read(name: str, leaf: Any, integer: bool, ndim: int = 0) -> Any:
    """A scalar leaf as a Python number (``ndim=1``: a vector leaf as a list of floats)."""
    if isinstance(leaf, jax.core.Tracer):
        raise ValueError(f"state_dict needs concrete values, but {name} is traced: call it "
                         "outside jit, on the state a compiled step returned.")
    array = _host_array(leaf)
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
    kind = _kind(scaler)
    config = {} if not isinstance(scaler, DynamicLossScale) else {
        name: getattr(scaler.config, name) for name in validation.config_fields(scaler.config)}
    values = {name: _read(name, getattr(scaler, name), integer=name not in FLOAT_LEAVES,
                          ndim=leaf_ndim(name)) for name in leaf_names(scaler)}
    if values.get("failure") == 0:  # written only when set: a healthy state's dict is unchanged
        del values["failure"]
    d = {"format_version": FORMAT_VERSION, "kind": kind, "config": config, "values": values}
    _parse(d)
    return d


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
    return _build(*_parse(d))
