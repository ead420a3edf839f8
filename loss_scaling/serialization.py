"""Saving and restoring loss-scale states.

Every route either returns a valid state in the target's layout or raises a
``ValueError`` that names the field and the value:

* :func:`state_dict` / :func:`from_state_dict`: a plain, JSON-compatible dict holding a
  format version, the kind, the configuration and the values. Restoring validates it as
  construction does and refuses anything else with a ``ValueError`` naming the field.
  ``json.dumps`` / ``json.loads`` round trips are bit-exact (every float is a float32
  value, which a Python float and JSON represent exactly).
* ``flax.serialization``: importing this module registers the three scaler classes.
  ``to_state_dict`` / ``to_bytes`` store a static or dynamic scaler as one *checked
  record* (bytes: its values, their shape and a CRC-32; the leaves by name for
  placeholders); ``from_state_dict`` / ``from_bytes`` restore it into a target, keeping
  the *target's* configuration and layout: the shapes must be the target's (scalars, or
  the leading device axes of a ``pmap``-replicated target), the values must be valid for
  its configuration, a ``StaticLossScale`` factor must be the target's. Why a checksum:
  a flipped bit of the scale's float32 is usually another valid, in-range scale, which
  no validation can tell from the saved one; the CRC-32 refuses every corruption of 1 to
  32 bits and all but 2**-32 of the others. Bytes written before the record (named
  leaves) still restore, range-checked only. :func:`from_bytes` is
  ``flax.serialization.from_bytes`` with msgpack's own decoding errors (truncated bytes,
  a corrupted header) turned into that ``ValueError`` too.
* :func:`restore_loss_scale`: the loss scale inside an optimizer state or TrainState
  replaced by a saved :func:`state_dict`, in the layout of the arrays it replaces
  (unreplicated, ``pmap``-replicated or sharded). ``loss_scaling.orbax_save_args`` /
  ``loss_scaling.orbax_restore`` (:mod:`loss_scaling.orbax`) do it for Orbax.

A saved state and a freshly configured target can disagree on the configuration (a new
``growth_interval``, a ``min_scale`` added on resume, a ``StaticLossScale`` built with
another factor). Nothing adopts the new settings silently: :func:`check_same_config`
raises, listing every difference, and :func:`restore_with_config` is the explicit way to
keep the saved scale and counters under the target's configuration.

A restored state that reaches a step without any of these checks (a hand-made array
checkpoint) cannot hurt either: a step whose scale is not a positive normal float32
applies no update and records ``Failure.INVALID_SCALE`` (see :func:`loss_scaling.check`).
"""

from __future__ import annotations

import dataclasses
import reprlib
import struct
import zlib
from collections.abc import Mapping
from typing import Any

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax

from loss_scaling._errors import Failure
from loss_scaling.scalers import (
    DynamicConfig,
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    positive_int32,
    positive_normal_float32,
    validate_dynamic_config,
)
from loss_scaling.transform import LossScalingState

__all__ = [
    "FORMAT_VERSION",
    "check_same_config",
    "from_state_dict",
    "restore_loss_scale",
    "restore_with_config",
    "state_dict",
]

FORMAT_VERSION = 1
"""The version :func:`state_dict` writes and :func:`from_state_dict` reads."""

_TOP_KEYS = ("format_version", "kind", "config", "values")
_CONFIG_KEYS = {
    "noop": (),
    "static": (),
    "dynamic": tuple(f.name for f in dataclasses.fields(DynamicConfig)),
}
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

PRE_LOSS_SCALING = (
    "{where}. Is it a checkpoint written before loss scaling was added (an fp32 run moving "
    "to float16, its optimizer state a bare optax state)? Such a checkpoint restores with "
    "its own structure; then start loss scaling from it by placing the old optimizer "
    "state into the new one's inner state, e.g. `opt_state = "
    "tx.init(params)._replace(inner_state=old_opt_state)`: see \"Starting loss scaling "
    "from an existing checkpoint\" in docs/checkpoints.md."
)

_repr = reprlib.Repr()
_repr.maxstring = 60
_repr.maxother = 60


def _show(value: Any) -> str:
    """A short repr for error messages that never fails (huge ints, deep nesting)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"<an integer of {value.bit_length()} bits>"
    try:
        return _repr.repr(value)
    except Exception:  # repr of hostile input: the message must still be a ValueError
        return f"<a {type(value).__name__} object>"


# ---------------------------------------------------------------------------- parsing


def _mapping(name: str | None, value: Any, keys: tuple[str, ...],
             optional: tuple[str, ...] = ()) -> Mapping[str, Any]:
    """``value`` as a mapping with exactly ``keys`` (and any of ``optional``); ``name`` None
    for the top level."""
    what = "the state dict" if name is None else name
    prefix = "" if name is None else f"{name}."
    if not isinstance(value, Mapping):
        raise ValueError(
            f"{_INVALID}{what} must be a dict, got {_show(value)} of type "
            f"{type(value).__name__}."
        )
    missing = [prefix + k for k in keys if k not in value]
    extra = [prefix + (k if isinstance(k, str) and k.isidentifier() else _show(k))
             for k in value if not (isinstance(k, str) and (k in keys or k in optional))]
    if missing or extra:
        problems = []
        if missing:
            problems.append("missing key(s) " + ", ".join(missing))
        if extra:
            problems.append("unexpected key(s) " + ", ".join(extra))
        raise ValueError(
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
        raise ValueError(f"{_INVALID}{name} must be a concrete number, got a traced value.")
    dtype = getattr(value, "dtype", None)
    if isinstance(dtype, np.dtype) and not (
            dtype.kind in "biufc" or jnp.issubdtype(dtype, jnp.floating)):
        raise ValueError(
            f"{_INVALID}{name} must be a number, got {_show(value)} of dtype {dtype}.")
    if isinstance(value, (np.ndarray, jax.Array)) and value.shape == ():
        return value.item()
    return value


def _number(name: str, value: Any) -> float:
    """A real number (int or float, not bool) as a Python float; range not checked."""
    value = _scalar_item(name, value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        raise ValueError(
            f"{_INVALID}{name} must be a number, got {_show(value)} of type "
            f"{type(value).__name__}."
        )
    try:
        return float(value)
    except OverflowError:
        raise ValueError(
            f"{_INVALID}{name} must be a finite number, got {_show(value)}."
        ) from None


def _integer(name: str, value: Any) -> int:
    """An integer (not bool, not float) as a Python int in the int64 range."""
    value = _scalar_item(name, value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(
            f"{_INVALID}{name} must be an integer, got {_show(value)} of type "
            f"{type(value).__name__}."
        )
    as_int = int(value)
    if not -_INT64_BOUND <= as_int < _INT64_BOUND:
        raise ValueError(f"{_INVALID}{name} is out of range: got {_show(value)}.")
    return as_int


def _scale(name: str, value: Any) -> float:
    number = _number(name, value)
    try:
        as_f32 = positive_normal_float32(name, number)
    except ValueError as error:
        raise ValueError(_prefixed(error)) from None
    return _exact_float32(name, number, as_f32)


_NOT_FLOAT32 = (
    "{prefix}{name} is {value!r}, which float32 does not represent exactly: the nearest "
    "float32 values are {below!r} and {above!r}. A state dict holds float32 values exactly "
    "(state_dict writes them so, and a JSON round trip keeps them): write one of those."
)


def _exact_float32(name: str, value: float, as_f32: float | None = None) -> float:
    """``value`` if float32 holds it exactly; a ValueError naming both neighbours if not.

    A value outside float32's finite normal range is left to the range checks (their
    message says what the range is)."""
    with np.errstate(over="ignore", under="ignore"):
        rounded = np.float32(value)
    if (as_f32 is None and not (np.isfinite(rounded) and abs(rounded) >= _F32.tiny)) \
            or float(rounded) == value:
        return value
    step = np.float32(np.inf if float(rounded) < value else -np.inf)
    below, above = sorted((float(rounded), float(np.nextafter(rounded, step))))
    raise ValueError(_NOT_FLOAT32.format(prefix=_INVALID, name=name, value=value,
                                         below=below, above=above))


def _prefixed(error: ValueError) -> str:
    message = str(error)
    return message if message.startswith(_INVALID) else _INVALID + message


def _in_range(name: str, value: int, low: int, high: int, bound: str) -> int:
    if not low <= value <= high:
        raise ValueError(
            f"{_INVALID}{name} must be an integer in [{low}, {bound}] = [{low}, {high}], "
            f"got {value}."
        )
    return value


def _parse(d: Any) -> tuple[str, DynamicConfig | None, dict[str, Any]]:
    """Validates a state dict; returns its kind, its config (dynamic only) and values."""
    d = _mapping(None, d, _TOP_KEYS)
    version = d["format_version"]
    if isinstance(version, (bool, np.bool_)) or not isinstance(version, (int, np.integer)):
        raise ValueError(
            f"{_INVALID}format_version must be the integer {FORMAT_VERSION}, got "
            f"{_show(version)} of type {type(version).__name__}."
        )
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{_INVALID}unsupported format_version {_show(version)}: this version of "
            f"loss_scaling reads format_version {FORMAT_VERSION}."
        )
    kind = d["kind"]
    if not isinstance(kind, str) or kind not in _CONFIG_KEYS:
        raise ValueError(
            f"{_INVALID}unknown kind {_show(kind)}: expected one of {list(_CONFIG_KEYS)}."
        )
    raw_config = _mapping("config", d["config"], _CONFIG_KEYS[kind])
    raw_values = _mapping("values", d["values"], _VALUE_KEYS[kind],
                          optional=("failure",) if kind == "dynamic" else ())
    if kind == "noop":
        return kind, None, {}
    loss_scale = _scale("values.loss_scale", raw_values["loss_scale"])
    if kind == "static":
        return kind, None, {"loss_scale": loss_scale}

    # Each field on its own first, so that the message names the one at fault.
    factors = {k: _exact_float32(f"config.{k}", _number(f"config.{k}", raw_config[k]))
               for k in ("growth_factor", "backoff_factor")}
    ints = {}
    for k in ("growth_interval", "hysteresis"):
        try:
            ints[k] = positive_int32(f"config.{k}", _integer(f"config.{k}", raw_config[k]))
        except ValueError as error:
            raise ValueError(_prefixed(error)) from None
    bounds = {k: None if raw_config[k] is None else _scale(f"config.{k}", raw_config[k])
              for k in ("min_scale", "max_scale")}
    if bounds["min_scale"] is not None and loss_scale < bounds["min_scale"]:
        raise ValueError(
            f"{_INVALID}values.loss_scale ({loss_scale!r}) is below config.min_scale "
            f"({bounds['min_scale']!r})."
        )
    if bounds["max_scale"] is not None and loss_scale > bounds["max_scale"]:
        raise ValueError(
            f"{_INVALID}values.loss_scale ({loss_scale!r}) is above config.max_scale "
            f"({bounds['max_scale']!r})."
        )
    try:
        config, loss_scale = validate_dynamic_config(
            init_scale=loss_scale, **factors, **ints, **bounds)
    except ValueError as error:  # names the argument (growth_factor, backoff_factor)
        raise ValueError(f"{_INVALID}config.{error}") from None
    growth_tracker = _in_range(
        "values.growth_tracker",
        _integer("values.growth_tracker", raw_values["growth_tracker"]),
        0, config.growth_interval - 1, "config.growth_interval - 1")
    nonfinite_tracker = _in_range(
        "values.nonfinite_tracker",
        _integer("values.nonfinite_tracker", raw_values["nonfinite_tracker"]),
        0, config.hysteresis, "config.hysteresis")
    failure = _in_range(
        "values.failure", _integer("values.failure", raw_values.get("failure", 0)),
        0, max(Failure), "the largest loss_scaling.Failure code")
    return kind, config, {
        "loss_scale": loss_scale,
        "growth_tracker": growth_tracker,
        "nonfinite_tracker": nonfinite_tracker,
        "failure": failure,
    }


def _build(kind: str, config: DynamicConfig | None, values: dict[str, Any]) -> LossScale:
    if kind == "noop":
        return NoOpLossScale()
    if kind == "static":
        return StaticLossScale(values["loss_scale"])
    assert config is not None
    return DynamicLossScale._from_parts(config, (
        jnp.asarray(values["loss_scale"], jnp.float32),
        jnp.asarray(values["growth_tracker"], jnp.int32),
        jnp.asarray(values["nonfinite_tracker"], jnp.int32),
        jnp.asarray(values.get("failure", 0), jnp.int32),
    ))


# --------------------------------------------------------------------------- reading


def _kind(scaler: Any) -> str:
    kind = _KIND_OF_TYPE.get(type(scaler))
    if kind is None:
        raise TypeError(
            "expected a NoOpLossScale, StaticLossScale or DynamicLossScale, got "
            f"{_show(scaler)} of type {type(scaler).__name__}."
        )
    return kind


def _host_array(leaf: Any) -> np.ndarray:
    """A concrete leaf on the host; a replicated array that spans other hosts' devices
    (multi-host ``NamedSharding``) is read from this host's own copy."""
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        if not leaf.is_fully_replicated:
            raise ValueError(
                f"a loss-scale leaf of shape {leaf.shape} is sharded across hosts: the loss "
                "scale must be replicated (it is, unless placed otherwise by hand).")
        return np.asarray(leaf.addressable_data(0))
    return np.asarray(leaf)


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
            f"the StaticLossScale's replicas disagree: loss_scale {_show(values.tolist())}.")
    return float(values[0])


def _read(name: str, leaf: Any, integer: bool) -> float | int:
    """A scalar leaf as a Python number; refuses tracers and non-scalars."""
    if isinstance(leaf, jax.core.Tracer):
        raise ValueError(
            f"state_dict needs concrete values, but {name} is a traced value {leaf!r}: call "
            "it outside jit/grad/vmap, on the state a compiled step returned."
        )
    array = _host_array(leaf)
    if array.shape != ():
        raise ValueError(
            f"state_dict needs scalar values, but {name} has shape {array.shape}. A "
            "replicated state (pmap) has a leading device axis: save one replica, e.g. "
            "`jax.tree.map(lambda x: x[0], scaler)`."
        )
    kinds = "iu" if integer else "f"
    if array.dtype.kind not in kinds:
        raise ValueError(
            f"state_dict needs {'an integer' if integer else 'a floating'} {name}, got "
            f"dtype {array.dtype}."
        )
    if integer:
        return int(array)
    with np.errstate(over="ignore", under="ignore"):
        return float(array.astype(np.float32))


def state_dict(scaler: LossScale) -> dict[str, Any]:
    """A loss-scale state as a plain, JSON-compatible dict.

    ``{"format_version": 1, "kind": ..., "config": {...}, "values": {...}}`` holding only
    str, int, float and None: ``kind`` is ``"noop"``, ``"static"`` or ``"dynamic"``;
    for ``"dynamic"``, ``config`` has every constructor setting but ``init_scale`` and
    ``values`` has ``loss_scale`` (float), ``growth_tracker`` and ``nonfinite_tracker``
    (int). Floats are float32 values, so ``json.dumps`` / ``json.loads`` round trips are
    bit-exact.

    The state is checked as :func:`from_state_dict` would check it, so a dict that cannot
    be restored is never written.

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
      >>> from loss_scaling.serialization import state_dict, from_state_dict
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
    config: dict[str, Any] = {}
    values: dict[str, Any] = {}
    if isinstance(scaler, StaticLossScale):
        values["loss_scale"] = _read("loss_scale", scaler.loss_scale, integer=False)
    elif isinstance(scaler, DynamicLossScale):
        config = dataclasses.asdict(scaler.config)
        values["loss_scale"] = _read("loss_scale", scaler.loss_scale, integer=False)
        for name in ("growth_tracker", "nonfinite_tracker"):
            values[name] = _read(name, getattr(scaler, name), integer=True)
        failure = _read("failure", scaler.failure, integer=True)
        if failure:  # written only when set: a healthy state's dict is unchanged
            values["failure"] = failure
    d = {"format_version": FORMAT_VERSION, "kind": kind, "config": config, "values": values}
    _parse(d)
    return d


def from_state_dict(d: Any) -> LossScale:
    """Rebuilds a loss-scale state from a dict made by :func:`state_dict`.

    The dict is validated as construction validates its arguments, and more: exactly the
    expected keys at every level, the expected types (ints are accepted where floats are
    expected, bools never), a known ``format_version`` and ``kind``, a valid
    configuration, a finite, positive, normal float32 ``loss_scale`` inside
    ``[min_scale, max_scale]``, ``0 <= growth_tracker < growth_interval`` and
    ``0 <= nonfinite_tracker <= hysteresis``. Every float (the scale, the factors and the
    bounds) must be a float32 value exactly, as :func:`state_dict` writes it: a
    hand-written ``16777217.0`` is refused (naming float32's neighbours 16777216 and
    16777218), never rounded silently.

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
      >>> from loss_scaling.serialization import from_state_dict
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


# -------------------------------------------------------------------- config changes


def _saved_parts(saved: Any) -> tuple[str, DynamicConfig | None, dict[str, Any]]:
    return _parse(saved if isinstance(saved, Mapping) else state_dict(saved))


def _config_differences(saved: Any, target: LossScale) -> list[str]:
    """Every field on which ``saved`` and ``target`` disagree, as readable lines."""
    target_kind = _kind(target)
    if isinstance(saved, Mapping):
        saved_kind, saved_config, _ = _parse(saved)
    else:
        saved_kind = _kind(saved)
        saved_config = saved.config if isinstance(saved, DynamicLossScale) else None
    if saved_kind != target_kind:
        return [f"kind: saved {saved_kind!r}, target {target_kind!r}"]
    if isinstance(target, StaticLossScale):
        # A static factor is configuration held in a leaf: compared, never adopted silently.
        saved_factor = (_parse(saved)[2]["loss_scale"] if isinstance(saved, Mapping)
                        else _static_factor(saved))
        target_factor = _static_factor(target)
        if None not in (saved_factor, target_factor) and saved_factor != target_factor:
            return [f"loss_scale (a StaticLossScale's factor): saved {saved_factor!r}, "
                    f"target {target_factor!r}"]
        return []
    if saved_config is None or not isinstance(target, DynamicLossScale):
        return []
    return [
        f"{f.name}: saved {getattr(saved_config, f.name)!r}, "
        f"target {getattr(target.config, f.name)!r}"
        for f in dataclasses.fields(DynamicConfig)
        if getattr(saved_config, f.name) != getattr(target.config, f.name)
    ]


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
      >>> from loss_scaling.serialization import check_same_config
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
    differences = _config_differences(saved, target)
    if differences:
        raise ValueError(
            "the saved loss-scale configuration differs from the target's:\n  "
            + "\n  ".join(differences) + "\n" + _USE_RESTORE_WITH_CONFIG
        )


def restore_with_config(saved: LossScale | Mapping[str, Any], target: LossScale) -> LossScale:
    """The saved values under the target's configuration: the explicit way to adopt it.

    Use it to resume a run with new loss-scale settings (say a shorter
    ``growth_interval``) while keeping the scale and counters the run had reached. The
    result has ``target``'s configuration and ``saved``'s ``loss_scale``; the counters are
    clamped into the new configuration's range (``growth_tracker`` to at most
    ``growth_interval - 1``, ``nonfinite_tracker`` to at most ``hysteresis``). The scale
    is not clamped: one outside the target's ``[min_scale, max_scale]`` is an error.
    ``target``'s own values are not used, with one exception: a ``StaticLossScale``'s
    factor *is* its configuration, so the result has the target's factor (the saved one
    when the target is abstract, e.g. from ``jax.eval_shape``, and has no value).

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
      >>> from loss_scaling.serialization import restore_with_config
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
    target_kind = _kind(target)
    kind, _, values = _saved_parts(saved)
    if kind != target_kind:
        raise ValueError(
            f"kind: saved {kind!r}, target {target_kind!r}. restore_with_config keeps the "
            "kind; to change it, build the new state from the saved scale, e.g. "
            "`ls.StaticLossScale(float(saved.loss_scale))`."
        )
    if isinstance(target, StaticLossScale):
        # The factor is the static scale's configuration: the target's wins (the saved one
        # when the target is abstract and has none).
        factor = _static_factor(target)
        return _in_layout(_build(kind, None, values if factor is None
                                 else {"loss_scale": factor}), target)
    if not isinstance(target, DynamicLossScale):
        return _build(kind, None, values)
    config = target.config
    scale = values["loss_scale"]
    if config.min_scale is not None and scale < config.min_scale:
        raise ValueError(
            f"the saved loss_scale ({scale!r}) is below the target's min_scale "
            f"({config.min_scale!r}); lower min_scale or keep the saved configuration."
        )
    if config.max_scale is not None and scale > config.max_scale:
        raise ValueError(
            f"the saved loss_scale ({scale!r}) is above the target's max_scale "
            f"({config.max_scale!r}); raise max_scale or keep the saved configuration."
        )
    return _in_layout(_build("dynamic", config, {
        "loss_scale": scale,
        "growth_tracker": min(values["growth_tracker"], config.growth_interval - 1),
        "nonfinite_tracker": min(values["nonfinite_tracker"], config.hysteresis),
        "failure": values["failure"],   # sticky: a new configuration does not heal a run
    }), target)


def _in_layout(scaler: LossScale, target: LossScale) -> LossScale:
    """``scaler`` (scalars) in the layout of a concrete ``target`` (replicated, sharded)."""
    if not all(map(_concrete, jax.tree.leaves(target))):
        return scaler
    return jax.tree.map(place_like, scaler, target)


# ------------------------------------------------------------- inside optimizer states


def restore_loss_scale(
    state: Any,
    saved: LossScale | Mapping[str, Any],
    *,
    adopt_config: bool = False,
    path: str | None = None,
) -> Any:
    """``state`` with its loss scale replaced by the saved one: the last step of a resume.

    Orbax (and any array checkpoint) stores the loss scale's *values* but not its
    configuration, which comes from the restore target: a resumed run built with a new
    ``growth_interval`` would silently run under it. Save :func:`state_dict` next to the
    arrays and pass it here after restoring. By default a configuration that differs
    from the saved one is an error (:func:`check_same_config`); ``adopt_config=True``
    keeps the saved scale and counters under ``state``'s configuration
    (:func:`restore_with_config`).

    Args:
      state: an optax state holding one :func:`~loss_scaling.with_loss_scaling` state
        (however nested), a flax ``TrainState``, an ``nnx.Optimizer`` or an ``nnx.State``
        of one; typically just restored from an array checkpoint into the freshly built
        optimizer's abstract state.
      saved: the saved loss scale: a dict from :func:`state_dict` (validated) or a
        loss-scale state.
      adopt_config: keep ``state``'s configuration instead of requiring the saved one.
      path: which loss scale, when ``state`` holds several (as for
        :func:`~loss_scaling.get_loss_scale`).

    Returns:
      A new state of the same structure; only the loss scale's leaves are new, each in
      the layout of the leaf it replaces: its shape (the leading device axis of a
      ``flax.jax_utils.replicate``-d state) and its sharding (``NamedSharding`` or
      ``pmap``'s, multi-host included: each device's copy comes from this host's value).
      A ``StaticLossScale`` restored by Orbax already holds the *saved* factor, so the
      configured one cannot be compared here: :func:`loss_scaling.orbax_restore` with a
      concrete target compares it.

    Raises:
      ValueError: if the configurations differ (unless ``adopt_config``), if ``saved``
        is invalid or of another kind, or if ``state`` holds no loss scale (or several
        and ``path`` picks none).

    A ``flax.nnx`` optimizer is mutable: its loss-scale variables are set in place and
    the optimizer itself is returned. An ``nnx.State`` of one (``nnx.state(optimizer)``,
    or the state from ``nnx.split``, e.g. as Orbax restored it) is not modified: a new
    ``nnx.State`` is returned, to pass on to ``nnx.update(optimizer, state)``. Its
    configuration comes from the metadata that ``loss_scaling.nnx.Optimizer`` keeps.

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
    import loss_scaling  # for get_loss_scale, whichever module defines it

    target = loss_scaling.get_loss_scale(state, path)  # clear errors for none or several
    return replace_loss_scale(state, resolve(saved, target, adopt_config=adopt_config), path)


def resolve(saved: LossScale | Mapping[str, Any], target: LossScale, *,
            adopt_config: bool) -> LossScale:
    """The scaler a restore gives: ``saved`` checked against ``target``'s configuration,
    or (``adopt_config``) the saved values under it."""
    if adopt_config:
        return restore_with_config(saved, target)
    check_same_config(saved, target)
    return from_state_dict(saved if isinstance(saved, Mapping) else state_dict(saved))


def replace_loss_scale(state: Any, new: LossScale, path: str | None = None) -> Any:
    """``state`` with the loss scale ``get_loss_scale(state, path)`` picks replaced by
    ``new`` (a scalar state), placed in the layout of the leaves it replaces."""
    from flax import nnx  # imported here, as in transform: nnx is slow to import

    import loss_scaling

    def is_variable(x: Any) -> bool:
        return isinstance(x, nnx.Variable)

    if isinstance(state, nnx.Optimizer) or any(
            map(is_variable, jax.tree.leaves(state, is_leaf=is_variable))):
        return _replace_nnx(state, new, path)
    target = loss_scaling.get_loss_scale(state, path)
    target_leaves = jax.tree.leaves(target)
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

    new = jax.tree.map(place_like, new, target)
    out = optax.tree_utils.tree_set(
        state, is_target, LossScalingState=found[0][1]._replace(scaler=new))
    if any(a is not b for a, b in zip(jax.tree.leaves(loss_scaling.get_loss_scale(out, path)),
                                      jax.tree.leaves(new), strict=True)):
        # optax.tree_utils.tree_set does not reach a wrapper inside another's inner state.
        raise ValueError(
            "restore_loss_scale cannot replace a loss scale nested inside another "
            "with_loss_scaling's inner state.")
    return out


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


def _replace_nnx(state: Any, new: LossScale, path: str | None) -> Any:
    """:func:`replace_loss_scale` for an ``nnx.Optimizer`` (in place) or an ``nnx.State``."""
    from flax import nnx

    import loss_scaling

    target = loss_scaling.get_loss_scale(state, path)  # clear errors for none or several
    # get_loss_scale returns the values the Variables hold: they identify the Variables.
    holder = state.opt_state if isinstance(state, nnx.Optimizer) else state
    is_variable = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    variables = jax.tree.leaves(holder, is_leaf=is_variable)
    replace = {}
    for old_leaf, new_leaf in zip(jax.tree.leaves(target), jax.tree.leaves(new), strict=True):
        owners = [v for v in variables if is_variable(v) and v.get_value() is old_leaf]
        if len(owners) != 1:
            raise ValueError(
                f"restore_loss_scale found {len(owners)} nnx Variables holding one loss-scale "
                "array; it replaces exactly one: give each loss scale its own arrays.")
        replace[id(owners[0])] = place_like(new_leaf, old_leaf)
    if isinstance(state, nnx.Optimizer):
        for v in variables:
            if id(v) in replace:
                v.set_value(replace[id(v)])
        return state
    return jax.tree.map(lambda v: v.replace(replace[id(v)]) if id(v) in replace else v,
                        state, is_leaf=is_variable)


# ------------------------------------------------------------------ flax.serialization

_FLAX_LEAVES = {
    NoOpLossScale: (),
    StaticLossScale: ("loss_scale",),
    DynamicLossScale: ("loss_scale", "growth_tracker", "nonfinite_tracker", "failure"),
}
_FLAX_OPTIONAL = ("failure",)  # absent from bytes written before failures were recorded

# The checked record that flax.serialization stores for a static or dynamic scaler:
#   magic b"LSR1" | kind u8 (1 static, 2 dynamic) | ndim u8 | dims u32[ndim] |
#   each leaf of _FLAX_LEAVES, little-endian float32 / int32, C order | crc32 u32
# of everything before it. One msgpack `bin`: msgpack never decodes inside it, so a
# corrupted byte of the record reaches `_flax_from_state_dict` (a ValueError naming the
# field), and the CRC-32 refuses every 1- to 32-bit burst and all but 2**-32 of the rest:
# a flipped bit of the scale's float32 can give another in-range scale, which no range
# check can see.
_RECORD_MAGIC = b"LSR1"
_RECORD_KIND = {StaticLossScale: 1, DynamicLossScale: 2}
_RECORD_DTYPE = {"loss_scale": np.dtype("<f4")}
_INT_DTYPE = np.dtype("<i4")


def _record(scaler: LossScale) -> bytes | None:
    """The checked record of a concrete scaler; None for placeholders and tracers."""
    names = _FLAX_LEAVES[type(scaler)]
    leaves = [getattr(scaler, name) for name in names]
    if not all(map(_concrete, leaves)):
        return None
    arrays = [_host_array(leaf) for leaf in leaves]
    shape = arrays[0].shape
    if any(a.shape != shape for a in arrays) or len(shape) > 255:
        return None
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        body = b"".join(np.ascontiguousarray(a.astype(_RECORD_DTYPE.get(n, _INT_DTYPE))).tobytes()
                        for n, a in zip(names, arrays, strict=True))
    payload = (_RECORD_MAGIC + struct.pack("<BB", _RECORD_KIND[type(scaler)], len(shape))
               + struct.pack(f"<{len(shape)}I", *shape) + body)
    return payload + struct.pack("<I", zlib.crc32(payload))


def _read_record(target: LossScale, record: bytes) -> dict[str, np.ndarray]:
    """The named arrays of a checked record; a ValueError for anything corrupted."""
    names = _FLAX_LEAVES[type(target)]
    if len(record) < len(_RECORD_MAGIC) + 6 or zlib.crc32(record[:-4]) != struct.unpack(
            "<I", record[-4:])[0]:
        raise _flax_error(
            f"the record of {', '.join(names)} ({len(record)} bytes) fails its CRC-32 check: "
            "the bytes are corrupted or truncated. Restore an intact copy of the checkpoint.")
    if record[:4] != _RECORD_MAGIC:
        raise _flax_error(f"the record starts with {record[:4]!r}, not {_RECORD_MAGIC!r}: it "
                          "was written by a newer or another program.")
    kind, ndim = struct.unpack("<BB", record[4:6])
    if kind != _RECORD_KIND[type(target)]:
        saved = {v: k.__name__ for k, v in _RECORD_KIND.items()}.get(kind, f"kind {kind}")
        raise _flax_error(f"the bytes hold a {saved}, the target is a {type(target).__name__}.")
    shape = struct.unpack(f"<{ndim}I", record[6:6 + 4 * ndim])
    count = int(np.prod(shape, dtype=np.int64))
    if len(record) != 6 + 4 * ndim + 4 * count * len(names) + 4:
        raise _flax_error(f"the record's length ({len(record)} bytes) does not match its "
                          f"shape {shape}.")
    arrays, offset = {}, 6 + 4 * ndim
    for name in names:
        dtype = _RECORD_DTYPE.get(name, _INT_DTYPE)
        arrays[name] = np.frombuffer(record, dtype, count, offset).reshape(shape).astype(
            dtype.newbyteorder("="))
        offset += 4 * count
    return arrays


def _flax_to_state_dict(scaler: LossScale) -> Any:
    if isinstance(scaler, NoOpLossScale):
        return {}
    record = _record(scaler)
    if record is not None:
        return record
    # Placeholders (None, ShapeDtypeStruct) and tracers: the leaves by name, unchecked.
    return {name: getattr(scaler, name) for name in _FLAX_LEAVES[type(scaler)]}


_FLAX_ERROR = "cannot restore the loss-scale state at "


def _flax_error(message: str) -> ValueError:
    path = flax.serialization.current_path()
    return ValueError(f"{_FLAX_ERROR}{path!r}: {message}")


def _expected_shape(target_leaf: Any) -> tuple[int, ...]:
    """The shape a restored leaf must have: the target's (its replica or device axes
    included); a None placeholder stands for an unreplicated scalar."""
    return () if target_leaf is None else tuple(np.shape(target_leaf))


def _flax_leaf(target: LossScale, name: str, value: Any) -> Any:
    """Checks a concrete restored leaf against the target's layout and configuration.

    Placeholders (``None``, ``ShapeDtypeStruct``, tracers) pass through untouched into
    a placeholder target. Anything else must be a numeric array of the target leaf's
    shape (a ``pmap``-ed state has a leading device axis), checked elementwise.
    """
    target_leaf = getattr(target, name, None)
    if value is None or isinstance(value, (jax.ShapeDtypeStruct, jax.core.Tracer)):
        if _concrete(target_leaf):
            raise _flax_error(f"{name} is {_show(value)}, not a value: the saved state was a "
                              "placeholder (e.g. from jax.eval_shape).")
        return value
    try:
        array = np.asarray(value)
    except Exception:  # ragged lists and other junk: still a ValueError
        raise _flax_error(f"{name} must be an array, got {_show(value)}.") from None
    integer = name != "loss_scale"
    if array.dtype.kind not in ("iu" if integer else "f"):
        raise _flax_error(
            f"{name} must be {'an integer' if integer else 'a floating'} array, got "
            f"{_show(value)} of dtype {array.dtype}.")
    expected = _expected_shape(target_leaf)
    if array.shape != expected:
        raise _flax_error(
            f"{name} has shape {array.shape}, the target's has shape {expected}: restore into "
            "a target of the saved layout (a pmap-replicated state has a leading device "
            "axis: replicate the target with flax.jax_utils.replicate, or save one replica).")
    dtype = np.int32 if integer else np.float32
    if integer:
        assert isinstance(target, DynamicLossScale)  # the only kind with integer leaves
        config = target.config
        high = {"growth_tracker": config.growth_interval - 1,
                "nonfinite_tracker": config.hysteresis}.get(name, max(Failure))
        if not (array.min(initial=0) >= 0 and array.max(initial=0) <= high):
            raise _flax_error(
                f"{name} must lie in [0, {high}] for the target's configuration, got "
                f"{_show(value)}. If the saved configuration differs, restore the saved "
                "state with its own configuration and adopt the new one with "
                "`loss_scaling.serialization.restore_with_config`.")
    else:
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            as_f32 = array.astype(np.float32)
        low = float(_F32.tiny)
        high_scale = float(_F32.max)
        if isinstance(target, DynamicLossScale):
            low = max(low, target.min_scale or low)
            high_scale = min(high_scale, target.max_scale or high_scale)
        if not np.all(np.isfinite(as_f32) & (as_f32 >= low) & (as_f32 <= high_scale)):
            raise _flax_error(
                f"loss_scale must be a finite, positive, normal float32 in [{low!r}, "
                f"{high_scale!r}] (the target's range), got {_show(value)}.")
        if isinstance(target, StaticLossScale) and _concrete(target_leaf):
            configured = _host_array(target_leaf).astype(np.float32)
            if not np.array_equal(as_f32, configured):
                raise _flax_error(
                    f"loss_scale: saved {_show(as_f32.tolist())}, the target's "
                    f"StaticLossScale factor is {_show(configured.tolist())}. A static "
                    "factor is configuration: build the target with the saved factor, or "
                    "restore into a placeholder (`jax.tree.map(lambda _: None, target)`) and "
                    "adopt the new one with `loss_scaling.restore_with_config`.")
    if isinstance(value, jax.Array) and value.dtype == dtype:
        return value
    return jnp.asarray(array.astype(dtype))


def _flax_from_state_dict(target: LossScale, state: Any) -> LossScale:
    try:
        return _flax_restore(target, state)
    except Exception as error:  # hostile state: still a ValueError that names the path
        if isinstance(error, ValueError) and str(error).startswith(_FLAX_ERROR):
            raise
        raise _flax_error(f"{type(error).__name__}: {_show(str(error))}") from None


def _flax_restore(target: LossScale, state: Any) -> LossScale:
    names = _FLAX_LEAVES[type(target)]
    if isinstance(state, (bytes, bytearray, memoryview)) and names:
        state = _read_record(target, bytes(state))
    elif names and isinstance(state, Mapping) and set(names) - set(state) <= set(_FLAX_OPTIONAL):
        # Bytes written before the checked record (no CRC: the values are range-checked).
        if "failure" in names and "failure" not in state:
            shape = np.shape(np.asarray(state.get("loss_scale", 0)))
            state = {"failure": np.zeros(shape, np.int32), **state}
    if not isinstance(state, Mapping) or set(state) != set(names):
        got = sorted(map(_show, state)) if isinstance(state, Mapping) else _show(state)
        raise _flax_error(f"expected {'the checked record of' if names else 'a dict with'} "
                          f"the keys {list(names)}, got {got}.")
    leaves = [_flax_leaf(target, name, state[name]) for name in names]
    # Every child of the target counts as one leaf, whatever it holds (even None).
    treedef = jax.tree.structure(target, is_leaf=lambda x: x is not target)
    return jax.tree.unflatten(treedef, leaves)


def _state_key(key: Any) -> str:
    """The key flax's state dict has for one step of a jax key path."""
    return str(getattr(key, "key", getattr(key, "name", getattr(key, "idx", key))))


def _bare_optimizer_states(target: Any, state: Any) -> list[str]:
    """Paths where ``target`` has a ``LossScalingState`` but the decoded ``state`` holds
    a mapping without its ``scaler`` / ``inner_state`` fields (a checkpoint of the bare
    inner optimizer, saved before loss scaling was added)."""
    def is_wrapper(x: Any) -> bool:
        return isinstance(x, LossScalingState)

    bare = []
    for path, node in jax.tree_util.tree_flatten_with_path(target, is_leaf=is_wrapper)[0]:
        if not is_wrapper(node):
            continue
        saved = state
        for key in path:
            saved = saved.get(_state_key(key)) if isinstance(saved, Mapping) else None
        if isinstance(saved, Mapping) and not {"scaler", "inner_state"} & set(saved):
            bare.append("./" + "/".join(_state_key(k) for k in path))
    return bare


def from_bytes(target: Any, encoded: bytes) -> Any:
    """``flax.serialization.from_bytes``, with every failure a ``ValueError``.

    ``flax.serialization.from_bytes`` decodes the whole message with msgpack before any
    restore hook runs: truncated bytes, or a corrupted byte of msgpack's own framing,
    raise there (msgpack's ``ValueError`` / ``ExtraData``, or a ``TypeError`` or
    ``UnicodeDecodeError`` from flax's array decoding) and name no field. This function
    turns those into a ``ValueError`` that names the loss-scale states of ``target``, so
    that a caller can handle corrupted checkpoints with one ``except ValueError``. A
    corrupted loss-scale record itself is refused (CRC-32) by either function.

    Args:
      target: the restore target, as for ``flax.serialization.from_bytes``.
      encoded: bytes from ``flax.serialization.to_bytes``.

    Returns:
      ``target`` with the restored values.

    Raises:
      ValueError: for anything that does not restore into ``target``: undecodable bytes,
        another structure, a corrupted loss-scale record or invalid values.

    Examples:
      >>> import flax.serialization
      >>> import loss_scaling as ls
      >>> from loss_scaling.serialization import from_bytes
      >>> s = ls.update(ls.DynamicLossScale(init_scale=256.0), False)
      >>> data = flax.serialization.to_bytes({"scaler": s})
      >>> float(from_bytes({"scaler": ls.DynamicLossScale()}, data)["scaler"].loss_scale)
      128.0
      >>> from_bytes({"scaler": ls.DynamicLossScale()}, data[:-1])
      Traceback (most recent call last):
      ...
      ValueError: cannot decode the bytes for the loss-scale state at './scaler': ...
    """
    def is_scaler(x: Any) -> bool:
        return isinstance(x, (NoOpLossScale, StaticLossScale, DynamicLossScale))

    paths = [
        "./" + "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                        for k in path)
        for path, _ in jax.tree_util.tree_flatten_with_path(target, is_leaf=is_scaler)[0]
        if is_scaler(_)]
    where = (f"the loss-scale state at {', '.join(map(repr, paths))}" if paths
             else "a target holding no loss scale")
    try:
        state = flax.serialization.msgpack_restore(encoded)
    except Exception as error:
        raise ValueError(
            f"cannot decode the bytes for {where}: msgpack says {type(error).__name__}: "
            f"{_show(str(error))}. They are truncated or corrupted: restore an intact copy."
        ) from None
    bare = _bare_optimizer_states(target, state)
    if bare:
        raise ValueError(PRE_LOSS_SCALING.format(
            where=f"the bytes hold no loss-scale state at {', '.join(map(repr, bare))}, where "
                  "the target has a with_loss_scaling state"))
    try:
        return flax.serialization.from_state_dict(target, state)
    except ValueError as error:
        if str(error).startswith(_FLAX_ERROR):
            raise  # ours, naming the field
        raise ValueError(f"cannot restore {where}: the decoded bytes do not match the "
                         f"target's structure ({error}).") from None
    except Exception as error:
        raise ValueError(
            f"cannot restore {where}: the decoded bytes do not match the target's "
            f"structure ({type(error).__name__}: {_show(str(error))}).") from None


for _cls in _FLAX_LEAVES:
    # override=True: re-importing (or reloading) this module must not fail.
    flax.serialization.register_serialization_state(
        _cls, _flax_to_state_dict, _flax_from_state_dict, override=True)
