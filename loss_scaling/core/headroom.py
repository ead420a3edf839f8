"""Growth from measured headroom (``DynamicLossScale(growth="headroom")``), in one place:
its options, its three leaves, its rule, what the wrapper measures for it, its metrics,
its case of the suspicious-scale rule and a restore's handling of its window.

The rule, on top of the interval rule's hysteresis, backoff and failure
(:mod:`loss_scaling.core.update` asks :func:`clean_step` and :func:`nonfinite_step`)::

    state: grad_max_history[window] (unscaled maxima, a ring), headroom_tracker, ceiling
    clean step, given grads_max = max |g| of the SCALED gradients:
        growth_tracker += 1                      # saturating
        lifts = growth_tracker >= growth_interval
        if records_max(state):                   # filling, or 1 clean step in `window`
            grad_max_history[headroom_tracker % window] = |grads_max / scale|  # inf -> max
            headroom_tracker += 1                # wraps from 2 * window - 1 to window
        if lifts:
            ceiling = min(ceiling * growth_factor, high)   # high: max_scale, or float32's
            growth_tracker = 0
        peak = max(grad_max_history)
        if peak == 0:   target = min(grown(scale), ceiling)  # measured nothing: probe
        else:           target = min(T, ceiling, high)   # T: the largest power of two with
                                                         # T * margin * peak <= finfo(dtype).max
        if headroom_tracker >= window and target > scale:
            scale = target
            if peak == 0: headroom_tracker = 0   # a new window to fill before the next probe
    non-finite step that backs off (the interval rule's backoff, hysteresis included):
        ceiling = the backed-off scale           # strictly below the scale that overflowed
        headroom_tracker = 0                     # the window fills again before a growth
    records_max(state) = headroom_tracker < window  or  growth_tracker % window == 0

docs/headroom.md measures it. The wrapper reads ``grads_max`` in the same pass as its
finite test, only on the steps :func:`records_max` says (:func:`measures`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from loss_scaling._errors import show
from loss_scaling.core.validation import (
    F32,
    ScaleBounds,
    float32_where,
    int_in_range,
    scale_range,
)

RULE = "headroom"
"""The ``growth`` value of this rule."""


class HeadroomConfig(ScaleBounds, Protocol):
    """What this rule reads of a configuration
    (:class:`loss_scaling.core.fields.DynamicConfig`), typed by its shape: fields.py and
    scalers.py import this module, so it imports neither."""

    @property
    def growth(self) -> str: ...

    @property
    def growth_factor(self) -> float: ...

    @property
    def headroom_margin(self) -> float | None: ...

    @property
    def headroom_window(self) -> int | None: ...

    @property
    def headroom_dtype(self) -> str | None: ...


class HeadroomState(Protocol):
    """What this rule reads of a state (:class:`loss_scaling.core.scalers.DynamicLossScale`)."""

    @property
    def config(self) -> HeadroomConfig: ...

    @property
    def loss_scale(self) -> jax.Array: ...

    @property
    def growth_tracker(self) -> jax.Array: ...

    @property
    def grad_max_history(self) -> jax.Array | None: ...

    @property
    def headroom_tracker(self) -> jax.Array | None: ...

    @property
    def ceiling(self) -> jax.Array | None: ...
DEFAULTS: Mapping[str, Any] = {"headroom_margin": 2.0**4, "headroom_window": 16,
                               "headroom_dtype": "float16"}
"""Its options (``growth="headroom"`` only; :mod:`loss_scaling.core.fields` declares how
each is checked and read) and their defaults."""
OPTIONS = tuple(DEFAULTS)
MAX_WINDOW = 2**16
"""The longest ``headroom_window``."""
HISTORY = "grad_max_history"
"""Its leaf that holds ``headroom_window`` entries; :mod:`loss_scaling.core.fields`
declares it and its two scalars, ``headroom_tracker`` and ``ceiling``."""


def is_headroom(scaler: Any) -> bool:
    """Whether ``scaler`` (any state) grows by this rule."""
    return getattr(getattr(scaler, "config", None), "growth", None) == RULE


# ---------------------------------------------------------------------------- options


def check_margin(value: Any) -> float:
    return float32_where(
        "headroom_margin", value, lambda x: np.isfinite(x) and x >= 1.0 and np.frexp(x)[0] == 0.5,
        "be a power of two >= 1", ": use e.g. 16.0 (the default, 2**4)")


def check_window(value: Any) -> int:
    return int_in_range("headroom_window", value, 1, MAX_WINDOW)


def check_dtype(value: Any) -> str:
    """A floating dtype no wider than float32, by name."""
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating) or (
            float(jnp.finfo(dtype).max) > float(F32.max)):
        raise ValueError(f"headroom_dtype must be a floating dtype no wider than float32, got "
                         f"{show(value)}: use e.g. jnp.float16 (the default) or 'bfloat16'.")
    return dtype.name


def refuse_options_without_rule(options: Mapping[str, Any]) -> None:
    """The interval rule takes none of this rule's options."""
    given = [name for name in OPTIONS if options.get(name) is not None]
    if given:
        raise ValueError(f"{', '.join(given)} apply only to growth='headroom', got "
                         + ", ".join(f"{n}={show(options[n])}" for n in given)
                         + ": pass growth='headroom', or drop them.")


# ----------------------------------------------------------------------------- leaves


def initial_leaves(config: HeadroomConfig) -> tuple[Any, ...]:
    """A new state's own leaves: an empty window, no steps, the ceiling at the top."""
    assert config.headroom_window is not None
    return (jnp.zeros((config.headroom_window,), jnp.float32), jnp.zeros((), jnp.int32),
            jnp.asarray(scale_range(config)[1], jnp.float32))


def tracker_range(config: HeadroomConfig) -> tuple[int, int, str]:
    """``headroom_tracker``'s range ``(low, high, how high is named)``: it wraps at
    ``2 * window`` (a template of the config's name, ``{c}``)."""
    assert config.headroom_window is not None
    return 0, 2 * config.headroom_window - 1, "2 * {c}headroom_window - 1"


def history_in_range(name: str, values: Any) -> None:
    """A ``grad_max_history``: every entry a finite float32 >= 0 (an unscaled maximum)."""
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        as_f32 = np.asarray(values).astype(np.float32)
    if not np.all(np.isfinite(as_f32) & (as_f32 >= 0)):
        raise ValueError(f"{name}: every entry must be a finite float32 >= 0, got "
                         f"{show(values)}.")


def adopted(values: Mapping[str, Any], config: HeadroomConfig) -> dict[str, Any]:
    """The saved leaves of this rule under a target configuration (``restore_with_config``):
    the history kept if its window has the target's length (else it starts over), the
    ceiling clamped into the target's range (its top when none was saved); ``{}`` for
    the interval rule."""
    if config.growth != RULE:
        return {}
    assert config.headroom_window is not None
    window = config.headroom_window
    low, high = scale_range(config)
    history = values.get(HISTORY)
    kept = history is not None and len(history) == window
    return {
        HISTORY: history if kept else [0.0] * window,
        "headroom_tracker": values["headroom_tracker"] if kept else 0,
        "ceiling": min(max(values.get("ceiling", high), low), high),
    }


# ------------------------------------------------------------------------------- rule


def parts(state: HeadroomState) -> tuple[jax.Array, jax.Array, jax.Array, int]:
    """``(grad_max_history, headroom_tracker, ceiling, headroom_window)``."""
    state_parts = (state.grad_max_history, state.headroom_tracker, state.ceiling,
                   state.config.headroom_window)
    assert all(part is not None for part in state_parts), "not a growth='headroom' state"
    return state_parts  # type: ignore[return-value]


def records_max(state: HeadroomState) -> jax.Array:
    """Whether a clean step of this headroom state records its ``grads_max`` (a bool).

    Every clean step while the window fills (after the start and after each backoff:
    ``headroom_tracker < headroom_window``), then one clean step in ``headroom_window``
    (``growth_tracker % headroom_window == 0``). The sparse steady state is for XLA on
    CPU, which cannot fuse a max into the finite screen's sum: the wrapper reads the
    max there, in a second pass under a conditional, only on the steps that record it
    (docs/headroom.md has the measured cost). The rule decides it, not the backend: a
    run takes the same decisions on every backend and device.
    """
    _, steps, _, window = parts(state)
    return (steps < window) | (state.growth_tracker % window == 0)


def measures(scaler: Any) -> jax.Array | None:
    """What the wrapper's read of the gradients measures for ``scaler``: for this rule,
    whether it reads the max this step (:func:`records_max`); ``None`` for every other
    rule and kind (no max read)."""
    return records_max(scaler) if is_headroom(scaler) else None


def target(config: HeadroomConfig, peak: jax.Array, cap: jax.Array) -> jax.Array:
    """``min(T, cap)`` for the largest power of two ``T`` with ``T * margin * peak <=
    finfo(headroom_dtype).max`` (float32); ``peak`` 0 gives ``cap`` (the rule itself
    probes by one ``growth_factor`` instead, :func:`clean_step`).

    The power of two is read off the bits of the float32 ratio (its exponent, the
    mantissa cleared): exact, and 0 for a ratio below the normal range, never a
    subnormal. A ratio beyond float32 (``peak`` 0 or tiny) is float32's max first.
    """
    limit = jnp.float32(jnp.finfo(jnp.dtype(config.headroom_dtype)).max)
    # limit / margin is exact and normal (a power-of-two margin, validated <= 2**127);
    # margin * peak first would overflow for a peak above float32's max / margin.
    ratio = limit / jnp.float32(config.headroom_margin) / peak
    ratio = jnp.minimum(ratio, jnp.float32(F32.max))
    exponent_bits = lax.bitcast_convert_type(ratio, jnp.int32) & 0x7F800000
    return jnp.minimum(lax.bitcast_convert_type(exponent_bits, jnp.float32), cap)


def clean_step(state: HeadroomState, grads_max: jax.Array, lifts: jax.Array,
               counted_clean: jax.Array,
               grown: Callable[[Any, jax.Array], jax.Array]) -> dict[str, jax.Array]:
    """The rule's clean step: record the unscaled max, lift the ceiling on the
    growth_interval-th clean step, and once the window is full grow to the target.
    ``grown(state.config, scale)``: the interval rule's growth (the probe of an empty
    window), which reads the whole configuration."""
    config = state.config
    old_history, steps, old_ceiling, window = parts(state)
    scale = state.loss_scale
    records = records_max(state)
    # Unscaled by a division (a scalar): a subnormal quotient may flush to 0, which
    # counts as an empty entry. A non-finite max (inconsistent input) counts as no room.
    unscaled = jnp.abs(grads_max / scale)
    unscaled = jnp.where(jnp.isfinite(unscaled), unscaled, jnp.float32(F32.max))
    history = jnp.where(records, lax.dynamic_update_index_in_dim(
        old_history, unscaled, steps % window, axis=0), old_history)
    counted = steps + 1
    counted = jnp.where(counted >= 2 * window, jnp.full_like(steps, window), counted)
    counted = jnp.where(records, counted, steps)
    high = jnp.float32(scale_range(config)[1])
    ceiling = jnp.where(lifts, jnp.minimum(old_ceiling * jnp.float32(config.growth_factor),
                                           high), old_ceiling)
    cap = jnp.minimum(ceiling, high)
    peak = jnp.max(history)
    # A window of zeros measured nothing (the gradients are 0, or flushed to 0 below the
    # scale): no jump to the cap, from which the first real gradients would overflow and
    # back off one step at a time; one growth_factor, and a new window to fill first.
    probe = jnp.minimum(grown(config, scale), ceiling)
    empty = ~(peak > 0)
    to = jnp.where(empty, probe, target(config, peak, cap))
    grows = (counted >= window) & (to > scale)
    counted = jnp.where(grows & empty, jnp.zeros_like(counted), counted)
    return {"loss_scale": jnp.where(grows, to, scale),
            "growth_tracker": jnp.where(lifts, jnp.zeros_like(counted_clean), counted_clean),
            HISTORY: history, "headroom_tracker": counted, "ceiling": ceiling}


def nonfinite_step(state: HeadroomState, finite: jax.Array, backs_off: jax.Array,
                   shrunk: jax.Array, clean: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """This rule's leaves after a step: ``clean``'s on a finite one; a backoff sets the ceiling
    strictly below the scale that overflowed (to the backed-off ``shrunk``) and starts
    the window over: growth waits ``window`` clean steps."""
    history, steps, ceiling, _ = parts(state)
    return {
        HISTORY: jnp.where(finite, clean[HISTORY], history),
        "headroom_tracker": jnp.where(finite, clean["headroom_tracker"],
                                      jnp.where(backs_off, jnp.zeros_like(steps), steps)),
        "ceiling": jnp.where(finite, clean["ceiling"], jnp.where(backs_off, shrunk, ceiling)),
    }


# ---------------------------------------------------------------------------- metrics


SUSPICIOUS_GRAD_MAX = 2.0**-48
"""With ``growth="headroom"``, a scale past ``SUSPICIOUS_SCALE_LIMIT`` (``2**64``) is
suspicious only while the largest gradient the rule recorded (unscaled) is at most this:
the rule derives the scale from that measurement, and a wide ``headroom_dtype``
(bfloat16, float32) takes ordinary gradients far past ``2**64``. A forgotten scale shows
as the recorded maxima falling with every growth (the gradients do not follow the
scale)."""


def window_max(scaler: Any) -> Any:
    """The largest unscaled max |g| in the rule's window (in-graph); ``None`` for every
    other rule and kind."""
    return history_max(getattr(scaler, HISTORY, None))


def history_max(history: Any) -> Any:
    """The largest entry of a ``grad_max_history`` (its last axis: replicas stay), on the
    host for a host array; ``None`` for ``None``."""
    if history is None:
        return None
    return (np.max(history, axis=-1) if isinstance(history, np.ndarray)
            else jnp.max(history, axis=-1))


def large_scale_unexplained(large: Any, grad_max_window: Any) -> Any:
    """The suspicious-scale rule's headroom case: a scale grown past ``2**64`` (``large``)
    is suspicious only while the maxima the rule measured (``grad_max_window``, ``None``
    for the interval rule) are at most :data:`SUSPICIOUS_GRAD_MAX`."""
    if grad_max_window is None:
        return large
    return large & (grad_max_window <= SUSPICIOUS_GRAD_MAX)


def metrics(scaler: Any) -> dict[str, jax.Array]:
    """``growth="headroom"`` only (else ``{}``): ``grad_max_window`` (the recent maximum),
    ``headroom_log2`` (the room it leaves, :func:`log2_ratio`) and ``scale_ceiling``."""
    peak = window_max(scaler)
    if peak is None:
        return {}
    limit = jnp.float32(jnp.finfo(jnp.dtype(scaler.config.headroom_dtype)).max)
    return {
        "grad_max_window": peak,
        "headroom_log2": log2_ratio(limit, scaler.loss_scale, peak),
        "scale_ceiling": scaler.ceiling,
    }


def log2_ratio(limit: jax.Array, scale: jax.Array, peak: jax.Array) -> jax.Array:
    """``log2(limit / (scale * peak))``, never below an integer ``k`` where the ratio is at
    least ``2**k`` (inf for ``peak`` 0).

    A difference of three float32 logarithms reads 3.9999998 for a ratio of exactly 16
    (the margin a headroom growth leaves). Here the exponents are split off exactly
    (``frexp``) and only a mantissa ratio ``q`` in ``[1, 2)`` goes through ``log2``,
    clamped at ``log2(1) = 0``: the integer part is exact, and the rounding of ``q``
    (monotonic) cannot take the result below it.
    """
    (m_limit, e_limit), (m_scale, e_scale), (m_peak, e_peak) = (
        jnp.frexp(x) for x in (limit, scale, peak))
    m_q, e_q = jnp.frexp(m_limit / m_scale / jnp.where(peak > 0, m_peak, 1.0))
    exponent = (e_limit - e_scale - e_peak + e_q - 1).astype(jnp.float32)
    fraction = jnp.maximum(jnp.log2(2 * m_q), 0.0)
    return jnp.where(peak > 0, exponent + fraction, jnp.inf)
