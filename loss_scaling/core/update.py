"""The update rule of :class:`DynamicLossScale` and :func:`update`."""

from __future__ import annotations

from typing import Any, Literal, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from loss_scaling import _errors
from loss_scaling._errors import Failure
from loss_scaling.core.scalers import (
    DynamicLossScale,
    LossScale,
    StaticLossScale,
    require_scaler,
)
from loss_scaling.core.validation import (
    _F32,
    DynamicConfig,
    _is_traced,
    scale_range,
)


def _as_finite_flag(grads_finite: Any) -> jax.Array:
    dtype = getattr(grads_finite, "dtype", None)
    if not isinstance(grads_finite, bool) and (getattr(grads_finite, "shape", None) != ()
                                               or dtype is None
                                               or not jnp.issubdtype(dtype, jnp.bool_)):
        raise ValueError(
            "grads_finite must be a scalar bool (a Python bool or a bool array of shape ()), "
            f"got {grads_finite!r}."
        )
    return jnp.asarray(grads_finite)


def _as_grads_max(state: LossScale, grads_max: Any) -> jax.Array | None:
    """``grads_max`` checked: a real scalar (float32), required by the headroom rule."""
    headroom = isinstance(state, DynamicLossScale) and state.growth == "headroom"
    if grads_max is None:
        if headroom:
            raise ValueError(
                "a DynamicLossScale with growth='headroom' needs grads_max=, the largest "
                "|entry| of this step's SCALED gradients as a float32 scalar, got None: "
                "pass `grads_max=loss_scaling.grads_max(grads)` to update (the optax "
                "wrapper passes it itself).")
        return None
    shape, dtype = getattr(grads_max, "shape", ()), getattr(grads_max, "dtype", None)
    if isinstance(grads_max, (bool, np.bool_)) or shape != () or (
            dtype is not None and not (jnp.issubdtype(dtype, jnp.floating)
                                       or jnp.issubdtype(dtype, jnp.integer))) or (
            dtype is None and not isinstance(grads_max, (int, float))):
        raise ValueError(
            "grads_max must be a real scalar (the largest |entry| of the scaled gradients, "
            f"e.g. loss_scaling.grads_max(grads)), got {grads_max!r}.")
    return jnp.asarray(grads_max, jnp.float32) if headroom else None


def _grown(config: DynamicConfig, scale: jax.Array) -> jax.Array:
    """The scale times ``growth_factor``, capped at ``max_scale``; a product beyond float32
    is no growth."""
    grown = scale * jnp.float32(config.growth_factor)
    if config.max_scale is not None:
        grown = jnp.minimum(grown, jnp.float32(config.max_scale))
    return jnp.where(jnp.isfinite(grown), grown, scale)


def _clean_step(state: DynamicLossScale,
                grads_max: jax.Array | None) -> dict[str, jax.Array]:
    """The leaves a clean step changes (``nonfinite_tracker`` is then 0)."""
    config = state.config
    scale, tracker = state.loss_scale, state.growth_tracker
    # Count, and grow on the growth_interval-th one unless that overflows. The counters
    # saturate at int32's max: hysteresis and growth_interval may be anything in
    # [1, 2**31 - 1], and no counter ever wraps.
    counted = optax.safe_increment(tracker)
    grows = counted >= config.growth_interval
    if config.growth == "headroom":
        assert grads_max is not None
        return _headroom_clean(state, grads_max, grows, counted)
    return {"loss_scale": jnp.where(grows, _grown(config, scale), scale),
            "growth_tracker": jnp.where(grows, jnp.zeros_like(tracker), counted)}


def _headroom_clean(state: DynamicLossScale, grads_max: jax.Array, lifts: jax.Array,
                    counted_clean: jax.Array) -> dict[str, jax.Array]:
    """The headroom rule's clean step: record the unscaled max, lift the ceiling on the
    growth_interval-th clean step, and once the window is full grow to the target."""
    config = state.config
    old_history, steps, old_ceiling, window = _headroom_parts(state)
    scale = state.loss_scale
    records = records_max(state)
    # Unscaled by a division (a scalar): a subnormal quotient may flush to 0, which
    # counts as an empty entry. A non-finite max (inconsistent input) counts as no room.
    unscaled = jnp.abs(grads_max / scale)
    unscaled = jnp.where(jnp.isfinite(unscaled), unscaled, jnp.float32(_F32.max))
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
    probe = jnp.minimum(_grown(config, scale), ceiling)
    empty = ~(peak > 0)
    target = jnp.where(empty, probe, headroom_target(config, peak, cap))
    grows = (counted >= window) & (target > scale)
    counted = jnp.where(grows & empty, jnp.zeros_like(counted), counted)
    return {"loss_scale": jnp.where(grows, target, scale),
            "growth_tracker": jnp.where(lifts, jnp.zeros_like(counted_clean), counted_clean),
            "grad_max_history": history, "headroom_tracker": counted, "ceiling": ceiling}


def _headroom_parts(state: DynamicLossScale) -> tuple[jax.Array, jax.Array, jax.Array, int]:
    """``(grad_max_history, headroom_tracker, ceiling, headroom_window)``."""
    parts = (state.grad_max_history, state.headroom_tracker, state.ceiling,
             state.config.headroom_window)
    assert all(part is not None for part in parts), "not a growth='headroom' state"
    return cast(tuple[jax.Array, jax.Array, jax.Array, int], parts)


def records_max(state: DynamicLossScale) -> jax.Array:
    """Whether a clean step of this headroom state records its ``grads_max`` (a bool).

    Every clean step while the window fills (after the start and after each backoff:
    ``headroom_tracker < headroom_window``), then one clean step in ``headroom_window``
    (``growth_tracker % headroom_window == 0``). The sparse steady state is for XLA on
    CPU, which cannot fuse a max into the finite screen's sum: the wrapper reads the
    max there, in a second pass under a conditional, only on the steps that record it
    (docs/headroom.md has the measured cost). The rule decides it, not the backend: a
    run takes the same decisions on every backend and device.
    """
    _, steps, _, window = _headroom_parts(state)
    return (steps < window) | (state.growth_tracker % window == 0)


def headroom_target(config: DynamicConfig, peak: jax.Array, cap: jax.Array) -> jax.Array:
    """``min(T, cap)`` for the largest power of two ``T`` with ``T * margin * peak <=
    finfo(headroom_dtype).max`` (float32); ``peak`` 0 gives ``cap`` (the rule itself
    probes by one ``growth_factor`` instead, :func:`_headroom_clean`).

    The power of two is read off the bits of the float32 ratio (its exponent, the
    mantissa cleared): exact, and 0 for a ratio below the normal range, never a
    subnormal. A ratio beyond float32 (``peak`` 0 or tiny) is float32's max first.
    """
    limit = jnp.float32(jnp.finfo(jnp.dtype(config.headroom_dtype)).max)
    # limit / margin is exact and normal (a power-of-two margin, validated <= 2**127);
    # margin * peak first would overflow for a peak above float32's max / margin.
    ratio = limit / jnp.float32(config.headroom_margin) / peak
    ratio = jnp.minimum(ratio, jnp.float32(_F32.max))
    exponent_bits = lax.bitcast_convert_type(ratio, jnp.int32) & 0x7F800000
    return jnp.minimum(lax.bitcast_convert_type(exponent_bits, jnp.float32), cap)


def _dynamic_step(
    state: DynamicLossScale, finite: jax.Array, grads_max: jax.Array | None = None,
    backoff: bool = False, valid: jax.Array | None = None,
) -> tuple[DynamicLossScale, jax.Array]:
    """One application of the rule: (new state, whether it failed on this step).

    ``backoff=True`` is :func:`backoff_now`; ``valid``, the scale's validity when the caller
    checked it already. Fail closed and sticky: a failing step records a :class:`Failure`
    code and keeps every value, and a failed state never changes again.
    """
    config = state.config
    scale, tracker, streak = state.loss_scale, state.growth_tracker, state.nonfinite_tracker
    healthy = state.failure == 0
    valid = is_positive_normal(scale) if valid is None else valid
    clean = _clean_step(state, grads_max)

    # Non-finite step: back off once the hysteresis is used up (at once for a replay).
    bad_streak = jnp.minimum(optax.safe_increment(streak), config.hysteresis)
    backs_off = jnp.asarray(True) if backoff else bad_streak >= config.hysteresis
    shrunk = scale * jnp.float32(config.backoff_factor)
    if config.min_scale is not None:
        shrunk = jnp.maximum(shrunk, jnp.float32(config.min_scale))
    # `>= tiny` rather than `> 0`: XLA on CPU flushes subnormals to zero, GPUs may not.
    underflow = ~finite & backs_off & ~(shrunk >= jnp.float32(_F32.tiny))

    code = jnp.where(~valid, Failure.INVALID_SCALE,
                     jnp.where(underflow, Failure.BACKOFF_UNDERFLOW, Failure.NONE))
    fails = healthy & (code != Failure.NONE)
    frozen = ~healthy | fails
    stepped = {
        "loss_scale": jnp.where(finite, clean["loss_scale"], jnp.where(backs_off, shrunk, scale)),
        "growth_tracker": jnp.where(finite, clean["growth_tracker"], jnp.zeros_like(tracker)),
        "nonfinite_tracker": jnp.where(finite, jnp.zeros_like(streak), bad_streak),
    }
    if config.growth == "headroom":
        # A backoff sets the ceiling strictly below the scale that overflowed (to the
        # backed-off scale) and starts the window over: growth waits `window` clean steps.
        history, steps, ceiling, _ = _headroom_parts(state)
        stepped["grad_max_history"] = jnp.where(finite, clean["grad_max_history"], history)
        stepped["headroom_tracker"] = jnp.where(
            finite, clean["headroom_tracker"], jnp.where(backs_off, jnp.zeros_like(steps),
                                                         steps))
        stepped["ceiling"] = jnp.where(finite, clean["ceiling"],
                                       jnp.where(backs_off, shrunk, ceiling))
    new_leaves = {name: jnp.where(frozen, getattr(state, name), value)
                  for name, value in stepped.items()}
    new_leaves["failure"] = jnp.where(healthy, code.astype(jnp.int32), state.failure)
    return state._replace(**new_leaves), fails


_dynamic_step_jit = jax.jit(_dynamic_step, static_argnames="backoff")


def _run(state: DynamicLossScale, finite: jax.Array, grads_max: jax.Array | None,
         backoff: bool = False, valid: jax.Array | None = None
         ) -> tuple[DynamicLossScale, jax.Array]:
    """The rule traced in place inside a trace, else one cached compiled call."""
    if any(_is_traced(x) for x in jax.tree.leaves((state, finite, grads_max, valid))):
        return _dynamic_step(state, finite, grads_max, backoff, valid)
    return _dynamic_step_jit(state, finite, grads_max, backoff=backoff, valid=valid)


def step_recorded(state: DynamicLossScale, finite: jax.Array, *, grads_max: Any = None,
                  valid: jax.Array | None = None) -> DynamicLossScale:
    """:func:`update`'s new state with a failure only recorded, never raised (eager too)."""
    return _run(state, jnp.asarray(finite), _as_grads_max(state, grads_max), valid=valid)[0]


def backoff_now(state: LossScale) -> LossScale:
    """The rule's non-finite branch applied at once, hysteresis ignored: a replay's backoff.

    A failing backoff is recorded in the state, never raised (eagerly neither).
    ``NoOpLossScale`` and ``StaticLossScale`` are returned as they are.

    Examples:
      >>> import loss_scaling as ls
      >>> from loss_scaling.core.update import backoff_now
      >>> s = backoff_now(ls.DynamicLossScale(init_scale=1024.0, hysteresis=3))
      >>> float(s.loss_scale), int(s.nonfinite_tracker)
      (512.0, 1)
    """
    if not isinstance(state, DynamicLossScale):
        return state
    peak = jnp.zeros((), jnp.float32) if state.growth == "headroom" else None
    return _run(state, jnp.asarray(False), peak, backoff=True)[0]


def is_positive_normal(scale: Any) -> jax.Array:
    """In-graph: whether ``scale`` is a finite, positive, normal float32 (NaN is not)."""
    scale = jnp.asarray(scale, jnp.float32)
    return (scale >= jnp.float32(_F32.tiny)) & (scale <= jnp.float32(_F32.max))


OnFailure = Literal["record", "raise"]


def resolve_on_failure(on_failure: Any) -> OnFailure:
    """Checks ``on_failure``."""
    if on_failure not in ("record", "raise"):
        raise ValueError(
            f"on_failure must be 'record' (the default: the failure is kept in the state and "
            f"`loss_scaling.check` raises it on the host) or 'raise' (an immediate raise from "
            f"a host callback, for debugging), got {on_failure!r}.")
    return on_failure


def scaler_failure_message(scaler: DynamicLossScale | StaticLossScale) -> str:
    """The host-side message for a failed scaler (concrete, unreplicated values)."""
    code = Failure(int(np.asarray(getattr(scaler, "failure", Failure.INVALID_SCALE))))
    if code == Failure.BACKOFF_UNDERFLOW:
        assert isinstance(scaler, DynamicLossScale)
        # In Python floats: a host callback runs on a thread that flushes float32 subnormals.
        old, factor = float(scaler.loss_scale), scaler.config.backoff_factor
        return _errors.BACKOFF_UNDERFLOW.format(old=old, factor=factor, new=old * factor,
                                                tiny=float(_F32.tiny))
    if code == Failure.TOO_MANY_SKIPS:  # written by the wrapper (one register)
        return _errors.SCALER_TOO_MANY_SKIPS.format(scale=float(scaler.loss_scale))
    if code == Failure.NONFINITE_LOSS:  # written by the wrapper too
        return _errors.SCALER_NONFINITE_LOSS.format(scale=float(scaler.loss_scale))
    return _errors.invalid_scale_message(scaler.loss_scale)


def update(
    state: LossScale,
    grads_finite: Any,
    *,
    grads_max: Any = None,
    on_failure: OnFailure = "record",
) -> LossScale:
    """Returns the state for the next step, given whether this step's gradients were finite.

    Call it on every step, skipped or not, after the optimizer step. ``NoOpLossScale`` and
    ``StaticLossScale`` are returned unchanged; ``DynamicLossScale`` follows the rule in
    its docstring, failing closed as it says (a scale invalid on arrival fails too): under
    ``jit`` the state keeps its last valid scale and never changes again.

    Args:
      state: the current loss-scale state.
      grads_finite: a scalar bool (Python or array), e.g. from :func:`all_finite`.
      grads_max: the largest ``|entry|`` of this step's *scaled* gradients, a real scalar
        (:func:`loss_scaling.grads_max`); required by ``growth="headroom"``, which divides
        it by the scale and records it; ignored by every other rule.
      on_failure: ``"record"`` (the default) or ``"raise"``: under ``jit``, also raise at
        once from a host callback when the state fails. Debugging only: any executable
        holding a callback leaves JAX's fast dispatch path (about 1 ms of host time per
        step, see the README), and a raise inside a donated step deletes its inputs.

    Returns:
      The new state, of the same kind and configuration.

    Raises:
      LossScaleError: called eagerly, when the new state has failed.
      ValueError: if ``grads_finite`` is not a scalar bool, ``grads_max`` is not a real
        scalar (or missing for ``growth="headroom"``), or ``on_failure`` is unknown.
      TypeError: if ``state`` is not a loss-scale state.

    Examples:
      >>> import jax
      >>> import loss_scaling as ls
      >>> s = ls.DynamicLossScale(init_scale=2.0**-125)
      >>> s = ls.update(s, False)   # 2**-126 is still normal
      >>> ls.update(s, False)
      Traceback (most recent call last):
      ...
      loss_scaling.LossScaleError: loss scale backoff failed: ...
      >>> failed = jax.jit(ls.update)(s, False)     # under jit: recorded, not raised
      >>> float(failed.loss_scale), int(failed.failure)
      (1.1754943508222875e-38, 1)
    """
    on_failure = resolve_on_failure(on_failure)
    require_scaler("state", state)
    finite = _as_finite_flag(grads_finite)
    peak = _as_grads_max(state, grads_max)
    if not isinstance(state, DynamicLossScale):
        return state
    new_state, fails = _run(state, finite, peak)
    if any(_is_traced(x) for x in jax.tree.leaves((state, finite, peak))):
        if on_failure == "raise":
            def message(*leaves: Any) -> str:
                return scaler_failure_message(DynamicLossScale._from_parts(state.config, leaves))

            _errors.raise_in_graph(fails, message, *jax.tree.leaves(new_state))
        return new_state
    if np.any(np.asarray(new_state.failure)):
        raise _errors.LossScaleError(scaler_failure_message(new_state))
    return new_state

