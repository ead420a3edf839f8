"""The JSON-compatible state-dict format: :func:`state_dict` and :func:`from_state_dict`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loss_scaling._errors import show
from loss_scaling.checkpoint._values import (
    _CONFIG_KEYS,
    _INVALID,
    _KIND_OF_TYPE,
    _TOP_KEYS,
    _VALUE_KEYS,
    FORMAT_VERSION,
    HEADROOM_VALUE_KEYS,
    INTERVAL_CONFIG_KEYS,
    InvalidStateDict,
    _exact_float32,
    _in_range,
    _integer,
    _mapping,
    _number,
    _prefixed,
    _scale,
)
from loss_scaling.core.scalers import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    require_scaler,
)
from loss_scaling.core.validation import (
    DynamicConfig,
    config_fields,
    counter_ranges,
    history_problem,
    positive_int32,
    scale_range,
    validate_dynamic_config,
)


def _parse(d: Any) -> tuple[str, DynamicConfig | None, dict[str, Any]]:
    """Validates a state dict; returns its kind, its config (dynamic only) and values."""
    d = _mapping(None, d, _TOP_KEYS)
    version = d["format_version"]
    if isinstance(version, (bool, np.bool_)) or not isinstance(version, (int, np.integer)):
        raise InvalidStateDict(
            f"{_INVALID}format_version must be the integer {FORMAT_VERSION}, got "
            f"{show(version)} of type {type(version).__name__}."
        )
    if version != FORMAT_VERSION:
        raise InvalidStateDict(
            f"{_INVALID}unsupported format_version {show(version)}: this version of "
            f"loss_scaling reads format_version {FORMAT_VERSION}."
        )
    kind = d["kind"]
    if not isinstance(kind, str) or kind not in _CONFIG_KEYS:
        raise InvalidStateDict(
            f"{_INVALID}unknown kind {show(kind)}: expected one of {list(_CONFIG_KEYS)}."
        )
    config_keys, value_keys = _CONFIG_KEYS[kind], _VALUE_KEYS[kind]
    if kind == "dynamic":
        if isinstance(d["config"], Mapping) and d["config"].get("growth") == "headroom":
            value_keys += HEADROOM_VALUE_KEYS
        else:  # the others may be given, and the validator refuses headroom options
            config_keys = INTERVAL_CONFIG_KEYS
    raw_config = _mapping("config", d["config"], config_keys,
                          optional=_CONFIG_KEYS[kind])
    raw_values = _mapping("values", d["values"], value_keys,
                          optional=("failure",) if kind == "dynamic" else ())
    if kind == "noop":
        return kind, None, {}
    loss_scale = _scale("values.loss_scale", raw_values["loss_scale"])
    if kind == "static":
        return kind, None, {"loss_scale": loss_scale}
    return (kind, *_parse_dynamic(raw_config, raw_values, loss_scale))


def _parse_dynamic(raw_config: Mapping[str, Any], raw_values: Mapping[str, Any],
                   loss_scale: float) -> tuple[DynamicConfig, dict[str, Any]]:
    """The config and values of a dynamic state dict (its keys already checked)."""
    # Each field on its own first, so that the message names the one at fault.
    factors = {k: _exact_float32(f"config.{k}", _number(f"config.{k}", raw_config[k]))
               for k in ("growth_factor", "backoff_factor")}
    ints = {}
    for k in ("growth_interval", "hysteresis"):
        try:
            ints[k] = positive_int32(f"config.{k}", _integer(f"config.{k}", raw_config[k]))
        except ValueError as error:
            raise InvalidStateDict(_prefixed(error)) from None
    bounds = {k: None if raw_config[k] is None else _scale(f"config.{k}", raw_config[k])
              for k in ("min_scale", "max_scale")}
    growth = _growth_options(raw_config)
    if bounds["min_scale"] is not None and loss_scale < bounds["min_scale"]:
        raise InvalidStateDict(
            f"{_INVALID}values.loss_scale ({loss_scale!r}) is below config.min_scale "
            f"({bounds['min_scale']!r})."
        )
    if bounds["max_scale"] is not None and loss_scale > bounds["max_scale"]:
        raise InvalidStateDict(
            f"{_INVALID}values.loss_scale ({loss_scale!r}) is above config.max_scale "
            f"({bounds['max_scale']!r})."
        )
    try:
        config, loss_scale = validate_dynamic_config(
            init_scale=loss_scale, **factors, **ints, **bounds, **growth)
    except ValueError as error:  # names the argument (growth_factor, backoff_factor)
        raise InvalidStateDict(f"{_INVALID}config.{error}") from None
    counters = {}
    for name, (low, high, bound) in counter_ranges(config).items():  # failure: optional
        value = _integer(f"values.{name}", raw_values.get(name, 0))
        counters[name] = _in_range(f"values.{name}", value, low, high, bound)
    values = {"loss_scale": loss_scale, **counters}
    if config.growth == "headroom":
        values.update(_parse_headroom(config, raw_values))
    return config, values


def _growth_options(raw_config: Mapping[str, Any]) -> dict[str, Any]:
    """The growth rule and its options as read (checked by the core validator after)."""
    options: dict[str, Any] = {}
    if "growth" in raw_config:
        options["growth"] = raw_config["growth"]
    if "headroom_margin" in raw_config:
        options["headroom_margin"] = _exact_float32(
            "config.headroom_margin", _number("config.headroom_margin",
                                              raw_config["headroom_margin"]))
    if "headroom_window" in raw_config:
        options["headroom_window"] = _integer("config.headroom_window",
                                              raw_config["headroom_window"])
    if "headroom_dtype" in raw_config:
        dtype = raw_config["headroom_dtype"]
        if not isinstance(dtype, str):
            raise InvalidStateDict(
                f"{_INVALID}config.headroom_dtype must be a dtype name (a str such as "
                f"'float16'), got {show(dtype)} of type {type(dtype).__name__}.")
        options["headroom_dtype"] = dtype
    return options


def _parse_headroom(config: DynamicConfig, raw_values: Mapping[str, Any]) -> dict[str, Any]:
    """``grad_max_history`` (``headroom_window`` float32 values, finite, >= 0) and
    ``ceiling`` (a scale in the config's range) of a headroom state dict."""
    raw = raw_values["grad_max_history"]
    if not isinstance(raw, (list, tuple)) or len(raw) != config.headroom_window:
        raise InvalidStateDict(
            f"{_INVALID}values.grad_max_history must be a list of config.headroom_window "
            f"= {config.headroom_window} numbers, got {show(raw)}.")
    history = [_exact_float32(f"values.grad_max_history[{i}]",
                              _number(f"values.grad_max_history[{i}]", x), below_normal=True)
               for i, x in enumerate(raw)]
    problem = history_problem(np.asarray(history, np.float64))
    if problem is not None:
        raise InvalidStateDict(f"{_INVALID}values.grad_max_history: {problem}, got "
                               f"{show(raw)}.")
    ceiling = _scale("values.ceiling", raw_values["ceiling"])
    low, high = scale_range(config)
    if not low <= ceiling <= high:
        raise InvalidStateDict(
            f"{_INVALID}values.ceiling ({ceiling!r}) must lie in [{low!r}, {high!r}] (the "
            "config's scale range).")
    return {"grad_max_history": history, "ceiling": ceiling}


def _build(kind: str, config: DynamicConfig | None, values: dict[str, Any]) -> LossScale:
    if kind == "noop":
        return NoOpLossScale()
    if kind == "static":
        return StaticLossScale(values["loss_scale"])
    assert config is not None
    leaves: tuple[Any, ...] = (
        jnp.asarray(values["loss_scale"], jnp.float32),
        jnp.asarray(values["growth_tracker"], jnp.int32),
        jnp.asarray(values["nonfinite_tracker"], jnp.int32),
        jnp.asarray(values.get("failure", 0), jnp.int32),
    )
    if config.growth == "headroom":
        leaves += (jnp.asarray(np.asarray(values["grad_max_history"], np.float32)),
                   jnp.asarray(values["headroom_tracker"], jnp.int32),
                   jnp.asarray(values["ceiling"], jnp.float32))
    return DynamicLossScale._from_parts(config, leaves)


# --------------------------------------------------------------------------- reading


def _kind(scaler: Any) -> str:
    require_scaler("state", scaler)
    return _KIND_OF_TYPE[type(scaler)]


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
            f"the StaticLossScale's replicas disagree: loss_scale {show(values.tolist())}.")
    return float(values[0])


def _read(name: str, leaf: Any, integer: bool, ndim: int = 0) -> Any:
    """A scalar leaf as a Python number (``ndim=1``: a vector leaf as a list of floats);
    refuses tracers and other shapes."""
    if isinstance(leaf, jax.core.Tracer):
        raise ValueError(
            f"state_dict needs concrete values, but {name} is a traced value {leaf!r}: call "
            "it outside jit/grad/vmap, on the state a compiled step returned."
        )
    array = _host_array(leaf)
    if array.ndim != ndim:
        raise ValueError(
            f"state_dict needs {'scalar' if ndim == 0 else 'vector'} values, but {name} has "
            f"shape {array.shape}. A "
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
        as_f32 = array.astype(np.float32)
    return [float(x) for x in as_f32] if ndim else float(as_f32)


def state_dict(scaler: LossScale) -> dict[str, Any]:
    """A loss-scale state as a plain, JSON-compatible dict.

    ``{"format_version": 1, "kind": ..., "config": {...}, "values": {...}}`` holding only
    str, int, float and None: ``kind`` is ``"noop"``, ``"static"`` or ``"dynamic"``;
    for ``"dynamic"``, ``config`` has every constructor setting but ``init_scale`` and
    ``values`` has ``loss_scale`` (float), ``growth_tracker`` and ``nonfinite_tracker``
    (int). With ``growth="headroom"``, ``config`` also has ``growth`` and the headroom
    options, and ``values`` has ``grad_max_history`` (a list of floats),
    ``headroom_tracker`` (int) and ``ceiling`` (float). Floats are float32 values, so
    ``json.dumps`` / ``json.loads`` round trips are bit-exact.

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
    config: dict[str, Any] = {}
    values: dict[str, Any] = {}
    if isinstance(scaler, StaticLossScale):
        values["loss_scale"] = _read("loss_scale", scaler.loss_scale, integer=False)
    elif isinstance(scaler, DynamicLossScale):
        config = {name: getattr(scaler.config, name) for name in config_fields(scaler.config)}
        values["loss_scale"] = _read("loss_scale", scaler.loss_scale, integer=False)
        for name in ("growth_tracker", "nonfinite_tracker"):
            values[name] = _read(name, getattr(scaler, name), integer=True)
        failure = _read("failure", scaler.failure, integer=True)
        if failure:  # written only when set: a healthy state's dict is unchanged
            values["failure"] = failure
        if scaler.growth == "headroom":
            values["grad_max_history"] = _read("grad_max_history", scaler.grad_max_history,
                                               integer=False, ndim=1)
            values["headroom_tracker"] = _read("headroom_tracker", scaler.headroom_tracker,
                                               integer=True)
            values["ceiling"] = _read("ceiling", scaler.ceiling, integer=False)
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
    try:
        return _build(*_parse(d))
    except InvalidStateDict as error:  # the internal class stays inside: a ValueError out
        raise ValueError(str(error)) from None


# -------------------------------------------------------------------- config changes
